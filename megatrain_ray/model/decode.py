"""The decoder layer with a KV cache: what the rollout engine (engine/rollout/) runs to prefill the prompts and then
decode one token per row at a time.

Rows are left-padded to a common prompt length, so every row writes its next token at the same cache index and
the whole batch decodes together. A row's padding is never attended to (`cache_mask`); RoPE positions count the
row's own tokens only (0 at its first real token), as transformers' generate derives them from the attention
mask. The layer's math is the training template's (model/templates.py: attention_qkv, attention_out,
mlp_in_chunks); only the keys and values come from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from megatrain_ray.model.attention import masked_attention
from megatrain_ray.model.layer_spec import LayerSpec
from megatrain_ray.model.sinks import explicit_sink_attention
from megatrain_ray.model.templates import attention_out, attention_qkv, mlp_in_chunks


@dataclass(slots=True)
class KVCache:
    """One layer's keys and values of every row, [rows, H_kv, capacity, head_dim] each."""

    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def empty(cls, rows: int, spec: LayerSpec, capacity: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        shape = (rows, spec.num_kv_heads, capacity, spec.head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    @staticmethod
    def bytes_per_token(spec: LayerSpec, dtype: torch.dtype) -> int:
        """Keys and values of one token of one row."""
        return 2 * spec.num_kv_heads * spec.head_dim * torch.tensor([], dtype=dtype).element_size()


def cache_mask(valid: torch.Tensor, start: int, count: int, window: int) -> torch.Tensor:
    """[rows, 1, count, start + count] which cached keys the queries at cache indices start..start+count-1 may
    attend to: real tokens (`valid` [rows, capacity]) at or before the query, within `window` tokens when > 0. A
    padding query may see itself, so no softmax row is empty (its output is never read)."""
    end = start + count
    query = torch.arange(start, end, device=valid.device)[:, None]
    key = torch.arange(end, device=valid.device)[None, :]
    causal = key <= query
    if window:
        causal = causal & (query - key < window)
    return (valid[:, None, None, :end] & causal) | (key == query)


def positions_of(valid: torch.Tensor) -> torch.Tensor:
    """[rows, capacity] RoPE position of each cache index: the count of the row's real tokens before it (padding
    takes 0, as its output is never read)."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


def cached_decoder_layer(x: torch.Tensor, w: Mapping[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                         spec: LayerSpec, cache: KVCache, start: int, allowed: torch.Tensor,
                         mlp_chunk_tokens: int = 0) -> torch.Tensor:
    """decoder_layer for x [rows, T, hidden] at cache indices start..start+T-1: its keys and values go into `cache`,
    its queries attend to the cache's first start + T indices where `allowed` (cache_mask) says."""
    q, k, v = attention_qkv(x, w, rope, spec)
    end = start + x.shape[1]
    cache.keys[:, :, start:end] = k
    cache.values[:, :, start:end] = v
    keys, values = cache.keys[:, :, :end], cache.values[:, :, :end]
    if "self_attn.sinks" in w:  # gpt-oss: the explicit form takes any mask
        a = explicit_sink_attention(q, keys, values, w["self_attn.sinks"], spec.head_dim ** -0.5, spec.sliding_window,
                                    allowed)
    else:
        a = masked_attention(q, keys, values, allowed, spec)
    return mlp_in_chunks(attention_out(x, a, w, spec), w, spec, mlp_chunk_tokens)
