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


@pytest.mark.parametrize("heads, kv_heads, capacity", [(8, 2, 256), (6, 6, 320), (8, 2, 100)])
def test_decode_attention_split_along_the_keys_equals_repeated_heads_math(heads, kv_heads, capacity):
    """A decode step over a cache of whole 64-key chunks (model/decode_attention.py splits it: 4 and 5 chunks here)
    and of a length that is none (one chunk), with left padding and unwritten slots; float64 within 1e-12."""
    from megatrain_ray.model.decode_attention import _chunk_len

    torch.manual_seed(1)
    rows, dim = 3, 16
    spec = LayerSpec(heads, kv_heads, dim, 1e-6, qk_norm=False, attention_bias=False, sliding_window=0)
    valid = torch.ones(rows, capacity, dtype=torch.bool)
    valid[1, :5] = False
    valid[2, :70] = False  # padding across a whole chunk
    allowed = cache_mask(valid, torch.tensor(capacity - 30), 1, 0)
    q = torch.randn(rows, 1, heads, dim, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(rows, kv_heads, capacity, dim, dtype=torch.float64)
    v = torch.randn(rows, kv_heads, capacity, dim, dtype=torch.float64)
    chunk = _chunk_len(capacity, rows * kv_heads)
    assert capacity % chunk == 0 and (capacity // chunk > 1) == (capacity % 64 == 0)
    out = cached_attention(q, k, v, allowed, spec)
    expected = reference(q, k, v, allowed)
    assert ((out - expected).abs().max() / expected.abs().max()).item() <= 1e-12
    # a slice of the cache (the eager decode pass attends to its first indices only): one chunk, the same math
    end = capacity - 29
    sliced = cached_attention(q, k[:, :, :end], v[:, :, :end], allowed[..., :end], spec)
    assert ((sliced - expected).abs().max() / expected.abs().max()).item() <= 1e-12


def test_the_cache_holds_whole_key_chunks():
    from megatrain_ray.model.decode import cache_capacity

    assert [cache_capacity(n) for n in (1, 64, 65, 1461, 12800)] == [64, 64, 128, 1472, 12800]
