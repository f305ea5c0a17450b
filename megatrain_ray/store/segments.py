"""The host store: named shared-memory segments, one flat buffer per stage per kind.

Every process on the node maps the same files (`torch.from_file(..., shared=True)`), so the
HostShard that owns them, the optimizer workers that update them and the GPU worker that
streams from them all see one copy. Only `SegmentSpec`s (path, dtype, size) travel through
Ray; the bytes never do. Kinds per stage:

- `master`, `exp_avg`, `exp_avg_sq`: the fp32 (or fp64) weights and AdamW moments (the moments in
  `optimizer.moment_dtype`; with `host.moments_tier: disk` they are files in `host.disk_dir`, read and
  written by offset, never mapped: megatrain_ray/store/disk_tier.py);
- with optimizer.state=lean instead `master` in bfloat16 (streamed directly: there is no `stream`),
  `master_comp` (its bfloat16 compensation), `exp_avg` and `exp_avg_sq` in uint8 codes (with
  `exp_avg_scale` and `exp_avg_sq_scale`, one float32 per optimizer.lean_block elements) or bfloat16
  (LEAN_KINDS, optim/lean_adamw.py);
- `stream`: the copy the GPU reads each step, in `precision.stream_dtype`; absent when it
  would equal the master weights, which are then streamed directly;
- `reference`: GRPO's KL reference (finetune.grpo.beta > 0, full fine-tuning: RunSpec.reference_copy), the initial
  weights in the streaming dtype, never updated, streamed by the reference pass instead of `stream`;
- `grad`: per-stage gradients, only when the master weights are streamed and clipping is on
  (all gradients must wait for the global norm). Otherwise gradients land in the stage's
  `stream` buffer, which is free between the layer's backward and its update, or, when the
  master is streamed and clipping is off, in a small pool of `gradpool` slabs (pool_slab_sizes).

With a frozen base (finetune.method=lora, RunSpec.frozen_base) a stage has its `master` only, in the
streaming dtype: the weights the device reads, never updated; with finetune.lora.base_quantization=nf4 a decoder
layer has instead its `nf4` bytes (uint8, store/nf4_base.py).

A stage of the GPU-resident tier (engine.gpu_resident, RunSpec.resident_layers) has none of these: its whole
state lives on the compute device (engine/resident.py), and the GPU worker fills it, checkpoints it and
serves its weights itself. A frozen base's resident layers keep their `master` here: the device copies it
(engine/resident_base.py).

Each shard also owns a `gate`: one int32 per stage of the model, set while a checkpoint still has
to write that stage (megatrain_ray/store/checkpoint.py); optimizer workers wait on it. With several GPU
workers on the node, shard 0 also owns `sync`: the per-stage counters through which they learn that
a stage's gradients landed and its update is done (megatrain_ray/engine/collective.py).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from megatrain_ray.config.runtime_sections import HostConfig
from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.dtypes import DTYPE_BYTES, TORCH_DTYPES
from megatrain_ray.exceptions import ConfigError, HostMemoryError
from megatrain_ray.model.layout import ModelLayout, token_chunks
from megatrain_ray.observe.log import get_logger
from megatrain_ray.quant.nf4_stage import nf4_stage_bytes
from megatrain_ray.store.disk_tier import DiskSegment, allocate_file

log = get_logger(__name__)

SegmentKind = Literal["master", "exp_avg", "exp_avg_sq", "stream", "grad", "gradpool", "gate", "sync", "nf4",
                      "alt_master", "alt_exp_avg", "alt_exp_avg_sq", "saved_grad", "parity", "master_comp",
                      "exp_avg_scale", "exp_avg_sq_scale", "reference"]
STATE_KINDS: tuple[SegmentKind, ...] = ("master", "exp_avg", "exp_avg_sq")
"""What AdamW keeps of a stage: the master weights and both moments."""
ALT_KINDS: tuple[SegmentKind, ...] = ("alt_master", "alt_exp_avg", "alt_exp_avg_sq")
LEAN_KINDS: tuple[SegmentKind, ...] = ("master", "master_comp", "exp_avg", "exp_avg_sq", "exp_avg_scale",
                                       "exp_avg_sq_scale")
"""What the lean state (optimizer.state=lean, optim/lean_adamw.py) keeps of a stage: the bfloat16 master (streamed
directly), its bfloat16 compensation, the moments (8-bit codes, or bfloat16) and, for 8-bit ones, a float32 scale
per block of each."""
"""The second set of a speculatively updated stage (optimizer.speculative_stages): its update reads the current
set and writes the other, and the stage's one-element `parity` segment says which set is current (0: the plain
kinds). HostStore.get follows it, so every reader of a stage's state sees the current set. The gradients the
update read go to `saved_grad`, for a redo."""


@dataclass(frozen=True, slots=True)
class SegmentSpec:
    """Everything another process needs to map a segment: where, what type, how long."""

    path: str
    dtype: str
    numel: int
    kind: SegmentKind
    stage: int
    """Stage index, or the slab number for `gradpool`."""
    on_disk: bool = False
    """A file in host.disk_dir (the disk tier of the moments), not a shared-memory segment."""

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def specs_of(specs: list[SegmentSpec], kinds: tuple[SegmentKind, ...]) -> list[SegmentSpec]:
    """The specs of `kinds`, and what a HostStore needs to read a stage's current state: its second set and its
    parity (ALT_KINDS) where it has them."""
    wanted = set(kinds)
    if wanted & set(STATE_KINDS):
        wanted |= {*ALT_KINDS, "parity"}
    return [s for s in specs if s.kind in wanted]


def segment_prefix(run_id: str) -> str:
    """Every file of a run in host.shm_dir and host.disk_dir starts with this."""
    return f"megatrain-{run_id}-"


def plan_segments(layout: ModelLayout, host: HostConfig, grad_slabs: int, run: RunSpec, run_id: str,
                  stages: list[int], shard: int) -> list[SegmentSpec]:
    """The segments one HostShard owns: its stages' buffers and its checkpoint gate, plus on shard 0 the
    gradient pool and, with several GPU workers on the node, their counters."""
    directory = host.shm_dir
    master = run.master_dtype
    specs: list[SegmentSpec] = []
    home, ranks_per_node = run.grad_home, run.ranks_per_node
    moments, on_disk = run.moment_dtype, host.moments_tier == "disk"
    # A frozen base (LoRA) keeps its resident layers here too: the device copies them from the store.
    resident = set() if run.frozen_base else {s.index for s in layout.resident_stages(run.resident_layers,
                                                                                 run.resident_vocab)}
    speculative = set(layout.speculative_stages(run.speculative_stages, run.resident_layers, run.resident_vocab))
    for index in stages:
        if index in resident:
            continue
        stage = layout.stages[index]
        kinds: list[tuple[SegmentKind, str]] = [("master", master), ("exp_avg", moments), ("exp_avg_sq", moments)]
        numel = stage.numel
        if run.frozen_base:  # LoRA: the base once, in the streaming dtype (RunSpec's master), streamed directly
            kinds = [("master", master)]
            if run.base_quantization == "nf4" and stage.kind == "layer":  # its bytes packed (store/nf4_base.py)
                kinds, numel = [("nf4", "uint8")], nf4_stage_bytes(stage, run.compute_dtype)
        sizes = {}
        if run.optimizer_state == "lean":
            kinds = [("master", "bfloat16"), ("master_comp", "bfloat16"), ("exp_avg", moments),
                     ("exp_avg_sq", moments)]
            if run.lean_block:  # 8-bit moments: a float32 scale per block of each
                kinds += [("exp_avg_scale", "float32"), ("exp_avg_sq_scale", "float32")]
                sizes = dict.fromkeys(("exp_avg_scale", "exp_avg_sq_scale"), -(-numel // run.lean_block))
        if not run.stream_is_master:
            kinds.append(("stream", run.stream_dtype))
        if home == "stage":
            kinds.append(("grad", run.grad_dtype))
        if run.reference_copy:
            kinds.append(("reference", run.stream_dtype))
        if index in speculative:
            kinds += [*zip(ALT_KINDS, (master, moments, moments)), ("saved_grad", run.grad_dtype)]
        for kind, dtype in kinds:
            disk = on_disk and kind in ("exp_avg", "exp_avg_sq")
            path = os.path.join(host.disk_dir if disk else directory, f"{segment_prefix(run_id)}{stage.name}-{kind}")
            specs.append(SegmentSpec(path, dtype, sizes.get(kind, numel), kind, index, on_disk=disk))
        if index in speculative:
            specs.append(SegmentSpec(os.path.join(directory, f"{segment_prefix(run_id)}{stage.name}-parity"), "int32",
                                     1, "parity", index))
    specs.append(SegmentSpec(os.path.join(directory, f"{segment_prefix(run_id)}gate{shard}"), "int32",
                             len(layout.stages), "gate", shard))
    if shard == 0 and home == "pool":
        for k, numel in enumerate(pool_slab_sizes(layout, grad_slabs, run.vocab_in_pieces)):
            path = os.path.join(directory, f"{segment_prefix(run_id)}gradpool{k}")
            specs.append(SegmentSpec(path, run.grad_dtype, numel, "gradpool", k))
    if shard == 0 and ranks_per_node > 1:
        specs.append(SegmentSpec(os.path.join(directory, f"{segment_prefix(run_id)}sync"), "int64",
                                 (ranks_per_node + 1) * len(layout.stages), "sync", 0))
    return specs


def pool_slab_sizes(layout: ModelLayout, slabs: int, vocab_pieces: bool) -> list[int]:
    """Elements of each gradient slab: `slabs` of a layer's size, which the stages take in turn. When the
    embedding and the LM head are larger than a layer (a large vocabulary), their gradients go through those
    slabs in layer-sized pieces (`vocab_pieces`, see RunSpec.vocab_in_pieces), or else through one more slab of
    their size, which the two share: the head's gradients are the first of a backward, the embedding's the
    last, so the head's update is long done when the embedding needs it."""
    vocab = max(layout.embed.numel, layout.head.numel)
    own = vocab > layout.max_layer_numel and not vocab_pieces
    return [layout.max_layer_numel] * slabs + ([vocab] if own else [])


