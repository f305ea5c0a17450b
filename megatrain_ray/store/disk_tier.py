"""The disk tier of the AdamW moments (`host.moments_tier: disk`).

The moments are the largest part of the host store (8 of the 12 bytes per parameter at full
precision) and are touched once per step, by the optimizer only, in an order known in advance: a
disk can hold them while RAM keeps what the GPU streams (master weights, streaming copy).

    HostShard        creates one file per stage and kind in host.disk_dir (blocks allocated at start),
                     fills them from a checkpoint, writes them into checkpoints: `DiskSegment`
    OptimizerWorker  per update of stage i: wait for its share of i's moments (read ahead), update,
                     write them back behind, start reading the next stage in update order: `MomentStager`

Each worker stages only its own share [start, end) of a stage (optim.split_span), through two slots
of that size per moment: one updated while the other is read ahead; a slot is refilled only once
its write-back is on disk. One reader and one writer thread per worker overlap the two directions
of I/O with each other and with the AdamW math (file I/O releases the GIL).

The page cache: I/O is buffered (no O_DIRECT, so spans need no block alignment), and every range is
dropped from the page cache once used (POSIX_FADV_DONTNEED after a read; fdatasync, then the same,
after a write). The moments therefore do not creep back into RAM as cache, and what a benchmark
measures is the disk.
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from megatrain_ray.exceptions import HostMemoryError
from megatrain_ray.optim.adamw import split_span

IO_CHUNK = 64 << 20
"""Bytes per read or write system call."""
MOMENT_KINDS = ("exp_avg", "exp_avg_sq")


def byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:done + IO_CHUNK]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short read at byte {offset + done} (the file ends early)")
        done += n
    os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)


def pwrite_from(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:done + IO_CHUNK]], offset + done)
    os.fdatasync(fd)  # dirty pages cannot be dropped: write them first
    os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)


def allocate_file(fd: int, nbytes: int, path: str) -> None:
    """Allocate every block of a new file (it reads as zeros), so a full disk fails now."""
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, 0)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise HostMemoryError(f"host.disk_dir: no space left on the disk for {path} ({nbytes / 1e9:.2f} GB); "
                                  "free space there or set host.moments_tier=ram") from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)  # a file system without fallocate: blocks come on first write


class DiskSegment:
    """A disk-tier file of `numel` elements, read and written by offset (never mapped). Slicing it gives
    a DiskTensor, which is what checkpoints and tests read and write."""

    def __init__(self, path: str, dtype: torch.dtype, numel: int):
        self.path, self.dtype, self._numel = path, dtype, numel

    def numel(self) -> int:
        return self._numel

    def __getitem__(self, index: slice) -> DiskTensor:
        start, stop, step = index.indices(self._numel)
        if step != 1:
            raise ValueError("a DiskSegment slices contiguously only")
        return DiskTensor(self.path, self.dtype, start, (max(0, stop - start),))

    def clone(self) -> torch.Tensor:
        return self[:].clone()


@dataclass(frozen=True)
class DiskTensor:
    """Elements [offset, offset + numel) of a disk-tier file, with a shape: enough of a tensor's
    interface (dtype, shape, numel, element_size, view, clone) for checkpoints to stream it."""

    path: str
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]

    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel() * self.element_size()

    def view(self, *shape) -> DiskTensor:
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else tuple(shape)
        if torch.Size(shape).numel() != self.numel():
            raise ValueError(f"cannot view {self.numel()} elements as {shape}")
        return DiskTensor(self.path, self.dtype, self.offset, shape)

    def read_bytes(self, begin: int, out: memoryview) -> None:
        """Bytes [begin, begin + len(out)) of this tensor into `out`."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            pread_into(fd, out, self.offset * self.element_size() + begin)
        finally:
            os.close(fd)

    def write_bytes(self, begin: int, data: memoryview) -> None:
        fd = os.open(self.path, os.O_WRONLY)
        try:
            pwrite_from(fd, data, self.offset * self.element_size() + begin)
        finally:
            os.close(fd)

    def clone(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.read_bytes(0, byte_view(out))
        return out


def update_order(num_stages: int, clipped: bool) -> list[int]:
    """The order in which StreamEngine.train_step orders the updates of one step: with exact clipping in
    stage order after the backward (embedding first), without it as the backward produces gradients (LM
    head first). The disk tier reads ahead along it; another order is still correct, only slower."""
    stages = list(range(num_stages))
    return stages if clipped else stages[::-1]


@dataclass(eq=False)
class _Slot:
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    read: Future | None = None
    """The read filling it (done once its moments are usable)."""
    write: Future | None = None
    """The write-back out of it: the slot is refilled only after it."""
    released: int = 0


Piece = tuple[int, int]
"""(stage, k): the k-th piece of a worker's span of a stage."""


class MomentStager:
    """One optimizer worker's share of every stage's moments, staged from disk through `slots` buffers.

    The worker's span of each stage is cut into pieces of at most `piece_elems` elements (a stage as large
    as the embedding would otherwise set the size of every buffer). Called from one thread (the worker's):
    `acquire((stage, k))` returns the staged exp_avg and exp_avg_sq of piece k of the stage (element 0 is
    the piece's first element, `pieces(stage)[k][0]` in the stage); `release((stage, k))` writes them back
    behind and reads the next piece in `order` ahead; `drain()` waits for every write (before a checkpoint
    reads the files).
    """

    def __init__(self, paths: dict[tuple[str, int], str], spans: dict[int, tuple[int, int]], order: list[int],
                 dtype: torch.dtype, piece_elems: int, slots: int = 2, poison: bool = False):
        if slots < 2:
            raise ValueError("the disk tier needs two staging slots: one updated, one read ahead")
        self.dtype = dtype
        self._pieces = {stage: [(lo, min(hi, lo + piece_elems)) for lo in range(start, hi, piece_elems)]
                        for stage, (start, hi) in spans.items()}
        units = [(stage, k) for stage in order for k in range(len(self._pieces[stage]))]
        self._next = {unit: units[(i + 1) % len(units)] for i, unit in enumerate(units)}
        self.fds = {key: os.open(path, os.O_RDWR) for key, path in paths.items()}
        size = max((hi - lo for pieces in self._pieces.values() for lo, hi in pieces), default=0)
        fill = float("nan") if poison else 0.0
        self.slots = [_Slot(torch.full((size,), fill, dtype=dtype), torch.full((size,), fill, dtype=dtype))
                      for _ in range(slots)]
        self.staged: dict[Piece, _Slot] = {}
        self.writes: dict[Piece, Future] = {}
        self.current: tuple[Piece, _Slot] | None = None
        self._clock = itertools.count(1)
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="moments-read")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="moments-write")
        self.misses = 0
        """Pieces whose moments were not read ahead (the first one, or an order other than `order`)."""
        self.wait_seconds = 0.0
        """Time acquire() waited for reads: the I/O the AdamW math did not hide."""

    def pieces(self, stage: int) -> list[tuple[int, int]]:
        """[lo, hi) in the stage of each piece of this worker's span, in order."""
        return self._pieces[stage]

    @property
    def staging_bytes(self) -> int:
        return sum(s.exp_avg.numel() * 2 * self.dtype.itemsize for s in self.slots)

    def acquire(self, piece: Piece) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.current is None, "release the piece acquired before"
        slot = self.staged.pop(piece, None)
        if slot is None:
            self.misses += 1
            self._drop_staged()
            slot = self._start_read(piece)
            self.staged.pop(piece)
        t0 = time.perf_counter()
        assert slot.read is not None
        slot.read.result()
        self.wait_seconds += time.perf_counter() - t0
        self.current = (piece, slot)
        lo, hi = self._pieces[piece[0]][piece[1]]
        return slot.exp_avg[:hi - lo], slot.exp_avg_sq[:hi - lo]

    def release(self, piece: Piece) -> None:
        assert self.current is not None and self.current[0] == piece, f"piece {piece} was not acquired"
        slot = self.current[1]
        self.current = None
        slot.write = self.writes[piece] = self.writer.submit(self._io, piece, slot, True)
        slot.released = next(self._clock)
        upcoming = self._next[piece]
        if upcoming not in self.staged:
            self._start_read(upcoming)

    def drain(self) -> None:
        """Wait until every moment written back is on disk (raises what a write raised)."""
        for future in list(self.writes.values()):
            future.result()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.reader.shutdown(wait=True)
            self.writer.shutdown(wait=True)
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()

    # ------------------------------------------------------------------ internals

    def _drop_staged(self) -> None:
        """Forget reads ahead that the orders did not follow (their slots become free)."""
        for slot in self.staged.values():
            if slot.read is not None:
                slot.read.result()
        self.staged.clear()

    def _start_read(self, piece: Piece) -> _Slot:
        busy = list(self.staged.values())
        slot = min((s for s in self.slots if s not in busy), key=lambda s: s.released)
        after = [f for f in (slot.write, self.writes.get(piece)) if f is not None]
        slot.read = self.reader.submit(self._read, piece, slot, after)
        self.staged[piece] = slot
        return slot

    def _read(self, piece: Piece, slot: _Slot, after: list[Future]) -> None:
        for future in after:  # the slot's old contents are on disk, and so is this piece's last update
            future.result()
        self._io(piece, slot, False)

    def _io(self, piece: Piece, slot: _Slot, write: bool) -> None:
        stage, k = piece
        lo, hi = self._pieces[stage][k]
        for kind, buf in zip(MOMENT_KINDS, (slot.exp_avg, slot.exp_avg_sq)):
            view = byte_view(buf[:hi - lo])
            (pwrite_from if write else pread_into)(self.fds[(kind, stage)], view, lo * self.dtype.itemsize)


