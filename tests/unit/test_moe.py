"""The mixture-of-experts templates (model/moe.py, model/sinks.py) against transformers, float32.

Tiny random models with odd sizes: hidden 72 (not a power of two), GQA 4/2, 5 or 6 experts, top-k 2 and 4;
Qwen3-MoE with a dense layer (mlp_only_layers) or every 2nd layer sparse (decoder_sparse_step), Mixtral and
gpt-oss with a sliding window of 7 shorter than the 33-token inputs (gpt-oss: alternating sliding and full
layers, YaRN, attention sinks, a SwiGLU limit of 0.6 that clamps this model's activations). Logits through the
templates and through the engine's full layer stream, against transformers' in float32 within 4x the noise
measured by a float64 copy of the model (tests/numerics.py; floor 16 float32 ulps, 1.9e-6): MKL's float32 GEMMs
sum in a CPU-dependent order. Measured on an AVX-512 Xeon: noise 1.9e-7 (gpt-oss) to 4.0e-7 (Qwen3-MoE), ours
(templates and stream) 1.6e-7 to 3.2e-7 from transformers' float32 logits, so the bound is the floor; logits off
by 1e-3 land 500x past it. Routing is discrete: a top-k choice that parted from transformers' would move the
logits far past it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.hf import hf_config_from_model, model_config_from_hf  # noqa: E402
from megatrain_ray.config.resolved import RunSpec  # noqa: E402
from megatrain_ray.model.layout import build_layout  # noqa: E402
from megatrain_ray.model.moe import MoeSpec, experts, route  # noqa: E402
from tests.conftest import streamed_logits, tiny_config  # noqa: E402
from tests.numerics import assert_within_noise  # noqa: E402
from tests.unit.test_templates import assert_template_logits_match  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=72, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, pad_token_id=None)

MOE_FAMILIES = {
    # Top-4 of 6 experts, renormalised; layer 1 dense (mlp_only_layers), q/k norms, head_dim 20 set apart.
    "qwen3-moe-dense-layer": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=20, num_experts=6, num_experts_per_tok=4, moe_intermediate_size=24, norm_topk_prob=True,
        mlp_only_layers=[1])),
    # Top-2 of 5 experts, not renormalised; layers 1 and 3 sparse (decoder_sparse_step 2); tied head.
    "qwen3-moe-sparse-step": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=4, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24,
        decoder_sparse_step=2, tie_word_embeddings=True)),
    # Top-2 of 5, every layer sparse, a sliding window of 7.
    "mixtral-sliding": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=40, num_local_experts=5, num_experts_per_tok=2, sliding_window=7)),
    # Top-4 of 6 with router bias, attention biases and sinks, layers sliding / full / sliding, YaRN over an
    # original context of 16, the clamped SwiGLU.
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=20, intermediate_size=40, num_local_experts=6, num_experts_per_tok=4, sliding_window=7,
        swiglu_limit=0.6, rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False, "original_max_position_embeddings": 16,
                                           "rope_theta": 150000.0})),
}


def hf_moe_model(name: str, **overrides):
    config_cls, model_cls, extra = MOE_FAMILIES[name]
    config = getattr(transformers, config_cls)(**{**BASE, **extra, **overrides}, attn_implementation="eager",
                                                experts_implementation="eager")  # float64 too
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    # Non-trivial norms and biases (transformers initialises the expert biases to zero), so that a template
    # that skipped one would differ.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1 or pname.endswith("_bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.float32_parity
@pytest.mark.parametrize("name", list(MOE_FAMILIES))
def test_moe_templates_match_transformers(name):
    assert_template_logits_match(name, hf_moe_model(name))


@pytest.mark.float32_parity
@pytest.mark.parametrize("name", list(MOE_FAMILIES))
def test_moe_streamed_engine_logits_match_transformers(tmp_path, name):
    assert_within_noise(f"{name}: streamed logits", *streamed_logits(tmp_path, hf_moe_model(name)))


@pytest.mark.parametrize("name", list(MOE_FAMILIES))
def test_moe_layout_is_transformers_state_dict(name):
    """Every tensor of the transformers model, by name and shape, and nothing else (Qwen3-MoE: the dense
    layers keep their gate/up/down projections)."""
    model = hf_moe_model(name)
    layout = build_layout(model_config_from_hf(model.config.to_dict()))
    ours = {stage.hf_name(slot): slot.shape for stage in layout.stages for slot in stage.slots}
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert ours == theirs


@pytest.mark.parametrize("name", list(MOE_FAMILIES))
def test_moe_hf_config_round_trip(name):
    cfg = model_config_from_hf(hf_moe_model(name).config.to_dict())
    hf = transformers.AutoConfig.for_model(**hf_config_from_model(cfg))
    assert model_config_from_hf(hf.to_dict()) == cfg


def test_router_and_experts_against_a_per_token_loop():
    """The sorted, grouped expert compute against the definition token by token (float64): each token's
    output is the sum over its k experts of weight * down(silu(gate(x)) * up(x))."""
    gen = torch.Generator().manual_seed(3)
    e, h, f, k, tokens = 5, 12, 7, 2, 19
    w = {"mlp.gate.weight": torch.randn(e, h, generator=gen, dtype=torch.float64),
         "mlp.experts.gate_up_proj": torch.randn(e, 2 * f, h, generator=gen, dtype=torch.float64),
         "mlp.experts.down_proj": torch.randn(e, h, f, generator=gen, dtype=torch.float64)}
    x = torch.randn(tokens, h, generator=gen, dtype=torch.float64)
    spec = MoeSpec(e, k, "softmax_topk", norm_topk_prob=True)
    weights, index = route(x, w, spec)
    # The softmax in float32 as transformers' Qwen3-MoE router (dtype=torch.float even for a float64 model).
    probs = torch.softmax((x @ w["mlp.gate.weight"].T).float(), -1)
    for t in range(tokens):
        top = probs[t].topk(k)
        assert torch.equal(index[t], top.indices)
        torch.testing.assert_close(weights[t], (top.values / top.values.sum()).double(), rtol=1e-12, atol=0)
    out = experts(x, weights, index, w, spec)
    for t in range(tokens):
        want = torch.zeros(h, dtype=torch.float64)
        for j in range(k):
            gate_up = w["mlp.experts.gate_up_proj"][index[t, j]] @ x[t]
            act = torch.nn.functional.silu(gate_up[:f]) * gate_up[f:]
            want += weights[t, j] * (w["mlp.experts.down_proj"][index[t, j]] @ act)
        torch.testing.assert_close(out[t], want, rtol=1e-12, atol=1e-12)


# Published figures (model cards) with the unit of their last digit: total parameters, and active ones as each
# card counts them. Qwen3 and Mixtral count the embedding and the LM head, OpenAI's gpt-oss card the LM head
# only (its "active parameters" leave out the embedding lookup). Qwen's card truncates (3.35 B active reads
# "3.3B"; its 29.9B non-embedding total, without embedding and head, is checked too), the others round.
PUBLISHED = {
    "qwen3-30b-a3b": dict(total=30.5e9, active=3.3e9, unit=0.1e9, embedding=True, truncated=True,
                          non_embedding=29.9e9),
    "mixtral-8x7b": dict(total=46.7e9, active=12.9e9, unit=0.1e9, embedding=True, truncated=False),
    "gpt-oss-20b": dict(total=20.91e9, active=3.61e9, unit=0.01e9, embedding=False, truncated=False),
    "gpt-oss-120b": dict(total=116.83e9, active=5.13e9, unit=0.01e9, embedding=False, truncated=False),
}


def _as_published(ours: int, card: float, unit: float, truncated: bool) -> bool:
    return 0 <= ours - card < unit if truncated else abs(ours - card) <= unit / 2


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_moe_shapes_match_published_parameter_counts(name):
    """configs/shapes/<name>.yaml against the model card, to the card's last digit."""
    from pathlib import Path

    from megatrain_ray.config.load import load_config
    from megatrain_ray.model.flops import active_params

    cfg = load_config(Path(__file__).parents[2] / "configs" / "shapes" / f"{name}.yaml")
    layout = build_layout(cfg.model)
    card = PUBLISHED[name]
    active = active_params(cfg.model, layout) - (0 if card["embedding"] else layout.embed.numel)
    assert _as_published(layout.num_params, card["total"], card["unit"], False), layout.num_params
    assert _as_published(active, card["active"], card["unit"], card["truncated"]), active
    if "non_embedding" in card:
        rest = layout.num_params - layout.embed.numel - layout.head.slot("lm_head.weight").numel
        assert _as_published(rest, card["non_embedding"], card["unit"], False), rest
    # On a GPU the layers compile (torch._grouped_mm keeps their shapes fixed), but gpt-oss's (its attention with sinks)
    assert cfg.model.is_moe and RunSpec.resolve(cfg).compiles == (cfg.model.family != "gpt_oss")


