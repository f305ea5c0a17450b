"""Expected step time and tok/s of a run on a described machine, from measured costs.

`megatrain plan CONFIG --machine h200-1tb` prints it next to the memory plan; nothing here needs
the hardware. Each stage (the embedding, each layer, the head) costs GPU compute (its model FLOPs x
tokens / the GPU's achieved model TFLOPS, eager or compiled as the run's layers go), an H2D copy of
its weights, a D2H copy of its gradients and a CPU AdamW update; `estimate` combines them by replaying
the engine's schedule (engine/step.py) on the compute stream, the two copy streams and the optimizer
workers, as the engine overlaps them with clipping on and off. The measured rates live in
machines.yaml beside this file, each with its source; docs/speed-model.md explains the model, its
rates and its limits.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.dtypes import DTYPE_BYTES
from megatrain_ray.model.flops import stage_flops_per_token
from megatrain_ray.model.layout import ModelLayout, build_layout
from megatrain_ray.model.lora import lora_params
from megatrain_ray.planning.lora import ADAPTER_UPDATE_BYTES, lora_stage_seconds, streamed_bytes
from megatrain_ray.planning.profiles import (
    HostProfile,
    SpeedProfile,
    adamw_gparams,
    optimizer_dram_bytes,
    speculative_extra_bytes,
)
from megatrain_ray.planning.speed_estimate import SpeedEstimate
from megatrain_ray.store.segments import (
    SlabTurns,
    grad_pieces,
    pool_slab_sizes,
)

WAITS = ("CPU optimizer", "H2D", "D2H")
"""What the GPU can wait for in a step (the speed model's `bound`)."""

LINEAR_CHUNK_SECONDS = (2.1e-4, 7.5e-4)
"""A linear-attention layer's (Qwen3.5, Qwen3-Next) time per chunk of 64 positions, forward and recompute +
backward, whatever the rows (they share each step of the chunk loop): its delta rule runs one chunk after another,
each step a few small kernels the host dispatches, so the layer takes at least this long where its FLOPs would
say far less. Measured on the H200 in bfloat16, a layer of Qwen3-Next-80B's widths at 32K tokens: 108 and 382 ms
for 512 chunks (benchmarks/linear_layer_memory.py, linear-layer-memory-h200-20261201-220714.json; another machine of
the kind 91 and 308 ms, and 0.25 / 0.73 ms a chunk at 8K: -222810.json); on a slower host, longer."""

GPU_ADAMW_GBPS = {"h100": 0.75 * 3350, "h200": 0.75 * 4800}
"""HBM bytes per second a GPU-resident stage's update moves (engine.gpu_resident): 75 % of the data-sheet
bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s). An assumption, not measured here; the update is a few
milliseconds per layer either way, small beside the layer's compute."""


def gpu_adamw_bytes(run: RunSpec) -> int:
    """HBM bytes per element of a resident stage's update (engine/resident.py): the gradient read, master and both
    moments read and written, the compute copy written; the per-chunk path also writes and reads the gradient's
    cast in a scratch buffer, which the one compiled pass (engine/resident_update.py: a GPU that compiles, a
    float32 master) does inside the kernel. That pass: 28 bytes with bf16 gradients, measured at about 3.96 TB/s
    on the H200 (tests/gpu/test_resident_update_gpu.py), above the rate assumed here."""
    master = DTYPE_BYTES[run.master_dtype]
    copy = DTYPE_BYTES[run.compute_dtype] if run.compute_dtype != run.master_dtype else 0
    one_pass = run.device_type == "cuda" and run.device_compiles and run.master_dtype == "float32"
    scratch = 0 if one_pass else 2 * master
    return DTYPE_BYTES[run.grad_dtype] + scratch + 6 * master + copy


# ----------------------------------------------------------------------------- per-stage costs


@dataclass(frozen=True)
class StageCost:
    index: int
    kind: str
    numel: int
    forward_seconds: float
    """Layers: the forward; head: loss and its gradients; embedding: 0."""
    backward_seconds: float
    """Layers: recompute + backward."""
    h2d_bytes: int
    d2h_bytes: int
    activation_bytes: int = 0
    """Layers, with activation offload: the layer input that goes to host memory and comes back."""
    resident_update_seconds: float = 0.0
    """A GPU-resident layer (no copies, no CPU update): its update on the GPU; 0 for a streamed stage."""
    resident: bool = False
    """A GPU-resident layer: its weights are on the device (a LoRA one's frozen base: no update at all)."""


def stage_costs(cfg: Config, run: RunSpec, profile: SpeedProfile, layout: ModelLayout,
                offload: bool = False) -> list[StageCost]:
    """Per stage; the run's GPU-resident layers (RunSpec.resident_layers) copy nothing and update on the GPU."""
    tokens = run.rank_tokens  # one GPU's rows: with data parallelism every GPU runs this schedule at once
    flops = stage_flops_per_token(cfg.model, layout, cfg.data.seq_len)
    stream_b = DTYPE_BYTES[run.stream_dtype]
    grad_b = DTYPE_BYTES[run.grad_dtype]

    rate = profile.gpu.tflops(run.layers_compiled, cfg.model.is_moe, lora=run.frozen_base) * 1e12
    activation = tokens * cfg.model.hidden_size * DTYPE_BYTES[run.compute_dtype] if offload else 0
    resident = {s.index for s in layout.resident_stages(run.resident_layers, run.resident_vocab)}
    kept = {s.index for s in layout.kept_stages(run.resident_layers, run.kept_layers)}
    update_rate = GPU_ADAMW_GBPS[profile.gpu.kind] * 1e9 / gpu_adamw_bytes(run)
    costs = []
    for stage, f in zip(layout.stages, flops):
        seconds = f * tokens / rate
        fwd, bwd = (seconds / 4, 3 * seconds / 4) if stage.kind == "layer" else (seconds, 0.0)
        if stage.index in kept:  # its forward graph kept (engine.kept_activations): the backward recomputes nothing
            bwd = seconds / 2
        if stage.kind == "layer" and cfg.model.template != "generic" and cfg.model.layer_is_linear(stage.index - 1):
            chunks = math.ceil(cfg.data.seq_len / 64)  # at least the chunk loop's dispatch (LINEAR_CHUNK_SECONDS)
            fwd, bwd = max(fwd, chunks * LINEAR_CHUNK_SECONDS[0]), max(bwd, chunks * LINEAR_CHUNK_SECONDS[1])
        if run.frozen_base:  # LoRA: no weight gradients (planning/lora.py); nothing goes back to the host
            fwd, bwd = lora_stage_seconds(cfg, stage, fwd, bwd, tokens, rate)
            on_device = stage.index in resident
            costs.append(StageCost(stage.index, stage.kind, stage.numel, fwd, bwd,
                                   streamed_bytes(run, stage, on_device), 0,
                                   activation if stage.kind == "layer" else 0, resident=on_device))
            continue
        copies = 0 if stage.index in resident else 1
        costs.append(StageCost(stage.index, stage.kind, stage.numel, fwd, bwd, copies * stage.numel * stream_b,
                               copies * stage.numel * grad_b, activation if stage.kind == "layer" else 0,
                               stage.numel / update_rate if stage.index in resident else 0.0,
                               resident=stage.index in resident))
    return costs


# ----------------------------------------------------------------------------- the schedule


@dataclass
class _Replay:
    """Free times of the resources and the engine's events, in seconds."""

    costs: list[StageCost]
    host: HostProfile
    clip: bool
    adamw_gparams: float
    issue: float = 0.0
    compute: float = 0.0
    h2d: float = 0.0
    d2h: float = 0.0
    dispatcher: float = 0.0
    optimizer: float = 0.0
    busy: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("compute", "h2d", "d2h", "optimizer"), 0.0))
    idle: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WAITS, 0.0))
    """GPU idle time of the step by what the compute stream waited for."""
    optimizer_spans: list[tuple[float, float]] = field(default_factory=list)
    pending: dict[int, float] = field(default_factory=dict)
    """Stage -> when its ordered update is known applied."""
    slot_holds: dict[str, int] = field(default_factory=dict)
    slot_ready: dict[str, float] = field(default_factory=dict)
    slot_issued: dict[str, float] = field(default_factory=dict)
    slot_free: dict[str, float] = field(default_factory=dict)
    grad_drained: dict[str, float] = field(default_factory=dict)
    stored: dict[int, float] = field(default_factory=dict)
    """Offloaded layer input -> when its D2H is done (and when its H2D back is done, once issued)."""
    slab_turns: SlabTurns | None = None
    """The gradient slabs' turns (host.SlabTurns), as the engine takes them; None without the pool."""
    slab_numel: int = 0
    """Stages larger than this go through the slabs in pieces (0: none do)."""
    frozen: bool = False
    """LoRA (RunSpec.frozen_base): no gradient leaves the device, no CPU update is ordered."""
    device_update_seconds: float = 0.0
    """LoRA: the adapters' AdamW step on the device, after the backward."""
    speculative: frozenset[int] = frozenset()
    """Stages updated as their gradients land although clipping is on (optimizer.speculative_stages); the
    estimate takes steps whose norm stays below the clip (else their updates are redone after the backward)."""
    speculative_factor: float = 1.0
    """A speculative update's time over a plain one's: its DRAM bytes over a plain update's
    (profiles.speculative_extra_bytes)."""

    def _optimizer_busy(self, t: float) -> bool:
        k = bisect.bisect_right(self.optimizer_spans, (t, math.inf)) - 1  # the spans are disjoint and sorted
        return k >= 0 and t < self.optimizer_spans[k][1]

    def wait_update(self, stage: int) -> None:
        if stage in self.pending:
            self.issue = max(self.issue, self.pending.pop(stage))

    def slot(self, c: StageCost) -> str:
        return c.kind if c.kind != "layer" else f"layer{c.index % 2}"

    def load(self, c: StageCost) -> None:
        slot = self.slot(c)
        if c.resident or self.slot_holds.get(slot) == c.index:
            return
        self.wait_update(c.index)
        start = max(self.issue, self.h2d, self.slot_free.get(slot, 0.0))
        rate = self.host.h2d_loaded_gbps if self._optimizer_busy(start) else self.host.h2d_gbps
        self.h2d = start + c.h2d_bytes / (rate * 1e9)
        self.busy["h2d"] += self.h2d - start
        self.slot_ready[slot], self.slot_holds[slot], self.slot_issued[slot] = self.h2d, c.index, self.issue

    def offload(self, c: StageCost) -> None:
        """The layer's input (just produced on compute) goes to host memory on the D2H stream."""
        start = max(self.issue, self.d2h, self.compute)
        self.d2h = self.stored[c.index] = start + c.activation_bytes / (self.host.d2h_gbps * 1e9)
        self.busy["d2h"] += self.d2h - start

    def bring_back(self, c: StageCost) -> None:
        """Its H2D, after the weights of the same layer on the H2D stream."""
        if c.index not in self.stored:
            return
        start = max(self.issue, self.h2d, self.stored[c.index])
        rate = self.host.h2d_loaded_gbps if self._optimizer_busy(start) else self.host.h2d_gbps
        self.h2d = self.stored[c.index] = start + c.activation_bytes / (rate * 1e9)
        self.busy["h2d"] += self.h2d - start

    def run(self, c: StageCost, seconds: float, grad_slot: str | None = None, backward: bool = False) -> None:
        """Compute on the stage's weights (after their copy); a gradient write waits for its buffer's last D2H."""
        slot = self.slot(c)
        ready = 0.0 if c.resident else self.slot_ready.get(slot, 0.0)
        if backward and c.index in self.stored:
            ready = max(ready, self.stored.pop(c.index))
        start = max(self.issue, self.compute, ready)
        # The issuing thread is late only where it waited for an update (or at the step's start: ~1 ms); a copy
        # issued late for that reason counts as waiting for the optimizer up to its issue, for the copy after.
        blocked = min(start, self.issue if c.resident else max(self.issue, self.slot_issued.get(slot, 0.0)))
        self.idle["CPU optimizer"] += max(0.0, blocked - self.compute)
        self.idle["H2D"] += start - max(self.compute, blocked)
        end = start + seconds
        if grad_slot is not None and self.grad_drained.get(grad_slot, 0.0) > end:
            self.idle["D2H"] += self.grad_drained[grad_slot] - end
            end = self.grad_drained[grad_slot]
        self.busy["compute"] += seconds
        self.compute = end
        if not c.resident:
            self.slot_free[slot] = end

    def update_on_gpu(self, c: StageCost) -> None:
        """A resident layer's update, on the compute stream."""
        self.compute += c.resident_update_seconds
        self.busy["compute"] += c.resident_update_seconds

    def emit(self, c: StageCost, grad_slot: str, deferred: list[tuple[int, float]]) -> None:
        if self.frozen:
            return
        if c.resident:  # no D2H: the update at once, or after the backward with the others (clipping)
            if self.clip:
                deferred.append((c.index, self.compute))
            else:
                self.update_on_gpu(c)
            return
        split = self.slab_numel and c.numel > self.slab_numel
        for lo, hi in grad_pieces(c.numel, self.slab_numel) if split else [(0, c.numel)]:
            if self.slab_turns is not None:
                _, previous = self.slab_turns.take(c.index, c.kind == "layer")
                if previous >= 0:
                    self.wait_update(previous)
            start = max(self.issue, self.d2h, self.compute)
            self.d2h = self.grad_drained[grad_slot] = start + c.d2h_bytes * (hi - lo) / c.numel / (
                self.host.d2h_gbps * 1e9)
            self.busy["d2h"] += self.d2h - start
            if self.clip and not (c.index in self.speculative and not split):
                deferred.append((c.index, self.d2h))
            else:
                self.order(c, self.d2h, hi - lo, self.speculative_factor if self.clip else 1.0)

    def order(self, c: StageCost, drained: float, numel: int | None = None, factor: float = 1.0) -> None:
        """The dispatcher thread waits for the D2H, then the workers run the update (of `numel` elements, a
        piece, or the whole stage) in arrival order."""
        self.dispatcher = max(self.dispatcher, drained, self.issue)
        latency = self.host.control_seconds / 2
        start = max(self.optimizer, self.dispatcher + latency)
        seconds = (c.numel if numel is None else numel) / (self.adamw_gparams * 1e9) * factor
        self.optimizer = start + seconds
        self.busy["optimizer"] += seconds
        self.optimizer_spans.append((start, self.optimizer))
        self.pending[c.index] = self.optimizer + latency

    def step(self) -> float:
        """One train_step from now; returns its end (the trainer's clock stops there)."""
        costs = self.costs
        embed, layers, head = costs[0], costs[1:-1], costs[-1]
        deferred: list[tuple[int, float]] = []
        self.busy = dict.fromkeys(self.busy, 0.0)
        self.idle = dict.fromkeys(self.idle, 0.0)
        self.load(embed)
        self.run(embed, embed.forward_seconds)
        self.load(layers[0])
        for i, c in enumerate(layers):
            self.load(layers[i + 1] if i + 1 < len(layers) else head)
            if c.activation_bytes and i + 1 < len(layers):  # the last input stays on the device
                self.offload(c)
            self.run(c, c.forward_seconds)
        self.run(head, head.forward_seconds, grad_slot="head")
        self.emit(head, "head", deferred)
        self.load(layers[-1])
        for i in range(len(layers) - 1, -1, -1):
            if i > 0:
                self.load(layers[i - 1])
                self.bring_back(layers[i - 1])
            self.run(layers[i], layers[i].backward_seconds, grad_slot=None if layers[i].resident else f"grad{i % 2}",
                     backward=True)
            self.emit(layers[i], f"grad{i % 2}", deferred)
        self.run(embed, embed.backward_seconds, grad_slot="embed")
        self.emit(embed, "embed", deferred)
        self.issue = max(self.issue, self.compute)  # the loss and the norm are read back
        for index, drained in sorted(deferred):
            if not costs[index].resident:
                self.order(costs[index], drained)
        for index, _ in sorted(deferred):  # the resident layers' updates once the CPU's are ordered
            if costs[index].resident:
                self.update_on_gpu(costs[index])
        self.compute += self.device_update_seconds
        self.busy["compute"] += self.device_update_seconds
        if not self.frozen:  # the weights change with the updates just ordered (a frozen base's stay)
            self.slot_holds.clear()
        end = max(self.issue, self.compute, self.h2d, self.d2h)
        self.idle["D2H"] += end - self.compute  # the last gradients drain after the last compute
        self.issue = self.compute = end
        return end


