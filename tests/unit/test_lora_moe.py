"""LoRA on the mixture-of-experts families: which projections get adapters (as peft 0.21.2 on transformers 5.23's
models), the refusals of what is not built, and (below) the NF4 base of a MoE layer and its plan."""

from __future__ import annotations

import pytest

from megatrain_ray.config.load import load_config
from megatrain_ray.exceptions import ConfigError
from tests.conftest import tiny_raw

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


def peft_adapted(family: str, target_modules) -> set[str]:
    """The modules of layer 0 that peft 0.21.2 puts adapters on, by their short names (mlp.* kept whole)."""
    config_cls, extra = HF_CONFIGS[family]
    config = getattr(transformers, config_cls)(vocab_size=64, hidden_size=16, intermediate_size=24,
                                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=8, num_experts_per_tok=2, **extra)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                                peft.LoraConfig(r=4, target_modules=target_modules))
    prefix = "base_model.model.model.layers.0."
    names = {k[len(prefix):].split(".lora_A.")[0] for k in model.state_dict() if k.startswith(prefix) and ".lora_A." in k}
    return {n.removeprefix("self_attn.") for n in names}


def test_gpt_oss_all_linear_is_the_attention_projections_as_in_peft():
    assert moe_lora("gpt_oss", "all-linear").finetune.lora.targets("gpt_oss") == ("q_proj", "k_proj", "v_proj",
                                                                                  "o_proj")
    assert peft_adapted("gpt_oss", "all-linear") == {"q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_peft_all_linear_on_qwen3_moe_and_mixtral_also_adapts_router_and_experts_so_it_is_refused(family):
    adapted = peft_adapted(family, "all-linear")
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate"} <= adapted and any("experts" in n for n in adapted)
    with pytest.raises(ConfigError, match=r"finetune\.lora\.target_modules.*router.*q_proj, k_proj, v_proj, o_proj"):
        moe_lora(family, "all-linear")
    cfg = moe_lora(family, ["v_proj", "q_proj"])
    assert cfg.finetune.lora.targets(family) == ("q_proj", "v_proj")
    assert peft_adapted(family, ["q_proj", "v_proj"]) == {"q_proj", "v_proj"}


@pytest.mark.parametrize("family,name", [("qwen3_moe", "gate"), ("qwen3_moe", "down_proj"), ("mixtral", "w1"),
                                         ("mixtral", "w2"), ("gpt_oss", "router"), ("gpt_oss", "gate_up_proj"),
                                         ("gpt_oss", "experts"), ("gpt_oss", "mlp"), ("qwen3_moe", "qkv_proj")])
def test_router_and_expert_targets_are_refused_naming_what_to_use(family, name):
    with pytest.raises(ConfigError, match=rf"finetune\.lora\.target_modules.*'{name}'.*q_proj, k_proj, v_proj, o_proj"):
        moe_lora(family, ["q_proj", name])
