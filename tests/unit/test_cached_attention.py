"""The rollout's attention over its KV cache (model/attention.py cached_attention): grouped-query heads folded into
the query length so SDPA needs no enable_gqa beside a mask. Against plain PyTorch math in float64 (keys and values
repeated to every query head, scores, masked softmax, weighted sum), for a decode step (one query per row over a
cache with left padding and unwritten slots) and a prefill (several queries, causal), with and without groups."""

from __future__ import annotations

import pytest
import torch

from megatrain_ray.model.attention import cached_attention
from megatrain_ray.model.decode import cache_mask
from megatrain_ray.model.layer_spec import LayerSpec


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (6, 6)])
@pytest.mark.parametrize("start, count", [(9, 1), (0, 5)])
def test_cached_attention_equals_repeated_heads_math(heads, kv_heads, start, count):
    torch.manual_seed(0)
    rows, capacity, dim = 3, 12, 16
    spec = LayerSpec(heads, kv_heads, dim, 1e-6, qk_norm=False, attention_bias=False, sliding_window=0)
    valid = torch.ones(rows, capacity, dtype=torch.bool)
    valid[1, :2] = False  # left padding of a shorter prompt
    valid[2, :4] = False
    # a decode step (tensor start) attends over the whole cache, the prefill over its first `count` indices
    index = torch.tensor(start) if count == 1 else start
    allowed = cache_mask(valid, index, count, 0)
    keys = allowed.shape[-1]
    q = torch.randn(rows, count, heads, dim, dtype=torch.float64).transpose(1, 2)  # as attention_qkv: not contiguous
    k = torch.randn(rows, kv_heads, keys, dim, dtype=torch.float64)
    v = torch.randn(rows, kv_heads, keys, dim, dtype=torch.float64)
    out = cached_attention(q, k, v, allowed, spec)
    expected = reference(q, k, v, allowed)
    assert out.shape == expected.shape
    assert ((out - expected).abs().max() / expected.abs().max()).item() <= 1e-12
