"""The native DeepSeek-V3 template (multi-head latent attention, dense first layers, experts with shared experts and
the sigmoid, bias-corrected, group-limited router) and GLM-4.5 MoE's (the same MoE beside GQA with qkv biases,
optional q/k norms and half of each head rotated) against transformers' DeepseekV3ForCausalLM and Glm4MoeForCausalLM,
and their config, layout, router and plan.

Models (tests/reference_deepseek.py): hidden 72, 3 heads of q.k width 20 (12 + 8 rotated) and value width 14, a
24-wide latent, a rank-40 query (or one q_proj), 10 experts in 2 groups (1 open to a token, or both), top-3, 2 shared
experts; interleaved RoPE, RoPE by halves, and YaRN with mscale. GLM-4.5 MoE: GQA 4/2 of head_dim 20 (10 rotated),
qkv biases, with and without q/k norms, the same experts. Inputs of 2 x 37 tokens.

Bounds (tests/numerics.py):
- float64: 1e-10 (EXACT) against the reference float64 throughout (tests/reference_deepseek.float64_deepseek:
  transformers keeps the norms, the RoPE tables and the router in float32 in a float64 model; the reference computes
  them in float64, as megatrain does). Measured 1.6e-16 to 3.6e-16.
- float32: within 4x the noise of transformers' float32 logits against the float64 reference, floor 16 float32 ulps
  (1.9e-6). Measured errors 1.4e-7 to 2.9e-7 (transformers' own float32 against float64: about 2e-7): the bound is
  the floor.
Fault injection (by hand, reverted; DeepSeek-V3's float64 logits): the routing bias left out of the choice moves them
by 7.1e-2, the interleaved RoPE taken by halves by 3.3e-3, the latent norms at rms_norm_eps (1e-5) in place of their
1e-6 by 7.0e-5. Packed documents: the loss of packed rows equals each document's alone, 1.8e-16.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.hf import hf_config_from_model, model_config_from_hf  # noqa: E402
from megatrain_ray.model.layout import build_layout  # noqa: E402
from tests.conftest import one_thread, tiny_config  # noqa: E402
from tests.numerics import EXACT, assert_exact, assert_within_noise  # noqa: E402
from tests.reference_deepseek import DEEPSEEKS, GLMS, float64_deepseek, hf_deepseek_model  # noqa: E402
from tests.unit.test_hybrid_templates import template_logits  # noqa: E402

NAMES = [*DEEPSEEKS, *GLMS]
IDS = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def references() -> dict:
    """Per model: the float32 model, its float64 twin and their logits on IDS (made once for the module)."""
    out = {}
    with torch.no_grad(), one_thread():
        for name in NAMES:
            model = hf_deepseek_model(name)
            twin = float64_deepseek(model)
            out[name] = (model, twin, model(IDS).logits, twin(IDS).logits)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_deepseek_float64_logits_equal_transformers(references, name):
    _, twin, _, theirs64 = references[name]
    with one_thread():
        err = assert_exact(f"{name}: float64 logits", template_logits(twin, IDS, torch.float64), theirs64, EXACT)
    print(f"{name}: float64 logits relative error {err:.2e}")


@pytest.mark.float32_parity
@pytest.mark.parametrize("name", NAMES)
def test_deepseek_float32_logits_within_noise(references, name):
    model, _, theirs32, theirs64 = references[name]
    with one_thread():
        err = assert_within_noise(f"{name}: float32 logits", template_logits(model, IDS, torch.float32), theirs32,
                                  theirs64)
    print(f"{name}: float32 logits relative error {err:.2e}")


def test_sigmoid_router_is_transformers_router():
    """model/sigmoid_router.py against DeepseekV3TopkRouter on 64 rows (float32, as transformers computes): the same
    experts and weights; every chosen expert in the one group open to its row, and the bias changes the choice."""
    from megatrain_ray.model.moe import MoeSpec
    from megatrain_ray.model.sigmoid_router import BIAS, sigmoid_route

    model = hf_deepseek_model("deepseek_v3")
    router = model.model.layers[1].mlp.gate
    spec = MoeSpec.from_config(model_config_from_hf(model.config.to_dict()))
    h = torch.randn(64, 72, generator=torch.Generator().manual_seed(3))
    w = {"mlp.gate.weight": router.weight.detach(), BIAS: router.e_score_correction_bias}
    with torch.no_grad(), one_thread():
        _, their_weights, their_index = router(h)
        weights, index = sigmoid_route(h, w, spec)
        unbiased = sigmoid_route(h, {**w, BIAS: torch.zeros(10)}, spec)[1]
    order, their_order = index.sort(dim=-1), their_index.sort(dim=-1)
    assert torch.equal(order.values, their_order.values)
    assert torch.equal(weights.gather(1, order.indices), their_weights.gather(1, their_order.indices))
    assert weights.dtype == torch.float32
    groups = index // 5
    assert (groups == groups[:, :1]).all(), "every expert of a row in its one chosen group"
    assert not torch.equal(unbiased.sort(dim=-1).values, order.values), "the correction bias should change a choice"


def test_the_routing_bias_takes_no_gradient_and_keeps_its_place():
    """The backward (recompute) of a MoE layer: a zero gradient for mlp.gate.e_score_correction_bias (bound without
    requires_grad), nonzero ones for the router and every other tensor."""
    from megatrain_ray.model.layer_spec import LayerSpec
    from megatrain_ray.model.rope import rope_tables
    from megatrain_ray.model.templates import bind, decoder_layer_backward

    cfg = model_config_from_hf(hf_deepseek_model("deepseek_v3").config.to_dict())
    stage = build_layout(cfg).layers[1]
    w = bind(torch.randn(stage.numel, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 0.1, stage)
    x = torch.randn(1, 9, 72, dtype=torch.float64)
    with one_thread():
        _, grads = decoder_layer_backward(x, w, rope_tables(cfg, 9, x.device, x.dtype), LayerSpec.from_config(cfg, 1),
                                          None, torch.randn_like(x))
    assert set(grads) == set(w)
    assert torch.equal(grads["mlp.gate.e_score_correction_bias"], torch.zeros(10, dtype=torch.float64))
    assert all(g.abs().sum() > 0 for n, g in grads.items() if n != "mlp.gate.e_score_correction_bias")


def test_a_kept_graph_gives_the_recompute_gradients_and_the_bias_zeros():
    """engine/kept_graphs.py (a GPU-resident layer's forward with its graph kept): a MoE layer's backward through the
    kept graph equals the recompute's (float64, 1e-12), the routing bias's gradient zeros in both."""
    from megatrain_ray.engine.kept_graphs import backward_kept, forward_kept
    from megatrain_ray.model.layer_spec import LayerSpec
    from megatrain_ray.model.rope import rope_tables
    from megatrain_ray.model.templates import bind, decoder_layer, decoder_layer_backward

    cfg = model_config_from_hf(hf_deepseek_model("deepseek_v3").config.to_dict())
    stage, spec = build_layout(cfg).layers[2], LayerSpec.from_config(cfg, 2)
    w = bind(torch.randn(stage.numel, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 0.1, stage)
    x = torch.randn(2, 9, 72, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grad_y = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    rope = rope_tables(cfg, 9, x.device, x.dtype)
    with one_thread():
        y, kept = forward_kept(decoder_layer, x, w, rope, spec, None, 0)
        grad_x, grads = backward_kept(kept, grad_y)
        ref_x, ref = decoder_layer_backward(x, w, rope, spec, None, grad_y)
    assert set(grads) == set(ref) == set(w)
    assert_exact("input gradient", grad_x, ref_x, 1e-12)
    for name, g in ref.items():
        if name.endswith("e_score_correction_bias"):
            assert not g.any() and not grads[name].any()
        else:
            assert_exact(name, grads[name], g, 1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_deepseek_layout_is_transformers_state_dict(name):
    """Every tensor of the transformers model by name and shape (the routing bias, a buffer, included; no q_proj
    beside the low-rank query), nothing else; the parameter count is transformers' (the buffer not in it)."""
    model = hf_deepseek_model(name)
    layout = build_layout(model_config_from_hf(model.config.to_dict()))
    ours = {stage.hf_name(slot): slot.shape for stage in layout.stages for slot in stage.slots}
    assert ours == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert layout.num_params == model.num_parameters()


@pytest.mark.parametrize("name", NAMES)
def test_deepseek_hf_config_round_trip(name):
    """config.json -> ModelConfig -> config.json -> DeepseekV3Config -> the same ModelConfig, and the transformers
    config as the original in every key the model reads."""
    hf = hf_deepseek_model(name).config
    cfg = model_config_from_hf(hf.to_dict())
    again = transformers.AutoConfig.for_model(**hf_config_from_model(cfg))
    assert type(again) is type(hf)
    assert model_config_from_hf(again.to_dict()) == cfg
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave",
                "n_routed_experts", "n_shared_experts", "moe_intermediate_size", "num_experts_per_tok", "n_group",
                "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "head_dim",
                "use_qk_norm", "attention_bias"):
        assert getattr(again, key, None) == getattr(hf, key, None), key
    rope = dict(again.rope_parameters)
    assert rope.pop("truncate", True) is True  # YaRN's default, written out
    assert rope == hf.rope_parameters


