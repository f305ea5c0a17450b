"""AdamW on flat host spans, and the learning-rate schedule.

The update of a span runs in cache-sized chunks. Per chunk: the gradient is cast to the master
dtype in a small scratch buffer (when it arrives in bf16 or fp32), torch's fused CPU AdamW
updates master and moments, and the new weights are written to the streaming copy while the
chunk is still in cache. Each byte of master, moments, gradient and streaming copy then
crosses DRAM once per step, which is what bounds a CPU optimizer (docs/speed-model.md).

bfloat16 moments (`optimizer.moment_dtype`) are widened to float32 in scratch chunks, updated in
float32 and rounded back stochastically: the float32 bits plus 16 bits of noise, truncated. The
noise is a hash of (step, stage, element index), not a random generator, so the result does not
depend on how spans are split among workers and threads, and a resumed run repeats it bit for bit.
Round-to-nearest would be biased: a moment whose change per step is below half a bfloat16 step
(0.2 to 0.4 % of its value; exp_avg_sq decays by 1 - beta2 per step, 0.1 % at beta2 = 0.999) would
never change at all. Stochastic rounding keeps every moment unbiased (its expectation is the float32 value).
The native kernel (kernels/adamw.cpp) does the same per element with the same hash.
"""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor

import torch

from megatrain_ray.config.engine_sections import OptimizerConfig
from megatrain_ray.dtypes import dtype_name
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.observe.log import get_logger, warn_once
from megatrain_ray.optim.kernels import KernelUnavailable, adamw_library

log = get_logger(__name__)


def split_span(numel: int, part: int, parts: int, align: int = 64) -> tuple[int, int]:
    """[start, end) of one worker's share of a stage of `numel` elements, on aligned boundaries."""
    def edge(k: int) -> int:
        return min(numel, (numel * k // parts + align - 1) // align * align)
    return edge(part), edge(part + 1)


# ----------------------------------------------------------------------------- stochastic rounding

_MASK32 = 0xFFFFFFFF
_ROUND_ELEMS = 1 << 13
"""Elements per sub-chunk of the torch path's rounding: its int64 temporaries (3 x 64 KiB) stay in L2."""


def noise_key(adam_step: int, stage: int) -> int:
    """The 32-bit key of the rounding noise of one stage's update at one step."""
    return int.from_bytes(hashlib.sha256(f"moments:{adam_step}:{stage}".encode()).digest()[:4], "little")


def rounding_noise(start: int, end: int, key: int, out: torch.Tensor | None = None,
                   tmp: torch.Tensor | None = None) -> torch.Tensor:
    """32 bits of noise per element index in [start, end) (int64 tensor): mix32(index mod 2**32 XOR key), with
    mix32 the low-bias integer hash [16 21f0aaad 15 735a2d97 15] of Wellons' hash-prospector. Each multiplier
    is below 2**31, so no int64 product overflows. The low 16 bits round exp_avg, the high 16 exp_avg_sq.
    `out` and `tmp` (int64, at least end - start long) avoid allocations."""
    n = end - start
    x = torch.arange(start, end, dtype=torch.int64, out=None if out is None else out[:n])
    t = torch.empty_like(x) if tmp is None else tmp[:n]
    x.bitwise_and_(_MASK32).bitwise_xor_(key)
    for shift, multiplier in ((16, 0x21F0AAAD), (15, 0x735A2D97)):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=t))
        x.mul_(multiplier).bitwise_and_(_MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=t))


def round_bf16_stochastic_(dst: torch.Tensor, src: torch.Tensor, noise16: torch.Tensor,
                           tmp: torch.Tensor | None = None) -> None:
    """dst (bfloat16) = src (float32) rounded up or down at random: truncate(bits + noise16). Infinities and
    NaNs round to nearest (noise would turn an infinity into a NaN). `tmp`: int64 scratch of src's length."""
    bits = torch.empty(src.numel(), dtype=torch.int64) if tmp is None else tmp[:src.numel()]
    bits.copy_(src.view(torch.int32)).bitwise_and_(_MASK32)
    special = (bits & 0x7F800000) == 0x7F800000
    bits.add_(noise16).bitwise_right_shift_(16)
    if bool(special.any()):
        nearest = src.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
        bits = torch.where(special, nearest, bits)
    dst.view(torch.int16).copy_(bits)  # keeps the low 16 bits: the same bits as signed 16-bit


