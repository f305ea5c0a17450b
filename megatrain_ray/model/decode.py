"""The decoder layer with a KV cache: what the rollout engine (engine/rollout/) runs to prefill the prompts and then
decode one token per row at a time.

Rows are left-padded to a common prompt length, so every row writes its next token at the same cache index and
the whole batch decodes together. A row's padding is never attended to (`cache_mask`); RoPE positions count the
row's own tokens only (0 at its first real token), as transformers' generate derives them from the attention
mask. The layer's math is the training template's (model/templates.py: attention_qkv, attention_out,
mlp_in_chunks); only the keys and values come from the cache. DeepSeek-V3's latent-attention layers cache their
compressed keys and values instead (model/latent_decode.py: LatentCache, cached_latent_layer), and the linear-attention
layers of Qwen3.5 and Qwen3-Next a fixed-size state per row (model/recurrent_decode.py: RecurrentCache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from megatrain_ray.model.attention import cached_attention
from megatrain_ray.model.decode_attention import CHUNK_UNIT
from megatrain_ray.model.latent_decode import LatentCache, cached_latent_layer
from megatrain_ray.model.layer_spec import LayerSpec
from megatrain_ray.model.lora import projection
from megatrain_ray.model.recurrent_decode import RecurrentCache, cached_linear_block
from megatrain_ray.model.sinks import explicit_sink_attention
from megatrain_ray.model.templates import attention_out, gated_attention_inputs, mlp_in_chunks


@dataclass(slots=True)
class KVCache:
    """One layer's keys and values of every row, [rows, H_kv, capacity, head_dim] each."""

    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def empty(cls, rows: int, spec: LayerSpec, capacity: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        shape = (rows, spec.num_kv_heads, capacity, spec.head_dim)
        # Zeros, not empty: the CUDA graph's decode step attends over the whole cache under a mask, and a masked
        # slot's value still enters the weighted sum times 0, so a NaN left in unwritten memory would poison it.
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @staticmethod
    def bytes_per_token(spec: LayerSpec, dtype: torch.dtype) -> int:
        """Keys and values of one token of one row."""
        return 2 * spec.num_kv_heads * spec.head_dim * torch.tensor([], dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def write(self, k: torch.Tensor, v: torch.Tensor, start: Start) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [rows, H_kv, T, D] at cache indices start..start+T-1; returns the keys and values the queries
        attend over: the first start + T indices, or with a tensor `start` (one token, a CUDA graph's decode step,
        whose index lives on the device) the whole cache (cache_mask hides what lies beyond)."""
        if isinstance(start, int):
            end = start + k.shape[2]
            self.keys[:, :, start:end] = k
            self.values[:, :, start:end] = v
            return self.keys[:, :, :end], self.values[:, :, :end]
        self.keys.index_copy_(2, start.view(1), k)
        self.values.index_copy_(2, start.view(1), v)
        return self.keys, self.values


def layer_cache(rows: int, spec: LayerSpec, capacity: int, dtype: torch.dtype,
                device: torch.device) -> LayerCache:
    """An empty cache of one layer: its keys and values, a latent-attention layer's compressed ones, or a
    linear-attention layer's states."""
    if spec.linear is not None:
        return RecurrentCache.empty(rows, spec, dtype, device)
    if spec.latent is not None:
        return LatentCache.empty(rows, spec, capacity, dtype, device)
    return KVCache.empty(rows, spec, capacity, dtype, device)


def cache_capacity(tokens: int) -> int:
    """The KV cache's slots for prompts and completions of `tokens` together: rounded up to a whole number of
    decode_attention's key chunks (the slots past `tokens` are never written nor attended to)."""
    return -(-tokens // CHUNK_UNIT) * CHUNK_UNIT


LayerCache = KVCache | LatentCache | RecurrentCache
"""One layer's cache: grouped-query keys and values, latent attention's compressed ones, or a linear-attention
layer's states."""

Start = int | torch.Tensor
"""The cache index of a pass's first token: a Python int, or a 0-d int64 tensor on the device (a CUDA graph's decode
step, replayed for every token)."""


def cache_mask(valid: torch.Tensor, start: Start, count: int, window: int) -> torch.Tensor:
    """[rows, 1, count, keys] which cached keys the queries at cache indices start..start+count-1 may attend to
    (keys: start + count, or the whole cache for a tensor `start`, as KVCache.write returns them): real tokens
    (`valid` [rows, capacity]) at or before the query, within `window` tokens when > 0. A padding query may see
    itself, so no softmax row is empty (its output is never read)."""
    end = start + count if isinstance(start, int) else valid.shape[1]
    query = (start + torch.arange(count, device=valid.device))[:, None]
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
                         spec: LayerSpec, cache: LayerCache, start: Start, allowed: torch.Tensor,
                         mlp_chunk_tokens: int = 0, valid: torch.Tensor | None = None) -> torch.Tensor:
    """decoder_layer for x [rows, T, hidden] at cache indices start..start+T-1: its keys and values go into `cache`,
    its queries attend to the cached keys where `allowed` (cache_mask) says. A linear-attention layer reads `valid`
    ([rows, capacity], the rows' real tokens) in the prefill (start 0), which it runs from the zero state; a later
    pass must be one decode token."""
    if spec.linear is not None:
        prefill = isinstance(start, int) and start == 0
        if not prefill and x.shape[1] != 1:
            raise ValueError("a linear-attention layer's cache takes a prefill from index 0, then one token a pass")
        if prefill and valid is None:
            raise ValueError("a linear-attention layer's prefill needs `valid` (its padding must not write the state)")
        real = valid[:, :x.shape[1]] if prefill else None
        return mlp_in_chunks(cached_linear_block(x, w, spec, cache, real, projection(w, spec)), w, spec,
                             mlp_chunk_tokens)
    if spec.latent is not None:
        return cached_latent_layer(x, w, rope, spec, cache, start, allowed, mlp_chunk_tokens)
    q, k, v, gate = gated_attention_inputs(x, w, rope, spec)
    keys, values = cache.write(k, v, start)
    if "self_attn.sinks" in w:  # gpt-oss: the explicit form takes any mask
        a = explicit_sink_attention(q, keys, values, w["self_attn.sinks"], spec.head_dim ** -0.5, spec.sliding_window,
                                    allowed)
    else:
        a = cached_attention(q, keys, values, allowed, spec)
    return mlp_in_chunks(attention_out(x, a, w, spec, gate), w, spec, mlp_chunk_tokens)
