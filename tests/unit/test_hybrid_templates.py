"""The hybrid families' templates (Qwen3.5 text, Qwen3-Next, Qwen3.5-MoE text: linear-attention layers and gated
full-attention layers by layer_types) against transformers, and their config, layout and plan.

Models (tests/reference_hybrid.py): hidden 72, GQA 4/2 with head_dim 24 (6 dimensions rotated), 2 key heads for 4
value heads of widths 12 and 10 in the linear layers, a causal convolution of 4; Qwen3-Next with MoE layers (top-2
of 5, a shared expert) and a dense one, tied; Qwen3.5-MoE every layer sparse. Inputs of 2 x 150 tokens: three chunks
of the delta rule, the last one 22 tokens.

Bounds (tests/numerics.py):
- float64: 1e-10 (EXACT) against the reference float64 throughout (tests/reference_hybrid.float64_hybrid: transformers
  keeps the delta rule, its norms, RoPE tables and softmax in float32 in a float64 model; the reference computes them
  in float64, as megatrain does). Measured: 0 (Qwen3.5: the same operations in the same order) to 2.7e-16.
- float32: within 4x the noise of transformers' float32 logits against the float64 reference, floor 16 float32 ulps
  (1.9e-6). Measured: errors 1.5e-7 to 1.6e-7, noise 1.9e-7 to 2.0e-7: the bound is the floor.
The delta rule in chunks against transformers' token-by-token recurrence (another algorithm, its float32 casts made
float64): outputs and gradients within 1e-12 (measured 1.5e-15).
Fault injection (by hand, reverted): the attention's output gate as sigmoid(-gate) moves the logits by 3.2e-2 to
4.0e-2; the chunk state left undecayed between chunks by 1.5e-5 to 7.7e-4, and the rule's output by 7.5e-2.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.hf import hf_config_from_model, model_config_from_hf  # noqa: E402
from megatrain_ray.model.layout import build_layout  # noqa: E402
from megatrain_ray.model.templates import model_logits  # noqa: E402
from tests.conftest import one_thread, tiny_config  # noqa: E402
from tests.numerics import EXACT, assert_exact, assert_within_noise  # noqa: E402
from tests.reference_hybrid import HYBRIDS, _recompiled, float64_hybrid, hf_hybrid_model  # noqa: E402

NAMES = list(HYBRIDS)
IDS = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(1))


def template_logits(model, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The stateless templates' logits on `model`'s weights in `dtype` (every stage's padding NaN)."""
    cfg = model_config_from_hf(model.config.to_dict())
    layout = build_layout(cfg)
    state = model.state_dict()
    buffers = [torch.full((s.numel,), float("nan"), dtype=dtype) for s in layout.stages]
    for stage, buf in zip(layout.stages, buffers):
        for slot in stage.slots:
            buf[slot.offset:slot.offset + slot.numel] = state[stage.hf_name(slot)].reshape(-1)
    with torch.no_grad():
        return model_logits(cfg, list(layout.stages), buffers, ids)


@pytest.fixture(scope="module")
def references() -> dict:
    """Per model: the float32 model, its float64 twin and their logits on IDS (made once for the module)."""
    out = {}
    with torch.no_grad(), one_thread():
        for name in NAMES:
            model = hf_hybrid_model(name)
            twin = float64_hybrid(model)
            out[name] = (model, twin, model(IDS).logits, twin(IDS).logits)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_hybrid_float64_logits_equal_transformers(references, name):
    _, twin, _, theirs64 = references[name]
    with one_thread():
        err = assert_exact(f"{name}: float64 logits", template_logits(twin, IDS, torch.float64), theirs64, EXACT)
    print(f"{name}: float64 logits relative error {err:.2e}")


@pytest.mark.float32_parity
@pytest.mark.parametrize("name", NAMES)
def test_hybrid_float32_logits_within_noise(references, name):
    model, _, theirs32, theirs64 = references[name]
    with one_thread():
        err = assert_within_noise(f"{name}: float32 logits", template_logits(model, IDS, torch.float32), theirs32,
                                  theirs64)
    print(f"{name}: float32 logits relative error {err:.2e}")