def test_moe_plan_counts_active_parameters_and_expert_flops():
    """The plan's header names the active parameters; the model FLOPs per token of a MoE layer count its
    experts' matrices by top-k / num_experts (Mixtral 8x7B: 2 of 8)."""
    from pathlib import Path

    from megatrain_ray.config.load import load_config
    from megatrain_ray.model.flops import stage_flops_per_token
    from megatrain_ray.planning.machine import Machine
    from megatrain_ray.planning.memory import plan_run
    from megatrain_ray.planning.plan_text import format_plan

    cfg = load_config(Path(__file__).parents[2] / "configs" / "shapes" / "mixtral-8x7b.yaml")
    layout = build_layout(cfg.model)
    m = cfg.model
    attention = 2 * m.hidden_size * (m.num_attention_heads + m.num_key_value_heads) * m.resolved_head_dim
    per_token = attention + m.num_experts * m.hidden_size + 2 * 3 * m.hidden_size * m.intermediate_size
    flops = stage_flops_per_token(m, layout, cfg.data.seq_len)
    assert flops[1] == 6.0 * per_token + 6.0 * cfg.data.seq_len * m.num_attention_heads * m.resolved_head_dim
    text = format_plan(plan_run(cfg, Machine.from_preset("h200-1tb")))
    assert "46.7 B parameters (12.9 B active per token)" in text


