"""Which projections of a decoder layer LoRA adapts (finetune.lora.target_modules), per family, as peft 0.21.2's
get_peft_model chooses them on transformers 5.23's models.

Dense families: every nn.Linear of a layer (all-linear) or the named ones. Mixture-of-experts families: the
attention projections are nn.Linear as in a dense model; the experts are fused [E, ...] parameters and the router
a module of its own, neither an nn.Linear, so PEFT adapts them only through `target_parameters`:
- gpt_oss: all-linear is the four attention projections; naming the router or the experts fails in PEFT itself
  (GptOssTopKRouter and GptOssExperts are not supported modules), so these four are all there is.
- qwen3_moe, mixtral: PEFT 0.21 maps transformers 4's names onto transformers 5's fused tensors
  (peft/utils/transformers_weight_conversion.py): `gate` (the router) becomes LoRA on `mlp.gate.weight`,
  `gate_proj` + `up_proj` (Mixtral: `w1` + `w3`, both or neither) on each expert of `mlp.experts.gate_up_proj`,
  `down_proj` (`w2`) on each expert of `down_proj` (model/lora_moe.py); all-linear is all of them and the
  attention projections. A dense layer between MoE layers (Qwen3-MoE's mlp_only_layers) gets no MLP adapter, as
  in peft.
- deepseek_v3, glm4_moe: peft maps them as Qwen3-MoE (transformers' conversion pattern qwen2_moe): the router
  `gate` and the fused experts by `gate_proj` + `up_proj` / `down_proj`. Those names reach the routed experts only:
  peft turns every target ending in them into a target parameter, so the shared experts (mlp.shared_experts.*) and
  the dense first layers' MLPs, though nn.Linear, get no adapter under any name (all-linear included), and neither
  do they here. DeepSeek-V3's attention projections are its latent attention's: q_a_proj, q_b_proj (or q_proj where
  q_lora_rank is 0), kv_a_proj_with_mqa, kv_b_proj, o_proj; GLM-4.5 MoE's are q/k/v/o_proj (with their biases,
  which stay frozen).
The resolved names: the attention projections, and `gate`, `gate_up_proj`, `down_proj` for the router and experts.

Hybrid families (qwen3_5, qwen3_5_moe, qwen3_next): a full-attention layer has q/k/v/o_proj (q_proj holds the output
gate's rows too), a linear-attention layer its Gated DeltaNet's projections (LINEAR_MIXER_PROJECTIONS), each nn.Linear,
so peft adapts each on the layers that have it. Qwen3.5's dense MLP is gate/up/down_proj. On Qwen3.5-MoE (which
peft 0.21.2 has no weight conversion for) gate/up/down_proj are its shared expert's (mlp.shared_expert.*) and
shared_expert_gate its gate, each nn.Linear; the router and experts are no nn.Linear and take no adapter, so its
all-linear is the attention, linear-attention and shared-expert projections. Qwen3-Next's MoE layers are mapped as
Qwen3-MoE's (PARAM_TARGETS): `gate` is the router, gate_proj + up_proj / down_proj the fused experts, so its shared
expert's gate/up/down_proj and the dense layers' (mlp_only_layers) MLPs get no adapter under any name; its
shared_expert_gate is an nn.Linear (SHARED_EXPERT_TARGETS). Its all-linear: the attention and linear-attention
projections, shared_expert_gate, the router and the experts (a dense Qwen3-Next, num_experts 0: the first two only).
HYBRID_MLP_LINEAR holds each hybrid's MLP names that reach an nn.Linear.
"""

from __future__ import annotations

from typing import Literal

from megatrain_ray.config.fields import refuse

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
LATENT_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
"""DeepSeek-V3's latent attention (model/latent_attention.py): q_proj where q_lora_rank is 0, else q_a_proj and
q_b_proj (a model has one or the other: model/lora.adapter_shapes keeps those it has)."""
LORA_PROJECTIONS = (*ATTENTION_PROJECTIONS, "gate_proj", "up_proj", "down_proj")
"""The linear modules of a dense decoder layer by PEFT's short names."""
PHI3_LORA_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""Phi-3's fused projections."""

