"""The double-buffered layer stream: one training step, stage by stage.

Forward: the embedding, then each layer, then the head. While layer i computes on one device
buffer, layer i+1 is copied host->device into the other (the H2D stream); the input of each
layer (the boundary activation) is kept, nothing else. The head computes the loss and its
gradients in token chunks. Backward walks the layers in reverse: reload the layer's weights,
recompute it with autograd on, take the gradients of its input and weights, copy the weight
gradients device->host on the D2H stream, and hand the stage to the optimizer workers.

Updates: with clipping off, each stage's update is ordered as soon as its gradients are on
the host, overlapping the rest of the backward. With exact clipping on, the global norm is
known only after the whole backward; the updates are then ordered in forward order, so the
next step's forward of stage i waits only for stage i's update.

The whole batch goes through stage i before stage i+1: no gradient accumulation buffers.
Long sequences: the MLP runs in chunks of engine.mlp_chunk_tokens tokens; the kept layer inputs
can live in pinned host memory instead of the GPU (engine.activation_offload, engine/activations.py).

Data parallel (megatrain_ray/engine/collective.py): each rank runs this loop on its slice of the
batch; a stage's gradients are summed over the ranks on the device before the D2H, each rank copies
its piece of the sum, and only the node's first rank orders updates. With one rank none of it runs.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.dtypes import TORCH_DTYPES
from megatrain_ray.engine.activations import ActivationStash
from megatrain_ray.engine.collective import FAILED, Collectives, RankInfo, StageSync, padded
from megatrain_ray.engine.streams import DeviceStreams
from megatrain_ray.engine.telemetry import UpdateTrace
from megatrain_ray.exceptions import ParallelError
from megatrain_ray.messages import IGNORE_INDEX, Batch, StepResult, UpdateDone, UpdateOrder
from megatrain_ray.model.layout import ModelLayout, StageLayout
from megatrain_ray.model.templates import (
    DocumentBucket,
    LayerSpec,
    bind,
    decoder_layer,
    decoder_layer_backward,
    document_buckets,
    embed,
    head_logits,
    head_loss_and_grads,
    rope_tables,
)
from megatrain_ray.observe.log import get_logger, warn_once
from megatrain_ray.store.segments import HostStore, SlabTurns, grad_pieces

log = get_logger(__name__)


class _CompiledLayer:
    """A layer function (decoder_layer) through torch.compile. Shapes are fixed per run (the weights of
    every layer are views at the same offsets), so one graph per sequence shape serves every layer. With
    engine.compile auto, a failure to compile (no Triton or C compiler: Dynamo wraps it in
    BackendCompilerFailed) is logged once and the eager function runs from then on; with true it
    propagates. It surfaces at the call that compiles, before the layer computed anything, so the eager
    function in its place loses nothing."""

    def __init__(self, eager: Any, fall_back: bool) -> None:
        self.eager = eager
        self.fn = torch.compile(eager, dynamic=False)
        self.fall_back = fall_back
        self.failed = False

    def __call__(self, *args: Any) -> Any:
        try:
            return self.fn(*args)
        except torch._dynamo.exc.TorchDynamoException as exc:
            if not self.fall_back:
                raise
            self.failed = True
            warn_once(log, f"engine.compile=auto: torch.compile of the decoder layer failed "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                           "the layer runs eagerly. Set engine.compile=false: that skips the attempt, and the "
                           "memory plan then budgets the GPU for eager layers, which need more")
            return self.eager(*args)


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


@dataclass(slots=True)
class GradSlot:
    """A device buffer of one stage's weight gradients on their way to the host."""

    buf: torch.Tensor
    """The stage's flat gradients, padded to split into equal pieces over the node's ranks."""
    out: torch.Tensor | None = None
    """This rank's piece of the sum over the ranks (several ranks per node only)."""
    drained: Any = None
    """Event: the previous D2H out of this buffer is complete."""


_STEP_STATS = ("optimizer_seconds", "optimizer_bytes", "update_wait_seconds", "slab_wait_seconds", "h2d_bytes",
               "d2h_bytes")
