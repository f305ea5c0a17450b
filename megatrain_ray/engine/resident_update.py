"""The GPU-resident tier's AdamW in one pass over each span (engine/resident.py; issue 45).

Per chunk, the tier's update through torch._fused_adamw_ (ResidentTier._update_chunks) is three passes over the
stage: the bf16 gradient cast into a float32 scratch, the fused AdamW, and the master cast back into the compute
copy. In a trace of the 3.5B bench at 8k tokens (benchmarks/results/tier-profile-3.5b-8k-h200-20261202-034712.json)
the casts took 12.7 ms and 5.9 ms a step beside the kernel's 26 ms: 18.6 ms of the 0.342 s step, most of the tier's
gap to the compiled resident run (0.31 s). `adamw_span` is the same math as one function of the whole span; through
torch.compile on a GPU it is one kernel that reads the gradient in its own dtype and writes master, moments and the
compute copy in the same pass (28 bytes a parameter with a float32 master and moments and bf16 gradients and
weights, as many as the fused kernel alone reads and writes).

The math is torch._fused_adamw_'s (ATen's fused_adam_utils.cuh, ADAMW mode) in the master's dtype, scalars
included: the bias corrections, 1 - beta and lr * weight_decay are computed from the scalars in that dtype as the
kernel computes them, and the gradient is divided by the inverse of clipping's coefficient as the kernel's
grad_scale divides it. The scalars reach the device in one small tensor per span kind (`SpanScalars`), so no value
of a step is a constant of the compiled code (one graph per run, dynamic shapes for the span lengths).
"""

from __future__ import annotations

import torch

from megatrain_ray.config.engine_sections import OptimizerConfig
from megatrain_ray.engine.compiled import CompiledFunction

LR, WEIGHT_DECAY, BETA1, BETA2, EPS, STEP, INV_COEF = range(7)
"""Positions in a span's scalars tensor."""


def adamw_span(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               compute: torch.Tensor | None, s: torch.Tensor, via: torch.dtype | None) -> None:
    """AdamW on one span in place: `master`, `exp_avg`, `exp_avg_sq` (the master's dtype) from `grad` (any float
    dtype); `compute` (None: the master is the compute copy) gets the new master cast through `via` (the streaming
    dtype, where it differs from both) to its own dtype. `s`: the span's scalars (LR, ... INV_COEF), master dtype."""
    lr, weight_decay, beta1, beta2, eps, step, inv_coef = (s[i] for i in range(7))
    g = grad.to(master.dtype) / inv_coef
    step_size = lr / (1 - beta1 ** step)
    bias_correction2_sqrt = (1 - beta2 ** step).sqrt()
    p = master - lr * weight_decay * master
    m = beta1 * exp_avg + (1 - beta1) * g
    v = beta2 * exp_avg_sq + (1 - beta2) * g * g
    p = p - step_size * m / (v.sqrt() / bias_correction2_sqrt + eps)
    master.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if compute is not None:
        compute.copy_(p if via is None else p.to(via))


class SpanScalars:
    """The scalars of a step's resident updates on the device, (decay span, no-decay span), made once per
    (lr, step, coefficient): two copies of 28 bytes a step, from pinned memory without waiting on the device."""

    def __init__(self, cfg: OptimizerConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.key: tuple | None = None
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, lr: float, adam_step: int, coef: float) -> tuple[torch.Tensor, torch.Tensor]:
        key = (lr, adam_step, coef)
        if key != self.key:
            cfg = self.cfg
            self.rows = tuple(self._put([lr, decay, cfg.beta1, cfg.beta2, cfg.eps, float(adam_step), 1.0 / coef])
                              for decay in (cfg.weight_decay, 0.0))
            self.key = key
        return self.rows

    def _put(self, values: list[float]) -> torch.Tensor:
        row = torch.tensor(values, dtype=self.dtype)
        if self.device.type != "cuda":
            return row.to(self.device)
        return row.pin_memory().to(self.device, non_blocking=True)


def resident_update_function(device: torch.device, device_compiles: bool, master_dtype: torch.dtype,
                             fall_back: bool) -> CompiledFunction | None:
    """`adamw_span` through torch.compile where the engine compiles on a GPU and the master is float32 (the case
    torch._fused_adamw_'s grad_scale serves too); None: the tier keeps the fused kernel per chunk (every CPU run:
    the float64 parity tests run that path unchanged)."""
    if device.type != "cuda" or not device_compiles or master_dtype != torch.float32:
        return None
    return CompiledFunction(adamw_span, fall_back, "the GPU-resident update", dynamic=True)