LINEAR_MIXER_PROJECTIONS = {"qwen3_5": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
                            "qwen3_5_moe": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
                            "qwen3_next": ("in_proj_qkvz", "in_proj_ba", "out_proj")}
"""A hybrid family's linear-attention (Gated DeltaNet) projections (model/linear_attention.py), by PEFT's names."""
SHARED_EXPERT_PROJECTIONS = {"gate_proj": "mlp.shared_expert.gate_proj", "up_proj": "mlp.shared_expert.up_proj",
                             "down_proj": "mlp.shared_expert.down_proj", "shared_expert_gate": "mlp.shared_expert_gate"}
"""A hybrid MoE layer's shared expert and its gate: PEFT's target names and the modules they reach."""
SHARED_EXPERT_TARGETS = {"qwen3_5_moe": tuple(SHARED_EXPERT_PROJECTIONS), "qwen3_next": ("shared_expert_gate",)}
"""The target names that reach a hybrid family's shared expert or its gate (nn.Linear, on its MoE layers): all four on
Qwen3.5-MoE, the gate alone on Qwen3-Next (peft maps gate_proj, up_proj and down_proj onto its routed experts:
PARAM_TARGETS). model/lora.adapter_shapes."""
HYBRID_MLP_LINEAR = {"qwen3_5": ("gate_proj", "up_proj", "down_proj"), **SHARED_EXPERT_TARGETS}
"""A hybrid family's MLP target names that reach an nn.Linear: Qwen3.5's dense MLP, the shared expert's."""
_QWEN2_MOE_NAMES = {"gate": "gate", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
ROUTER_AND_EXPERT_NAMES = {"qwen3_moe": ("gate", "gate_proj", "up_proj", "down_proj"),
                           "qwen3_next": ("gate", "gate_proj", "up_proj", "down_proj"),
                           "deepseek_v3": ("gate", "gate_proj", "up_proj", "down_proj"),
                           "glm4_moe": ("gate", "gate_proj", "up_proj", "down_proj"),
                           "mixtral": ("gate", "w1", "w2", "w3"),
                           "gpt_oss": ("router", "experts", "gate_up_proj", "down_proj")}
"""The target_modules names that reach a MoE layer's router or fused experts in PEFT (gpt_oss: that PEFT refuses)."""
PARAM_TARGETS = {"qwen3_moe": _QWEN2_MOE_NAMES, "deepseek_v3": _QWEN2_MOE_NAMES, "glm4_moe": _QWEN2_MOE_NAMES,
                 "qwen3_next": _QWEN2_MOE_NAMES,
                 "mixtral": {"gate": "gate", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}}
"""PEFT's transformers-4 names -> the resolved router / expert target (model/lora_moe.py)."""
FUSED_PAIRS = {"qwen3_moe": ("gate_proj", "up_proj"), "deepseek_v3": ("gate_proj", "up_proj"),
               "glm4_moe": ("gate_proj", "up_proj"), "qwen3_next": ("gate_proj", "up_proj"), "mixtral": ("w1", "w3")}
ROUTER_AND_EXPERTS = ("gate", "gate_up_proj", "down_proj")
MLP_NAMES_ON_SHARED_EXPERT = frozenset(SHARED_EXPERT_TARGETS) - frozenset(PARAM_TARGETS)
"""Families whose MLP target names reach the shared expert (SHARED_EXPERT_PROJECTIONS) and never the routed experts
or the router (peft has no weight conversion for them: Qwen3.5-MoE): model/lora_moe.param_adapters."""
_SHARED = (" ({} and the dense {}MLPs take no adapter: peft maps every target named gate_proj, up_proj or "
           "down_proj onto the routed experts)")
_SHARED_NOTE = {"deepseek_v3": _SHARED.format("the shared experts", "first layers' "),
                "glm4_moe": _SHARED.format("the shared experts", "first layers' "),
                "qwen3_next": _SHARED.format("the shared expert's projections", "layers' ")}


def lora_targets(family: str, target_modules: list[str] | Literal["all-linear"], key: str) -> tuple[str, ...]:
    """The targeted projections' short names for a family, in the layer's order; `key`: the config field, named
    in the error when a target cannot be adapted."""
    if family in LINEAR_MIXER_PROJECTIONS:
        return _hybrid_targets(family, target_modules, key)
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


def _hybrid_targets(family: str, target_modules: list[str] | Literal["all-linear"], key: str) -> tuple[str, ...]:
    linear = (*ATTENTION_PROJECTIONS, *LINEAR_MIXER_PROJECTIONS[family], *HYBRID_MLP_LINEAR[family])
    return _linear_and_param_targets(family, target_modules, key, linear)


def _moe_targets(family: str, target_modules: list[str] | Literal["all-linear"], key: str) -> tuple[str, ...]:
    if family == "gpt_oss":
        if target_modules == "all-linear":
            return ATTENTION_PROJECTIONS
        for name in target_modules:
            if name not in ATTENTION_PROJECTIONS:
                why = (f"{name!r} is gpt_oss's router or experts, which peft cannot adapt (GptOssTopKRouter and "
                       "GptOssExperts are not nn.Linear); " if name in ROUTER_AND_EXPERT_NAMES[family]
                       else f"{name!r} is not a linear module of a gpt_oss layer; ")
                refuse(key, target_modules, why + f"choose from {', '.join(ATTENTION_PROJECTIONS)} (or all-linear, "
                       "which is those four on gpt_oss)")
        return tuple(name for name in ATTENTION_PROJECTIONS if name in target_modules)
    attention = LATENT_PROJECTIONS if family == "deepseek_v3" else ATTENTION_PROJECTIONS
    return _linear_and_param_targets(family, target_modules, key, attention)


def _linear_and_param_targets(family: str, target_modules: list[str] | Literal["all-linear"], key: str,
                              linear: tuple[str, ...]) -> tuple[str, ...]:
    """The targets of a family whose nn.Linear targets are `linear` and whose router and experts peft maps by
    PARAM_TARGETS (where it has a mapping): all-linear is both; a name that reaches neither is refused."""
    params = PARAM_TARGETS.get(family, {})
    if target_modules == "all-linear":
        return (*linear, *(ROUTER_AND_EXPERTS if params else ()))
    for name in target_modules:
        if name not in linear and name not in params:
            refuse(key, target_modules, f"{name!r} is not a module of a {family} layer peft adapts; choose from "
                   f"{', '.join((*linear, *params))} or all-linear" + _SHARED_NOTE.get(family, ""))
    return (*(n for n in linear if n in target_modules), *_param_targets(family, target_modules, key))


def _param_targets(family: str, target_modules: list[str], key: str) -> tuple[str, ...]:
    """The router and expert targets (ROUTER_AND_EXPERTS' names, in that order) that the named targets map to in
    peft's conversion (PARAM_TARGETS; none in a family without one); the fused pair both or neither, as peft."""
    mapping = PARAM_TARGETS.get(family)
    if not mapping:
        return ()
    pair = FUSED_PAIRS[family]
    if (pair[0] in target_modules) != (pair[1] in target_modules):
        refuse(key, target_modules, f"{pair[0]} and {pair[1]} are fused into {family}'s mlp.experts.gate_up_proj: "
               "target both or neither (as peft requires)")
    resolved = {mapping[name] for name in target_modules if name in mapping}
    return tuple(n for n in ROUTER_AND_EXPERTS if n in resolved)


def refuse_param_adapter_settings(family: str, targets: tuple[str, ...], use_rslora: bool, lora_dropout: float,
                                  section: str) -> None:
    """peft's ParamWrapper (router and expert adapters) refuses lora_dropout; use_rslora would scale the
    rank-2r gate_up_proj adapter by 2 lora_alpha / sqrt(2 r), which is not built: both refused with such targets."""
    if family not in PARAM_TARGETS or not any(t in ROUTER_AND_EXPERTS for t in targets):
        return
    if lora_dropout:
        refuse(f"{section}.lora_dropout", lora_dropout, "peft cannot apply dropout to adapters on the router or the "
               f"fused experts ({section}.target_modules names them, or all-linear on this family); set it to 0 or "
               "target the attention projections only")
    if use_rslora:
        refuse(f"{section}.use_rslora", use_rslora, "is not built with adapters on the router or the fused experts; "
               "set it false or target the attention projections only")
