"""The weights' way in: device slots that each hold one stage's weights, filled host->device on the H2D stream.

Two slots serve the layers (layer i computes in one while layer i+1 is copied into the other), one each the
embedding and the LM head. A load waits first for the stage's last ordered update (its weights change), and
compute waits for the load by an event; a slot is overwritten only once compute released its occupant.

Several ranks per node with parallel.gather_weights: each rank copies its piece of the stage from the host
and the pieces are all-gathered over the node's ranks. Several nodes: the leader sums a sample of every stage's
host weights, which the step's totals compare across the nodes (their copies must stay equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatrain_ray.engine.collective import Collectives, RankInfo, padded
from megatrain_ray.engine.packed_stream import PackedArrival
from megatrain_ray.engine.streams import DeviceStreams
from megatrain_ray.engine.telemetry import StepTelemetry
from megatrain_ray.engine.updates import UpdateDispatch
from megatrain_ray.model.layout import ModelLayout, StageLayout
from megatrain_ray.model.templates import bind
from megatrain_ray.store.segments import HostStore

CHECKSUM_SAMPLES = 4096
"""Elements per stage (evenly strided) in the per-step checksum that compares the nodes' copies."""


@dataclass(slots=True)
class WeightSlot:
    """A device buffer that holds one stage's weights at a time."""

    raw: torch.Tensor
    """Destination of the H2D copy, in the streaming dtype."""
    compute: torch.Tensor
    """The same buffer when the streaming dtype is the compute dtype, else its cast."""
    ready: Any = None
    """Event: the copy (and cast) of `holds` is complete."""
    free: Any = None
    """Event: compute no longer reads the previous occupant."""
    holds: int = -1
    nf4_experts: bool = False
    """The stage was loaded with its fused experts left in NF4 (WeightStream.experts_in_nf4): bind adds their views."""


