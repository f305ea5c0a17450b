"""Data parallelism inside the layer stream: who a rank is, how gradients are summed, how the ranks of
a node learn that a stage's update is done.

    node 0: host store + optimizer workers          node 1: host store + optimizer workers
            rank 0 (leader)  rank 1  ...                    rank L (leader)  rank L+1  ...

Every rank streams its own slice of the batch through the same stages of its node's host store.

Gradient sum (`Collectives.reduce`), per stage, on the device, before anything reaches the host:
a reduce-scatter among the L ranks of a node, then, with several nodes, an all-reduce of each piece
among the ranks that hold the same piece on the other nodes (rank l of every node). Rank l of each
node ends with piece l of the global sum, which it alone copies device->host into its node's
gradient buffer, at the piece's offset. Why not one all-reduce: it moves twice the bytes of a
reduce-scatter over NVLink, and every rank would then hold the whole sum of which it copies 1/L;
with the reduce-scatter each GPU's PCIe link carries 1/L of the gradients and the host sees each
gradient byte once, whatever L (the optimizer reads one summed buffer, so its work does not grow
with the number of GPUs). The sum is in the gradient's dtype (bf16 with the bf16 streaming copy,
as DDP does; a rank's gradients are bf16 already, so that adds log2(L) roundings).

Update completion (`StageSync`): one small int64 table per node in shared memory (a `sync` segment of
the node's first HostShard), rows 0..L-1: the step up to which local rank r's piece of stage s is on
the host; row L: the step up to which stage s's update is applied. A rank writes its row after its
D2H of the stage completes. The node's leader (local rank 0), the only rank that talks to the
optimizer workers, orders a stage's update once every row shows the stage landed (so there is one
update per stage and node, never one per rank) and writes row L when the update is done; every
other rank reads row L before it loads the stage again. Why shared memory and not a collective: the
ranks of a node share that memory anyway, a counter costs a store and a few polls, and a collective
would put the optimizer's latency on the other GPUs' streams; across nodes nothing is needed, as
each node updates its own copy. Stores to the table come after the data they announce is written
(cudaEventSynchronize on the D2H, or the optimizer's result): on x86 (TSO) a reader that sees the
counter sees the data.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from megatrain_ray.exceptions import ParallelError

FAILED = -1
"""Written to row L when the leader's update of a stage failed: the other ranks stop at once."""


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where one GPU worker sits in a data-parallel run; the defaults are the single-GPU run."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    """Ranks on this node (they share its host store)."""
    node: int = 0
    nodes: int = 1

    @classmethod
    def of(cls, node: int, local_rank: int, local_world: int, nodes: int) -> RankInfo:
        return cls(node * local_world + local_rank, nodes * local_world, local_rank, local_world, node, nodes)

    @property
    def leader(self) -> bool:
        """Orders its node's updates (the only rank of a single-GPU run)."""
        return self.local_rank == 0

    def piece(self, numel: int) -> tuple[int, int]:
        """[start, end) of a stage's flat buffer that is this rank's piece: of the gradients it sums and copies to the
        host, and (parallel.gather_weights) of the weights it copies from the host."""
        if self.local_world == 1:
            return 0, numel
        chunk = math.ceil(numel / self.local_world)
        start = min(numel, self.local_rank * chunk)
        return start, min(numel, start + chunk)


def padded(numel: int, local_world: int) -> int:
    """Length of a device gradient buffer that splits into local_world equal pieces."""
    return math.ceil(numel / local_world) * local_world


