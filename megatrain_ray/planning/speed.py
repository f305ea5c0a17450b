"""Expected step time and tok/s of a run on a described machine, from measured costs.

`megatrain plan CONFIG --machine h200-1tb` prints it next to the memory plan; nothing here needs
the hardware. Every rate below was measured; each names its source.

Costs of one stage (the embedding, each layer, the head):
- GPU compute = model FLOPs of the stage (metrics.stage_flops_per_token, the harness formula
  6 N + 6 L T d_attn split by stage) x tokens / the GPU's achieved model TFLOPS, the eager or the
  compiled one as the run's layers go (plan.layers_compiled: engine.compile on the GPU). That rate is
  measured on GPU-busy time (the engine's timed compute spans), so it already holds the
  recomputation and the elementwise work. A layer's time splits 1 : 3 between forward and
  recompute + backward (forward F, recompute F, backward 2 F); the head runs whole after the forward.
- H2D = stage elements x streaming dtype bytes / the H2D rate, the lower "loaded" rate when the
  optimizer runs at the copy's start (they share DRAM bandwidth);
- D2H = stage elements x gradient dtype bytes / the D2H rate;
- CPU AdamW = stage elements / the measured AdamW rate (all workers together: the rate is DRAM
  bound and flat in the number of workers).

They are combined by replaying the engine's schedule (megatrain_ray/engine/step.py) on
four resources, each busy serially: the compute stream, the H2D stream, the D2H stream and the
optimizer workers, plus the issuing thread that blocks where the engine blocks:
- forward: H2D of stage i+1 overlaps the compute of stage i, into the weight slot stage i-1
  released; the issuing thread waits for stage i+1's update before issuing stage i's compute;
- backward: H2D of layer i-1 overlaps recompute + backward of layer i; the two layers still in
  the slots at the end of the forward are not copied again; layer i's gradients go D2H while
  layer i-1 computes, into one of two device gradient buffers;
- clipping off: each stage's update is ordered once its gradients are on the host, so the
  optimizer overlaps the backward; the next forward waits for the embedding's update, the last;
- clipping on: the updates are ordered after the backward in forward order; the next step's
  forward of stage i waits only for stage i's update (overlap with the forward);
- gradients in a pool of slabs (fp32 master streamed, clipping off): a slab is reused only after
  the update that read it.
The step time is that of a steady-state step (the fourth replayed), as the trainer times it.

Measured rates (the `benchmarks/results/` files; "in-engine" = the per-step figures megatrain's
bench rows record, i.e. measured under the engine's own overlap):

| constant | H200 box (`nvidia-h200`) | H100 box (`nvidia-h100-x1`) |
|---|---|---|
| model TFLOPS on GPU-busy time, eager layers | 371.7: median of model FLOPs / compute_seconds (one GPU's tokens) over the 34 eager megatrain rows of `*-h200-*.json`, both H200 hosts (347-379; the lowest at 256K-512K tokens) | 358.9: the H200 figure x 16.8 / 17.4, the 7B-layer fwd+bwd times of DESIGN.md section 3 on the two boxes (no megatrain compute split was recorded on the H100) |
| the same, compiled layers | 461.8: median over the 41 compiled rows (449-474; 7B-width layers at 32k-64k tokens per GPU, Qwen2.5-14B and -32B widths at 32k) | 445.9: scaled the same way (not measured) |
| H2D GB/s, idle / under optimizer load | 53 / 40: DESIGN.md section 3 ("H2D drops 53 -> 40 GB/s" while AdamW runs); in-engine link 46-54 | 55 / 43.4: DESIGN.md section 3; `optimizer-scaling-h100-*`, 4 workers + H2D |
| D2H GB/s | 51.8: median in-engine d2h_gbps_link of the 39 rows of this box | 51.7: assumed equal (DESIGN.md gives 55 one way on both) |
| AdamW G params/s (fp32, all workers) | 4.20: median in-engine optimizer_gparams_per_s of the 11 rows of this box it bounds (GPU busy under 90 %: the 8k rows and the 32k rows with clipping on; 3.5-4.7 across the sessions' boxes; the 32-core `nvidia-h200-x2` host ran 4.3-5.1, not counted). Where the GPU bounds the step the in-engine rate says little (2.9-5.6) | 4.36: `optimizer-scaling-h100-*`, 4 workers (*) |
| control round trip per update | 1.1 ms: DESIGN.md section 2, an actor call | same |

(*) The microbenchmark's rate without concurrent H2D (with it: 3.84). On the H200 box the in-engine median
(4.20) matches the microbenchmark without H2D (4.2, DESIGN.md section 3; 4.16-4.56 for 2-16 workers in
`optimizer-scaling-h200-*`), not the one with it (3.5-3.9): in a step the copies run only part of the
time. The H100 figure follows that evidence; the H100 run of `fault-recovery-h100-*` (4 layers, 16k tokens, clipping on) checks it in tests/unit/test_speed.py.

A host of 512 GB .. 1.5 TB (the presets) is assumed to stream and update at the rates of the
measured 16-core VM of its GPU kind; a server with more DRAM channels updates faster (DESIGN.md
section 3 gives 6.2 G params/s on 32 cores of `nvidia-h200-x2`; the x2 box measured here ran 4.0-5.2 for
1-32 workers, `optimizer-scaling-h200-20261123-184223.json`): `--optimizer-gparams` plans with another
rate. Data parallelism: every GPU runs the schedule on its own rows at once (plan.rank_tokens); the sum
of the gradients over the GPUs (0.03-0.06 s per step on two), the weight all-gather of
parallel.gather_weights and the slower AdamW while two GPUs copy (5.1 -> 4.3 G params/s in
`data-parallel-x2-*` before the GPU workers were pinned; 5.3 -> 5.0-5.3 after) are not modelled. tests/unit/test_speed.py replays every measured
megatrain point and holds the prediction within 10 % (docs/plan-large-models.md lists them), with two
named known misses: a 2-GPU point measured before a stall was fixed (+27 %), and a 1-GPU point of the
32-core x2 box where AdamW ran faster than the 16-core rate the model uses (-10.1 %). The H200 rows are
in sample (the H200 rates are their medians): they test the schedule; the H100 run is out of sample.

Limits. The rates were measured on one shape (3.5B-bench width: hidden 4096, T2048); wider layers run
their matrix products at least as fast, so the eager GPU term is, if anything, pessimistic for 70B+
shapes (compiling saves elementwise work, a smaller share of a wider layer, so the compiled rate is
less sure), while a longer sequence raises the share of attention, which the FLOPs count but whose rate was not
measured apart. Not modelled: kernel-launch time of the issuing thread, several NUMA nodes (host
shards and workers per node), activation offload, bf16 AdamW moments (their rate is unmeasured).
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, field, replace

from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.dtypes import DTYPE_BYTES
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.model.flops import stage_flops_per_token
from megatrain_ray.model.layout import ModelLayout, build_layout
from megatrain_ray.store.segments import (
    SlabTurns,
    grad_pieces,
    pool_slab_sizes,
)

GiB = 2**30
WAITS = ("CPU optimizer", "H2D", "D2H")
"""What the GPU can wait for in a step (the speed model's `bound`)."""


@dataclass(frozen=True)
class GpuProfile:
    kind: str
    """h100 or h200."""
    name: str
    """As nvidia-smi names it."""
    memory: int
    """Bytes, as nvidia-smi reports memory.total."""
    model_tflops: float
    """Achieved model TFLOPS on GPU-busy time (recompute included in the time, not in the FLOPs), layers
    run eagerly."""
    compiled_model_tflops: float
    """The same with the layer template compiled (engine.compile)."""
    source: str

    def tflops(self, compiled: bool) -> float:
        """The achieved model TFLOPS of layers run compiled or eagerly."""
        return self.compiled_model_tflops if compiled else self.model_tflops


REFERENCE_OPTIMIZER_BYTES = 28
"""DRAM bytes per parameter of the update the AdamW rates were measured with: fp32 master and moments
read and written (24), the bf16 gradient read (2), the bf16 streaming copy written (2)."""
DISK_GBPS = 5.0


def optimizer_dram_bytes(cfg: Config) -> int:
    """DRAM bytes per parameter of one update (FlatAdamW.bytes_per_element of the config's formats)."""
    run = RunSpec.resolve(cfg)
    master = DTYPE_BYTES[run.master_dtype]
    moments = DTYPE_BYTES[cfg.optimizer.moment_dtype]
    copy = 0 if run.stream_is_master else DTYPE_BYTES[run.stream_dtype]
    return 2 * master + 4 * moments + DTYPE_BYTES[run.grad_dtype] + copy


def adamw_gparams(cfg: Config, host: "HostProfile") -> float:
    """The profile's AdamW rate for this config: DRAM-bound, so scaled by the bytes per parameter against
    the measured configuration's; with the moments on disk, at most what the disk moves (each moment read
    and written once per step)."""
    rate = host.adamw_gparams * REFERENCE_OPTIMIZER_BYTES / optimizer_dram_bytes(cfg)
    if cfg.host.moments_tier == "disk":
        rate = min(rate, host.disk_gbps / (4 * DTYPE_BYTES[cfg.optimizer.moment_dtype]))
    return rate


@dataclass(frozen=True)
class HostProfile:
    name: str
    h2d_gbps: float
    """Pinned host -> device copy, nothing else using DRAM."""
    h2d_loaded_gbps: float
    """The same while the CPU optimizer runs."""
    d2h_gbps: float
    adamw_gparams: float
    """CPU AdamW, all workers together, fp32 master and moments, while the engine runs."""
    control_seconds: float = 1.1e-3
    """Round trip of an update order to the optimizer workers and back (DESIGN.md section 2)."""
    source: str = ""
    disk_gbps: float = DISK_GBPS
    """Disk tier (host.moments_tier=disk): read plus write GB/s of host.disk_dir. Not measured on the GPU
    boxes: an assumption for an NVMe drive (benchmarks/moment_tiers.py measures a disk)."""


@dataclass(frozen=True)
class SpeedProfile:
    """The measured rates that the speed model uses for one machine."""

    gpu: GpuProfile
    host: HostProfile
    assumptions: tuple[str, ...] = ()

    def with_optimizer_rate(self, gparams: float) -> "SpeedProfile":
        note = f"AdamW at {gparams:g} G params/s (--optimizer-gparams), not the measured {self.host.adamw_gparams:g}"
        return replace(self, host=replace(self.host, adamw_gparams=gparams), assumptions=(*self.assumptions, note))

    def with_disk_rate(self, gbps: float) -> "SpeedProfile":
        note = f"disk tier at {gbps:g} GB/s read + write (--disk-gbps), not the assumed {self.host.disk_gbps:g}"
        return replace(self, host=replace(self.host, disk_gbps=gbps), assumptions=(*self.assumptions, note))


H200 = GpuProfile("h200", "NVIDIA H200", 143771 * 2**20, 371.7, 461.8,
                  "median model FLOPs / GPU-busy s of the megatrain rows in benchmarks/results/*-h200-*.json "
                  "(34 eager, 41 compiled)")
H100 = GpuProfile("h100", "NVIDIA H100 80GB HBM3", 81559 * 2**20, round(H200.model_tflops * 16.8 / 17.4, 1),
                  round(H200.compiled_model_tflops * 16.8 / 17.4, 1),
                  "the H200 rates x 16.8 / 17.4 (7B-layer fwd+bwd on each box, DESIGN.md section 3)")
H200_BOX = HostProfile("nvidia-h200 (16 cores, 1 NUMA node)", h2d_gbps=53.0, h2d_loaded_gbps=40.0, d2h_gbps=51.8,
                       adamw_gparams=4.20, source="AdamW and D2H: in-engine medians of benchmarks/results/*-h200-*.json; "
                       "H2D idle/loaded: DESIGN.md section 3")
H100_BOX = HostProfile("nvidia-h100-x1 (16 cores, 1 NUMA node)", h2d_gbps=55.0, h2d_loaded_gbps=43.4, d2h_gbps=51.7,
                       adamw_gparams=4.36, source="benchmarks/results/optimizer-scaling-h100-*.json, 4 workers "
                       "(H2D under load: 4 workers + H2D); H2D idle: DESIGN.md section 3")
GPUS = {"h100": H100, "h200": H200}
HOSTS = {"h100": H100_BOX, "h200": H200_BOX}
HOST_RAM = {"512gb": 512 * GiB, "1tb": 1024 * GiB, "1.5tb": 1536 * GiB}
"""Installed RAM of the presets (DIMM sizes are binary: 16 x 32 GB = 512 GiB)."""
MEMTOTAL_FRACTION = 125 / 128
"""Share of the installed RAM the kernel reports as MemTotal: 125 of 128 GiB on the H100 box (DESIGN.md section 3)."""


@dataclass(frozen=True)
class MachinePreset:
    name: str
    gpu: GpuProfile
    installed_ram: int

    @property
    def host_memory(self) -> int:
        return int(self.installed_ram * MEMTOTAL_FRACTION)

    @property
    def profile(self) -> SpeedProfile:
        return SpeedProfile(self.gpu, HOSTS[self.gpu.kind], (
            f"host assumed as fast as the measured {HOSTS[self.gpu.kind].name} (DRAM bandwidth bounds AdamW)",))


PRESETS = {f"{g}-{r}": MachinePreset(f"{g}-{r}", gpu, ram) for g, gpu in GPUS.items() for r, ram in HOST_RAM.items()}
"""`--machine` names: h100-512gb, h100-1tb, h100-1.5tb, h200-512gb, h200-1tb, h200-1.5tb."""


def preset(name: str) -> MachinePreset:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"--machine {name!r} is not a known machine; choose one of {', '.join(PRESETS)}") from None


