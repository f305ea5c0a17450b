"""Attention of one decode step over the rollout's KV cache, split along the keys (flash-decoding's split-K, in plain
PyTorch so it runs on any device, in float64 too, and inside the decode step's CUDA graph).

A decode step has one query per row. torch's SDPA kernels that take a mask (the rollout needs one: left padding and
the unwritten slots) do not split the keys across thread blocks: on an H200 with torch 2.11, cuDNN's masked kernel
took 277 us a layer over 12,800 keys of 2 rows x 8 KV heads, its unmasked kernel (split, with a reduction after it)
28 us, this one 68 us (benchmarks/decode_step.py). Here the scores of all query heads of a KV head against the whole
cache are one batched product (parallel along the keys), the masked softmax one kernel over them, and the weighted
sum of the values a batched product per chunk of keys (many small independent products) summed over the chunks.
Scores and softmax are float32 (float64 when computing in it), the probabilities in the values' dtype for their
product, as the flash kernels do.
"""

from __future__ import annotations

import torch

CHUNK_UNIT = 64
"""Chunks of keys are whole multiples of this many (model/decode.cache_capacity rounds the cache to it)."""
TARGET_PRODUCTS = 512
"""About this many independent chunk products per layer (4 per SM of an H200) when the cache is long enough."""

_out_dtype_ok: dict[torch.device, bool] = {}


def _chunk_len(length: int, batches: int) -> int:
    """Keys per chunk: the fewest chunks, at least TARGET_PRODUCTS / batches, that split `length` into equal
    multiples of CHUNK_UNIT; the whole length (one chunk) when it is no such multiple."""
    if length % CHUNK_UNIT:
        return length
    units = length // CHUNK_UNIT
    wanted = max(1, min(units, -(-TARGET_PRODUCTS // batches)))
    chunks = next(n for n in range(wanted, units + 1) if units % n == 0)
    return length // chunks


def _bmm_wide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (batched), float32 for half-precision a and b: on a GPU the product's own float32 accumulators (torch's
    bmm out_dtype; a torch without it rounds the product to a's dtype first), elsewhere from float32 copies; float32
    and float64 in their dtype."""
    if a.dtype not in (torch.float16, torch.bfloat16):
        return torch.bmm(a, b)
    if not a.is_cuda:
        return torch.bmm(a.float(), b.float())
    if _out_dtype_ok.get(a.device, True):
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            _out_dtype_ok[a.device] = False
    return torch.bmm(a, b).float()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q k^T * scale where `allowed`) v for q [B, H, 1, D] over k [B, H_kv, L, D] and v [B, H_kv, L, Dv] (H a
    multiple of H_kv, query head h reading KV head h // (H / H_kv) as in GQA), `allowed` [B, 1, 1, L]; returns
    [B, H, 1, Dv] in q's dtype."""
    batch, heads, _, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    groups, n = heads // kv_heads, batch * kv_heads
    wide = torch.promote_types(q.dtype, torch.float32)
    folded = q.reshape(n, groups, dim)
    scores = _bmm_wide(folded, k.reshape(n, length, dim).transpose(1, 2)).view(batch, kv_heads, groups, length)
    keep = allowed.view(batch, 1, 1, length)
    scores = torch.where(keep, scores * scale, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(n, groups, length)
    chunk = _chunk_len(length, n) if v.is_contiguous() else length  # a slice of the cache: one chunk, no copy
    chunks = length // chunk
    # [n, G, L] -> [n * chunks, G, chunk]: each chunk's probabilities beside its keys (a copy, cast to v's dtype)
    split = torch.empty((n, chunks, groups, chunk), dtype=v.dtype, device=v.device)
    split.copy_(probs.view(n, groups, chunks, chunk).transpose(1, 2))
    width = v.shape[-1]
    partial = _bmm_wide(split.view(n * chunks, groups, chunk), v.reshape(n * chunks, chunk, width))
    out = partial.view(n, chunks, groups, width).sum(dim=1, dtype=wide)
    return out.to(q.dtype).view(batch, heads, 1, width)
