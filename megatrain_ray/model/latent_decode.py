"""DeepSeek-V3's latent attention with the rollout's cache (model/decode.py): the compressed cache and the absorbed
attention over it, as DeepSeek's inference runs it.

The cache keeps, per row and token, what kv_a_proj_with_mqa makes: the normed latent (kv_lora_rank values) and the
rotated key part every head shares (qk_rope_head_dim values), one [rows, 1, capacity, kv_lora_rank +
qk_rope_head_dim] tensor a layer: 576 values a token for DeepSeek-V3, against 128 heads x (192 + 128) once expanded.

No key or value is expanded from it. kv_b_proj's rows are each head's key map W_k [qk_nope_head_dim, kv_lora_rank]
and value map W_v [v_head_dim, kv_lora_rank]; since q_nope . (W_k c) = (q_nope W_k) . c, each head's unrotated query
is taken into the latent's space (q_nope W_k) and set beside its rotated part, so every head attends over the one
cached [latent | rotated key] per token, a multi-query attention with keys kv_lora_rank + qk_rope_head_dim wide and
values the latents themselves; each head's weighted sum of latents then goes through its W_v, and o_proj as in
training. The same scores and outputs as training's expanded form (model/latent_attention.latent_qkv), summed in
another order. A kv_b_proj with a LoRA adapter bound is merged for this (W + scaling B A, model/lora.merged_weight,
rounded to W's dtype).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch

from megatrain_ray.model.attention import cached_attention
from megatrain_ray.model.latent_attention import P, latent_compress, latent_output, latent_query
from megatrain_ray.model.lora import lora_a, lora_b, merged_weight
from megatrain_ray.model.norms import rms_norm
from megatrain_ray.model.templates import mlp_in_chunks


@dataclass(slots=True)
class LatentCache:
    """One layer's compressed keys and values of every row: [rows, 1, capacity, kv_lora_rank + qk_rope_head_dim],
    the normed latent first, then the rotated key part."""

    entries: torch.Tensor
    rank: int
    """kv_lora_rank: the latent's width (the values are entries[..., :rank])."""

    @classmethod
    def empty(cls, rows: int, spec: Any, capacity: int, dtype: torch.dtype, device: torch.device) -> LatentCache:
        width = spec.latent.kv_lora_rank + spec.latent.qk_rope_head_dim
        # zeros, not empty: a masked slot still enters the weighted sum times 0 (model/decode.KVCache.empty)
        return cls(torch.zeros((rows, 1, capacity, width), dtype=dtype, device=device), spec.latent.kv_lora_rank)

    @staticmethod
    def bytes_per_token(spec: Any, dtype: torch.dtype) -> int:
        """The latent and the rotated key part of one token of one row."""
        width = spec.latent.kv_lora_rank + spec.latent.qk_rope_head_dim
        return width * torch.tensor([], dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.entries.numel() * self.entries.element_size()

    def write(self, entry: torch.Tensor, start: int | torch.Tensor) -> torch.Tensor:
        """Store entry [rows, 1, T, width] at cache indices start..start+T-1; returns the entries the queries attend
        over (the first start + T, or all of them for a tensor `start`: model/decode.KVCache.write)."""
        if isinstance(start, int):
            end = start + entry.shape[2]
            self.entries[:, :, start:end] = entry
            return self.entries[:, :, :end]
        self.entries.index_copy_(2, start.view(1), entry)
        return self.entries


def _head_maps(w: Mapping[str, torch.Tensor], spec: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's per-head key and value maps, [H, qk_nope_head_dim, kv_lora_rank] and [H, v_head_dim,
    kv_lora_rank] (its adapter merged where one is bound)."""
    mla, name = spec.latent, f"{P}kv_b_proj"
    weight = w[f"{name}.weight"]
    if lora_a(name) in w:
        weight = merged_weight(weight, w[lora_a(name)], w[lora_b(name)], spec.lora_scaling).to(weight.dtype)
    maps = weight.view(spec.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
    return maps[:, :mla.qk_nope_head_dim], maps[:, mla.qk_nope_head_dim:]


def cached_latent_layer(x: torch.Tensor, w: Mapping[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                        spec: Any, cache: LatentCache, start: int | torch.Tensor, allowed: torch.Tensor,
                        mlp_chunk_tokens: int = 0) -> torch.Tensor:
    """model/decode.cached_decoder_layer for a latent-attention layer: x [rows, T, hidden] at cache indices
    start..start+T-1, its compressed keys and values into `cache`, its queries over the cached ones where `allowed`
    (model/decode.cache_mask) says."""
    h = rms_norm(x, w["input_layernorm.weight"], spec.eps)
    q_pass, q_rot = latent_query(h, w, rope, spec)
    latent, k_rot = latent_compress(h, w, rope, spec)
    key_map, value_map = _head_maps(w, spec)
    q = torch.cat((torch.matmul(q_pass, key_map), q_rot), dim=-1)  # [rows, H, T, rank + rope]
    entries = cache.write(torch.cat((latent.unsqueeze(1), k_rot), dim=-1), start)
    # one key head for all: the cached entries, their latents the values (the scale is the layer's own)
    mqa = replace(spec, num_kv_heads=1, head_dim=entries.shape[-1])
    a = cached_attention(q, entries, entries[..., :cache.rank], allowed, mqa)  # [rows, H, T, rank]
    a = torch.matmul(a, value_map.transpose(1, 2))  # [rows, H, T, v_head_dim]
    return mlp_in_chunks(x + latent_output(a, w, spec), w, spec, mlp_chunk_tokens)