@dataclass(slots=True)
class SlabTurns:
    """Which gradient slab the next gradients (a stage's, or a piece of one) take, and whose update last read
    it: the engine waits for that update before copying into the slab, the speed model replays the same
    turns. Layers (and pieces) rotate over the `layer_slabs` layer-sized ones; the embedding and LM head
    take the last slab when pool_slab_sizes gave them one of their own."""

    layer_slabs: int
    slabs: int
    """All slabs: layer_slabs, or one more for the embedding and LM head."""
    users: list[int] = field(default_factory=list)
    next: int = 0

    def __post_init__(self) -> None:
        self.users = [-1] * self.slabs

    def take(self, stage: int, is_layer: bool) -> tuple[int, int]:
        """(slab, stage whose update last read it or -1), the slab now `stage`'s."""
        if self.slabs > self.layer_slabs and not is_layer:
            k = self.slabs - 1
        else:
            k, self.next = self.next, (self.next + 1) % self.layer_slabs
        previous, self.users[k] = self.users[k], stage
        return k, previous




def grad_pieces(numel: int, slab: int) -> list[tuple[int, int]]:
    """[start, end) element ranges of at most `slab` elements covering a stage of `numel` (one when it fits)."""
    return [(part.start, part.stop) for part in token_chunks(numel, slab)]