CHECKSUM_SAMPLES = 4096
"""Elements per stage (evenly strided) in the per-step checksum that compares the nodes' copies."""


class Timeline:
    """Device time of each activity in a step (compute, H2D, D2H), from timing events that are
    read once at the end of the step: no synchronisation inside it."""

    def __init__(self, streams: DeviceStreams):
        self.streams = streams
        self.spans: dict[str, list] = {"compute": [], "h2d": [], "d2h": [], "comm": []}

    def start(self, stream: Any) -> Any:
        return self.streams.record(stream, timing=True)

    def stop(self, kind: str, stream: Any, start: Any) -> Any:
        """Close a span of `kind` on `stream`; returns its end event."""
        end = self.streams.record(stream, timing=True)
        self.spans[kind].append((start, end))
        return end

    def seconds(self) -> dict[str, float]:
        out = {}
        for kind, spans in self.spans.items():
            if spans:
                spans[-1][1].synchronize()
            out[kind] = sum(a.elapsed_time(b) for a, b in spans) / 1e3
        return out


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


class StreamEngine:
    def __init__(self, cfg: Config, run: RunSpec, layout: ModelLayout, store: HostStore, optimizers: list[Any],
                 device: torch.device, rank: RankInfo | None = None):
        """`optimizers`: the node's OptimizerWorker handles (only its first rank gets them); `rank`: this
        worker's place in a data-parallel run (None: the only one)."""
        self.cfg = cfg
        self.run = run
        self.rank = rank = rank or RankInfo()
        self.comm: Collectives | None = None
        """The process group, attached by the GPU worker once every rank has joined (several ranks only)."""
        self.sync = StageSync(store.get("sync", 0), rank, len(layout.stages), cfg.parallel.timeout_s) \
            if rank.local_world > 1 else None
        self.layout = layout
        self.store = store
        self.optimizers = optimizers
        self.device = device
        self.streams = DeviceStreams(device)
        self.spec = LayerSpec.from_config(cfg.model)
        self.compute_dtype = TORCH_DTYPES[run.compute_dtype]
        self.stream_dtype = TORCH_DTYPES[run.stream_dtype]
        self.grad_dtype = TORCH_DTYPES[run.grad_dtype]
        self.grad_home = run.grad_home
        # Accumulation of the vocabulary-sized gradients and of norms: float32, or float64 when computing in it.
        self.acc_dtype = torch.promote_types(self.compute_dtype, torch.float32)
        self.clip = cfg.optimizer.grad_clip
        self.mlp_chunk = cfg.engine.mlp_chunk_tokens
        self._compiled = _CompiledLayer(decoder_layer, fall_back=cfg.engine.compile == "auto") \
            if run.compiles else None
        self.offload = run.activation_offload
        poison = cfg.engine.poison_buffers

        def weight_slot(numel: int) -> WeightSlot:
            numel = padded(numel, rank.local_world)  # room for every rank's piece (parallel.gather_weights)
            raw = torch.empty(numel, dtype=self.stream_dtype, device=device)
            compute = raw if self.stream_dtype == self.compute_dtype else \
                torch.empty(numel, dtype=self.compute_dtype, device=device)
            for t in {id(raw): raw, id(compute): compute}.values():
                t.fill_(float("nan") if poison else 0.0)
            return WeightSlot(raw, compute)

        def grad_slot(stage: StageLayout) -> GradSlot:
            numel = padded(stage.numel, rank.local_world)
            buf = torch.full((numel,), float("nan") if poison else 0.0, dtype=self.grad_dtype, device=device)
            for a, b in [*_gaps(stage), (stage.numel, numel)]:
                buf[a:b].zero_()
            out = torch.empty(numel // rank.local_world, dtype=self.grad_dtype, device=device) \
                if rank.local_world > 1 else None
            return GradSlot(buf, out)

        layer0 = layout.layers[0]
        self.layer_slots = [weight_slot(layout.max_layer_numel) for _ in range(2)]
        self.embed_slot = weight_slot(layout.embed.numel)
        self.head_slot = weight_slot(layout.head.numel)
        self.layer_grads = [grad_slot(layer0) for _ in range(2)]
        self.embed_grad = grad_slot(layout.embed)
        self.head_grad = grad_slot(layout.head)
        v, h = cfg.model.vocab_size, cfg.model.hidden_size
        self.vocab_acc = torch.zeros((v, h), dtype=self.acc_dtype, device=device)
        # The host side of gradients in flight: (stage whose update reads it, slab) in pool mode.
        self.pool = store.pool() if self.grad_home == "pool" else []
        self.slab_turns = SlabTurns(cfg.engine.grad_slabs, len(self.pool))
        # A stage larger than the slabs (the embedding, the LM head) goes through them in pieces.
        self.slab_numel = layout.max_layer_numel if run.vocab_in_pieces else 0
        self.pending: dict[int, list[tuple[int, Future]]] = {}
        """Stage -> (step, ordered update) for its updates (one, or one per piece) not yet awaited."""
        self.dispatcher = ThreadPoolExecutor(1, thread_name_prefix="update-dispatch")
        # Several ranks per node: the leader's thread that publishes each update's completion to the
        # node's other ranks, and (other ranks) the step whose update of each stage they wait for.
        self.publisher = ThreadPoolExecutor(1, thread_name_prefix="update-publish") if self.sync else None
        self.awaited: dict[int, int] = {}
        self._serial = 0
        """train_step calls so far: the step number the ranks of a node exchange in `sync`."""
        self._gather = False
        """This step loads weights in pieces gathered over the node's ranks (training steps only)."""
        self._checksum: float | None = None
        self._nan_armed = False
        """Fault drill `nan_grad` armed for the next train_step (arm_nan_grad)."""
        self._summed: set[int] = set()
        self._rope_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._step_stats: dict[str, float] = dict.fromkeys(_STEP_STATS, 0.0)
        self.timeline = Timeline(self.streams)
        # Pinned host buffers of offloaded layer inputs live as long as the engine: allocated once.
        self.activations = ActivationStash(self.streams, self.offload, len(layout.layers), self._copied)
        self.trace = UpdateTrace(cfg.engine.update_trace, rank.rank, rank.world) if cfg.engine.update_trace else None

    def _mark(self, event: str, stage: int, step: int, at: float | None = None) -> None:
        if self.trace is not None:
            self.trace.mark(event, stage, step, at)

    # ------------------------------------------------------------------ updates

    def _wait_update(self, stage: int, for_slab: bool = False) -> None:
        """Block the issuing thread until the last ordered update of `stage` is applied. `for_slab`: the wait
        is for a gradient slab that update reads (counted apart from waits for weights to load)."""
        # The leader orders the updates and holds their futures; the other ranks learn through `sync`.
        ordered_updates = self.pending.pop(stage, [])
        step = None if self.rank.leader else self.awaited.pop(stage, None)
        if not ordered_updates and step is None:
            return
        stats = self._step_stats
        t0 = time.perf_counter()
        if step is not None:
            self.sync.wait_applied(stage, step)
        for step, ordered in ordered_updates:
            results: list[UpdateDone] = [done.result() for done in ordered.result()]
            stats["optimizer_seconds"] += max(r.seconds for r in results)
            stats["optimizer_bytes"] += sum(r.dram_bytes for r in results)
            self._mark("run_start", stage, step, min(r.started for r in results))
            self._mark("run_end", stage, step, max(r.ended for r in results))
        t1 = time.perf_counter()
        waited = t1 - t0
        if self.trace is not None and waited > 1e-4:
            self._mark("wait_start", stage, step, t0)
            self._mark("wait_end", stage, step, t1)
        stats["update_wait_seconds"] += waited
        if for_slab:
            stats["slab_wait_seconds"] += waited

    def _order_update(self, stage: int, drained: Any, order: UpdateOrder) -> None:
        step, sync = self._serial, self.sync
        if not self.rank.leader:
            self.awaited[stage] = step
            return

        def send() -> list[Any]:
            drained.synchronize()  # gradients are on the host before any worker reads them
            self._mark("drained", stage, step)
            if sync is not None:
                sync.wait_landed(stage, step)  # and so are the other ranks' pieces
                self._mark("landed", stage, step)
            self._mark("sent", stage, step)
            return [worker.call("apply", order) for worker in self.optimizers]
        future = self.dispatcher.submit(send)
        self.pending.setdefault(stage, []).append((step, future))
        if self.publisher is not None:
            self.publisher.submit(self._publish_applied, stage, step, future)

    def _publish_applied(self, stage: int, step: int, ordered: Future) -> None:
        try:
            for done in ordered.result():
                done.result()
        except BaseException:
            self.sync.applied(stage, FAILED)  # the other ranks stop waiting; _wait_update raises it here
            raise
        self.sync.applied(stage, step)
        self._mark("applied", stage, step)

    def _publish_landed(self, stage: int, drained: Any) -> None:
        """(Not the leader) Tell the leader when this rank's piece of `stage` is on the host."""
        step, sync = self._serial, self.sync

        def landed() -> None:
            drained.synchronize()
            self._mark("drained", stage, step)
            sync.landed(stage, step)
            self._mark("landed", stage, step)
        self.dispatcher.submit(landed)

    def flush(self) -> float:
        """Wait for every ordered update; returns the optimizer seconds they took."""
        self._step_stats = dict.fromkeys(_STEP_STATS, 0.0)
        for stage in [*self.pending, *self.awaited]:
            self._wait_update(stage)
        return self._step_stats["optimizer_seconds"]

    # ------------------------------------------------------------------ weights in

    def _slot_for(self, stage: StageLayout) -> WeightSlot:
        if stage.kind == "embed":
            return self.embed_slot
        if stage.kind == "head":
            return self.head_slot
        return self.layer_slots[stage.index % 2]

    def _load(self, stage: StageLayout) -> WeightSlot:
        """Issue the H2D copy of a stage's weights (no-op if its slot still holds them this step)."""
        slot = self._slot_for(stage)
        if slot.holds == stage.index:
            return slot
        self._wait_update(stage.index)
        if self._checksum is not None and stage.index not in self._summed:
            self._summed.add(stage.index)
            self._checksum += self._sample_sum(stage)
        s = self.streams
        with s.on(s.h2d):
            s.wait(s.h2d, slot.free)
            start = self.timeline.start(s.h2d)
            first, end = self.rank.piece(stage.numel) if self._gather else (0, stage.numel)
            slot.raw[first:end].copy_(self.store.stream(stage.index)[first:end], non_blocking=True)
            self.timeline.stop("h2d", s.h2d, start)
            if self._gather:
                start = self.timeline.start(s.h2d)
                self.comm.gather(slot.raw[:padded(stage.numel, self.rank.local_world)])
                self.timeline.stop("comm", s.h2d, start)
            if slot.compute is not slot.raw:
                slot.compute[:stage.numel].copy_(slot.raw[:stage.numel])
            slot.ready = s.record(s.h2d)
        slot.holds = stage.index
        self._step_stats["h2d_bytes"] += (end - first) * slot.raw.element_size()
        return slot

    def _sample_sum(self, stage: StageLayout) -> float:
        """float64 sum of evenly strided elements of the weights the node streams for `stage` (read once
        its update is applied, before this step's gradients exist): equal on every node, or a copy is wrong."""
        host = self.store.stream(stage.index)[:stage.numel]
        return float(host[::max(1, stage.numel // CHECKSUM_SAMPLES)].sum(dtype=torch.float64))

    def _weights(self, stage: StageLayout, slot: WeightSlot) -> dict[str, torch.Tensor]:
        self.streams.wait(self.streams.compute, slot.ready)
        return bind(slot.compute[:stage.numel], stage)

    def _release(self, slot: WeightSlot) -> None:
        slot.free = self.streams.record(self.streams.compute)

    # ------------------------------------------------------------------ gradients out

    def _host_grad(self, stage: int) -> tuple[torch.Tensor, str, int]:
        if self.grad_home == "stream":
            return self.store.get("stream", stage), "stream", stage
        if self.grad_home == "stage":
            return self.store.get("grad", stage), "grad", stage
        k, previous = self.slab_turns.take(stage, self.layout.stages[stage].kind == "layer")
        if previous >= 0:
            self._wait_update(previous, for_slab=True)  # the slab's last reader is done
        return self.pool[k], "gradpool", k

    def _emit(self, stage: StageLayout, grad: GradSlot, deferred: list) -> None:
        """Sum over the ranks (if several), norm on the device, then D2H of this rank's piece on its own
        stream; order the update (now or after clipping). A stage larger than the gradient slabs goes
        through them in slab-sized pieces, each copied and its update ordered on its own."""
        s = self.streams
        first, end = self.rank.piece(stage.numel)
        piece = grad.buf[:stage.numel]
        if self.comm is not None:
            start = self.timeline.start(s.compute)
            piece = self.comm.reduce(grad.buf, grad.out)[:end - first]
            self.timeline.stop("comm", s.compute, start)
        self._sqnorm += torch.linalg.vector_norm(piece, dtype=self.acc_dtype).square()
        ready = s.record(s.compute)
        split = self.slab_numel and stage.numel > self.slab_numel
        for lo, hi in grad_pieces(stage.numel, self.slab_numel) if split else [(first, end)]:
            host, kind, index = self._host_grad(stage.index)
            at = lo if split else 0  # where element lo sits in the host buffer: a piece at its start
            with s.on(s.d2h):
                s.wait(s.d2h, ready)
                start = self.timeline.start(s.d2h)
                host[lo - at:hi - at].copy_(piece[lo - first:hi - first], non_blocking=True)
                copied = self.timeline.stop("d2h", s.d2h, start)
                grad.drained = s.record(s.d2h, blocking=True)  # the dispatcher sleeps on it, off AdamW's cores
            if self.trace is not None:
                self._mark("emit", stage.index, self._serial)
                self.trace.on_device(stage.index, self._serial, copied)
            self._step_stats["d2h_bytes"] += (hi - lo) * piece.element_size()
            if self.sync is not None and not self.rank.leader:
                self._publish_landed(stage.index, grad.drained)
            if self.clip > 0:
                deferred.append((stage.index, grad.drained, kind, index))
            else:
                self._order_update(stage.index, grad.drained, UpdateOrder(
                    stage.index, kind, index, self._adam_step, self._lr, span=(lo, hi) if split else None))

    def _write_grads(self, stage: StageLayout, grad: GradSlot, grads: dict[str, torch.Tensor]) -> None:
        self.streams.wait(self.streams.compute, grad.drained)  # the previous D2H out of it is done
        for slot in stage.slots:
            grad.buf[slot.offset:slot.offset + slot.numel].copy_(grads[slot.name].reshape(-1))

    # ------------------------------------------------------------------ the step

    def _rope(self, seq_len: int, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for positions 0..seq_len-1, or gathered per row for packed documents."""
        if seq_len not in self._rope_cache:
            self._rope_cache[seq_len] = rope_tables(self.cfg.model, seq_len, self.device, self.compute_dtype)
        cos, sin = self._rope_cache[seq_len]
        if positions is None:
            return cos, sin
        positions = positions.to(self.device, non_blocking=True)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def _layer(self, x: torch.Tensor, documents: Any) -> Any:
        """The decoder-layer template for these inputs: compiled (engine.compile) for plain rows whose MLP
        runs in one piece, else the eager function."""
        if self._compiled is None or self._compiled.failed or \
                not self.run.runs_compiled(x.shape[0] * x.shape[1], self.mlp_chunk, documents is not None):
            return decoder_layer
        return self._compiled

    def _copied(self, kind: str, stream: Any, start: Any, nbytes: int) -> None:
        """An activation copy of the stash: into the timeline and the byte counts with the weight copies."""
        self.timeline.stop(kind, stream, start)
        self._step_stats[f"{kind}_bytes"] += nbytes

    def _forward(self, ids: torch.Tensor, batch: Batch,
                 keep: ActivationStash | None) -> tuple[torch.Tensor, WeightSlot, torch.Tensor, tuple, Any]:
        """Embedding and layers over `ids` (the batch's ids on the device); returns the last hidden state,
        the embedding's slot and weight, the RoPE tables and the document buckets (packed rows) that the
        backward reuses."""
        rope = self._rope(ids.shape[1], batch.positions)
        documents = document_buckets(batch.segments, self.device) if batch.segments is not None else None
        embed_slot = self._load(self.layout.embed)
        embed_w = self._weights(self.layout.embed, embed_slot)["embed_tokens.weight"]
        x = self._forward_layers(embed(ids, embed_w), rope, documents, keep)
        return x, embed_slot, embed_w, rope, documents

    def _forward_layers(self, x: torch.Tensor, rope: tuple, documents: tuple[DocumentBucket, ...] | None,
                        keep: ActivationStash | None) -> torch.Tensor:
        layers = self.layout.layers
        upcoming = self._load(layers[0])
        for i, stage in enumerate(layers):
            slot = upcoming
            upcoming = self._load(layers[i + 1] if i + 1 < len(layers) else self.layout.head)
            if keep is not None:
                keep.put(i, x)
            weights = self._weights(stage, slot)
            start = self.timeline.start(self.streams.compute)
            x = self._layer(x, documents)(x, weights, rope, self.spec, documents, self.mlp_chunk)
            self.timeline.stop("compute", self.streams.compute, start)
            self._release(slot)
        return x

    def _begin(self, lr: float, adam_step: int) -> None:
        self._lr, self._adam_step = lr, adam_step
        self._step_stats = dict.fromkeys(_STEP_STATS, 0.0)
        self.timeline = Timeline(self.streams)
        self._sqnorm = torch.zeros((), dtype=self.acc_dtype, device=self.device)
        self._checksum = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _end(self) -> None:
        self._gather = False  # evaluation runs on one rank: it must never wait for the others' pieces
        # Weights change with the updates just ordered: nothing on the device is current any more.
        for slot in (*self.layer_slots, self.embed_slot, self.head_slot):
            slot.holds = -1

    def arm_nan_grad(self) -> None:
        """Fault drill `nan_grad`: the next train_step puts a NaN into the first layer's gradients."""
        self._nan_armed = True

    @torch.no_grad()
    def train_step(self, batch: Batch, lr: float, adam_step: int, loss_tokens: int) -> StepResult:
        """One optimizer step on this rank's rows of the batch.

        The loss is the mean over the tokens whose label counts (labels != -100) in the whole batch:
        `loss_tokens` of them (the driver counts them; with one rank, those of `batch`).
        """
        t0 = time.perf_counter()
        inject_nan, self._nan_armed = self._nan_armed, False
        self._begin(lr, adam_step)
        self._serial += 1
        self._gather = self.cfg.parallel.gather_weights and self.comm is not None and self.rank.local_world > 1
        trace_origin = None
        if self.trace is not None:  # the device is idle here (the last step synchronised): its clock meets the host's
            trace_origin = (time.perf_counter(), self.streams.record(self.streams.compute, timing=True))
            self._mark("step_start", -1, self._serial)
        if self.comm is not None and self.rank.nodes > 1 and self.rank.leader:
            self._checksum, self._summed = 0.0, set()
        layout, cfg = self.layout, self.cfg
        n_valid = max(1, loss_tokens)
        ids = batch.input_ids.to(self.device, non_blocking=True)
        labels = batch.labels.to(self.device, non_blocking=True)
        deferred: list = []

        # Forward: embedding, layers (inputs kept), head with loss and its gradients.
        compute = self.streams.compute
        acts = self.activations
        x, embed_slot, embed_w, rope, documents = self._forward(ids, batch, acts)
        head_slot = self._slot_for(layout.head)
        head_w = self._weights(layout.head, head_slot)
        lm_w = head_w.get("lm_head.weight", embed_w)
        start = self.timeline.start(compute)
        self.vocab_acc.zero_()
        head = head_loss_and_grads(x, head_w["model.norm.weight"], lm_w, labels, n_valid, cfg.model.rms_norm_eps,
                                   cfg.engine.loss_chunk_tokens, self.vocab_acc)
        self._release(head_slot)
        head_grads = {"model.norm.weight": head.grad_norm_weight}
        if not layout.tied:
            head_grads["lm_head.weight"] = self.vocab_acc
        self._write_grads(layout.head, self.head_grad, head_grads)
        self.timeline.stop("compute", compute, start)
        self._emit(layout.head, self.head_grad, deferred)
        # The last hidden state and the head's own reference to its input gradient would each hold a
        # [tokens, hidden] tensor through the whole backward (8 GiB at 512K tokens of an 8B model).
        grad_y, head.grad_x = head.grad_x, None
        del x

        # Backward: recompute each layer from its kept input, in reverse.
        layers = layout.layers
        upcoming = self._load(layers[-1])
        acts.prefetch(len(layers) - 1, self.device)
        for i in range(len(layers) - 1, -1, -1):
            stage, slot = layers[i], upcoming
            if i > 0:
                upcoming = self._load(layers[i - 1])
                acts.prefetch(i - 1, self.device)
            w = self._weights(stage, slot)
            x_in = acts.take(i, self.device)
            start = self.timeline.start(compute)
            grad_x, weight_grads = decoder_layer_backward(x_in, w, rope, self.spec, documents, grad_y, self.mlp_chunk,
                                                          self._layer(x_in, documents))
            del x_in
            self._release(slot)
            grad_slot = self.layer_grads[i % 2]
            self._write_grads(stage, grad_slot, weight_grads)
            del weight_grads  # else the float32 MLP sums of this layer live through the next layer's backward
            if inject_nan and i == 0:
                grad_slot.buf[:1].fill_(float("nan"))
            self.timeline.stop("compute", compute, start)
            self._emit(stage, grad_slot, deferred)
            grad_y = grad_x

        # Embedding: scatter-add of the input gradients (onto the LM head's part when tied).
        start = self.timeline.start(compute)
        if not layout.tied:
            self.vocab_acc.zero_()
        self.vocab_acc.index_add_(0, ids.reshape(-1), grad_y.reshape(-1, grad_y.shape[-1]).to(self.acc_dtype))
        self._release(embed_slot)
        self._write_grads(layout.embed, self.embed_grad, {"embed_tokens.weight": self.vocab_acc})
        self.timeline.stop("compute", compute, start)
        self._emit(layout.embed, self.embed_grad, deferred)

        self._mark("backward_end", -1, self._serial)
        # The device is still far behind this thread (the whole backward may be queued). Wait for it here,
        # where the GIL is let go: blocking in the reads below instead (the all-reduce of the totals, their
        # copy to the host) kept the dispatcher threads of a node's ranks from handing over the last
        # stages' updates until the device was done (0.45 s of waiting per step on two H200s).
        self.streams.drain(compute)
        self._mark("device_idle", -1, self._serial)
        if self.comm is None:
            loss = float(head.loss_sum)
            grad_norm = float(self._sqnorm.sqrt())
        else:
            loss, grad_norm = self._global_totals(head.loss_sum)
        skipped = False
        if self.clip > 0:
            skipped = not (torch.isfinite(torch.tensor(grad_norm)) and torch.isfinite(torch.tensor(loss)))
            if not skipped:
                # Exact global clipping, as torch.nn.utils.clip_grad_norm_: scale = min(1, clip / (norm + 1e-6)).
                coef = min(1.0, self.clip / (grad_norm + 1e-6))
                for index, drained, kind, src in sorted(deferred):
                    self._order_update(index, drained, UpdateOrder(index, kind, src, adam_step, lr, coef))
            else:
                # Dropped step: weights stay as they are, but the streaming copies that hold gradients
                # must be rewritten from the master weights before the next forward reads them.
                for index, drained, kind, src in sorted(deferred):
                    self._order_update(index, drained, UpdateOrder(index, kind, src, adam_step, lr, apply=False))
        self._end()
        device_seconds = self.timeline.seconds()
        if self.trace is not None:
            self._mark("step_end", -1, self._serial)
            self.trace.write(trace_origin)
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        stats = self._step_stats
        return StepResult(
            loss=loss, grad_norm=grad_norm, tokens=ids.numel(), valid_tokens=n_valid,
            seconds=time.perf_counter() - t0, update_wait_seconds=stats["update_wait_seconds"],
            slab_wait_seconds=stats["slab_wait_seconds"],
            optimizer_seconds=stats["optimizer_seconds"],
            optimizer_bytes=int(stats["optimizer_bytes"]), h2d_bytes=int(stats["h2d_bytes"]),
            d2h_bytes=int(stats["d2h_bytes"]), compute_seconds=device_seconds["compute"],
            h2d_seconds=device_seconds["h2d"], d2h_seconds=device_seconds["d2h"], skipped=skipped, gpu_peak_bytes=peak,
            comm_seconds=device_seconds["comm"])

    def _global_totals(self, loss_sum: torch.Tensor) -> tuple[float, float]:
        """The step's loss and gradient norm over all ranks, in one all-reduce that also compares the nodes'
        checksums: [loss, squared norm, checksum of node 0, ..., checksum of node M-1]. Each piece of the
        summed gradients is held by one rank per node, so only node 0's ranks add their squared norms."""
        info = self.rank
        totals = torch.zeros(2 + info.nodes, dtype=torch.float64, device=self.device)
        totals[0] = loss_sum
        if info.node == 0:
            totals[1] = self._sqnorm
        if self._checksum is not None:
            totals[2 + info.node] = self._checksum
        self.comm.all_reduce(totals)
        loss, sqnorm, *sums = totals.tolist()
        self._checksum = None
        if info.nodes > 1 and any(x != sums[0] and not (math.isnan(x) and math.isnan(sums[0])) for x in sums):
            raise ParallelError(f"the nodes' host copies of the weights differ at train step {self._serial}: "
                                f"checksums {', '.join(f'node {k}: {x!r}' for k, x in enumerate(sums))}. Each node "
                                "applies the same summed gradients to its own copy, so one copy was corrupted or "
                                "missed an update; resume from the last checkpoint (--resume auto)")
        return loss, math.sqrt(sqnorm)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Full logits of a small batch through the same layer stream (tests, small inputs)."""
        def head(x: torch.Tensor, norm_w: torch.Tensor, lm_w: torch.Tensor) -> torch.Tensor:
            return head_logits(x, norm_w, lm_w, self.cfg.model.rms_norm_eps).float().cpu()

        return self._forward_only(Batch(ids, torch.full_like(ids, IGNORE_INDEX)), head)

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> tuple[float, int]:
        """Mean loss over the batch's loss tokens, and their number, without gradients or updates."""
        n_valid = max(1, batch.loss_tokens)
        labels = batch.labels.to(self.device, non_blocking=True)
        cfg = self.cfg

        def head(x: torch.Tensor, norm_w: torch.Tensor, lm_w: torch.Tensor) -> torch.Tensor:
            return head_loss_and_grads(x, norm_w, lm_w, labels, n_valid, cfg.model.rms_norm_eps,
                                       cfg.engine.loss_chunk_tokens, grad_lm_acc=None).loss_sum

        return float(self._forward_only(batch, head)), batch.loss_tokens

    def _forward_only(self, batch: Batch, head: Any) -> Any:
        """The forward of train_step (same stream, same templates) with `head(x, norm_w, lm_w)` at the end."""
        self._begin(0.0, 0)
        x, embed_slot, embed_w, _, _ = self._forward(batch.input_ids.to(self.device), batch, None)
        head_w = self._weights(self.layout.head, self.head_slot)
        out = head(x, head_w["model.norm.weight"], head_w.get("lm_head.weight", embed_w))
        self._release(self.head_slot)
        self._release(embed_slot)
        self._end()
        return out

    def close(self) -> None:
        self.flush()
        self.dispatcher.shutdown(wait=True)
        if self.publisher is not None:
            self.publisher.shutdown(wait=True)
        if self.trace is not None:
            self.trace.write(None)
        # Let go of every device buffer and pinned activation buffer now: a closed engine can outlive
        # its run (a reference cycle, a caller's handle), and the next run in this process needs the memory.
        self.layer_slots, self.layer_grads = [], []
        self.embed_slot = self.head_slot = self.embed_grad = self.head_grad = None
        self.vocab_acc = self._sqnorm = None
        self._rope_cache.clear()
        self.activations.release()
