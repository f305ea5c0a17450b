"""The lean optimizer state's AdamW (optimizer.state=lean): a bfloat16 master with a bfloat16 compensation buffer,
and moments in 8-bit blocks (optim/quant8.py) or bfloat16.

The exact math, per element, in float32 (every constant a float32 value, LeanConstants; no fused multiply-add):

    g  = grad * grad_coef
    m  = m_old + (1 - beta1) * (g - m_old)             m_old, v_old: the stored moments read back
    v  = beta2 * v_old + ((1 - beta2) * g) * g
    d  = sqrt(v) / sqrt(1 - beta2^t) + eps             sqrt correctly rounded
    u  = -(lr * weight_decay * p) - (lr / (1 - beta1^t)) * (m / d)     weight decay only below decay_end
    y  = c + u                                         p, c: the bfloat16 master and compensation, widened
    p' = bf16(p + y)                                   round to nearest even
    c' = bf16(y - (p' - p))                            what p' did not take, carried to the next step

p + c is the weight to about 16 bits of mantissa: a step smaller than half a bfloat16 ulp of p accumulates in c
until it moves p (Kahan summation, as optimi's Kahan-compensated AdamW and Zamirai et al., "Revisiting
BFloat16 Training"). The moments m and v used for the update are the float32 values; what is stored is their
8-bit codes with a fresh absmax per block (int8), or their stochastic bfloat16 rounding with the hashed noise of
optim/adamw.py (bfloat16). The master is the streaming copy: the device reads it directly, and there is no copy to
write. `lean_chunk_` is that definition in torch; kernels/lean_adamw.cpp does the same per element, bit for bit
(tests/unit/test_lean_adamw.py holds it to that, and both to an independent reference).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from megatrain_ray.config.engine_sections import OptimizerConfig
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.observe.log import get_logger, warn_once
from megatrain_ray.optim.adamw import noise_key, round_bf16_stochastic_, rounding_noise, split_span
from megatrain_ray.optim.kernels import KernelUnavailable, lean_library
from megatrain_ray.optim.quant8 import ByteCode, byte_code, dequantize, quantize_

log = get_logger(__name__)


def f32(x: float) -> float:
    """x rounded to the nearest float32, as a Python float (exact in float32 arithmetic on either side)."""
    return float(np.float32(x))


@dataclass(frozen=True, slots=True)
class LeanConstants:
    """The float32 constants of one update (see the module docstring)."""

    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    eps: float
    bias_correction2_sqrt: float
    step_size: float
    """lr / (1 - beta1^t)."""
    decay: float
    """lr * weight_decay."""
    grad_coef: float

    @classmethod
    def of(cls, cfg: OptimizerConfig, adam_step: int, lr: float, grad_coef: float) -> "LeanConstants":
        # Each from its exact (double) value, rounded once: 1 - beta in float32 would be off by ulps.
        return cls(f32(1.0 - cfg.beta1), f32(cfg.beta2), f32(1.0 - cfg.beta2), f32(cfg.eps),
                   f32(math.sqrt(1.0 - cfg.beta2 ** adam_step)), f32(lr / (1.0 - cfg.beta1 ** adam_step)),
                   f32(lr * cfg.weight_decay), f32(grad_coef))


@dataclass(frozen=True, slots=True)
class LeanStage:
    """One stage's lean state (views of its segments): `scales` are (exp_avg's, exp_avg_sq's) with int8 moments,
    None with bfloat16 ones."""

    master: torch.Tensor
    comp: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor] | None = None


def sqrt_(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root in place: torch's CPU sqrt goes through MKL's vector math, which is
    not (a sixth of results one ulp off on an AVX2 host); numpy's is the hardware's IEEE instruction."""
    np.sqrt(x.numpy(), out=x.numpy())
    return x