def profile_for_gpu(name: str) -> SpeedProfile | None:
    """The measured profile of a GPU as nvidia-smi names it (this machine), or None when none was measured
    (a GH200 is not an H200 here: its host link is another one)."""
    for kind, gpu in GPUS.items():
        if re.search(rf"\b{kind}\b", name.lower()):
            return SpeedProfile(gpu, HOSTS[kind], (f"host taken as the measured {HOSTS[kind].name}",))
    return None


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


def stage_costs(cfg: Config, profile: SpeedProfile, layout: ModelLayout | None = None,
                offload: bool = False) -> list[StageCost]:
    layout = layout or build_layout(cfg.model)
    run = RunSpec.resolve(cfg)
    tokens = run.rank_tokens  # one GPU's rows: with data parallelism every GPU runs this schedule at once
    flops = stage_flops_per_token(cfg.model, layout, cfg.data.seq_len)
    stream_b = DTYPE_BYTES[run.stream_dtype]
    grad_b = DTYPE_BYTES[run.grad_dtype]

    rate = profile.gpu.tflops(run.layers_compiled) * 1e12
    activation = tokens * cfg.model.hidden_size * DTYPE_BYTES[run.compute_dtype] if offload else 0
    costs = []
    for stage, f in zip(layout.stages, flops):
        seconds = f * tokens / rate
        fwd, bwd = (seconds / 4, 3 * seconds / 4) if stage.kind == "layer" else (seconds, 0.0)
        costs.append(StageCost(stage.index, stage.kind, stage.numel, fwd, bwd, stage.numel * stream_b,
                               stage.numel * grad_b, activation if stage.kind == "layer" else 0))
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
        if self.slot_holds.get(slot) == c.index:
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
        ready = self.slot_ready.get(slot, 0.0)
        if backward and c.index in self.stored:
            ready = max(ready, self.stored.pop(c.index))
        start = max(self.issue, self.compute, ready)
        # The issuing thread is late only where it waited for an update (or at the step's start: ~1 ms); a copy
        # issued late for that reason counts as waiting for the optimizer up to its issue, for the copy after.
        blocked = min(start, max(self.issue, self.slot_issued.get(slot, 0.0)))
        self.idle["CPU optimizer"] += max(0.0, blocked - self.compute)
        self.idle["H2D"] += start - max(self.compute, blocked)
        end = start + seconds
        if grad_slot is not None and self.grad_drained.get(grad_slot, 0.0) > end:
            self.idle["D2H"] += self.grad_drained[grad_slot] - end
            end = self.grad_drained[grad_slot]
        self.busy["compute"] += seconds
        self.compute = self.slot_free[slot] = end

    def emit(self, c: StageCost, grad_slot: str, deferred: list[tuple[int, float]]) -> None:
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
            if self.clip:
                deferred.append((c.index, self.d2h))
            else:
                self.order(c, self.d2h, hi - lo)

    def order(self, c: StageCost, drained: float, numel: int | None = None) -> None:
        """The dispatcher thread waits for the D2H, then the workers run the update (of `numel` elements, a
        piece, or the whole stage) in arrival order."""
        self.dispatcher = max(self.dispatcher, drained, self.issue)
        latency = self.host.control_seconds / 2
        start = max(self.optimizer, self.dispatcher + latency)
        seconds = (c.numel if numel is None else numel) / (self.adamw_gparams * 1e9)
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
            self.run(layers[i], layers[i].backward_seconds, grad_slot=f"grad{i % 2}", backward=True)
            self.emit(layers[i], f"grad{i % 2}", deferred)
        self.run(embed, embed.backward_seconds, grad_slot="embed")
        self.emit(embed, "embed", deferred)
        self.issue = max(self.issue, self.compute)  # the loss and the norm are read back
        for index, drained in sorted(deferred):
            self.order(costs[index], drained)
        self.slot_holds.clear()  # the weights change with the updates just ordered
        end = max(self.issue, self.compute, self.h2d, self.d2h)
        self.idle["D2H"] += end - self.compute  # the last gradients drain after the last compute
        self.issue = self.compute = end
        return end


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

    @property
    def tok_per_s(self) -> float:
        return self.tokens_per_step / self.step_seconds

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


