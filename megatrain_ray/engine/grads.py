"""The gradients' way out: each stage's weight gradients, written into a device slot, go to their host home.

Per stage, on the device: the sum over the ranks (several), its squared norm into the step's total (for
clipping and the logged norm), then the D2H of this rank's piece on its own stream into the host home
(RunSpec.grad_home): the streaming copy, the stage's gradient segment, or a slab of the pool, whose
last reader (SlabTurns) must be done first. A stage larger than the slabs goes through them in pieces. Each
copy is handed to the update dispatch (engine/updates.py), which orders the update that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatrain_ray.config.resolved import GradHome
from megatrain_ray.engine.collective import Collectives, RankInfo, padded
from megatrain_ray.engine.streams import DeviceStreams
from megatrain_ray.engine.telemetry import StepTelemetry
from megatrain_ray.engine.updates import LandedGrads, UpdateDispatch
from megatrain_ray.model.layout import ModelLayout, StageLayout
from megatrain_ray.store.segments import HostStore, SlabTurns, grad_pieces


@dataclass(slots=True)
class GradSlot:
    """A device buffer of one stage's weight gradients on their way to the host."""

    buf: torch.Tensor
    """The stage's flat gradients, padded to split into equal pieces over the node's ranks."""
    out: torch.Tensor | None = None
    """This rank's piece of the sum over the ranks (several ranks per node only)."""
    drained: Any = None
    """Event: the previous D2H out of this buffer is complete."""
    slots: tuple = ()
    """The tensor slots of the stage last written: its padding is zero (layers of two layouts, Qwen3-MoE's
    dense and MoE layers, share the buffer)."""