def shard_stages(layout: ModelLayout, num_shards: int) -> list[list[int]]:
    """Contiguous ranges of stages of about equal size, one per shard."""
    if num_shards > len(layout.stages):
        raise ConfigError(f"config key 'host.num_shards' = {num_shards}: the model has {len(layout.stages)} stages "
                          "(the embedding, each layer, the head) to divide among the HostShards, each a process of "
                          f"its own; set it to at most {len(layout.stages)} (one per NUMA node is the usual choice)")
    total = sum(s.numel for s in layout.stages)
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    running = 0
    for stage in layout.stages:
        shard = min(num_shards - 1, running * num_shards // total)
        shards[shard].append(stage.index)
        running += stage.numel
    return shards


def create_segment(spec: SegmentSpec) -> None:
    """A zero-filled file of the exact size, every page or block allocated now: a full /dev/shm or disk fails
    here, at start, with its sizes, instead of a SIGBUS at the first touch of a page in the middle of a step.
    A file that cannot be allocated whole is removed."""
    fd = os.open(spec.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if spec.on_disk:
            allocate_file(fd, spec.nbytes, spec.path)
        else:
            allocate_shared(fd, spec.nbytes, spec.path)
    except BaseException:
        unlink_segment(spec)
        raise
    finally:
        os.close(fd)


def binary_size(nbytes: int) -> str:
    """Memory sizes as the kernel counts them: 1.50 GiB, 820.0 MiB."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def allocate_shared(fd: int, nbytes: int, path: str) -> None:
    os.ftruncate(fd, nbytes)
    if nbytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        directory = os.path.dirname(path)
        usage = shutil.disk_usage(directory)
        raise HostMemoryError(
            f"host.shm_dir={directory!r} has no room for segment {os.path.basename(path)} of "
            f"{binary_size(nbytes)}: {binary_size(usage.free)} free of {binary_size(usage.total)} now "
            "(another process may have filled it since the memory check). Free shared memory, enlarge it "
            "(mount -o remount,size=... /dev/shm) or run `megatrain plan` for a configuration that fits") from None


def map_segment(spec: SegmentSpec) -> torch.Tensor | DiskSegment:
    """A shared-memory segment as a tensor; a disk-tier file as a DiskSegment (read and written by offset)."""
    if not os.path.exists(spec.path):
        raise HostMemoryError(f"{'disk-tier file' if spec.on_disk else 'shared-memory segment'} {spec.path} is "
                              "missing: its HostShard has exited")
    if spec.on_disk:
        return DiskSegment(spec.path, TORCH_DTYPES[spec.dtype], spec.numel)
    return torch.from_file(spec.path, shared=True, size=spec.numel, dtype=TORCH_DTYPES[spec.dtype])


def unlink_segment(spec: SegmentSpec) -> None:
    try:
        os.unlink(spec.path)
    except FileNotFoundError:
        pass


class HostStore:
    """Mapped views of a set of segments, from any process on the node."""

    def __init__(self, specs: list[SegmentSpec]):
        self.specs = list(specs)
        self._tensors: dict[tuple[str, int], Any] = {(s.kind, s.stage): map_segment(s) for s in specs}
        self._registered: list[torch.Tensor] = []

    def get(self, kind: SegmentKind, stage: int) -> torch.Tensor:
        """The segment of `kind` of `stage`; of a stage with two sets (ALT_KINDS), the current set's."""
        if kind in STATE_KINDS and self.current_set(stage):
            kind = ALT_KINDS[STATE_KINDS.index(kind)]
        return self._tensors[(kind, stage)]

    def current_set(self, stage: int) -> int:
        """0: the stage's state is in the plain kinds; 1: in ALT_KINDS (a stage with one set: always 0)."""
        parity = self._tensors.get(("parity", stage))
        return 0 if parity is None else int(parity[0])

    def other_set(self, stage: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Master, exp_avg and exp_avg_sq of the set that is not current: where a speculative update writes."""
        kinds = STATE_KINDS if self.current_set(stage) else ALT_KINDS
        return tuple(self._tensors[(kind, stage)] for kind in kinds)  # type: ignore[return-value]

    def switch_set(self, stage: int) -> None:
        """Make the other set current (a speculative update kept)."""
        parity = self._tensors[("parity", stage)]
        parity[0] = 1 - int(parity[0])

    def state_flats(self, stage: int) -> dict[str, torch.Tensor]:
        """The optimizer state this store maps of `stage` (what a checkpoint holds), by kind: master and both
        moments; with the lean state also the compensation and the scales."""
        return {kind: self.get(kind, stage) for kind in LEAN_KINDS if self.has(kind, stage)}

    def has(self, kind: SegmentKind, stage: int) -> bool:
        return (kind, stage) in self._tensors

    def on_disk(self, kind: SegmentKind, stage: int) -> bool:
        return isinstance(self._tensors[(kind, stage)], DiskSegment)

    def stream(self, stage: int) -> torch.Tensor:
        """The buffer the device reads: the streaming copy, or the master weights themselves."""
        found = self._tensors.get(("stream", stage))
        return found if found is not None else self._tensors[("master", stage)]

    def gates(self) -> list[torch.Tensor]:
        return [t for (kind, _), t in sorted(self._tensors.items()) if kind == "gate"]

    def pool(self) -> list[torch.Tensor]:
        return [t for (kind, _), t in sorted(self._tensors.items()) if kind == "gradpool"]

    def register_pinned(self, kinds: tuple[SegmentKind, ...]) -> float:
        """cudaHostRegister the segments the copy engines touch; returns the GiB registered."""
        cudart = torch.cuda.cudart()
        total = 0
        for (kind, _), tensor in self._tensors.items():
            if kind not in kinds or isinstance(tensor, DiskSegment) or tensor.numel() == 0:
                continue
            nbytes = tensor.numel() * tensor.element_size()
            err = cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise HostMemoryError(f"cudaHostRegister of {nbytes / 2**20:.0f} MiB failed with CUDA error "
                                      f"{int(err)}; the pinned-memory limit (ulimit -l) may be too low")
            self._registered.append(tensor)
            total += nbytes
        return total / 2**30

    def unregister_pinned(self) -> None:
        if not self._registered:
            return
        cudart = torch.cuda.cudart()
        for tensor in self._registered:
            cudart.cudaHostUnregister(tensor.data_ptr())
        self._registered.clear()

    # --------------------------------------------------------------- whole-model views (tests, export)

    def read_tensors(self, layout: ModelLayout, kind: SegmentKind = "master") -> dict[str, torch.Tensor]:
        """Copies of every tensor of the stages this store maps, by Hugging Face name."""
        return {name: view.clone() for name, view in StoreTensors(self, layout, kind).items()}

    def write_tensors(self, layout: ModelLayout, tensors: dict[str, torch.Tensor]) -> None:
        """Set master weights (and their streaming copy, and GRPO's reference copy: the initial weights are these now)
        from Hugging Face-named tensors."""
        for name, value in tensors.items():
            stage, slot = layout.stage_of(name)
            if tuple(value.shape) != slot.shape:
                raise ValueError(f"tensor {name}: shape {tuple(value.shape)} != model's {slot.shape}")
            for kind in ("master", "stream", "reference"):
                if self.has(kind, stage.index):
                    self.get(kind, stage.index)[slot.offset:slot.offset + slot.numel].copy_(value.reshape(-1))
            if self.has("master_comp", stage.index):  # the lean state: what the bf16 master dropped of the value
                span = slice(slot.offset, slot.offset + slot.numel)
                comp, master = self.get("master_comp", stage.index)[span], self.get("master", stage.index)[span]
                comp.copy_(value.reshape(-1).float() - master.float())


class StoreTensors(Mapping[str, torch.Tensor]):
    """Views (no copies) of the tensors of the stages a store maps, by Hugging Face name, in layout order:
    what export reads one tensor at a time."""

    def __init__(self, store: HostStore, layout: ModelLayout, kind: SegmentKind = "master"):
        self.store, self.layout, self.kind = store, layout, kind
        self.names = [stage.hf_name(slot) for stage in layout.stages if store.has(kind, stage.index)
                      for slot in stage.slots]

    def __getitem__(self, name: str) -> torch.Tensor:
        stage, slot = self.layout.stage_of(name)
        if not self.store.has(self.kind, stage.index):
            raise KeyError(name)
        return self.store.get(self.kind, stage.index)[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
