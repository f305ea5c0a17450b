"""LoRA on a mixture-of-experts layer's router and fused experts, as peft 0.21.2's ParamWrapper does it
(target_parameters; Qwen3-MoE and Mixtral, whose transformers-4 names peft maps onto transformers 5's tensors:
config/lora_targets.py).

- The router `mlp.gate.weight` [E, hidden] gets one adapter, A [r, hidden], B [E, r]: the router computes with
  W + (B A) * scaling (peft's delta, in the weight's dtype), under PEFT's name `mlp.gate`.
- A fused expert tensor W [E, out, in] gets one adapter per expert, stacked as PEFT stacks them: A [E * r, in]
  (expert e's rows e*r .. e*r + r - 1) and B [out, r * E] (expert e's columns e, e + E, e + 2E, ...); the experts
  compute with baddbmm(W, B_e, A_e, alpha=scaling), the factors cast to W's dtype. `gate_up_proj` takes rank 2r
  (and alpha 2 lora_alpha: the same scaling) when both gate_proj and up_proj (w1 and w3) are targeted, as peft's
  rank_pattern; `down_proj` rank r. PEFT nests the two wrappers: with both, gate_up_proj's adapter is
  `mlp.experts.base_layer` and down_proj's `mlp.experts`; alone, either is `mlp.experts`.
peft refuses lora_dropout and DoRA on such parameters; use_rslora would scale the rank-2r adapter differently,
so both are refused here with the targets (config/lora_targets.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatrain_ray.config.lora_targets import MLP_NAMES_ON_SHARED_EXPERT

ROUTER, EXPERTS, INNER = "mlp.gate", "mlp.experts", "mlp.experts.base_layer"
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


@dataclass(frozen=True, slots=True)
class ParamAdapter:
    module: str
    """PEFT's name of the wrapper inside the layer (its adapter's keys are `<module>.lora_A.weight`, ...)."""
    param: str
    """The adapted tensor inside the layer."""
    experts: int
    """1 for the router."""
    rank: int
    """Per expert."""
    in_features: int
    out_features: int

    @property
    def a_shape(self) -> tuple[int, int]:
        return (self.experts * self.rank, self.in_features)

    @property
    def b_shape(self) -> tuple[int, int]:
        return (self.out_features, self.experts * self.rank)


def param_adapters(model, targets: tuple[str, ...], r: int, layer: int) -> list[ParamAdapter]:
    """The router and expert adapters of decoder layer `layer` (none on a dense layer), for the targets' short
    names (config/lora_targets.py: `gate`, `gate_up_proj`, `down_proj` once resolved). None in the
    MLP_NAMES_ON_SHARED_EXPERT families (Qwen3.5-MoE): their MLP names reach the shared expert."""
    if not model.is_moe or not model.layer_is_moe(layer) or model.family in MLP_NAMES_ON_SHARED_EXPERT:
        return []
    e, h, f = model.num_experts, model.hidden_size, model.expert_intermediate_size
    out = []
    if "gate" in targets:
        out.append(ParamAdapter(ROUTER, f"{ROUTER}.weight", 1, r, h, e))
    both = "gate_up_proj" in targets and "down_proj" in targets
    if "gate_up_proj" in targets:
        out.append(ParamAdapter(INNER if both else EXPERTS, GATE_UP, e, 2 * r, h, 2 * f))
    if "down_proj" in targets:
        out.append(ParamAdapter(EXPERTS, DOWN, e, r, f, h))
    return out


def _factors(a: torch.Tensor, b: torch.Tensor, experts: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's (lhs, rhs) of a stacked expert adapter: B_e [E, out, r] and A_e [E, r, in], in `dtype`."""
    rhs = a.reshape(experts, -1, a.shape[-1])
    lhs = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)
    return lhs.to(dtype), rhs.to(dtype)


def adapted_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The tensor the layer computes with: W + scaling * B A for the router (2-D), per expert for [E, out, in]."""
    if weight.dim() == 2:
        return weight + ((b @ a) * scaling).to(weight.dtype)
    lhs, rhs = _factors(a, b, weight.shape[0], weight.dtype)
    return torch.baddbmm(weight, lhs, rhs, alpha=scaling)


def which_param(module: str, a: torch.Tensor, b: torch.Tensor, shapes: Mapping[str, tuple[int, ...]]) -> str:
    """The tensor an adapter bound under PEFT's `module` adapts: its shapes tell gate_up_proj [E, 2f, h] from
    down_proj [E, h, f] when the adapter is `mlp.experts` alone (A's width is the tensor's input, B's height its
    output; they differ for the two whatever h and f)."""
    if module == ROUTER:
        return f"{ROUTER}.weight"
    if module == INNER:
        return GATE_UP
    for name in (DOWN, GATE_UP):
        shape = shapes[name]
        if (a.shape[-1], b.shape[0]) == (shape[2], shape[1]):
            return name
    raise ValueError(f"the adapter {module} (A {tuple(a.shape)}, B {tuple(b.shape)}) fits no expert tensor")


def with_param_adapters(w: Mapping[str, torch.Tensor], scaling: float) -> Mapping[str, torch.Tensor]:
    """A MoE layer's tensors with the router and expert tensors its bound adapters adapt replaced by the adapted
    ones (w itself when none is bound)."""
    modules = [m for m in (ROUTER, INNER, EXPERTS) if f"{m}.lora_A.weight" in w]
    if not modules:
        return w
    out = dict(w)
    shapes = {n: tuple(w[n].shape) for n in (GATE_UP, DOWN)}
    for m in modules:
        a, b = w[f"{m}.lora_A.weight"], w[f"{m}.lora_B.weight"]
        name = which_param(m, a, b, shapes)
        out[name] = adapted_weight(w[name], a, b, scaling)
    return out