def test_chunked_delta_rule_equals_the_token_by_token_recurrence():
    """model/delta_rule.py's chunks (130 tokens: 64 + 64 + 2) against transformers' recurrent form, float64, with a
    key head shared by 3 value heads: outputs, and the gradients of q, k, v, g and beta."""
    from megatrain_ray.model.delta_rule import chunk_gated_delta_rule

    module = sys.modules[type(hf_hybrid_model("qwen3_5").model.layers[0].linear_attn).__module__]
    namespace = vars(module)
    recurrent = _recompiled(namespace["torch_recurrent_gated_delta_rule"], {"torch.float32": "torch.float64"},
                            {"torch.float32": 1}, namespace)
    gen = torch.Generator().manual_seed(4)
    b, t, hk, hv, dk, dv = 2, 130, 2, 6, 12, 10

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_(True)
    q, k, v = leaf(b, t, hk, dk), leaf(b, t, hk, dk), leaf(b, t, hv, dv)
    g = (-torch.rand(b, t, hv, generator=gen, dtype=torch.float64) * 0.5).requires_grad_(True)
    beta = torch.rand(b, t, hv, generator=gen, dtype=torch.float64).requires_grad_(True)
    grad_out = torch.randn(b, t, hv, dv, generator=gen, dtype=torch.float64)
    with one_thread():
        ours = chunk_gated_delta_rule(q, k, v, g, beta)
        theirs, _ = recurrent(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        errors = [assert_exact("delta rule output", ours.detach(), theirs.detach(), 1e-12)]
        ours_grads = torch.autograd.grad(ours, (q, k, v, g, beta), grad_out)
        their_grads = torch.autograd.grad(theirs, (q, k, v, g, beta), grad_out)
    for name, a, b_ in zip("q k v g beta".split(), ours_grads, their_grads):
        errors.append(assert_exact(f"delta rule gradient of {name}", a, b_, 1e-12))
    print(f"chunked against recurrent delta rule: output and gradients within {max(errors):.1e}")


@pytest.mark.parametrize("name", NAMES)
def test_hybrid_layout_is_transformers_state_dict(name):
    """Every tensor of the transformers model by name and shape (Qwen3-Next's fused in_proj_qkvz, the gated
    q_proj, the shared experts), nothing else."""
    model = hf_hybrid_model(name)
    layout = build_layout(model_config_from_hf(model.config.to_dict()))
    ours = {stage.hf_name(slot): slot.shape for stage in layout.stages for slot in stage.slots}
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert ours == theirs


@pytest.mark.parametrize("name", NAMES)
def test_hybrid_hf_config_round_trip(name):
    """config.json -> ModelConfig -> config.json -> transformers' config class -> the same ModelConfig, and the
    transformers config as the original in every key the model reads."""
    hf = hf_hybrid_model(name).config
    cfg = model_config_from_hf(hf.to_dict())
    again = transformers.AutoConfig.for_model(**hf_config_from_model(cfg))
    assert type(again) is type(hf)
    assert model_config_from_hf(again.to_dict()) == cfg
    for key in ("layer_types", "linear_num_value_heads", "linear_key_head_dim", "head_dim", "num_experts",
                "shared_expert_intermediate_size", "tie_word_embeddings"):
        assert getattr(again, key, None) == getattr(hf, key, None), key
    assert again.rope_parameters["partial_rotary_factor"] == 0.25


def test_hybrid_plan_counts_the_delta_rule_not_attention():
    """A linear-attention layer's FLOPs: 6 per matrix parameter (the convolution's 3-d weight among them) plus 3x the
    chunked rule's forward, whatever the sequence length; a full-attention layer's grow with it."""
    from megatrain_ray.model.delta_rule import delta_rule_flops_per_token
    from megatrain_ray.model.flops import stage_flops_per_token

    cfg = model_config_from_hf(hf_hybrid_model("qwen3_5").config.to_dict())
    layout = build_layout(cfg)
    matmul = [sum(s.numel for s in stage.slots if s.decay) for stage in layout.layers]
    rule = 3.0 * delta_rule_flops_per_token(4, 12, 10)
    assert rule == 3.0 * 4 * (4 * 64 * 12 + 64 * 22 + 2 * 64 * 10 + 6 * 12 * 10)
    for seq_len in (100, 4000):
        flops = stage_flops_per_token(cfg, layout, seq_len)
        assert flops[1] == flops[3] == 6.0 * matmul[0] + rule
        assert flops[2] == 6.0 * matmul[1] + 6.0 * seq_len * 4 * 24
    conv = layout.layers[0].slot("linear_attn.conv1d.weight")
    assert conv.decay and conv.shape == (2 * 24 + 40, 1, 4)  # decayed as transformers' AdamW groups take it (ndim 3)


def test_bad_hybrid_settings_are_one_clear_error(tmp_path):
    """Each names the config key (or config.json field) and what to do, before anything starts."""
    from megatrain_ray.exceptions import CheckpointError, ConfigError

    hf = hf_hybrid_model("qwen3_5").config.to_dict()
    model = dataclasses.asdict(model_config_from_hf(hf))
    cases = [
        (dict(model=model, finetune={"method": "lora", "lora": {"target_modules": ["in_proj_qkvz"]}}),
         "finetune.lora.target_modules"),  # Qwen3-Next's fused projection, not Qwen3.5's
        (dict(model=model, engine={"compile": True}), "engine.compile"),
        (dict(model={**model, "layer_types": ["full_attention"] * 3, "linear_attention": None}),
         "model.linear_attention"),
        (dict(model={**model, "layer_types": model["layer_types"][:2]}), "model.layer_types"),
        (dict(model={**model, "attention_bias": True}), "model.attention_bias"),
        (dict(model={**model, "family": "qwen3", "partial_rotary_factor": 1.0, "layer_types": []}),
         "model.linear_attention"),
    ]
    for sections, key in cases:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            tiny_config(tmp_path, data={"seq_len": 24, **sections.pop("data", {})}, **sections)
    for bad, field in [({"hidden_act": "gelu"}, "hidden_act"),
                       ({"layer_types": ["linear_attention"] * 2}, "layer_types"),
                       ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
                       ({"attention_bias": True}, "attention_bias")]:
        with pytest.raises((ConfigError, CheckpointError), match=field):
            model_config_from_hf({**hf, **bad})


def test_the_plan_counts_what_the_linear_mixer_saves():
    """model/delta_rule.linear_mixer_saved_bytes against the bytes autograd keeps for a linear mixer's backward
    (its weights and normed input aside), for two shapes: at least them and within 15 % (measured 3.2 % above)."""
    from megatrain_ray.model.delta_rule import linear_mixer_saved_bytes
    from megatrain_ray.model.layer_spec import LayerSpec
    from megatrain_ray.model.linear_attention import linear_attention
    from megatrain_ray.model.templates import bind
    from tests.conftest import saved_storage_bytes

    for name, tokens in (("qwen3_5", 256), ("qwen3_next", 192)):
        cfg = model_config_from_hf(hf_hybrid_model(name).config.to_dict())
        stage = build_layout(cfg).layers[0]
        w = {n: t.requires_grad_(True) for n, t in bind(torch.randn(stage.numel) * 0.1, stage).items()
             if n.startswith("linear_attn.")}
        h = torch.randn(1, tokens, cfg.hidden_size, requires_grad=True)
        with saved_storage_bytes() as seen, one_thread():
            linear_attention(h, w, LayerSpec.from_config(cfg, 0).linear)
        measured = (sum(seen.values()) - stage.numel * 4 - h.numel() * 4) / tokens
        la = cfg.linear_attention
        planned = linear_mixer_saved_bytes(la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_width,
                                           la.value_width, 4, 4)
        print(f"{name}: the linear mixer saves {measured:.0f} bytes per token, the plan counts {planned:.0f}")
        assert measured <= planned <= 1.15 * measured, (name, measured, planned)


def test_the_qwen3_next_80b_shape_has_the_published_size_and_plans():
    """configs/shapes/qwen3-next-80b-a3b.yaml: the model card's 80B in total and 3B activated (without the embedding
    and the LM head), to its one digit; `megatrain plan` prints it, its linear layers' backward among the terms."""
    import os

    from megatrain_ray.config.load import load_config
    from megatrain_ray.config.resolved import RunSpec
    from megatrain_ray.model.flops import active_params
    from megatrain_ray.planning.gpu_memory import gpu_bytes, layer_backward_bytes, linear_layer_backward_bytes
    from megatrain_ray.planning.machine import Machine
    from megatrain_ray.planning.memory import plan_run
    from megatrain_ray.planning.plan_text import format_plan
    from tests.conftest import REPO

    cfg = load_config(os.path.join(REPO, "configs", "shapes", "qwen3-next-80b-a3b.yaml"))
    layout = build_layout(cfg.model)
    assert layout.num_params == 79_674_391_296 and round(layout.num_params / 1e10) == 8
    active = active_params(cfg.model, layout) - layout.embed.numel - layout.head.slot("lm_head.weight").numel
    assert active == 3_252_599_552 and round(active / 1e9) == 3
    assert sum(cfg.model.layer_is_linear(i) for i in range(48)) == 36
    run = RunSpec.resolve(cfg)
    tokens = run.rank_tokens
    linear = linear_layer_backward_bytes(cfg, tokens, tokens, 0, 2)
    m = cfg.model
    assert linear > layer_backward_bytes(tokens, tokens, m.hidden_size, 2 * 16 * 256, 2 * 256, 0, 2)
    assert gpu_bytes(cfg, run)["layer backward working set"] >= linear
    assert "qwen3_next, 79.7 B parameters (3.9 B active per token)" in format_plan(
        plan_run(cfg, Machine.from_preset("h200-1tb")))


def test_the_speed_model_takes_the_linear_layers_chunk_loop_as_a_floor():
    """Qwen3-Next-80B on one row of 32K tokens: a linear layer's forward and backward 512 chunks x the H200's measured
    time per chunk (planning/speed.LINEAR_CHUNK_SECONDS), above what its FLOPs give; a full-attention layer by its
    FLOPs alone, less."""
    import os

    from megatrain_ray.config.load import load_config
    from megatrain_ray.config.resolved import RunSpec
    from megatrain_ray.planning.machine import Machine
    from megatrain_ray.planning.speed import LINEAR_CHUNK_SECONDS, stage_costs
    from tests.conftest import REPO

    cfg = load_config(os.path.join(REPO, "configs", "shapes", "qwen3-next-80b-a3b.yaml"),
                      ["data.seq_len=32768", "data.batch_size=1"])
    costs = stage_costs(cfg, RunSpec.resolve(cfg), Machine.from_preset("h200-1tb").profile, build_layout(cfg.model))
    linear, full = costs[1], costs[4]  # layers 0 and 3
    assert (linear.forward_seconds, linear.backward_seconds) == (512 * LINEAR_CHUNK_SECONDS[0],
                                                                   512 * LINEAR_CHUNK_SECONDS[1])
    assert full.forward_seconds < linear.forward_seconds and full.backward_seconds == 3 * full.forward_seconds


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_hybrid_packed_documents_equal_each_document_alone(tmp_path, name):
    """Packed rows (data.packing: the linear layers' convolution and delta rule start afresh at each document, RoPE
    positions restart, attention stops at each): the float64 loss of a row of documents (70, 20, 10) and a row (100)
    through the layer stream equals transformers' on each document alone (float64 throughout), within 1e-10; the
    70-token document spans two chunks of the rule. Measured 0 to 1.8e-16; the linear layers run over the whole row
    instead (their state carried from one document into the next): 2.4e-6 to 7.8e-6."""
    import torch.nn.functional as F

    from megatrain_ray.driver.trainer import Trainer
    from megatrain_ray.messages import Batch

    model = float64_hybrid(hf_hybrid_model(name))
    mcfg = model_config_from_hf(model.config.to_dict())
    cfg = tiny_config(tmp_path, model=dataclasses.asdict(mcfg), data={"seq_len": 100},
                      precision={"master_dtype": "float64", "compute_dtype": "float64"})
    gen = torch.Generator().manual_seed(6)
    rows = ((70, 20, 10), (100,))
    docs = [[torch.randint(0, mcfg.vocab_size, (n + 1,), generator=gen) for n in lengths] for lengths in rows]
    ids = torch.stack([torch.cat([d[:-1] for d in row]) for row in docs])
    labels = torch.stack([torch.cat([d[1:] for d in row]) for row in docs])
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
    with torch.no_grad(), one_thread():
        total = sum(F.cross_entropy(model(d[None, :-1]).logits[0], d[1:], reduction="sum").item()
                    for row in docs for d in row)
    with Trainer(cfg) as trainer:
        trainer.load_weights({k: v for k, v in model.state_dict().items() if k in trainer.master_weights()})
        ours, count = trainer.gpu.eval_loss(Batch(ids, labels, positions, rows)).result()
    assert count == 200
    err = assert_exact(f"{name}: loss of the packed rows", ours, total / 200, EXACT)
    print(f"{name}: packed rows' loss relative error {err:.1e}")