def estimate(cfg: Config, profile: SpeedProfile, steps: int = 4, offload: bool = False) -> SpeedEstimate:
    """Replay `steps` steps of the engine's schedule with the profile's rates; the last one is the estimate.
    `offload`: the layer inputs go through host memory (engine.activation_offload as the plan resolved it)."""
    layout = build_layout(cfg.model)
    costs = stage_costs(cfg, profile, layout, offload)
    run = RunSpec.resolve(cfg)
    pieces = run.vocab_in_pieces
    turns = SlabTurns(cfg.engine.grad_slabs, len(pool_slab_sizes(layout, cfg.engine.grad_slabs, pieces))) \
        if run.grad_home == "pool" else None
    replay = _Replay(costs, profile.host, cfg.optimizer.grad_clip > 0, adamw_gparams(cfg, profile.host),
                     slab_turns=turns, slab_numel=layout.max_layer_numel if pieces else 0)
    start = end = 0.0
    for _ in range(steps):
        start = replay.issue = end + profile.host.control_seconds  # the trainer's next call
        end = replay.step()
    busy = replay.busy
    flops = sum(stage_flops_per_token(cfg.model, layout, cfg.data.seq_len))
    return SpeedEstimate(profile, cfg.data.tokens_per_step, end - start, flops, busy["compute"], busy["h2d"],
                         busy["d2h"], busy["optimizer"], dict(replay.idle), cfg.optimizer.grad_clip > 0,
                         replay.adamw_gparams, run.layers_compiled)