@pytest.mark.float32_parity
@pytest.mark.parametrize("transposed", [False, True], ids=["qwen-mixtral", "gpt-oss"])
def test_grouped_mm_call_matches_the_expert_loop(monkeypatch, transposed):
    """On CUDA (bfloat16, sm90) the expert products go through torch._grouped_mm. Its call (cumulative int32
    offsets, the weight's orientation, gpt-oss's [E, in, out] layout) is checked here against the loop,
    through torch's CPU kernel of it (float32 only, forward, strides of 16 bytes), with an expert of no rows.
    The grouped kernel and the loop's GEMMs sum in their own orders: the bound is 4x the loop's float32 noise
    (its float64 twin), floor 16 ulps. Measured on an AVX-512 Xeon: the grouped products equal the loop's
    (error 0), noise 6e-8; a wrong offset or orientation moves them by O(1)."""
    from megatrain_ray.model import moe

    gen = torch.Generator().manual_seed(5)
    counts = [3, 0, 6, 4]
    rows = torch.randn(sum(counts), 8, generator=gen)
    weight = torch.randn(4, 8, 12, generator=gen) if transposed else torch.randn(4, 12, 8, generator=gen)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    loop = moe._expert_products(rows, weight, counts, offsets, transposed)
    loop64 = moe._expert_products(rows.double(), weight.double(), counts, offsets, transposed)
    monkeypatch.setattr(moe, "grouped_mm_usable", lambda *tensors: True)
    try:
        grouped = moe._expert_products(rows, weight, [], offsets, transposed)
    except RuntimeError as exc:  # a torch build without the CPU kernel
        pytest.skip(f"torch._grouped_mm on the CPU: {exc}")
    assert grouped.shape == loop.shape and grouped.dtype == torch.float32
    assert_within_noise("grouped expert products", grouped, loop, loop64)


def test_gpt_oss_plan_counts_its_attention_as_the_path_it_takes():
    """Attention with sinks runs fused in bfloat16 (model/sinks.py): the plan counts no [rows, heads, T, T + 1]
    tensor for it. In float32 on a GPU it is explicit: the plan counts the 4.07 of them (4 x 64 x 4096 x 4097 x 4
    bytes each for gpt-oss-20b) measured at its peak (SINK_ATTENTION_SCORES) and the T x T mask."""
    from pathlib import Path

    from megatrain_ray.config.load import load_config
    from megatrain_ray.planning.gpu_memory import SINK_ATTENTION_SCORES, explicit_attention_bytes, gpu_bytes

    path = Path(__file__).parents[2] / "configs" / "shapes" / "gpt-oss-20b.yaml"
    tokens = 4 * 4096
    fused = load_config(path)
    assert explicit_attention_bytes(fused, tokens, 2) == 0
    explicit = load_config(path, ["precision.compute_dtype=float32"])
    scores = 4 * 64 * 4096 * 4097 * 4
    assert explicit_attention_bytes(explicit, tokens, 4) == int(SINK_ATTENTION_SCORES * scores) + 4096 * 4096
    assert gpu_bytes(explicit, RunSpec.resolve(explicit))["layer backward working set"] > SINK_ATTENTION_SCORES * scores


def test_bad_moe_settings_are_one_clear_error(tmp_path):
    """Each names the config key (or config.json field) and what to do, before anything starts."""
    from megatrain_ray.exceptions import ConfigError

    qwen = dataclasses.asdict(model_config_from_hf(hf_moe_model("qwen3-moe-dense-layer").config.to_dict()))
    cases = [
        ({**qwen, "num_experts_per_tok": 7}, {}, "model.num_experts_per_tok"),
        ({**qwen, "qk_norm": False}, {}, "model.qk_norm"),
        ({**qwen, "mlp_only_layers": [3]}, {}, "model.mlp_only_layers"),
        ({**qwen, "family": "qwen3", "num_experts": 6}, {}, "model.num_experts"),
        ({**qwen, "swiglu_limit": 7.0, "swiglu_alpha": 1.7}, {}, "model.swiglu_limit"),
    ]
    for model, data, key in cases:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            tiny_config(tmp_path, model=model, data={"seq_len": 24, **data})
    gpt = dataclasses.asdict(model_config_from_hf(hf_moe_model("gpt-oss").config.to_dict()))
    with pytest.raises(ConfigError, match="attention sinks run on plain rows"):
        tiny_config(tmp_path, model=gpt, data={"seq_len": 24, "packing": True})
    mixtral = hf_moe_model("mixtral-sliding").config.to_dict()
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        model_config_from_hf({**mixtral, "router_jitter_noise": 0.1})