def test_deepseek_plan_counts_latent_attention():
    """FLOPs of a layer: 6 per matrix parameter (the experts at top-3 of 10) plus causal attention of 3 heads x the mean
    of the q.k width 20 and the value width 14; the memory plan's attention widths are the heads' q.k and mean."""
    from megatrain_ray.model.flops import stage_flops_per_token
    from megatrain_ray.planning.gpu_memory import attention_widths

    cfg = model_config_from_hf(hf_deepseek_model("deepseek_v3").config.to_dict())
    layout = build_layout(cfg)
    flops = stage_flops_per_token(cfg, layout, 100)
    dense = sum(s.numel for s in layout.layers[0].slots if s.decay)
    moe = sum(s.numel * (0.3 if s.name.startswith("mlp.experts.") else 1.0) for s in layout.layers[1].slots if s.decay)
    assert flops[1] == 6.0 * dense + 6.0 * 100 * 3 * 17
    assert flops[2] == pytest.approx(6.0 * moe + 6.0 * 100 * 3 * 17, rel=1e-15)
    assert attention_widths(cfg) == (60, 51)


def test_bad_deepseek_settings_are_one_clear_error(tmp_path):
    """Each names the config key (or config.json field) and what to do, before anything starts."""
    from megatrain_ray.exceptions import CheckpointError, ConfigError

    hf = hf_deepseek_model("deepseek_v3").config.to_dict()
    model = dataclasses.asdict(model_config_from_hf(hf))
    cases = [
        (dict(model=model, finetune={"method": "lora", "lora": {"target_modules": ["q_proj", "kv_b_proj"]}}),
         "finetune.lora.target_modules"),  # the low-rank query has no q_proj
        (dict(model={**model, "output_router_logits": True}), "model.output_router_logits"),
        (dict(model={**model, "num_key_value_heads": 1}), "model.num_key_value_heads"),
        (dict(model={**model, "mlp_only_layers": [1]}), "model.mlp_only_layers"),
        (dict(model={**model, "sigmoid_router": None}), "model.sigmoid_router"),
        (dict(model={**model, "latent_attention": None}), "model.latent_attention"),
        (dict(model={**model, "num_experts_per_tok": 6}), "model.num_experts_per_tok"),
    ]
    for sections, key in cases:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            tiny_config(tmp_path, data={"seq_len": 24}, **sections)
    for bad, field in [({"hidden_act": "gelu"}, "hidden_act"), ({"n_group": 3}, "n_group"),
                       ({"attention_bias": True}, "attention_bias")]:
        with pytest.raises((ConfigError, CheckpointError), match=field):
            model_config_from_hf({**hf, **bad})


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_deepseek_packed_documents_equal_each_document_alone(tmp_path, name):
    """Packed rows (data.packing: RoPE positions restart at each document, attention stops at it; latent attention's
    values narrower than its queries and keys, 14 against 20): the float64 loss of a row of documents (25, 9, 6) and a
    row (40) through the layer stream equals transformers' on each document alone (float64 throughout), within 1e-10."""
    import torch.nn.functional as F

    from megatrain_ray.driver.trainer import Trainer
    from megatrain_ray.messages import Batch

    model = float64_deepseek(hf_deepseek_model(name))
    mcfg = model_config_from_hf(model.config.to_dict())
    cfg = tiny_config(tmp_path, model=dataclasses.asdict(mcfg), data={"seq_len": 40},
                      precision={"master_dtype": "float64", "compute_dtype": "float64"})
    gen = torch.Generator().manual_seed(6)
    rows = ((25, 9, 6), (40,))
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
    assert count == 80
    err = assert_exact(f"{name}: loss of the packed rows", ours, total / 80, EXACT)
    print(f"{name}: packed rows' loss relative error {err:.1e}")