def format_speed(est: SpeedEstimate) -> list[str]:
    """The plan's speed lines for an estimate."""
    p = est.profile
    return [
        f"expected speed: a prediction of megatrain_ray/planning/speed.py from measured rates, clipping "
        f"{'on' if est.clip else 'off'}",
        f"  {'tok/s':<38}{est.tok_per_s:10,.0f}      ({est.model_tflops:.0f} model TFLOPS, {est.step_seconds:.2f} s/step)",
        f"  {'GPU compute per step':<38}{est.compute_seconds:10.2f} s    ({p.gpu.kind.upper()}: "
        f"{p.gpu.tflops(est.compiled):g} model TFLOPS on busy time, "
        f"layers {'compiled' if est.compiled else 'eager'}; busy {est.gpu_busy:.0%} of the step)",
        f"  {'H2D per step':<38}{est.h2d_seconds:10.2f} s    ({p.host.h2d_gbps:g} GB/s, "
        f"{p.host.h2d_loaded_gbps:g} while AdamW runs)",
        f"  {'D2H per step':<38}{est.d2h_seconds:10.2f} s    ({p.host.d2h_gbps:g} GB/s)",
        f"  {'CPU AdamW per step':<38}{est.optimizer_seconds:10.2f} s    ({est.optimizer_gparams:.3g} G params/s"
        + (f"; {p.host.adamw_gparams:g} measured at {REFERENCE_OPTIMIZER_BYTES} B/param, scaled by DRAM bytes"
           if abs(est.optimizer_gparams - p.host.adamw_gparams) > 1e-9 else "") + ")",
        f"  {'bound by':<38}{est.bound}   (GPU idle "
        + ", ".join(f"{s:.2f} s on {what}" for what, s in est.gpu_waits.items()) + ")",
        f"  rates from: GPU {p.gpu.source}; host {p.host.source}",
        *(f"  assumption: {a}" for a in p.assumptions),
    ]


def speed_lines(cfg: Config, profile: SpeedProfile | None, offload: bool = False) -> list[str]:
    """The speed part of `megatrain plan`: the estimate, or why there is none."""
    if cfg.engine.device == "cpu":
        return []
    if profile is None:
        return [f"expected speed: no measured rates for this GPU; name a machine with --machine "
                f"({', '.join(PRESETS)})", ""]
    return [*format_speed(estimate(cfg, profile, offload=offload)), ""]
