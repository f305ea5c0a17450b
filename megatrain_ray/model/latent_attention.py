"""Multi-head latent attention (MLA) of DeepSeek-V3, as a stateless function of its normed input and its weights,
following transformers' DeepseekV3Attention operation by operation (training: no cache):

- the query: q_b_proj(q_a_layernorm(q_a_proj(x))) (one q_proj where q_lora_rank is 0), num_heads x (qk_nope_head_dim
  + qk_rope_head_dim) wide; each head's first qk_nope_head_dim dimensions pass unrotated, the rest take RoPE;
- the compressed latent: kv_a_proj_with_mqa(x) = [kv_lora_rank values | qk_rope_head_dim values]; the first part
  normed (kv_a_layernorm) and expanded by kv_b_proj into each head's unrotated key part and its value; the second is
  one key part RoPE rotates, shared by every head;
- RoPE over the rotated parts: by halves as Llama, or over interleaved pairs (rope_interleave: each pair (x0, x1),
  (x2, x3), ... turned by one frequency, the results laid out evens then odds, as transformers does for q and k
  alike, which leaves q.k unchanged);
- causal attention (model/attention.py: SDPA, per document for packed rows) scaled by qk_head_dim ** -0.5, times
  YaRN's mscale(factor, mscale_all_dim) squared where the RoPE scaling is YaRN with mscale_all_dim (DeepSeek's);
- o_proj of the heads' values.

Both latent norms are RMSNorms with eps 1e-6 whatever rms_norm_eps says, as transformers builds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.model.lora import project
from megatrain_ray.model.norms import rms_norm

P = "self_attn."
LATENT_NORM_EPS = 1e-6
"""DeepseekV3RMSNorm's default, which q_a_layernorm and kv_a_layernorm keep (transformers passes no eps to them)."""


@dataclass(frozen=True, slots=True)
class LatentSpec:
    """The static facts of a latent-attention layer (from ModelConfig.latent_attention)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    interleave: bool

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "LatentSpec":
        la = cfg.latent_attention
        return cls(la.q_lora_rank, la.kv_lora_rank, la.qk_nope_head_dim, la.qk_rope_head_dim, la.v_head_dim,
                   la.rope_interleave)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def latent_scale(cfg: ModelConfig) -> float:
    """The factor on q.k: qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN scaling with
    mscale_all_dim (transformers' yarn_apply_mscale; mscale(s, m) = 0.1 m ln s + 1 for s > 1, else 1)."""
    scale = cfg.latent_attention.qk_head_dim ** -0.5
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.rope_type == "yarn" and scaling.mscale_all_dim and scaling.factor > 1:
        mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def latent_widths(cfg: ModelConfig) -> tuple[int, int]:
    """(query width, key/value width) per token of the attention the layer runs, for the memory plan: every head's
    query and key of qk_head_dim, its value of v_head_dim (the key/value width their mean, as the plan counts k and
    v alike)."""
    la, heads = cfg.latent_attention, cfg.num_attention_heads
    return heads * la.qk_head_dim, heads * (la.qk_head_dim + la.v_head_dim) // 2


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE over all of x's last dimension: by halves, or (interleave) over pairs (x0, x1), (x2, x3), ..., each
    turned by the angle of its pair's frequency, evens' results first then odds' (apply_rotary_pos_emb_interleave).
    cos, sin: [T, D] or [B, 1, T, D] (cat(freqs, freqs), as model/rope.py's tables)."""
    if not interleave:
        half = x.shape[-1] // 2
        turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + turned * sin
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def latent_query(h: torch.Tensor, w: Mapping[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                 spec: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's query from the normed rows h [B, T, hidden]: its unrotated part [B, H, T, qk_nope_head_dim] and
    its rotated part [B, H, T, qk_rope_head_dim], RoPE applied. `spec`: the layer's LayerSpec (num_heads, latent,
    the LoRA settings)."""
    mla: LatentSpec = spec.latent
    batch, seq_len, _ = h.shape
    if mla.q_lora_rank:
        q = project(rms_norm(project(h, w, f"{P}q_a_proj", spec), w[f"{P}q_a_layernorm.weight"], LATENT_NORM_EPS),
                    w, f"{P}q_b_proj", spec)
    else:
        q = project(h, w, f"{P}q_proj", spec)
    q = q.view(batch, seq_len, spec.num_heads, mla.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
    return q_pass, rotate(q_rot, *rope, mla.interleave)


def latent_compress(h: torch.Tensor, w: Mapping[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                    spec: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed key/value of each row and token: the normed latent [B, T, kv_lora_rank] and the rotated key
    part every head shares [B, 1, T, qk_rope_head_dim] (what the rollout caches: model/latent_decode.py)."""
    mla: LatentSpec = spec.latent
    batch, seq_len, _ = h.shape
    compressed = project(h, w, f"{P}kv_a_proj_with_mqa", spec)
    kv_latent, k_rot = torch.split(compressed, [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
    kv_latent = rms_norm(kv_latent, w[f"{P}kv_a_layernorm.weight"], LATENT_NORM_EPS)
    k_rot = k_rot.view(batch, 1, seq_len, mla.qk_rope_head_dim)
    return kv_latent, rotate(k_rot, *rope, mla.interleave)


def latent_qkv(h: torch.Tensor, w: Mapping[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
               spec: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention's inputs from the normed rows h [B, T, hidden]: q and k [B, H, T, qk_head_dim] (the rotated part
    last), v [B, H, T, v_head_dim], every head's key and value expanded from the latent by kv_b_proj. `spec`: the
    layer's LayerSpec (num_heads, latent, the LoRA settings)."""
    mla: LatentSpec = spec.latent
    batch, seq_len, _ = h.shape
    q_pass, q_rot = latent_query(h, w, rope, spec)
    kv_latent, k_rot = latent_compress(h, w, rope, spec)
    q = torch.cat((q_pass, q_rot), dim=-1)
    kv = project(kv_latent, w, f"{P}kv_b_proj", spec)
    kv = kv.view(batch, seq_len, spec.num_heads, mla.qk_nope_head_dim + mla.v_head_dim).transpose(1, 2)
    k_nope, v = torch.split(kv, [mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_rot.expand(-1, spec.num_heads, -1, -1)), dim=-1)
    return q, k, v


def latent_output(a: torch.Tensor, w: Mapping[str, torch.Tensor], spec: Any) -> torch.Tensor:
    """o_proj of the attention's output a [B, H, T, v_head_dim] (the residual add is the caller's)."""
    batch, _, seq_len, _ = a.shape
    return project(a.transpose(1, 2).reshape(batch, seq_len, spec.num_heads * spec.latent.v_head_dim), w,
                   f"{P}o_proj", spec)