class WeightStream:
    def __init__(self, layout: ModelLayout, store: HostStore, streams: DeviceStreams, telemetry: StepTelemetry,
                 updates: UpdateDispatch, rank: RankInfo, stream_dtype: torch.dtype, compute_dtype: torch.dtype,
                 poison: bool, gather_weights: bool, resident_layers: int = 0, frozen: bool = False,
                 decode: Any = None, nf4_kernels: str = "torch"):
        """`poison`: fill the slots with NaN (engine.poison_buffers); `gather_weights`: parallel.gather_weights;
        `resident_layers`: the first layers are GPU-resident (RunSpec.resident_layers: no layer slots when every one
        is, unless packed: an NF4 base keeps its resident layers packed and dequantizes them into the slots);
        `frozen`: the weights never change (a LoRA base), so a slot's stage stays valid from one step to the next;
        `decode`: an NF4 base's block decoding (quant/nf4_stage.decode_blocks compiled; None: eager); `nf4_kernels`:
        engine.nf4_kernels."""
        self.store = store
        self.streams = streams
        self.telemetry = telemetry
        self.updates = updates
        self.rank = rank
        self.stream_dtype, self.compute_dtype = stream_dtype, compute_dtype
        self.poison = poison
        self.gather_weights = gather_weights
        self.comm: Collectives | None = None
        """The process group (several ranks only), attached once every rank has joined."""
        self.gather = False
        """This step loads weights in pieces gathered over the node's ranks (training steps only)."""
        self.checksum: float | None = None
        self.summed: set[int] = set()
        self.experts_in_nf4 = False
        """Load device-resident packed MoE layers with their experts left in NF4 (a rollout's decode step:
        PackedArrival.keeps_experts); such a load is never reused, as its slot lacks the experts' dense values."""
        self.reading: str | None = None
        """The host kind the stages are copied from: None, the streaming copy (store.stream); "reference": GRPO's
        frozen initial weights (ForwardOnlyPasses.reference_weights)."""
        # An NF4 base (finetune.lora.base_quantization): its layers arrive packed and are dequantized on the device.
        self.packed = PackedArrival.of(layout, store, compute_dtype, streams.device, resident_layers, decode,
                                       nf4_kernels)
        self.frozen = frozen
        streams_layers = resident_layers < len(layout.layers) or self.packed is not None
        self.layer_slots = [self._slot(layout.max_layer_numel, dense=self.packed is None)
                            for _ in range(2 if streams_layers else 0)]
        self.embed_slot = self._slot(layout.embed.numel)
        self.head_slot = self._slot(layout.head.numel)

    def _slot(self, numel: int, dense: bool = True) -> WeightSlot:
        """`dense`: the slot receives streaming-dtype copies (else only dequantized packed stages)."""
        numel, device = padded(numel, self.rank.local_world), self.streams.device  # room for every rank's piece
        compute = torch.empty(numel, dtype=self.compute_dtype, device=device)
        raw = torch.empty(numel, dtype=self.stream_dtype, device=device) \
            if dense and self.stream_dtype != self.compute_dtype else compute
        for t in {id(raw): raw, id(compute): compute}.values():
            t.fill_(float("nan") if self.poison else 0.0)
        return WeightSlot(raw, compute)

    def begin_step(self, training: bool) -> None:
        """A step starts; a training step gathers weights (parallel.gather_weights) and, on the leader of one of
        several nodes, sums the checksum sample of each stage it loads."""
        self.checksum = None
        if not training:
            return
        self.gather = self.gather_weights and self.comm is not None and self.rank.local_world > 1
        if self.comm is not None and self.rank.nodes > 1 and self.rank.leader:
            self.checksum, self.summed = 0.0, set()

    def take_checksum(self) -> float | None:
        """The step's checksum sample (None: not summed on this rank); the next step sums its own."""
        checksum, self.checksum = self.checksum, None
        return checksum

    def end_step(self) -> None:
        self.gather = False  # evaluation runs on one rank: it must never wait for the others' pieces
        # Weights change with the updates just ordered: nothing on the device is current. A frozen base's stay,
        # unless gathered: then every rank must load (and gather) the same stages, and evaluation loads on one.
        if not self.frozen or self.gather_weights:
            self.invalidate()

    def invalidate(self) -> None:
        """Forget what the slots hold: the next load of every stage copies it again."""
        for slot in (*self.layer_slots, self.embed_slot, self.head_slot):
            slot.holds = -1

    def slot_for(self, stage: StageLayout) -> WeightSlot:
        if stage.kind == "embed":
            return self.embed_slot
        if stage.kind == "head":
            return self.head_slot
        return self.layer_slots[stage.index % 2]

    def load(self, stage: StageLayout) -> WeightSlot:
        """Issue the H2D copy of a stage's weights (no-op if its slot still holds them this step)."""
        slot = self.slot_for(stage)
        if slot.holds == stage.index:
            return slot
        self.updates.wait(stage.index)
        slot.holds = -1  # until the load below is issued: a load that raised leaves no stale claim behind
        if self.checksum is not None and stage.index not in self.summed:
            self.summed.add(stage.index)
            self.checksum += self._sample_sum(stage)
        s, timeline = self.streams, self.telemetry.timeline
        with s.on(s.h2d):
            s.wait(s.h2d, slot.free)
            start = timeline.start(s.h2d)
            first, end = self.rank.piece(stage.numel) if self.gather else (0, stage.numel)
            packed = self.packed is not None and self.packed.packs(stage)
            keep = packed and self.experts_in_nf4 and self.packed.keeps_experts(stage)
            if packed:  # one rank (LoRA): no pieces; dequantized straight into the compute dtype
                copied = self.packed.load(stage, slot.compute[:stage.numel], keep_experts=keep)
            else:
                host = self.store.stream(stage.index) if self.reading is None else \
                    self.store.get(self.reading, stage.index)  # type: ignore[arg-type]
                slot.raw[first:end].copy_(host[first:end], non_blocking=True)
                copied = (end - first) * slot.raw.element_size()
            timeline.stop("h2d", s.h2d, start)
            if self.gather:
                start = timeline.start(s.h2d)
                self.comm.gather(slot.raw[:padded(stage.numel, self.rank.local_world)])
                timeline.stop("comm", s.h2d, start)
            if slot.compute is not slot.raw and not packed:
                slot.compute[:stage.numel].copy_(slot.raw[:stage.numel])
            slot.ready = s.record(s.h2d)
        slot.holds, slot.nf4_experts = (-1 if keep else stage.index), keep
        self.telemetry.stats["h2d_bytes"] += copied
        return slot

    def _sample_sum(self, stage: StageLayout) -> float:
        """float64 sum of evenly strided elements of the weights the node streams for `stage` (read once
        its update is applied, before this step's gradients exist): equal on every node, or a copy is wrong."""
        host = self.store.stream(stage.index)[:stage.numel]
        return float(host[::max(1, stage.numel // CHECKSUM_SAMPLES)].sum(dtype=torch.float64))

    def bind(self, stage: StageLayout, slot: WeightSlot) -> dict[str, torch.Tensor]:
        """The stage's tensors, views of the slot, once compute waited for their load."""
        self.streams.wait(self.streams.compute, slot.ready)
        weights = bind(slot.compute[:stage.numel], stage)
        if slot.nf4_experts:
            weights.update(self.packed.expert_views(stage))
        return weights

    def release(self, slot: WeightSlot) -> None:
        """Compute is done with the slot's weights: the next load may overwrite them."""
        slot.free = self.streams.record(self.streams.compute)

    def close(self) -> None:
        """Let go of the device buffers."""
        self.layer_slots = []
        self.embed_slot = self.head_slot = None
