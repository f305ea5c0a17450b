"""`model.rope_scaling`: RoPE frequency scaling (Llama 3.1, YaRN, linear, LongRoPE), as config.json's rope_scaling
entry; a part of the model section (config/model_section.py), kept apart by concern."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megatrain_ray.config.fields import refuse as _fail


@dataclass(kw_only=True, slots=True)
class RopeScalingConfig:
    """RoPE frequency scaling, as in the `rope_scaling` entry of a Hugging Face config."""

    SECTION: ClassVar[str] = "model.rope_scaling"
    rope_type: Literal["llama3", "yarn", "linear", "longrope"] = "llama3"
    """llama3: Llama 3.1's wavelength-dependent scaling; yarn: YaRN (Qwen2.5 long context, as in
    transformers: interpolated and extrapolated frequencies blended over a ramp, cos/sin scaled by
    the attention factor); linear: positions divided by `factor`; longrope: Phi-3's LongRoPE (each
    frequency divided by its entry of short_factor, or of long_factor when a sequence is longer than
    original_max_position_embeddings; cos/sin scaled by the attention factor)."""
    factor: float = 8.0
    """How much longer the context is than the one the model was trained on (longrope: only derives
    the attention factor; Phi-3 configs leave it out and it is max_position_embeddings over
    original_max_position_embeddings)."""
    low_freq_factor: float = 1.0
    """llama3 only: wavelengths above original_max_position_embeddings / low_freq_factor are scaled fully."""
    high_freq_factor: float = 4.0
    """llama3 only: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """llama3, yarn and longrope: the context length of the unscaled model."""
    beta_fast: float = 32.0
    """yarn only: rotations at which the ramp from extrapolation starts."""
    beta_slow: float = 1.0
    """yarn only: rotations at which the ramp to interpolation ends."""
    attention_factor: float = 0.0
    """yarn and longrope: factor on cos and sin; 0 derives it from factor (yarn: and mscale, mscale_all_dim;
    longrope: sqrt(1 + ln(factor) / ln(original_max_position_embeddings)))."""
    mscale: float = 0.0
    """yarn only: with mscale_all_dim, derives attention_factor as in DeepSeek's configs; 0 when unused."""
    mscale_all_dim: float = 0.0
    """yarn only: see mscale."""
    truncate: bool = True
    """yarn only: round the ramp's ends to whole dimensions (transformers' default)."""
    short_factor: list[float] = field(default_factory=list)
    """longrope only: one divisor per rotated frequency (rotary dimensions / 2 of them), used while a
    sequence fits original_max_position_embeddings."""
    long_factor: list[float] = field(default_factory=list)
    """longrope only: the divisors used for sequences longer than original_max_position_embeddings."""

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            _fail(f"{self.SECTION}.factor", self.factor, "must be >= 1")
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            _fail(f"{self.SECTION}.low_freq_factor", self.low_freq_factor,
                  "must be > 0 and below high_freq_factor")
        if self.rope_type == "yarn" and not self.beta_fast > self.beta_slow > 0:
            _fail(f"{self.SECTION}.beta_slow", self.beta_slow, "must be > 0 and below beta_fast")
        if self.original_max_position_embeddings < 1:
            _fail(f"{self.SECTION}.original_max_position_embeddings", self.original_max_position_embeddings,
                  "must be >= 1")
        if self.rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                values = getattr(self, key)
                if not values or not all(math.isfinite(v) and v > 0 for v in values):
                    _fail(f"{self.SECTION}.{key}", values, "longrope needs a list of finite numbers > 0, one per "
                          "rotated frequency (rotary dimensions / 2)")

    @property
    def resolved_attention_factor(self) -> float:
        """The factor on cos and sin (1 except for yarn and longrope), as transformers derives it."""
        if self.rope_type not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor:
            return self.attention_factor
        if self.rope_type == "longrope":
            if self.factor <= 1:
                return 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))

        def mscale_of(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale_of(self.factor, self.mscale) / mscale_of(self.factor, self.mscale_all_dim)
        return mscale_of(self.factor)