def estimate(cfg: Config, profile: SpeedProfile, steps: int = 4, offload: bool = False,
             resident: int | None = None, run: RunSpec | None = None) -> SpeedEstimate:
    """Replay `steps` steps of the engine's schedule with the profile's rates; the last one is the estimate.
    `offload`: the layer inputs go through host memory (engine.activation_offload as the plan resolved it);
    `resident`: GPU-resident layers (engine.gpu_resident as the plan resolved it; None: as the config says);
    `run`: the settings as the plan resolved them (the tier's layers, embedding and head, kept graphs), which
    `resident` then overrides."""
    layout = build_layout(cfg.model)
    run = RunSpec.resolve(cfg) if run is None else run
    if resident is not None:
        run = replace(run, resident_layers=resident, resident_vocab=run.resident_vocab and resident > 0,
                      kept_layers=min(run.kept_layers, resident))
    costs = stage_costs(cfg, run, profile, layout, offload)
    pieces = run.vocab_in_pieces
    turns = SlabTurns(cfg.engine.grad_slabs, len(pool_slab_sizes(layout, cfg.engine.grad_slabs, pieces))) \
        if run.grad_home == "pool" else None
    replay = _Replay(costs, profile.host, cfg.optimizer.grad_clip > 0, adamw_gparams(cfg, profile.host),
                     slab_turns=turns, slab_numel=layout.max_layer_numel if pieces else 0, frozen=run.frozen_base,
                     device_update_seconds=lora_params(cfg) * ADAPTER_UPDATE_BYTES
                     / (GPU_ADAMW_GBPS[profile.gpu.kind] * 1e9),
                     speculative=frozenset(layout.speculative_stages(run.speculative_stages, run.resident_layers,
                                                                      run.resident_vocab)),
                     speculative_factor=1 + speculative_extra_bytes(cfg) / optimizer_dram_bytes(cfg))
    start = end = 0.0
    for _ in range(steps):
        start = replay.issue = end + profile.host.control_seconds  # the trainer's next call
        end = replay.step()
    busy = replay.busy
    flops = sum(stage_flops_per_token(cfg.model, layout, cfg.data.seq_len))
    return SpeedEstimate(profile, cfg.data.tokens_per_step, end - start, flops, busy["compute"], busy["h2d"],
                         busy["d2h"], busy["optimizer"], dict(replay.idle), cfg.optimizer.grad_clip > 0,
                         replay.adamw_gparams, run.layers_compiled, cfg.model.is_moe, run.frozen_base,
                         run.optimizer_state == "lean")
