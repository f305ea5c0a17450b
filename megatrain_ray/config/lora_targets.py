"""Which projections of a decoder layer LoRA adapts (finetune.lora.target_modules), per family, as peft 0.21.2's
get_peft_model chooses them on transformers 5.23's models.

Dense families: every nn.Linear of a layer (all-linear) or the named ones. Mixture-of-experts families: the
attention projections are nn.Linear as in a dense model; the experts are fused [E, ...] parameters and the router
a module of its own, neither an nn.Linear, so PEFT adapts them only through `target_parameters`:
- gpt_oss: all-linear is the four attention projections; naming the router or the experts fails in PEFT itself
  (GptOssTopKRouter and GptOssExperts are not supported modules), so these four are all there is.
- qwen3_moe, mixtral: PEFT 0.21 maps transformers 4's names onto transformers 5's fused tensors
  (peft/utils/transformers_weight_conversion.py): all-linear and the names `gate` (the router), `gate_proj` and
  `up_proj` (Mixtral: `w1`, `w3`), `down_proj` (`w2`) become LoRA on `mlp.gate.weight` and on each expert of
  `mlp.experts.gate_up_proj` / `down_proj` (peft's ParamWrapper). Those adapters are not built here: such a
  target is refused, naming the attention projections, which train exactly as PEFT trains them.
"""

from __future__ import annotations

from typing import Literal

from megatrain_ray.config.fields import refuse

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_PROJECTIONS = (*ATTENTION_PROJECTIONS, "gate_proj", "up_proj", "down_proj")
"""The linear modules of a dense decoder layer by PEFT's short names."""
PHI3_LORA_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""Phi-3's fused projections."""

ROUTER_AND_EXPERT_NAMES = {"qwen3_moe": ("gate", "gate_proj", "up_proj", "down_proj"),
                           "mixtral": ("gate", "w1", "w2", "w3"),
                           "gpt_oss": ("router", "experts", "gate_up_proj", "down_proj")}
"""The target_modules names that reach a MoE layer's router or fused experts in PEFT (or that PEFT refuses)."""


def lora_targets(family: str, target_modules: list[str] | Literal["all-linear"], key: str) -> tuple[str, ...]:
    """The targeted projections' short names for a family, in the layer's order; `key`: the config field, named
    in the error when a target cannot be adapted."""
    if family in ROUTER_AND_EXPERT_NAMES:
        return _moe_targets(family, target_modules, key)
    known = PHI3_LORA_PROJECTIONS if family == "phi3" else LORA_PROJECTIONS
    if target_modules == "all-linear":
        return known
    unknown = [name for name in target_modules if name not in known]
    if unknown:
        refuse(key, target_modules,
               f"{unknown[0]!r} is not a linear module of a {family} layer; choose from {', '.join(known)}")
    return tuple(name for name in known if name in target_modules)


def _moe_targets(family: str, target_modules: list[str] | Literal["all-linear"], key: str) -> tuple[str, ...]:
    use = f"set {key} to [{', '.join(ATTENTION_PROJECTIONS)}] or a subset of them"
    if family == "gpt_oss":
        if target_modules == "all-linear":
            return ATTENTION_PROJECTIONS
        use = f"choose from {', '.join(ATTENTION_PROJECTIONS)} (or all-linear, which is those four on gpt_oss)"
    elif target_modules == "all-linear":
        refuse(key, target_modules,
               f"on {family}, peft 0.21's all-linear also adapts the router (mlp.gate) and every expert of the fused "
               "mlp.experts tensors (its target_parameters), which megatrain does not build yet; " + use)
    assert isinstance(target_modules, list)
    for name in target_modules:
        if name in ATTENTION_PROJECTIONS:
            continue
        if name in ROUTER_AND_EXPERT_NAMES[family]:
            why = (f"{name!r} is a {family} router or expert projection: the experts are fused [E, ...] tensors and "
                   "the router a module of its own, not nn.Linear, and peft adapts them only through "
                   "target_parameters (gpt_oss: not at all), which megatrain does not build yet; ")
        else:
            why = f"{name!r} is not a linear module of a {family} layer; "
        refuse(key, target_modules, why + use)
    return tuple(name for name in ATTENTION_PROJECTIONS if name in target_modules)
