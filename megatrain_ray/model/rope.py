"""Rotary position embeddings: inverse frequencies (Llama 3.1, linear, YaRN and LongRoPE scaling, Gemma 3's
local tables), the cos and sin tables, and their application to q and k (partial rotary factor included)."""

from __future__ import annotations

import math

import torch

from megatrain_ray.config.model_section import ModelConfig, RopeScalingConfig
from megatrain_ray.model.norms import norm_dtype


def uses_local_rope(cfg: ModelConfig) -> bool:
    """Gemma 3: its sliding layers take their own RoPE tables (rope_local_base_freq, no scaling)."""
    return cfg.family == "gemma3"



def uses_long_factors(cfg: ModelConfig, context: int) -> bool:
    """LongRoPE (Phi-3): whether a forward whose longest position is `context` - 1 takes the long
    factors; as transformers, all positions of the pass then use them (the short ones otherwise)."""
    scaling = cfg.rope_scaling
    return scaling is not None and scaling.rope_type == "longrope" and context > scaling.original_max_position_embeddings


def rope_inv_freq(cfg: ModelConfig, dtype: torch.dtype = torch.float32, long: bool = False,
                  local: bool = False) -> torch.Tensor:
    """Inverse frequencies of the rotated dimensions (cfg.rotary_dim / 2 of them); `long`: LongRoPE's
    long factors (see uses_long_factors); `local`: Gemma 3's sliding layers (rope_local_base_freq, unscaled)."""
    dim = cfg.rotary_dim
    if local:
        base = cfg.rope_local_base_freq or cfg.rope_theta
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype) / dim))
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.rope_type == "longrope":
        # As transformers: each frequency divided by its factor, 1 / (factor * theta^(2i/dim)).
        ext = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=dtype)
        return 1.0 / (ext * cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype) / dim))
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype) / dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, scaling, dim, cfg.rope_theta)
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: RopeScalingConfig, dim: int, base: float) -> torch.Tensor:
    """YaRN: dimensions that rotate more than beta_fast times over the original context keep their
    frequency, those rotating fewer than beta_slow times are interpolated (divided by factor), a linear
    ramp blends the ones in between (the paper's NTK-by-parts, as transformers computes it)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(inv_freq.dtype)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    # (1 - keep), not ramp: the same float32 roundings as transformers, so the tables agree bit for bit.
    return inv_freq / scaling.factor * (1 - keep) + inv_freq * keep


def rope_tables(cfg: ModelConfig, seq_len: int, device: torch.device, dtype: torch.dtype,
                long: bool | None = None, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq_len, rotary_dim] in `dtype`, computed in float32 (float64 for float64)
    and scaled by the YaRN or LongRoPE attention factor when it applies. `long`: LongRoPE's long factors
    (None: when seq_len is past the original context, as transformers decides for positions 0..seq_len-1).
    `local`: the tables of Gemma 3's sliding layers (see LayerSpec.local_rope)."""
    work = norm_dtype(dtype)
    if long is None:
        long = uses_long_factors(cfg, seq_len)
    inv_freq = rope_inv_freq(cfg, work, long, local).to(device)
    positions = torch.arange(seq_len, device=device, dtype=work)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = cfg.rope_scaling.resolved_attention_factor if cfg.rope_scaling is not None and not local else 1.0
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos, sin: [seq, rotary_dim], or [batch, 1, seq, rotary_dim] when
    each row has its own positions (packed documents). A rotary_dim below head_dim (partial rotary factor)
    rotates the first rotary_dim dimensions and passes the rest through."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, kept), dim=-1)
