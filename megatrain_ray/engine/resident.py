"""The GPU-resident tier (engine.gpu_resident): stages whose whole training state lives on the compute device: the
first decoder layers, and the embedding and LM head with them where every layer and they fit (RunSpec.resident_vocab;
their vocabulary-sized gradients, summed on the device as a streamed run's, go into the tier's buffer).

A resident stage keeps on the device its master weights (precision.master_dtype), both AdamW moments, a
gradient buffer (the host gradients' format, RunSpec.grad_dtype) and, when the compute dtype differs from
the master's, the compute copy the layer reads. Its forward and backward read that copy (no H2D), its
gradients stay in the buffer (no D2H) and count in the global norm like every other stage's, and its
update runs on the device at the streamed stages' point of the step order: as soon as its gradients are
written with clipping off, with the deferred updates once the global norm is known with clipping on;
a dropped step (non-finite norm) leaves it as it is.

The update is the CPU optimizer's math (optim/adamw.py FlatAdamW, torch path) on the device: per chunk the
gradient is cast to the master dtype in a scratch buffer, multiplied by the clipping coefficient (unless
it is 1; a float32 master divides by its inverse inside the kernel instead, one rounding apart), then
torch._fused_adamw_ with the stage's decay span [0, decay_numel) and the rest without decay. The compute copy is then the master cast as a streamed stage's would be (through the streaming
dtype), so a resident stage computes on exactly the weights it would have had streamed. On a GPU that compiles
(engine.compile) with a float32 master, the same math runs as one compiled pass over each span instead, the casts
inside it (engine/resident_update.py: the three passes per chunk cost 18.6 ms of the 3.5B bench's 0.342 s step).

A resident stage has no host segments (store/segments.plan_segments): the GPU worker fills the tier at its
start (random initialisation, a Hugging Face directory, a checkpoint on resume or after a fault), writes its
stage files of each checkpoint and serves its tensors to export and the driver, one stage at a time through
CPU buffers of that stage's size (`staging`, `put`, `take`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatrain_ray.config.engine_sections import OptimizerConfig
from megatrain_ray.config.resolved import RESIDENT_UPDATE_CHUNK_ELEMS
from megatrain_ray.engine.grads import _gaps
from megatrain_ray.engine.resident_update import SpanScalars
from megatrain_ray.model.layout import ModelLayout, StageLayout
from megatrain_ray.model.templates import bind
from megatrain_ray.store.segments import STATE_KINDS

"""A resident stage's state, as a checkpoint's stage file holds it."""


@dataclass(slots=True)
class ResidentStage:
    """One stage's training state on the device."""

    stage: StageLayout
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    compute: torch.Tensor
    """The weights the layer reads: `master` itself when the compute dtype is the master's."""


