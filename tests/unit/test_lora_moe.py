"""LoRA on the mixture-of-experts families: which projections get adapters (as peft 0.21.2 on transformers 5.23's
models), the refusals of what is not built, and (below) the NF4 base of a MoE layer and its plan."""

from __future__ import annotations

import os

import pytest

from megatrain_ray.config.load import load_config
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.model.layout import build_layout
from megatrain_ray.model.lora import lora_params
from megatrain_ray.planning.machine import Machine
from megatrain_ray.planning.memory import plan_run
from megatrain_ray.planning.speed import stage_costs
from tests.conftest import REPO, tiny_raw

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

MOE_MODELS = {  # tiny ModelConfig sections of each family
    "qwen3_moe": {"family": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                  "qk_norm": True, "head_dim": 16},
    "mixtral": {"family": "mixtral", "num_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"family": "gpt_oss", "num_experts": 4, "num_experts_per_tok": 2, "attention_bias": True,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 8,
                "swiglu_limit": 7.0, "swiglu_alpha": 1.702},
}
HF_CONFIGS = {"qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "moe_intermediate_size": 12}),
              "mixtral": ("MixtralConfig", {"num_local_experts": 4}),
              "gpt_oss": ("GptOssConfig", {"num_local_experts": 4})}


def moe_lora(family: str, target_modules, **lora):
    return load_config(raw=tiny_raw(model=MOE_MODELS[family], finetune={
        "method": "lora", "lora": {"target_modules": target_modules, **lora}}))


def test_gpt_oss_all_linear_is_the_attention_projections_as_in_peft():
    assert moe_lora("gpt_oss", "all-linear").finetune.lora.targets("gpt_oss") == ("q_proj", "k_proj", "v_proj",
                                                                                  "o_proj")


def peft_keys(family: str, target_modules, r: int = 4) -> dict[str, tuple[int, ...]]:
    """Every adapter key of peft's model (the adapter name dropped, as peft saves them) with its shape."""
    config_cls, extra = HF_CONFIGS[family]
    config = getattr(transformers, config_cls)(vocab_size=64, hidden_size=16, intermediate_size=24,
                                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=8, num_experts_per_tok=2, **extra)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                                peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=target_modules))
    return {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(model).items()}