def lean_chunk_(s: LeanStage, grad: torch.Tensor, a: int, b: int, decay_end: int, k: LeanConstants, block: int,
                key: int, grad_base: int = 0) -> None:
    """Update stage elements [a, b) in place: the definition of the module docstring. With int8 moments `a` is a
    multiple of `block` and `b` one or the stage's end; `grad[j]` is element grad_base + j."""
    g = grad[a - grad_base:b - grad_base].float() * k.grad_coef
    if s.scales is not None:
        blocks = slice(a // block, -(-b // block))
        codes = byte_code(True), byte_code(False)
        m_old = dequantize(s.exp_avg[a:b], s.scales[0][blocks], block, codes[0])
        v_old = dequantize(s.exp_avg_sq[a:b], s.scales[1][blocks], block, codes[1])
    else:
        m_old, v_old = s.exp_avg[a:b].float(), s.exp_avg_sq[a:b].float()
    m = m_old + (g - m_old) * k.one_minus_beta1
    v = v_old * k.beta2 + (g * k.one_minus_beta2) * g
    denom = sqrt_(v.clone()).div_(k.bias_correction2_sqrt).add_(k.eps)
    ratio = m / denom
    p, c = s.master[a:b].float(), s.comp[a:b].float()
    cut = min(max(decay_end, a), b) - a  # weight decay on [a, decay_end), none beyond
    u = torch.empty_like(p)
    for lo, hi, decay in ((0, cut, k.decay), (cut, b - a, 0.0)):
        u[lo:hi] = (p[lo:hi] * decay).neg_() - ratio[lo:hi] * k.step_size
    y = c + u
    new = (p + y).to(torch.bfloat16)
    s.comp[a:b] = (y - (new.float() - p)).to(torch.bfloat16)
    s.master[a:b] = new
    if s.scales is not None:
        quantize_(s.exp_avg[a:b], s.scales[0][blocks], m, block, codes[0])
        quantize_(s.exp_avg_sq[a:b], s.scales[1][blocks], v, block, codes[1])
    else:
        noise = rounding_noise(a, b, key)
        round_bf16_stochastic_(s.exp_avg[a:b], m, noise & 0xFFFF)
        round_bf16_stochastic_(s.exp_avg_sq[a:b], v, noise >> 16)


def span_align(block: int) -> int:
    """Where optimizer workers (and threads) may split a stage: on quantization blocks (a block's scale has one
    writer), else on the layout's 64-element alignment."""
    return max(64, block)


class FlatLeanAdamW:
    """The lean update over spans of a stage, native (kernels/lean_adamw.cpp) or in torch chunks (lean_chunk_)."""

    def __init__(self, cfg: OptimizerConfig, threads: int = 1):
        self.cfg = cfg
        self.block = cfg.lean_block if cfg.lean_moments == "int8" else 0
        self.align = span_align(self.block)
        self.chunk = max(self.align, cfg.chunk_elems // self.align * self.align)
        self.threads = max(1, threads)
        self.native = self._load_native()
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="lean") \
            if self.threads > 1 and self.native is None else None

    def _load_native(self):
        if self.cfg.kernel == "torch":
            return None
        try:
            return lean_library()
        except KernelUnavailable as exc:
            if self.cfg.kernel == "native":
                raise ConfigError(f"optimizer.kernel=native: {exc}; use optimizer.kernel=torch") from exc
            warn_once(log, f"native lean AdamW kernel unavailable ({exc}); using the torch path")
            return None

    @property
    def kernel_name(self) -> str:
        return "native" if self.native is not None else "torch"

    def bytes_per_element(self, grad: torch.Tensor, apply: bool = True) -> float:
        """Host-memory bytes an update reads and writes per element: master, compensation and both moments read
        and written (and the scales, 8 bytes per block each way), the gradient read. A dropped step moves none."""
        if not apply:
            return 0.0
        moment = 1 if self.block else 2
        return 2 * (2 + 2 + 2 * moment + (8 / self.block if self.block else 0)) + grad.element_size()

    def update(self, *, state: LeanStage, grad: torch.Tensor, start: int, end: int, decay_end: int, adam_step: int,
               lr: float, grad_coef: float, stage: int = 0, grad_base: int = 0) -> None:
        """Update elements [start, end) of one stage (`start` on span_align, `end` too or the stage's end); weight
        decay below `decay_end`; `grad[j]` is element grad_base + j; `stage` keys bfloat16 moments' noise."""
        if start % self.align:
            raise ValueError(f"a lean update starts on a multiple of {self.align} elements, not at {start}")
        k = LeanConstants.of(self.cfg, adam_step, lr, grad_coef)
        key = noise_key(adam_step, stage)
        if self.native is not None:
            self._native(state, grad, start, end, decay_end, k, key, grad_base)
            return
        edges = [start + split_span(end - start, t, self.threads, self.align)[0] for t in range(self.threads)] + [end]
        pieces = [(edges[t], edges[t + 1]) for t in range(self.threads) if edges[t + 1] > edges[t]]

        def run(lo: int, hi: int) -> None:
            for a in range(lo, hi, self.chunk):
                lean_chunk_(state, grad, a, min(a + self.chunk, hi), decay_end, k, self.block, key, grad_base)
        if self.pool is None:
            for lo, hi in pieces:
                run(lo, hi)
            return
        for future in [self.pool.submit(run, lo, hi) for lo, hi in pieces]:
            future.result()

    def _native(self, s: LeanStage, grad: torch.Tensor, start: int, end: int, decay_end: int, k: LeanConstants,
                key: int, grad_base: int) -> None:
        if end <= start:
            return
        lib = self.native
        q8 = s.scales is not None
        name = f"megatrain_lean_adamw_{'bf16' if grad.dtype == torch.bfloat16 else 'f32'}grad_{'q8' if q8 else 'bf16m'}"
        if grad.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"lean AdamW takes bfloat16 or float32 gradients, not {grad.dtype}")
        codes: tuple[ByteCode, ByteCode] = (byte_code(True), byte_code(False))
        scales = (s.scales[0][start // self.block:].data_ptr(), s.scales[1][start // self.block:].data_ptr()) \
            if q8 else (None, None)
        getattr(lib, name)(
            s.master[start:end].data_ptr(), s.comp[start:end].data_ptr(), s.exp_avg[start:end].data_ptr(),
            s.exp_avg_sq[start:end].data_ptr(), *scales, grad[start - grad_base:end - grad_base].data_ptr(),
            end - start, start, min(max(decay_end - start, 0), end - start), k.one_minus_beta1, k.beta2,
            k.one_minus_beta2, k.eps, k.bias_correction2_sqrt, k.step_size, k.decay, k.grad_coef, self.block or 1,
            *(x for c in codes for x in (c.values.data_ptr(), c.prefix.data_ptr(), c.zero)),
            key, self.threads)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
