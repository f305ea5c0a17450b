"""What the speed model predicts for one config (planning/speed.estimate): a step's time split by what the GPU
did and waited for, and the figures the plan prints from it."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain_ray.planning.profiles import SpeedProfile

SHORTEST_CHECKED_STEP_S = 0.15
"""The speed model is checked against measured steps of 0.167 s and longer (tests/unit/test_speed.py replays every
measured point); a shorter modeled step is printed as not predicted."""


@dataclass(frozen=True)
class SpeedEstimate:
    profile: SpeedProfile
    tokens_per_step: int
    step_seconds: float
    flops_per_token: float
    compute_seconds: float
    """GPU busy time of a step."""
    h2d_seconds: float
    d2h_seconds: float
    optimizer_seconds: float
    """CPU AdamW time of a step's updates (all workers together)."""
    gpu_waits: dict[str, float]
    """GPU idle seconds of the step by what it waited for (WAITS)."""
    clip: bool
    optimizer_gparams: float
    """The AdamW rate for this config's formats and tier (adamw_gparams)."""
    compiled: bool = False
    """The layers run compiled (engine.compile), at the GPU's compiled rate."""
    moe: bool = False
    """A mixture-of-experts model, at the GPU's MoE rate."""
    lora: bool = False
    """A LoRA run (a frozen base), at the GPU's LoRA fraction of that rate."""
    lean: bool = False
    """The lean optimizer state (optimizer.state=lean): AdamW at its measured fraction of the full rate."""

    @property
    def tok_per_s(self) -> float:
        return self.tokens_per_step / self.step_seconds

    @property
    def below_resolution(self) -> bool:
        """The modeled step is shorter than any the speed model is checked on (SHORTEST_CHECKED_STEP_S): costs it
        leaves out (each kernel's launch, the per-layer Python work) would dominate it."""
        return self.step_seconds < SHORTEST_CHECKED_STEP_S

    @property
    def speed_text(self) -> str:
        """'N tok/s', or why there is no figure (below_resolution)."""
        if self.below_resolution:
            return f"tok/s not predicted (a modeled step of {self.step_seconds * 1e3:.3g} ms)"
        return f"{self.tok_per_s:,.0f} tok/s"

    @property
    def model_tflops(self) -> float:
        return self.tok_per_s * self.flops_per_token / 1e12

    @property
    def gpu_busy(self) -> float:
        return self.compute_seconds / self.step_seconds

    @property
    def bound(self) -> str:
        """GPU compute when the GPU is busy >= 90 % of the step, else what it waited for longest."""
        if self.gpu_busy >= 0.9:
            return "GPU compute"
        return max(self.gpu_waits, key=self.gpu_waits.__getitem__)
