"""AdamW on flat host spans, and the learning-rate schedule.

The update of a span runs in cache-sized chunks. Per chunk: the gradient is cast to the master
dtype in a small scratch buffer (when it arrives in bf16 or fp32), torch's fused CPU AdamW
updates master and moments, and the new weights are written to the streaming copy while the
chunk is still in cache. Each byte of master, moments, gradient and streaming copy then
crosses DRAM once per step, which is what bounds a CPU optimizer (see DESIGN.md section 3).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch

from megatrain_ray.config import OptimizerConfig, ScheduleConfig
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.kernels import KernelUnavailable, adamw_library
from megatrain_ray.log import get_logger, warn_once

log = get_logger(__name__)


def lr_at(step: int, peak_lr: float, total_steps: int, schedule: ScheduleConfig) -> float:
    """Learning rate of 0-based step `step` of `total_steps`.

    Warmup: peak * (step + 1) / warmup_steps. Then, with p = (step - warmup) / (total - warmup) in
    [0, 1): cosine: floor + (peak - floor) * (1 + cos(pi p)) / 2; linear: peak - (peak - floor) p;
    constant: peak. floor = min_lr_ratio * peak.
    """
    warmup = schedule.warmup_steps
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    if schedule.kind == "constant":
        return peak_lr
    floor = schedule.min_lr_ratio * peak_lr
    progress = (step - warmup) / max(1, total_steps - warmup)
    if schedule.kind == "linear":
        return peak_lr - (peak_lr - floor) * progress
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def split_span(numel: int, part: int, parts: int, align: int = 64) -> tuple[int, int]:
    """[start, end) of one worker's share of a stage of `numel` elements, on aligned boundaries."""
    def edge(k: int) -> int:
        return min(numel, (numel * k // parts + align - 1) // align * align)
    return edge(part), edge(part + 1)


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
        self.threads = max(1, threads)
        self.native = self._load_native()
        self.scratch = [torch.empty(self.chunk, dtype=master_dtype) for _ in range(self.threads)]
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

    def bytes_per_element(self, grad: torch.Tensor, stream_out: torch.Tensor | None, apply: bool = True) -> int:
        """Host-memory bytes an update reads and writes per element: master and both moments read and
        written, the gradient read, the streaming copy written. The torch path's scratch stays in cache."""
        copy = stream_out.element_size() if stream_out is not None else 0
        if not apply:  # a dropped step only rewrites the copy from the master
            return self.master_dtype.itemsize + copy
        return 6 * self.master_dtype.itemsize + grad.element_size() + copy

    @property
    def kernel_name(self) -> str:
        return "native" if self.native is not None else "torch"

    def update(self, *, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
               stream_out: torch.Tensor | None, start: int, end: int, decay_end: int, adam_step: int, lr: float,
               grad_coef: float) -> None:
        """Update elements [start, end) of one stage; weight decay applies below `decay_end`.

        The gradient is multiplied by `grad_coef` (the clipping coefficient) first, as
        clip_grad_norm_ does, in the scratch chunk: the host gradient buffer is never modified.
        """
        tensors = (master, exp_avg, exp_avg_sq, grad, stream_out)
        if self.native is not None and grad.dtype in (torch.float32, torch.bfloat16) and \
                (stream_out is None or stream_out.dtype == torch.bfloat16):
            self._native(tensors, start, end, decay_end, adam_step, lr, grad_coef)
            return
        step = torch.tensor(float(adam_step), dtype=torch.float32)
        if self.pool is None:
            self._piece(tensors, start, end, decay_end, step, lr, grad_coef, self.scratch[0])
            return
        edges = [start + split_span(end - start, k, self.threads)[0] for k in range(self.threads)] + [end]
        futures = [self.pool.submit(self._piece, tensors, edges[k], edges[k + 1], decay_end, step, lr, grad_coef,
                                    self.scratch[k]) for k in range(self.threads) if edges[k + 1] > edges[k]]
        for future in futures:
            future.result()

    def _native(self, tensors: tuple, start: int, end: int, decay_end: int, adam_step: int, lr: float,
                grad_coef: float) -> None:
        master, exp_avg, exp_avg_sq, grad, stream_out = tensors
        cfg = self.cfg
        native = self.native
        fn = native.megatrain_adamw_bf16grad if grad.dtype == torch.bfloat16 else native.megatrain_adamw_f32grad
        bc1 = 1.0 - cfg.beta1 ** adam_step
        bc2_sqrt = math.sqrt(1.0 - cfg.beta2 ** adam_step)
        for lo, hi, weight_decay in self._decay_spans(start, end, decay_end):
            if hi <= lo:
                continue
            fn(master[lo:hi].data_ptr(), exp_avg[lo:hi].data_ptr(), exp_avg_sq[lo:hi].data_ptr(),
               grad[lo:hi].data_ptr(), stream_out[lo:hi].data_ptr() if stream_out is not None else None, hi - lo, lr,
               cfg.beta1, cfg.beta2, cfg.eps, weight_decay, bc1, bc2_sqrt, grad_coef, self.threads)

    def _decay_spans(self, start: int, end: int, decay_end: int) -> tuple[tuple[int, int, float], ...]:
        """[start, end) cut at decay_end: the part below gets weight decay, the rest none."""
        return (start, min(end, decay_end), self.cfg.weight_decay), (max(start, decay_end), end, 0.0)

    def _piece(self, tensors: tuple, start: int, end: int, decay_end: int, step: torch.Tensor, lr: float,
               grad_coef: float, scratch: torch.Tensor) -> None:
        master, exp_avg, exp_avg_sq, grad, stream_out = tensors
        cfg = self.cfg
        for lo, hi, weight_decay in self._decay_spans(start, end, decay_end):
            for a in range(lo, hi, self.chunk):
                b = min(a + self.chunk, hi)
                g = scratch[:b - a].copy_(grad[a:b])  # cast to the master dtype while in cache
                if grad_coef != 1.0:
                    g.mul_(grad_coef)
                p = master[a:b]
                torch._fused_adamw_(
                    [p], [g], [exp_avg[a:b]], [exp_avg_sq[a:b]], [], [step], lr=lr, beta1=cfg.beta1,
                    beta2=cfg.beta2, weight_decay=weight_decay, eps=cfg.eps, amsgrad=False, maximize=False,
                    grad_scale=None, found_inf=None)
                if stream_out is not None:
                    stream_out[a:b].copy_(p)  # the new streaming copy, in the same pass

    @staticmethod
    def refresh(master: torch.Tensor, stream_out: torch.Tensor, start: int, end: int) -> None:
        """Rewrite the streaming copy from the master weights (after a dropped step)."""
        stream_out[start:end].copy_(master[start:end])