def our_keys(family: str, target_modules, r: int = 4) -> dict[str, tuple[int, ...]]:
    from megatrain_ray.model.lora import initial_adapters, peft_name

    hidden = {"num_experts": 4, "num_experts_per_tok": 2, "hidden_size": 16, "intermediate_size": 24,
              "num_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 64}
    model = {**MOE_MODELS[family], **hidden, **({"moe_intermediate_size": 12} if family == "qwen3_moe" else {})}
    if family == "gpt_oss":
        model["layer_types"] = ["sliding_attention", "full_attention"]
    cfg = load_config(raw=tiny_raw(model=model, finetune={"method": "lora", "lora": {
        "r": r, "lora_alpha": 2 * r, "target_modules": target_modules}}))
    return {peft_name(i, n): tuple(t.shape) for i in range(2)
            for n, t in initial_adapters(cfg.model, cfg.finetune.lora, 0, i).items()}


@pytest.mark.parametrize("family,targets", [
    ("gpt_oss", "all-linear"), ("qwen3_moe", "all-linear"), ("mixtral", "all-linear"),
    ("qwen3_moe", ["gate_proj", "up_proj"]), ("qwen3_moe", ["down_proj", "q_proj"]), ("qwen3_moe", ["gate"]),
    ("mixtral", ["w1", "w3", "w2"]), ("mixtral", ["w2", "v_proj"])])
def test_adapters_have_peft_keys_and_shapes(family, targets):
    """The adapters megatrain makes are exactly peft 0.21.2's on the transformers model: the same keys (the
    router's `mlp.gate`, the experts' `mlp.experts` / `mlp.experts.base_layer` as peft nests them) and shapes
    (an expert adapter stacks E ranks; gate_up_proj rank 2r)."""
    assert our_keys(family, targets) == peft_keys(family, targets)


@pytest.mark.parametrize("family,bad", [("qwen3_moe", ["gate_proj"]), ("mixtral", ["w1", "w2"])])
def test_half_of_a_fused_pair_is_refused_as_peft_refuses_it(family, bad):
    with pytest.raises(ValueError, match="fused"):
        peft_keys(family, bad)
    with pytest.raises(ConfigError, match=r"finetune\.lora\.target_modules.*both or neither"):
        moe_lora(family, bad)


def test_router_and_expert_adapters_refuse_dropout_and_rslora():
    with pytest.raises(ConfigError, match=r"finetune\.lora\.lora_dropout"):
        moe_lora("qwen3_moe", "all-linear", lora_dropout=0.1)
    with pytest.raises(ConfigError, match=r"finetune\.lora\.use_rslora"):
        moe_lora("mixtral", ["w2"], use_rslora=True)
    assert moe_lora("qwen3_moe", ["q_proj"], lora_dropout=0.1, use_rslora=True)  # attention only: as dense


@pytest.mark.parametrize("family,name", [("gpt_oss", "router"), ("gpt_oss", "gate_up_proj"), ("gpt_oss", "experts"),
                                         ("gpt_oss", "mlp"), ("qwen3_moe", "qkv_proj"), ("mixtral", "gate_proj")])
def test_targets_peft_cannot_adapt_are_refused_naming_what_to_use(family, name):
    with pytest.raises(ConfigError, match=rf"finetune\.lora\.target_modules.*'{name}'.*q_proj, k_proj, v_proj, o_proj"):
        moe_lora(family, ["q_proj", name])


# ----------------------------------------------------------------------------- gpt-oss-120b, 4-bit base, LoRA

GPT_OSS_120B = os.path.join(REPO, "configs", "shapes", "gpt-oss-120b.yaml")
QLORA_120B = ["finetune.method=lora", "finetune.lora.base_quantization=nf4", "finetune.lora.r=16"]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


def test_gpt_oss_120b_nf4_host_bytes_are_the_hand_count_from_its_published_dims():
    """openai/gpt-oss-120b's config.json: hidden 2880, 64 query and 8 key/value heads of 64, 128 experts of width
    2880, 36 layers, vocabulary 201088, untied head. Quantized (blocks of 64, double quantization: 32 code bytes
    and 1 absmax code per block, a float32 scale per 256 blocks and an offset per matrix): q, k, v, o and the two
    fused expert tensors; kept in bf16: the router's weight, the experts' biases, every vector. Each of the six
    sections starts at a multiple of 256 bytes."""
    h, q, kv, e, f, layers, vocab = 2880, 64 * 64, 8 * 64, 128, 2880, 36, 201088
    matrices = [q * h, kv * h, kv * h, h * q, e * h * 2 * f, e * f * h]
    kept = e * h + e * 2 * f + e * h  # router.weight, gate_up_proj_bias, down_proj_bias
    vectors = q + kv + kv + h + 64 + e + h + h  # q/k/v/o biases, sinks, router bias, two norms (64-aligned already)
    blocks = [n // 64 for n in matrices]
    layer = (_aligned(32 * sum(blocks)) + _aligned(sum(blocks)) + _aligned(4 * sum(-(-k // 256) for k in blocks))
             + _aligned(4 * len(matrices)) + _aligned(2 * kept) + _aligned(2 * vectors))
    cfg = load_config(GPT_OSS_120B, overrides=[*QLORA_120B, "precision.stream_dtype=bfloat16"])
    plan = plan_run(cfg, Machine.from_preset("h200-128gb"))
    assert plan.host["nf4"] == layers * layer
    assert plan.host["master"] == 2 * (2 * vocab * h + h)  # embedding, LM head and final norm in bf16
    assert abs(plan.host["nf4"] / 2**30 - 55.65) < 0.01  # 0.515 B per quantized value
    assert 60e9 < plan.host_total < 66e9 and plan.fits  # the "about 64 GB of host RAM"
    assert lora_params(cfg) == layers * 16 * ((h + q) + 2 * (h + kv) + (q + h))  # q, k, v, o adapters only


def test_gpt_oss_120b_lora_speed_counts_the_active_experts_only():
    """The frozen base drops the weight gradients' FLOPs: a quarter of the matrix time of the experts a token
    uses (top 4 of 128), not of all of them (which once made the GPU time negative)."""
    plan = plan_run(load_config(GPT_OSS_120B, overrides=QLORA_120B), Machine.from_preset("h200-128gb"))
    costs = stage_costs(plan.cfg, plan.run, plan.expected.profile, build_layout(plan.cfg.model))
    layers = [c for c in costs if c.kind == "layer"]
    assert all(c.forward_seconds > 0 and c.backward_seconds > 0 for c in layers)
    # backward = 3 x forward in a full run; LoRA drops the active matrices' weight gradients (2 of the 8 N)
    assert all(2.0 < c.backward_seconds / c.forward_seconds < 3.0 for c in layers)
    assert 0 < plan.expected.gpu_busy <= 1