class ResidentTier:
    def __init__(self, layout: ModelLayout, count: int, optimizer: OptimizerConfig, device: torch.device,
                 master_dtype: torch.dtype, stream_dtype: torch.dtype, compute_dtype: torch.dtype,
                 grad_dtype: torch.dtype, poison: bool, vocab: bool = False, fused: Any = None,
                 timed: Callable[[], contextlib.AbstractContextManager] | None = None):
        """`count`: resident layers (RunSpec.resident_layers); `vocab`: the embedding and LM head too
        (RunSpec.resident_vocab); the dtypes are the run's (RunSpec); `poison`: engine.poison_buffers (NaN gradient
        buffers, so a gradient never written fails loudly); `fused`: resident_update.adamw_span or its compiled
        CompiledFunction (resident_update_function), the update in one pass per span; None: per chunk; `timed`:
        a context around each stage's update, which times it on the device (StepTelemetry.device_update)."""
        self.cfg = optimizer
        self.timed = timed or contextlib.nullcontext
        self.device = device
        self.fused = fused
        self.span_scalars = SpanScalars(optimizer, master_dtype, device)
        self.master_dtype, self.stream_dtype, self.compute_dtype = master_dtype, stream_dtype, compute_dtype
        self.stages: dict[int, ResidentStage] = {}
        for stage in layout.resident_stages(count, vocab):
            master = torch.zeros(stage.numel, dtype=master_dtype, device=device)
            grad = torch.full((stage.numel,), float("nan") if poison else 0.0, dtype=grad_dtype, device=device)
            for a, b in _gaps(stage):  # padding between tensors: never written, counted in the norm as zero
                grad[a:b].zero_()
            compute = master if compute_dtype == master_dtype else \
                torch.zeros(stage.numel, dtype=compute_dtype, device=device)
            self.stages[stage.index] = ResidentStage(stage, master, torch.zeros_like(master),
                                                     torch.zeros_like(master), grad, compute)
        largest = max((s.stage.numel for s in self.stages.values()), default=0)
        self.scratch = torch.empty(min(largest, RESIDENT_UPDATE_CHUNK_ELEMS), dtype=master_dtype, device=device)
        self.deferred: list[int] = []
        """Stages whose gradients wait for the global norm (clipping on), in the order they were written."""

    def holds(self, stage: StageLayout) -> bool:
        return stage.index in self.stages

    @property
    def layouts(self) -> list[StageLayout]:
        return [resident.stage for resident in self.stages.values()]

    @property
    def bytes(self) -> int:
        """Device memory the tier holds."""
        seen = {id(t): t for s in self.stages.values()
                for t in (s.master, s.exp_avg, s.exp_avg_sq, s.grad, s.compute, self.scratch)}
        return sum(t.numel() * t.element_size() for t in seen.values())

    # ------------------------------------------------------------------ the state in and out (through the CPU)

    def staging(self, stage: StageLayout, kinds: tuple[str, ...] = STATE_KINDS) -> dict[str, torch.Tensor]:
        """Zeroed CPU buffers of one stage's state (of `kinds`), for `put`."""
        return {kind: torch.zeros(stage.numel, dtype=self.master_dtype) for kind in kinds}

    def put(self, stage: StageLayout, flats: dict[str, torch.Tensor]) -> None:
        """Set the stage's state from CPU buffers (staging's); a kind not among them is zero (the moments of a
        fresh run)."""
        resident = self.stages[stage.index]
        for kind in STATE_KINDS:
            if kind in flats:
                getattr(resident, kind).copy_(flats[kind])
            else:
                getattr(resident, kind).zero_()
        self._refresh_compute(resident, 0, stage.numel)

    def take(self, stage: StageLayout, kinds: tuple[str, ...] = STATE_KINDS) -> dict[str, torch.Tensor]:
        """CPU copies of the stage's state (of `kinds`)."""
        resident = self.stages[stage.index]
        return {kind: getattr(resident, kind).to("cpu", copy=True) for kind in kinds}

    def write_tensor(self, stage: StageLayout, offset: int, value: torch.Tensor) -> None:
        """Overwrite master weights from `offset` of the stage (the driver's load_weights)."""
        resident = self.stages[stage.index]
        resident.master[offset:offset + value.numel()].copy_(value.reshape(-1))
        self._refresh_compute(resident, offset, offset + value.numel())

    # ------------------------------------------------------------------ the step

    def weights(self, stage: StageLayout) -> dict[str, torch.Tensor]:
        """The stage's tensors (views of its compute copy), as WeightStream.bind gives a streamed stage's."""
        return bind(self.stages[stage.index].compute, stage)

    def write(self, stage: StageLayout, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """Copy the stage's gradients (by tensor name) into its buffer; returns the buffer."""
        resident = self.stages[stage.index]
        for slot in stage.slots:
            resident.grad[slot.offset:slot.offset + slot.numel].copy_(grads[slot.name].reshape(-1))
        return resident.grad

    def ready(self, stage: StageLayout, defer: bool, lr: float, adam_step: int) -> None:
        """The stage's gradients are written (and counted in the norm): update now, or hold it for the global
        norm (`defer`: clipping on)."""
        if defer:
            self.deferred.append(stage.index)
        else:
            self.update(stage.index, lr, adam_step, coef=1.0)

    def apply_deferred(self, coef: float, apply: bool, lr: float, adam_step: int) -> None:
        """The held-back updates in forward order, gradients scaled by `coef`; `apply` False drops them."""
        deferred, self.deferred = sorted(self.deferred), []
        if apply:
            for index in deferred:
                self.update(index, lr, adam_step, coef)

    def update(self, index: int, lr: float, adam_step: int, coef: float) -> None:
        """AdamW on one stage, as FlatAdamW's torch path computes it (see the module docstring)."""
        with self.timed():
            if self.fused is not None and not getattr(self.fused, "failed", False):
                self._update_spans(self.stages[index], lr, adam_step, coef)
            else:
                self._update_chunks(self.stages[index], lr, adam_step, coef)

    @torch.no_grad()
    def _update_spans(self, resident: ResidentStage, lr: float, adam_step: int, coef: float) -> None:
        """The update through `fused`: one call per span, the casts inside it (engine/resident_update.py)."""
        rows = self.span_scalars.get(lr, adam_step, coef)
        compute = None if resident.compute is resident.master else resident.compute
        via = self.stream_dtype if self.stream_dtype not in (self.master_dtype, self.compute_dtype) else None
        decay_end, numel = resident.stage.decay_numel, resident.stage.numel
        for (a, b), scalars in zip(((0, decay_end), (decay_end, numel)), rows):
            if b > a:
                self.fused(resident.master[a:b], resident.grad[a:b], resident.exp_avg[a:b],
                           resident.exp_avg_sq[a:b], None if compute is None else compute[a:b], scalars, via)

    def _update_chunks(self, resident: ResidentStage, lr: float, adam_step: int, coef: float) -> None:
        """The update through torch._fused_adamw_, chunk by chunk through the scratch buffer."""
        cfg = self.cfg
        step = torch.tensor(float(adam_step), dtype=torch.float32, device=self.device)
        # A float32 master takes clipping's coefficient inside the fused kernel (its grad_scale divides the
        # gradient by 1 / coef): one pass over the scratch less. The kernel's scale is float32 only, so a float64
        # master multiplies first, exactly as FlatAdamW does.
        fold = coef != 1.0 and self.master_dtype == torch.float32
        scale = torch.tensor(1.0 / coef, dtype=torch.float32, device=self.device) if fold else None
        decay_end, numel = resident.stage.decay_numel, resident.stage.numel
        for lo, hi, weight_decay in ((0, decay_end, cfg.weight_decay), (decay_end, numel, 0.0)):
            for a in range(lo, hi, self.scratch.numel()):
                b = min(a + self.scratch.numel(), hi)
                g = self.scratch[:b - a].copy_(resident.grad[a:b])
                if coef != 1.0 and not fold:
                    g.mul_(coef)
                torch._fused_adamw_(
                    [resident.master[a:b]], [g], [resident.exp_avg[a:b]], [resident.exp_avg_sq[a:b]], [], [step],
                    lr=lr, beta1=cfg.beta1, beta2=cfg.beta2, weight_decay=weight_decay, eps=cfg.eps,
                    amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)
                self._refresh_compute(resident, a, b)

    def _refresh_compute(self, resident: ResidentStage, a: int, b: int) -> None:
        """The compute copy of elements [a, b): the master through the streaming dtype, as a streamed stage's
        weights reach the device (host streaming copy, then the device's cast)."""
        if resident.compute is resident.master:
            return
        source = resident.master[a:b]
        if self.stream_dtype not in (self.master_dtype, self.compute_dtype):
            source = source.to(self.stream_dtype)
        resident.compute[a:b].copy_(source)

    def close(self) -> None:
        """Let go of the device buffers."""
        self.stages = {}
        self.scratch = None
