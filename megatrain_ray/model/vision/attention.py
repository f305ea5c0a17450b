"""The vision towers' segmented attention (Qwen2.5-VL's windows, each image of the Qwen-VL full-attention blocks) in
one SDPA call per segment length, where transformers makes one call per segment.

transformers' Qwen-VL vision attention takes the whole patch sequence with `cu_seqlens` (segment bounds) and, unless
a flash-attention implementation is configured, splits it and runs SDPA once per segment: for Qwen2.5-VL's
112-pixel windows that is 64 patches a call, 16 calls per 448x448 image in each of its 28 windowed blocks, 3,616
calls per step at 8 images (a host-bound tower: each call is a few microseconds of GPU work and tens of host work).
With a flash-attention implementation it calls the attention function once with the bounds (`cu_seq_lens_q`), so
`segment_attention` is registered under a name holding "flash" (transformers picks that path by the name, in
`is_flash_attention_requested`) and computes the same attention with PyTorch's SDPA: the segments of each length
stacked as the batch of one call (all of them in one call when every window is whole), the outputs put back in the
sequence's order. The same arithmetic per segment (queries, keys and values of that segment only, the same scale),
so the same logits (tests/unit/test_vision_attention.py, tests/integration/test_vision_parity.py).

The segment plan (which lengths, which rows) is read from the bounds once per bounds tensor (a tower's forward makes
one for its windows and one for its images) and kept on that tensor.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

SEGMENT_ATTENTION = "megatrain_flash_segments_sdpa"
"""The attention implementation's name (holding "flash": see the module's docstring)."""


class SegmentPlan:
    """The segments of bounds `cu` [segments + 1] by length: (length, first row, count, rows or None when the
    segments of that length lie one after another from the first row), and the order that puts the groups' outputs
    back (None: they already are in the sequence's order)."""

    def __init__(self, cu: torch.Tensor):
        bounds = [int(b) for b in cu.tolist()]
        self.total = bounds[-1] - bounds[0]
        starts: dict[int, list[int]] = {}
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                starts.setdefault(b - a, []).append(a)
        self.groups: list[tuple[int, int, int, torch.Tensor | None]] = []
        order: list[int] = []
        for length, firsts in starts.items():
            rows = [r for s in firsts for r in range(s, s + length)]
            runs = rows == list(range(firsts[0], firsts[0] + len(rows)))
            self.groups.append((length, firsts[0], len(firsts),
                                None if runs else torch.tensor(rows, dtype=torch.long, device=cu.device)))
            order += rows
        in_order = order == list(range(bounds[0], bounds[0] + len(order)))
        self.inverse = None if in_order else torch.argsort(torch.tensor(order, device=cu.device))
        self.offset = bounds[0]


def plan_of(cu: torch.Tensor) -> SegmentPlan:
    plan = getattr(cu, "_megatrain_segments", None)
    if plan is None:
        plan = SegmentPlan(cu)
        cu._megatrain_segments = plan  # lives as long as the bounds tensor (one tower forward)
    return plan


def segment_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None = None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                      cu_seq_lens_k: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query/key/value [1, heads, tokens, head_dim]; returns
    ([1, tokens, heads, head_dim], None). Attention within each segment of `cu_seq_lens_q` (the same bounds for the
    keys); without bounds, over the whole sequence as transformers' SDPA function."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is not None or query.shape[0] != 1 or \
            (cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q
             and not torch.equal(cu_seq_lens_k, cu_seq_lens_q)):
        raise ValueError("segment attention takes one sequence, the same segments for queries and keys, no mask")
    plan = plan_of(cu_seq_lens_q)
    heads, kv_heads = query.shape[1], key.shape[1]
    if plan.offset != 0 or plan.total != query.shape[2]:
        raise ValueError(f"the segments cover rows {plan.offset}..{plan.offset + plan.total} of a sequence of "
                         f"{query.shape[2]}")
    causal = bool(is_causal) if is_causal is not None else False
    outputs = []
    for length, first, count, rows in plan.groups:
        parts = []
        for t, h in ((query, heads), (key, kv_heads), (value, kv_heads)):
            t = t[0, :, first:first + count * length] if rows is None else t[0].index_select(1, rows)
            parts.append(t.reshape(h, count, length, t.shape[-1]).transpose(0, 1))  # [segments, heads, length, d]
        out = F.scaled_dot_product_attention(*parts, dropout_p=dropout, scale=scaling, is_causal=causal,
                                             enable_gqa=kv_heads != heads)
        outputs.append(out.permute(0, 2, 1, 3).reshape(count * length, heads, out.shape[-1]))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
    if plan.inverse is not None:
        out = out.index_select(0, plan.inverse)
    return out.unsqueeze(0), None


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
    return SEGMENT_ATTENTION


def takes_segments(part: torch.nn.Module) -> bool:
    """Whether a tower's attention runs over segment bounds (a module whose forward takes `cu_seqlens`)."""
    return any("cu_seqlens" in inspect.signature(type(m).forward).parameters
               for m in part.modules() if "Attention" in type(m).__name__)


def use_segment_attention(part: torch.nn.Module) -> bool:
    """Point a tower (a PreTrainedModel part) whose attention takes segment bounds at `segment_attention`; whether
    it did."""
    if not takes_segments(part):
        return False
    name = register()
    configs = {id(m.config): m.config for m in part.modules() if getattr(m, "config", None) is not None}
    for config in configs.values():
        config._attn_implementation = name
    return True
