"""Attention with sinks (gpt-oss): each head has a learned logit that joins every query's softmax as one more
column and is dropped after it, so a query may give part of its attention to nothing.

As transformers' eager gpt-oss attention: explicit products over a [B, H, T, T] score tensor (k and v repeated
to q's heads), the sink column appended, the row maximum subtracted, the softmax in the scores' dtype.
Memory grows with T^2: for long sequences the planner's attention estimate does not hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain_ray.exceptions import ConfigError


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float,
                   window: int, documents: object = None) -> torch.Tensor:
    """q: [B, H, T, D], k and v: [B, H_kv, T, D], sinks: [H]; causal, within `window` tokens when > 0."""
    if documents is not None:
        raise ConfigError("data.packing: attention with sinks (gpt_oss) runs on plain rows only; set "
                          "data.packing false")
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    seq_len = q.shape[2]
    i = torch.arange(seq_len, device=q.device)[:, None]
    j = torch.arange(seq_len, device=q.device)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, seq_len, 1).to(scores.dtype)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