class FlatAdamW:
    """AdamW over spans of flat buffers, chunk by chunk, fused with the streaming-copy write.

    A span is split into `threads` contiguous pieces run by a thread pool; each thread walks its
    piece chunk by chunk with single-threaded torch kernels (which release the GIL), so the cores
    of a worker run in parallel without a fork/join per chunk.
    """

    def __init__(self, cfg: OptimizerConfig, master_dtype: torch.dtype, threads: int = 1):
        self.cfg = cfg
        self.chunk = cfg.chunk_elems
        self.master_dtype = master_dtype
        self.moment_dtype = torch.bfloat16 if cfg.moment_dtype == "bfloat16" else master_dtype
        if self.moment_dtype == torch.bfloat16 and master_dtype != torch.float32:
            raise ConfigError("optimizer.moment_dtype=bfloat16 needs precision.master_dtype=float32")
        self.threads = max(1, threads)
        self.native = self._load_native()
        # Per thread: the gradient chunk, and with bf16 moments the two widened moment chunks and the integers
        # of the rounding (three sub-chunks of _ROUND_ELEMS).
        per_thread = 3 if self.moment_dtype != master_dtype else 1
        self.scratch = [[torch.empty(self.chunk, dtype=master_dtype) for _ in range(per_thread)]
                        + ([torch.empty(3 * _ROUND_ELEMS, dtype=torch.int64)] if per_thread == 3 else [])
                        for _ in range(self.threads)]
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="adamw") if self.threads > 1 else None

    def _load_native(self):
        if self.cfg.kernel == "torch" or self.master_dtype != torch.float32:
            if self.cfg.kernel == "native":
                raise ConfigError("optimizer.kernel=native needs precision.master_dtype=float32; use auto or torch")
            return None
        try:
            return adamw_library()
        except KernelUnavailable as exc:
            if self.cfg.kernel == "native":
                raise ConfigError(f"optimizer.kernel=native: {exc}; use optimizer.kernel=torch") from exc
            warn_once(log, f"native AdamW kernel unavailable ({exc}); using torch's kernel")
            return None

    def bytes_per_element(self, grad: torch.Tensor, stream_out: torch.Tensor | None, apply: bool = True,
                          speculative: bool = False) -> int:
        """Host-memory bytes an update reads and writes per element: master and both moments read and
        written, the gradient read, the streaming copy written. The torch path's scratch stays in cache.
        `speculative`: an update into the stage's other set, which also writes the gradient aside. The native
        kernel streams that set out on x86 (kernels/adamw.cpp); torch's stores, and the native kernel's elsewhere,
        read each of its lines first (it is not in cache, as the current set is)."""
        copy = stream_out.element_size() if stream_out is not None else 0
        if not apply:  # a dropped step only rewrites the copy from the master
            return self.master_dtype.itemsize + copy
        state = self.master_dtype.itemsize + 2 * self.moment_dtype.itemsize
        extra = 0
        if speculative:
            streams = self._runs_native(grad, stream_out) and self.native.megatrain_adamw_streams()
            extra = grad.element_size() + (0 if streams else state)
        return 2 * state + grad.element_size() + copy + extra

    def _runs_native(self, grad: torch.Tensor, stream_out: torch.Tensor | None) -> bool:
        """Whether an update with these gradients and streaming copy runs the native kernel."""
        return self.native is not None and self.cfg.runs_native_kernel(
            dtype_name(self.master_dtype), dtype_name(grad.dtype),
            dtype_name(stream_out.dtype) if stream_out is not None else None)

    @property
    def kernel_name(self) -> str:
        return "native" if self.native is not None else "torch"

    def update(self, *, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
               stream_out: torch.Tensor | None, start: int, end: int, decay_end: int, adam_step: int, lr: float,
               grad_coef: float, stage: int = 0, moments_base: int = 0, grad_base: int = 0,
               into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               save_grad: torch.Tensor | None = None) -> None:
        """Update elements [start, end) of one stage; weight decay applies below `decay_end`.

        The gradient is multiplied by `grad_coef` (the clipping coefficient) first, as
        clip_grad_norm_ does, in the scratch chunk: the host gradient buffer is never modified.
        `exp_avg[k]` and `exp_avg_sq[k]` hold element `moments_base + k` of the stage (the disk tier
        stages only a worker's span), `grad[k]` element `grad_base + k` (a piece of a larger stage at the
        start of a gradient slab); `stage` keys the rounding noise of bfloat16 moments. A speculative update
        writes the new master and moments `into` the stage's other set (else in place) and saves the gradients
        read in `save_grad` (element k: element k of the stage) before the streaming copy overwrites them.
        """
        if (into is not None or save_grad is not None) and (moments_base or grad_base):
            raise ValueError("a speculative update takes whole stages in RAM")
        tensors = (master, exp_avg, exp_avg_sq, grad, stream_out, into, save_grad)
        key = noise_key(adam_step, stage)
        if self._runs_native(grad, stream_out):
            self._native(tensors, start, end, decay_end, adam_step, lr, grad_coef, key, moments_base, grad_base)
            return
        step = torch.tensor(float(adam_step), dtype=torch.float32)
        if self.pool is None:
            self._piece(tensors, start, end, decay_end, step, lr, grad_coef, self.scratch[0], key, moments_base,
                        grad_base)
            return
        edges = [start + split_span(end - start, k, self.threads)[0] for k in range(self.threads)] + [end]
        futures = [self.pool.submit(self._piece, tensors, edges[k], edges[k + 1], decay_end, step, lr, grad_coef,
                                    self.scratch[k], key, moments_base, grad_base)
                   for k in range(self.threads) if edges[k + 1] > edges[k]]
        for future in futures:
            future.result()

    def _native(self, tensors: tuple, start: int, end: int, decay_end: int, adam_step: int, lr: float,
                grad_coef: float, key: int, base: int, grad_base: int) -> None:
        master, exp_avg, exp_avg_sq, grad, stream_out, into, save_grad = tensors
        cfg = self.cfg
        native = self.native
        bf16_moments = self.moment_dtype == torch.bfloat16
        fn = {(False, False): native.megatrain_adamw_f32grad, (True, False): native.megatrain_adamw_bf16grad,
              (False, True): native.megatrain_adamw_f32grad_bf16m,
              (True, True): native.megatrain_adamw_bf16grad_bf16m}[(grad.dtype == torch.bfloat16, bf16_moments)]
        bc1 = 1.0 - cfg.beta1 ** adam_step
        bc2_sqrt = math.sqrt(1.0 - cfg.beta2 ** adam_step)
        for lo, hi, weight_decay in self._decay_spans(start, end, decay_end):
            if hi <= lo:
                continue
            args = [master[lo:hi].data_ptr(), exp_avg[lo - base:hi - base].data_ptr(),
                    exp_avg_sq[lo - base:hi - base].data_ptr(), grad[lo - grad_base:hi - grad_base].data_ptr(),
                    stream_out[lo:hi].data_ptr() if stream_out is not None else None, hi - lo, lr,
                    cfg.beta1, cfg.beta2, cfg.eps, weight_decay, bc1, bc2_sqrt, grad_coef, self.threads,
                    lo, key]  # the bf16 moments' noise of element i is a hash of its index in the stage
            args += [t[lo:hi].data_ptr() for t in into] if into is not None else [None] * 3
            args.append(save_grad[lo:hi].data_ptr() if save_grad is not None else None)
            fn(*args)

    def _decay_spans(self, start: int, end: int, decay_end: int) -> tuple[tuple[int, int, float], ...]:
        """[start, end) cut at decay_end: the part below gets weight decay, the rest none."""
        return (start, min(end, decay_end), self.cfg.weight_decay), (max(start, decay_end), end, 0.0)

    def _piece(self, tensors: tuple, start: int, end: int, decay_end: int, step: torch.Tensor, lr: float,
               grad_coef: float, scratch: list[torch.Tensor], key: int, base: int, grad_base: int) -> None:
        master, exp_avg, exp_avg_sq, grad, stream_out, into, save_grad = tensors
        cfg = self.cfg
        widen = self.moment_dtype != self.master_dtype
        for lo, hi, weight_decay in self._decay_spans(start, end, decay_end):
            for a in range(lo, hi, self.chunk):
                b = min(a + self.chunk, hi)
                if save_grad is not None:  # before the streaming copy, which it may be, is written
                    save_grad[a:b].copy_(grad[a:b])
                g = scratch[0][:b - a].copy_(grad[a - grad_base:b - grad_base])  # cast to the master dtype in cache
                if grad_coef != 1.0:
                    g.mul_(grad_coef)
                m, v = exp_avg[a - base:b - base], exp_avg_sq[a - base:b - base]
                if into is not None:  # a speculative update: the other set starts as a copy of the current one
                    p = into[0][a:b].copy_(master[a:b])
                    m_home, v_home = into[1][a:b], into[2][a:b]
                    if not widen:
                        m, v = m_home.copy_(m), v_home.copy_(v)
                else:
                    p, m_home, v_home = master[a:b], m, v
                if widen:  # bf16 moments: update float32 copies of the chunk, round back below
                    m, v = scratch[1][:b - a].copy_(m), scratch[2][:b - a].copy_(v)
                torch._fused_adamw_(
                    [p], [g], [m], [v], [], [step], lr=lr, beta1=cfg.beta1,
                    beta2=cfg.beta2, weight_decay=weight_decay, eps=cfg.eps, amsgrad=False, maximize=False,
                    grad_scale=None, found_inf=None)
                if widen:  # in sub-chunks that stay in cache: the integer work is several passes
                    self._round_back(m_home, v_home, m, v, a, key, scratch[3])
                if stream_out is not None:
                    stream_out[a:b].copy_(p)  # the new streaming copy, in the same pass

    @staticmethod
    def _round_back(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, m: torch.Tensor, v: torch.Tensor, index: int,
                    key: int, ints: torch.Tensor) -> None:
        """Round the float32 moments m, v of elements index.. back into the bfloat16 exp_avg, exp_avg_sq."""
        step = ints.numel() // 3
        noise, low, tmp = ints[:step], ints[step:2 * step], ints[2 * step:3 * step]
        for a in range(0, m.numel(), step):
            b = min(a + step, m.numel())
            rounding_noise(index + a, index + b, key, noise, tmp)
            round_bf16_stochastic_(exp_avg[a:b], m[a:b], torch.bitwise_and(noise[:b - a], 0xFFFF, out=low[:b - a]),
                                   tmp)
            round_bf16_stochastic_(exp_avg_sq[a:b], v[a:b], noise[:b - a].bitwise_right_shift_(16), tmp)

    @staticmethod
    def refresh(master: torch.Tensor, stream_out: torch.Tensor, start: int, end: int) -> None:
        """Rewrite the streaming copy from the master weights (after a dropped step)."""
        stream_out[start:end].copy_(master[start:end])