def _within(spans, lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of `spans` (sorted, disjoint) inside [lo, hi)."""
    return [(max(a, lo), min(b, hi)) for a, b in spans if a < hi and b > lo]


def _between(spans: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) without `spans` (sorted, disjoint, inside it)."""
    out, at = [], lo
    for a, b in spans:
        if a > at:
            out.append((at, a))
        at = b
    return out + ([(at, hi)] if at < hi else [])


def _gaps(stage: StageLayout) -> list[tuple[int, int]]:
    """Padding between a stage's tensors: never written by the engine, kept at zero."""
    gaps, end = [], 0
    for slot in stage.slots:
        if slot.offset > end:
            gaps.append((end, slot.offset))
        end = slot.offset + slot.numel
    if stage.numel > end:
        gaps.append((end, stage.numel))
    return gaps


class GradientSink:
    def __init__(self, layout: ModelLayout, store: HostStore, streams: DeviceStreams, telemetry: StepTelemetry,
                 updates: UpdateDispatch, rank: RankInfo, grad_dtype: torch.dtype, acc_dtype: torch.dtype,
                 grad_home: GradHome, grad_slabs: int, slab_numel: int, poison: bool):
        """`acc_dtype`: of the squared norm; `grad_slabs`: engine.grad_slabs; `slab_numel`: the size of the pieces
        a stage larger than it goes through the slabs in (0: whole stages); `poison`: engine.poison_buffers."""
        self.store = store
        self.streams = streams
        self.telemetry = telemetry
        self.updates = updates
        self.rank = rank
        self.grad_dtype, self.acc_dtype = grad_dtype, acc_dtype
        self.grad_home = grad_home
        self.poison = poison
        self.comm: Collectives | None = None
        """The process group (several ranks only), attached once every rank has joined."""
        largest = max(layout.layers, key=lambda stage: stage.numel)
        self.layer_slots = [self._slot(largest) for _ in range(2)]
        self.embed_slot = self._slot(layout.embed)
        self.head_slot = self._slot(layout.head)
        # The host side of gradients in flight: (stage whose update reads it, slab) in pool mode.
        self.pool = store.pool() if grad_home == "pool" else []
        self.slab_turns = SlabTurns(grad_slabs, len(self.pool))
        self.slab_numel = slab_numel
        self.sqnorm: torch.Tensor | None = None
        """The step's squared norm of this rank's pieces of the summed gradients."""

    def _slot(self, stage: StageLayout) -> GradSlot:
        local_world, device = self.rank.local_world, self.streams.device
        numel = padded(stage.numel, local_world)
        buf = torch.full((numel,), float("nan") if self.poison else 0.0, dtype=self.grad_dtype, device=device)
        for a, b in [*_gaps(stage), (stage.numel, numel)]:
            buf[a:b].zero_()
        out = torch.empty(numel // local_world, dtype=self.grad_dtype, device=device) if local_world > 1 else None
        return GradSlot(buf, out, slots=stage.slots)

    def layer_slot(self, position: int) -> GradSlot:
        """The slot of the layer at `position` in the layer order (consecutive layers alternate)."""
        return self.layer_slots[position % 2]

    def begin_step(self) -> None:
        self.sqnorm = torch.zeros((), dtype=self.acc_dtype, device=self.streams.device)

    def write(self, stage: StageLayout, grad: GradSlot, grads: dict[str, torch.Tensor]) -> None:
        """Copy the stage's gradients (by tensor name) into its slot, once the slot's previous D2H is done."""
        self.streams.wait(self.streams.compute, grad.drained)
        if grad.slots != stage.slots:  # another layout: its padding lies elsewhere
            for a, b in _gaps(stage):
                grad.buf[a:b].zero_()
            grad.slots = stage.slots
        for slot in stage.slots:
            grad.buf[slot.offset:slot.offset + slot.numel].copy_(grads[slot.name].reshape(-1))

    def emit(self, stage: StageLayout, grad: GradSlot, zero_spans: list[tuple[int, int]] = ()) -> None:
        """Sum over the ranks (if several), norm on the device, then D2H of this rank's piece on its own
        stream; hand each copy to the update dispatch. A stage larger than the gradient slabs goes through
        them in slab-sized pieces, each copied and handed over on its own. `zero_spans` (one rank only): spans
        known to hold zeros (MoE experts without tokens), not copied; the update zeroes them on the host."""
        s, timeline = self.streams, self.telemetry.timeline
        first, end = self.rank.piece(stage.numel)
        piece = grad.buf[:stage.numel]
        if self.comm is not None:
            start = timeline.start(s.compute)
            n = padded(stage.numel, self.rank.local_world)  # the slot may be a larger layer's (Qwen3-MoE)
            piece = self.comm.reduce(grad.buf[:n], grad.out[:n // self.rank.local_world])[:end - first]
            timeline.stop("comm", s.compute, start)
        self.count(piece)
        ready = s.record(s.compute)
        split = self.slab_numel and stage.numel > self.slab_numel
        for lo, hi in grad_pieces(stage.numel, self.slab_numel) if split else [(first, end)]:
            host, kind, index = self._host_grad(stage)
            at = lo if split else 0  # where element lo sits in the host buffer: a piece at its start
            skipped = _within(zero_spans, lo, hi)
            with s.on(s.d2h):
                s.wait(s.d2h, ready)
                start = timeline.start(s.d2h)
                for a, b in _between(skipped, lo, hi):
                    host[a - at:b - at].copy_(piece[a - first:b - first], non_blocking=True)
                    self.telemetry.stats["d2h_bytes"] += (b - a) * piece.element_size()
                copied = timeline.stop("d2h", s.d2h, start)
                grad.drained = s.record(s.d2h, blocking=True)  # the dispatcher sleeps on it, off AdamW's cores
            zero = (host, [(a - at, b - at) for a, b in skipped]) if skipped else None
            self.updates.landed(LandedGrads(stage.index, grad.drained, copied, kind, index,
                                            (lo, hi) if split else None, zero))

    def count(self, piece: torch.Tensor) -> None:
        """Add a stage's gradients (this rank's piece of their sum) to the step's squared norm."""
        self.sqnorm += torch.linalg.vector_norm(piece, dtype=self.acc_dtype).square()

    def _host_grad(self, stage: StageLayout) -> tuple[torch.Tensor, str, int]:
        """Where the stage's gradients land on the host: (buffer, its segment kind, its index)."""
        if self.grad_home == "stream":
            return self.store.get("stream", stage.index), "stream", stage.index
        if self.grad_home == "stage":
            return self.store.get("grad", stage.index), "grad", stage.index
        k, previous = self.slab_turns.take(stage.index, stage.kind == "layer")
        if previous >= 0:
            self.updates.wait(previous, for_slab=True)  # the slab's last reader is done
        return self.pool[k], "gradpool", k

    def close(self) -> None:
        """Let go of the device buffers."""
        self.layer_slots = []
        self.embed_slot = self.head_slot = None
        self.sqnorm = None
