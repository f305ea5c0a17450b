"""Resident layers whose forward keeps its autograd graph (engine.kept_activations, RunSpec.kept_layers).

A streamed layer keeps only its input and recomputes its forward in the backward (templates.decoder_layer_backward):
a third more compute, the price of holding one layer's activations at a time. A GPU-resident layer whose
activations fit the memory the plan leaves (planning/gpu_memory.kept_layer_bytes) runs its forward with autograd
on instead, as a GPU-resident PyTorch run without activation checkpointing does, and its backward is
torch.autograd.grad over that graph: the same functions on the same inputs, so the same gradients (float64: equal
to rounding, tests/integration/test_kept_activations.py), without the recompute. The graph is freed as its
backward runs; a MoE layer's summed router probabilities stay in it for the load-balancing loss's gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatrain_ray.model.moe import RouterRecord
from megatrain_ray.model.sigmoid_router import FIXED_TENSORS, trains


@dataclass(slots=True)
class KeptLayer:
    """One layer's forward graph, waiting for its backward."""

    y: torch.Tensor
    """The layer's output, with its graph."""
    x: torch.Tensor
    """The layer's input (a leaf)."""
    names: list[str]
    """The weights whose gradients the backward takes, by name."""
    params: list[torch.Tensor]
    prob_sum: torch.Tensor | None = None
    """A MoE layer's summed router probabilities (the load-balancing loss on), with their graph."""
    fixed: dict[str, torch.Tensor] | None = None
    """Zero gradients of the layer's untrained tensors (model/sigmoid_router.FIXED_TENSORS)."""


def forward_kept(layer: Callable[..., torch.Tensor], x: torch.Tensor, w: dict[str, torch.Tensor], rope: Any,
                 spec: Any, documents: Any, mlp_chunk_tokens: int, trainable: Any = None,
                 router: RouterRecord | None = None) -> tuple[torch.Tensor, KeptLayer]:
    """The layer's output (no graph: the next layer's input) and its kept graph. `layer`: the decoder-layer
    template (compiled or eager) with decoder_layer's arguments; `trainable`: as decoder_layer_backward's;
    `router`: where the forward records a MoE layer's routing for the load-balancing loss (RouterAux.record)."""
    x = x.detach().requires_grad_(True)
    params = {n: t.detach().requires_grad_(trains(n, trainable)) for n, t in w.items()}
    names = [n for n, t in params.items() if t.requires_grad]
    prob_sum = None
    with torch.enable_grad():
        if router is not None:
            record = RouterRecord()
            y = layer(x, params, rope, spec, documents, mlp_chunk_tokens, record)
            router.add(record.counts, record.prob_sum.detach(), record.rows)
            prob_sum = record.prob_sum
        else:
            y = layer(x, params, rope, spec, documents, mlp_chunk_tokens)
    fixed = {n: torch.zeros_like(t) for n, t in w.items() if n in FIXED_TENSORS} if trainable is None else {}
    return y.detach(), KeptLayer(y, x, names, [params[n] for n in names], prob_sum, fixed)


def backward_kept(kept: KeptLayer, grad_y: torch.Tensor, router_grad: torch.Tensor | None = None) \
        -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(grad of the layer's input, grads of its weights by name) through the kept graph, which this frees.
    `router_grad`: the load-balancing loss's gradient of the summed router probabilities (RouterAux.layer_grad)."""
    outputs, grad_outputs = [kept.y], [grad_y]
    if router_grad is not None and kept.prob_sum is not None:
        outputs.append(kept.prob_sum)
        grad_outputs.append(router_grad)
    grads = torch.autograd.grad(outputs, [kept.x, *kept.params], grad_outputs)
    return grads[0], {**dict(zip(kept.names, grads[1:])), **(kept.fixed or {})}
