"""DeepSeek-V3's router, as a stateless function, following transformers' DeepseekV3TopkRouter operation by
operation: logits of the rows in float32 (float64 when computing in it), sigmoid scores; the choice by the scores
plus `mlp.gate.e_score_correction_bias`, limited to the topk_group best of n_group consecutive expert groups (a
group's score: the sum of its two best); the chosen experts' scores without the bias as their weights, renormalised
(norm_topk_prob, + 1e-20 in the denominator) and times routed_scaling_factor, kept in that dtype.

The correction bias is a buffer of the checkpoint (DeepSeek moves it between steps by the experts' load, outside
the gradient; transformers keeps it fixed in training): it is in its layer's stage so that it streams, is read and is
exported with the layer, takes no gradient (its only use is the choice, which has none), and AdamW leaves it as it
is (a zero gradient and zero moments give a zero step; one-dimensional, so no weight decay): FIXED_TENSORS.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

BIAS = "mlp.gate.e_score_correction_bias"
FIXED_TENSORS = frozenset({BIAS})
"""Tensors of a layer's stage that are never trained: bound without requires_grad, their gradient zeros."""


def trains(name: str, trainable=None) -> bool:
    """Whether the backward takes tensor `name`'s gradient: not one of FIXED_TENSORS, and `trainable`'s choice (None:
    all others; LoRA: its adapters)."""
    return name not in FIXED_TENSORS and (trainable is None or trainable(name))


def with_fixed_zeros(grads: dict[str, torch.Tensor], w: Mapping[str, torch.Tensor],
                     trainable=None) -> dict[str, torch.Tensor]:
    """`grads` with a zero gradient for each of w's FIXED_TENSORS where every other tensor is trained (trainable
    None): the stage's gradient buffer takes one per slot."""
    if trainable is None:
        for name in FIXED_TENSORS.intersection(w):
            grads[name] = torch.zeros_like(w[name])
    return grads


def sigmoid_route(h: torch.Tensor, w: Mapping[str, torch.Tensor], spec: Any,
                  record: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, k] (float32; float64 in float64) and expert indices [T, k] of the rows h [T, hidden].
    `spec`: the layer's model/moe.MoeSpec; `record`: its RouterRecord or None (moe.py imports this module)."""
    work = torch.promote_types(h.dtype, torch.float32)
    logits = F.linear(h.to(work), w["mlp.gate.weight"].to(work))
    scores = logits.sigmoid()
    experts, groups = spec.num_experts, spec.n_group
    with torch.no_grad():  # the choice takes no gradient (top-k indices)
        choice = scores.detach() + w[BIAS].to(work)
        group_scores = choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
        group_index = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_index, 1)
        allowed = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
        choice = choice.masked_fill(~allowed.bool(), float("-inf"))
        index = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * spec.routed_scaling_factor
    if record is not None:  # the expert counts (their idle experts' gradients skipped); no load-balancing loss
        flat = index.reshape(-1)
        counts = torch.zeros(experts, dtype=torch.float32, device=h.device).index_add_(
            0, flat, torch.ones(flat.shape, dtype=torch.float32, device=h.device))
        record.add(counts, scores.float().sum(0), h.shape[0])
    return weights, index
