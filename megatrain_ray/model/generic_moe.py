"""The generic path's mixtures of experts: the router logits captured as the model computes them.

transformers collects a MoE model's router logits with forward hooks on the modules its base model names in
`_can_record_outputs["router_logits"]` (OutputRecorder: a module class and the index of the logits in its
output; JetMoE names two per layer, its attention's router and its MLP's), and its causal LM turns them into
the load-balancing loss with load_balancing_loss_func(router_logits, self.num_experts,
self.num_experts_per_tok): each router's softmax over its logits, the top-k of that softmax counted per
expert, the probabilities summed per expert, pooled over every router and row; the loss adds
router_aux_loss_coef (JetMoE: aux_loss_coef) times it. The shared experts (Qwen2-MoE) and the routing itself
(GraniteMoE's top-k then softmax, Phimoe's sparsemixer, Ernie 4.5's corrected scores) are the layer module's
own and need nothing here.

Here the same modules get a forward hook while their layer runs (forward and recomputed backward), which
adds the router's counts, summed probabilities (float32, with autograd, as transformers sums them) and rows
to the layer's RouterRecord (model/moe.py); the engine pools them as for the native MoE families
(engine/router_aux.py). Nothing is recorded where the model's config.json has output_router_logits off.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatrain_ray.config.hf_generic import GenericArchitecture, UnsupportedModelError
from megatrain_ray.model.moe import RouterRecord

Router = tuple[Any, int]
"""A module whose output holds router logits, and their index in its output (a tuple; a tensor: itself)."""


@dataclass(frozen=True)
class GenericRouting:
    """What the load-balancing loss of a generic MoE model needs: the routers of each layer, as transformers
    records them, and the causal LM's own expert count, top-k and coefficient."""

    on: bool
    """config.json's output_router_logits: the loss is computed and added in training."""
    num_experts: int
    top_k: int
    coef: float
    routers: tuple[tuple[Router, ...], ...]
    """Per decoder layer (empty: a dense layer)."""

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, routers in enumerate(self.routers) if routers]


_LAYER_ROUTERS: weakref.WeakKeyDictionary[Any, tuple[GenericRouting, tuple[Router, ...]]] = \
    weakref.WeakKeyDictionary()
"""Each decoder layer module of a GenericTemplate with routers -> (its model's routing, its routers)."""


def _recorders(model: Any) -> list[Any]:
    """The OutputRecorders (or bare classes) transformers uses to collect `model`'s router logits."""
    specs = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if specs is None:
        return []
    return list(specs) if isinstance(specs, (list, tuple)) else [specs]


def _layer_routers(layer: Any, layer_name: str, recorders: list[Any]) -> tuple[Router, ...]:
    """The modules of decoder layer `layer` (named `layer_name` in the model) that transformers hooks for router
    logits, in the order transformers' hooks would record them (module order)."""
    found = []
    for name, module in layer.named_modules(prefix=layer_name):
        for spec in recorders:
            target = getattr(spec, "target_class", spec if isinstance(spec, type) else None)
            class_name = getattr(spec, "class_name", spec if isinstance(spec, str) else None)
            if not ((target is not None and isinstance(module, target)) or
                    (class_name is not None and name.endswith(class_name))):
                continue
            wanted = getattr(spec, "layer_name", None)
            if wanted is not None and f".{wanted.strip('.')}." not in name + ".":
                continue
            found.append((module, getattr(spec, "index", 1)))
    return tuple(found)


def _number(model: Any, names: tuple[str, ...], what: str, kind: type) -> Any:
    for name in names:
        value = getattr(model, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return kind(value)
    raise UnsupportedModelError(f"{type(model).__name__} cannot run on the generic path with output_router_logits "
                                f"on: its causal LM names no {what} (as {' or '.join(names)}), which transformers' "
                                "load-balancing loss takes; set output_router_logits to false in config.json to "
                                "train without that loss")


def generic_routing(arch: GenericArchitecture) -> GenericRouting | None:
    """The routing of `arch`'s model (None: it records no router logits, a dense model), its layers' routers
    registered for run_layer."""
    recorders = _recorders(arch.model)
    if not recorders:
        return None
    path = f"{arch.base_prefix}{arch.layers_name}"
    routers = tuple(_layer_routers(layer, f"{path}.{i}", recorders) for i, layer in enumerate(arch.layers))
    if not any(routers):
        return None
    model = arch.model
    on = bool(getattr(model.config, "output_router_logits", False))
    if on:
        routing = GenericRouting(True, _number(model, ("num_experts",), "expert count", int),
                                 _number(model, ("num_experts_per_tok",), "top-k", int),
                                 _number(model, ("router_aux_loss_coef", "aux_loss_coef"), "coefficient", float),
                                 routers)
    else:
        routing = GenericRouting(False, 0, 0, 0.0, routers)
    for layer, layer_routers in zip(arch.layers, routers):
        if layer_routers:
            _LAYER_ROUTERS[layer] = (routing, layer_routers)
    return routing


def _record(routing: GenericRouting, index: int, record: RouterRecord, module: Any, args: Any, output: Any) -> None:
    """A router's forward hook: its logits' counts and probability sums into `record`, as
    load_balancing_loss_func computes them (softmax in the logits' dtype, top-k of it, sums in float32)."""
    logits = output[index] if isinstance(output, tuple) else output
    if logits is None:
        return
    probs = F.softmax(logits.reshape(-1, logits.shape[-1]), dim=-1)
    _, selected = torch.topk(probs, routing.top_k, dim=-1)
    flat = selected.reshape(-1)
    counts = torch.zeros(probs.shape[-1], dtype=torch.float32, device=probs.device).index_add_(
        0, flat, torch.ones(flat.shape, dtype=torch.float32, device=probs.device))
    record.add(counts, probs.float().sum(0), probs.shape[0])


def call_recording(layer: Any, call: Any, record: RouterRecord | None) -> Any:
    """`call()` (the layer's forward), its routers' statistics added to `record` (None: nothing recorded)."""
    entry = _LAYER_ROUTERS.get(layer) if record is not None else None
    if entry is None:
        return call()
    routing, routers = entry
    handles = [module.register_forward_hook(functools.partial(_record, routing, index, record))
               for module, index in routers]
    try:
        return call()
    finally:
        for handle in handles:
            handle.remove()