class Collectives:
    """The run's torch.distributed process group and the groups the gradient sum uses.

    `init_method` is a FileStore on the node's shared memory when every rank is on one host (no
    socket at all), else tcp://<rank 0's node address>:<port> (see GPUWorker.rendezvous)."""

    def __init__(self, info: RankInfo, backend: str, init_method: str, timeout_s: float, device: torch.device):
        import torch.distributed as dist

        self.dist, self.info = dist, info
        timeout = timedelta(seconds=timeout_s)
        extra: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=init_method, rank=info.rank, world_size=info.world,
                                timeout=timeout, **extra)
        world, n, nodes = dist.group.WORLD, info.local_world, info.nodes
        self.local = world if n > 1 and nodes == 1 else None
        self.cross = world if nodes > 1 and n == 1 else None
        if n > 1 and nodes > 1:  # new_group is collective: every rank creates every group, in one order
            for node in range(nodes):
                group = dist.new_group([node * n + r for r in range(n)], timeout=timeout)
                if node == info.node:
                    self.local = group
            for r in range(n):
                group = dist.new_group([node * n + r for node in range(nodes)], timeout=timeout)
                if r == info.local_rank:
                    self.cross = group
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def reduce(self, buf: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Sum `buf` (a stage's padded gradients) over all ranks; returns this rank's piece of the sum
        (`out`, or `buf` itself with one rank per node). Issued on the current (compute) stream."""
        piece = buf
        if self.local is not None:
            assert out is not None
            self._reduce_scatter(out, buf, group=self.local)
            piece = out
        if self.cross is not None:
            self.dist.all_reduce(piece, group=self.cross)
        return piece

    def gather(self, buf: torch.Tensor) -> None:
        """(parallel.gather_weights) Fill `buf` (a stage's padded weights) from the node's ranks, each of which
        holds its piece (RankInfo.piece) in place. Issued on the current (H2D) stream."""
        start, end = self.info.piece(buf.numel())
        self.dist.all_gather_into_tensor(buf, buf[start:end], group=self.local)

    def all_reduce(self, values: torch.Tensor) -> None:
        """In-place sum over every rank (the step's totals: a few float64 numbers)."""
        self.dist.all_reduce(values)

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class StageSync:
    """The node's per-stage counters (module docstring); `table` is the node's `sync` segment."""

    POLL_S = (0.0, 2e-5, 5e-5, 1e-4, 2e-4)
    """Sleeps between polls: a waiting rank wakes within 0.2 ms of the store it waits for."""

    def __init__(self, table: torch.Tensor, info: RankInfo, num_stages: int, timeout_s: float):
        self.rows = table.numpy().reshape(info.local_world + 1, num_stages)  # numpy: a poll costs ~100 ns
        self.info, self.timeout_s = info, timeout_s

    def landed(self, stage: int, step: int) -> None:
        """This rank's piece of `stage`'s gradients of step `step` is on the host."""
        self.rows[self.info.local_rank, stage] = step

    def applied(self, stage: int, step: int) -> None:
        """(Leader) The update of `stage` with the gradients of step `step` is done, or FAILED."""
        self.rows[self.info.local_world, stage] = step

    def wait_landed(self, stage: int, step: int) -> None:
        """(Leader) Until every other rank of the node has its piece of `stage` on the host."""
        for row in range(1, self.info.local_world):
            self._wait(row, stage, step, f"local rank {row}'s gradients")

    def wait_applied(self, stage: int, step: int) -> None:
        self._wait(self.info.local_world, stage, step, "the update ordered by the node's first rank")

    def _wait(self, row: int, stage: int, step: int, what: str) -> None:
        rows = self.rows
        if rows[row, stage] >= step:
            return
        deadline = time.monotonic() + self.timeout_s
        polls = 0
        while rows[row, stage] < step:
            if rows[row, stage] == FAILED:
                raise ParallelError(f"rank {self.info.rank}: {what} of stage {stage} failed (step {step}); see the "
                                    "first rank's error")
            if time.monotonic() > deadline:
                raise ParallelError(f"rank {self.info.rank} waited {self.timeout_s:.0f} s (parallel.timeout_s) for "
                                    f"{what} of stage {stage} at step {step}: a rank or an optimizer worker of node "
                                    f"{self.info.node} is stuck or dead")
            time.sleep(self.POLL_S[min(polls, len(self.POLL_S) - 1)])
            polls += 1


def global_totals(comm: Collectives, info: RankInfo, loss_sum: torch.Tensor, sqnorm: torch.Tensor,
                  checksum: float | None, step: int) -> tuple[float, float]:
    """The step's loss and gradient norm over all ranks, in one all-reduce that also compares the nodes'
    checksums: [loss, squared norm, checksum of node 0, ..., checksum of node M-1]. Each piece of the
    summed gradients is held by one rank per node, so only node 0's ranks add their squared norms."""
    totals = torch.zeros(2 + info.nodes, dtype=torch.float64, device=sqnorm.device)
    totals[0] = loss_sum
    if info.node == 0:
        totals[1] = sqnorm
    if checksum is not None:
        totals[2 + info.node] = checksum
    comm.all_reduce(totals)
    loss, squared_norm, *sums = totals.tolist()
    if info.nodes > 1 and any(x != sums[0] and not (math.isnan(x) and math.isnan(sums[0])) for x in sums):
        raise ParallelError(f"the nodes' host copies of the weights differ at train step {step}: "
                            f"checksums {', '.join(f'node {k}: {x!r}' for k, x in enumerate(sums))}. Each node "
                            "applies the same summed gradients to its own copy, so one copy was corrupted or "
                            "missed an update; resume from the last checkpoint (--resume auto)")
    return loss, math.sqrt(squared_norm)