def piece_elems(layer_numel: int, workers: int) -> int:
    """Elements per staged piece: a worker's share of one decoder layer, so that the staging RAM is two
    layers' worth whatever the size of the embedding and the LM head."""
    return max(1, max(b - a for a, b in (split_span(layer_numel, w, workers) for w in range(workers))))


def disk_problems(disk_dir: str, need: int) -> list[str]:
    """What is wrong with host.disk_dir for `need` bytes of moments, checked before anything is allocated."""
    advice = "or set host.moments_tier=ram"
    if not os.path.isdir(disk_dir):
        return [f"host.disk_dir={disk_dir!r} is not a directory: create it on a fast local disk (NVMe), {advice}"]
    try:
        fd, probe = tempfile.mkstemp(dir=disk_dir, prefix=".megatrain-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return [(f"host.disk_dir={disk_dir!r} is not writable ({exc.strerror or exc}): choose a directory this "
                 f"user may write, {advice}")]
    free = shutil.disk_usage(disk_dir).free
    if need > free:
        return [(f"host.disk_dir={disk_dir!r} has {decimal_size(free)} free, the AdamW moments need "
                 f"{decimal_size(need)} there: free space, choose another disk, set optimizer.moment_dtype=bfloat16 "
                 f"(half the bytes), {advice}")]
    return []


def decimal_size(nbytes: int) -> str:
    """Disk sizes as disks are sold: 1.5 GB, 820 MB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def staging_bytes(stage_numels: list[int], layer_numel: int, workers: int, itemsize: int, slots: int = 2) -> int:
    """RAM the MomentStagers of `workers` optimizer workers hold: per worker, `slots` buffers of its largest
    piece for each of the two moments."""
    piece = piece_elems(layer_numel, workers)
    total = 0
    for w in range(workers):
        largest_span = max(b - a for a, b in (split_span(n, w, workers) for n in stage_numels))
        total += slots * 2 * itemsize * min(piece, largest_span)
    return total
