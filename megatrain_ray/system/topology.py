"""CPU topology and the plan that places the actors on it.

`detect_topology` reads the NUMA nodes and their CPUs from sysfs, keeps the CPUs this process
may use (affinity, i.e. the cpuset) and trims them to the cgroup's CPU quota; without sysfs
NUMA information everything is one node. `plan_placement` turns a topology into a core map:
which optimizer worker runs on which node and cores, which node each HostShard binds its
memory to, and which cores stay free for the GPU worker and the shards.

Why few optimizer workers: CPU AdamW is bound by DRAM bandwidth, not by cores. Measured on
the GPU machines (one NUMA node; docs/benchmarks.md): 4.2 G params/s on 16 cores, flat from 1 to 16
worker processes, and 4.0-5.2 on the 32 cores of nvidia-h200-x2, flat from 1 to 32. On the H100 box
1, 2 and 4 processes over the same 16 cores gave 4.58, 5.08, 4.36 G params/s alone and 4.10, 4.09,
3.84 beside H2D copies: two processes are as fast as any count, and each further one costs
~0.35 GiB of RAM and more messages per stage. Across sockets each socket's memory channels add
bandwidth, so `auto` puts workers on every node: min(2, usable cores // 2) per node, each worker
on its own disjoint cores (its threads use all of them).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from megatrain_ray.observe.log import get_logger

log = get_logger(__name__)

NODE_SYSFS = Path("/sys/devices/system/node")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Cores kept free per GPU worker (its launch thread, its NCCL proxy thread, copy bookkeeping) on the
# GPU's node, shared with the host shards there, when the node keeps MIN_OPTIMIZER_CORES for AdamW.
# Why per GPU worker: unpinned, two GPU workers' busy threads spilled onto the optimizer's cores, and
# one preempted thread holds up every thread of a worker's update (measured on nvidia-h200-x2).
RESERVED_CORES = 2
MIN_OPTIMIZER_CORES = 6
MAX_AUTO_WORKERS_PER_NODE = 2


@dataclass(frozen=True, slots=True)
class NumaNode:
    index: int
    cpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Topology:
    nodes: tuple[NumaNode, ...]
    source: str
    """Where the nodes came from: the sysfs directory read, or why it fell back to one node."""

    @property
    def num_cpus(self) -> int:
        return sum(len(n.cpus) for n in self.nodes)


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """One optimizer worker: its NUMA node and the cores it pins itself to."""

    index: int
    node: int
    cores: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Placement:
    """The core map of a run (logged at start; Ray bundles are built from it)."""

    topology: Topology
    workers: tuple[WorkerSlot, ...]
    shard_nodes: tuple[int, ...]
    """NUMA node whose memory HostShard k binds its segments to."""
    gpu_node: int
    gpu_cores: tuple[tuple[int, ...], ...]
    """Per GPU worker (local rank), the cores it runs on: its own reserved ones and the node's cores no
    optimizer worker got, or the whole node when the node is too small to reserve them."""
    workers_reason: str
    shared_cores: bool = field(default=False)
    """More workers than usable cores: some workers share a core (allowed, slower)."""

    @property
    def reserved_cores(self) -> tuple[int, ...]:
        """The GPU workers' cores together: the host shards of the GPU's node run on them too."""
        return tuple(sorted({c for cores in self.gpu_cores for c in cores}))

    def summary(self) -> str:
        nodes = ", ".join(f"node {n.index}: cpus {format_cpus(n.cpus)}" for n in self.topology.nodes)
        workers = "; ".join(f"optim{w.index} -> node {w.node} cpus {format_cpus(w.cores)}" for w in self.workers)
        shards = ", ".join(f"host{k} -> node {n}" for k, n in enumerate(self.shard_nodes))
        optimizers = (f"{len(self.workers)} optimizer worker(s) ({self.workers_reason}): {workers}" if self.workers
                      else f"no optimizer workers ({self.workers_reason})")
        return (f"topology ({self.topology.source}): {nodes}. {optimizers}. GPU worker(s): node {self.gpu_node} "
                f"{'; '.join(f'cpus {format_cpus(c)}' for c in self.gpu_cores)}. {shards}")


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the sysfs and cpuset list format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def cpu_compute_threads(sharers: int = 1) -> int:
    """torch's intra-op threads for a worker that computes on the CPU itself: its share of the cores this process
    may run on (its affinity, not the machine's count: a container's cpuset or `taskset`), capped by
    OMP_NUM_THREADS when that is set, as torch itself honours it at start."""
    threads = max(1, len(os.sched_getaffinity(0)) // max(1, sharers))
    limit = os.environ.get("OMP_NUM_THREADS", "")
    return min(threads, int(limit)) if limit.isdigit() and int(limit) > 0 else threads


def format_cpus(cpus: tuple[int, ...] | list[int]) -> str:
    """The inverse of parse_cpulist, for log lines."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs) or "-"


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup's quota allows (cgroup v2 cpu.max or v1 cfs quota), None when unlimited."""
    candidates = [(root / "cpu.max", None), (root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"),
                  (root / "cpu,cpuacct" / "cpu.cfs_quota_us", root / "cpu,cpuacct" / "cpu.cfs_period_us")]
    for quota_file, period_file in candidates:
        try:
            if period_file is None:
                quota, period = quota_file.read_text().split()[:2]
            else:
                quota, period = quota_file.read_text().strip(), period_file.read_text().strip()
        except (OSError, ValueError):
            continue
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period)
    return None


def detect_topology(root: Path | None = None, allowed: set[int] | None = None,
                    cgroup_root: Path | None = None) -> Topology:
    """NUMA nodes with the CPUs this process may use; one node when sysfs says nothing.

    `root`, `allowed` and `cgroup_root` exist for tests (a fake sysfs tree); by default they
    are /sys/devices/system/node, os.sched_getaffinity(0) and /sys/fs/cgroup.
    """
    root = root or NODE_SYSFS
    allowed = allowed if allowed is not None else set(os.sched_getaffinity(0))
    nodes = []
    for node_dir in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = [c for c in parse_cpulist((node_dir / "cpulist").read_text()) if c in allowed]
        except (OSError, ValueError):
            continue
        if cpus:  # a node without usable CPUs (memory-only, or outside the cpuset) hosts no actor
            nodes.append(NumaNode(int(node_dir.name[4:]), tuple(cpus)))
    source = str(root)
    if not nodes:
        nodes = [NumaNode(0, tuple(sorted(allowed)))]
        source = f"no NUMA nodes readable in {root}: one node"
    limit = cgroup_cpu_limit(cgroup_root or CGROUP_ROOT)
    total = sum(len(n.cpus) for n in nodes)
    if limit is not None and math.ceil(limit) < total:
        nodes = _trim_to(nodes, max(1, math.ceil(limit)))
        source += f", trimmed to the cgroup quota of {limit:g} CPUs"
    return Topology(tuple(nodes), source)


def _trim_to(nodes: list[NumaNode], keep: int) -> list[NumaNode]:
    """Keep `keep` CPUs in all, taken from the nodes in proportion to their size."""
    total = sum(len(n.cpus) for n in nodes)
    counts = [len(n.cpus) * keep // total for n in nodes]
    for i in sorted(range(len(nodes)), key=lambda i: -len(nodes[i].cpus)):
        if sum(counts) >= keep:
            break
        counts[i] += 1
    return [NumaNode(n.index, n.cpus[:c]) for n, c in zip(nodes, counts) if c]


def reserved_count(node: NumaNode, gpu_node: int, gpu_ranks: int) -> int:
    """Cores the node keeps for its GPU workers: RESERVED_CORES each on the GPU's node, none elsewhere
    or where that would leave AdamW fewer than MIN_OPTIMIZER_CORES."""
    want = RESERVED_CORES * gpu_ranks
    return want if node.index == gpu_node and len(node.cpus) - want >= MIN_OPTIMIZER_CORES else 0


def usable_cores(node: NumaNode, gpu_node: int, gpu_ranks: int = 1) -> tuple[int, ...]:
    """A node's cores for optimizer workers: all but those reserved for the GPU workers."""
    return node.cpus[reserved_count(node, gpu_node, gpu_ranks):]


def auto_workers_per_node(cores: int) -> int:
    """Workers `optimizer.workers: auto` puts on a node with `cores` usable cores (module docstring)."""
    return max(1, min(MAX_AUTO_WORKERS_PER_NODE, cores // 2))


def _split_workers(total: int, sizes: list[int]) -> list[int]:
    """`total` workers over nodes in proportion to their usable cores, every node at least one
    while there are enough workers (largest remainder)."""
    if total < len(sizes):
        order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
        return [1 if i in order[:total] else 0 for i in range(len(sizes))]
    counts = [1] * len(sizes)
    rest = total - len(sizes)
    all_cores = sum(sizes)
    shares = [rest * s / all_cores for s in sizes]
    for i, share in enumerate(shares):
        counts[i] += int(share)
    for i in sorted(range(len(sizes)), key=lambda i: -(shares[i] - int(shares[i]))):
        if sum(counts) == total:
            break
        counts[i] += 1
    return counts


def plan_placement(topology: Topology, workers: int | str, num_shards: int, gpu_node: int | None = None,
                   gpu_ranks: int = 1) -> Placement:
    """The core map: optimizer workers over nodes on disjoint cores, shards bound to nodes, each of
    the node's `gpu_ranks` GPU workers on cores of its own.

    `workers` is a count or "auto". The GPU's node is `gpu_node` when given, else the first
    node (megatrain does not initialise CUDA in the driver to ask the device's PCI node).
    HostShard k holds a contiguous range of stages, so shard k goes to the node whose share of
    the optimizer workers covers the middle of that range: the stages are split across nodes
    in proportion to the workers there.
    """
    nodes = topology.nodes
    gpu = gpu_node if gpu_node is not None and any(n.index == gpu_node for n in nodes) else nodes[0].index
    usable = [usable_cores(n, gpu, gpu_ranks) for n in nodes]
    if workers == "auto":
        per_node = [auto_workers_per_node(len(u)) for u in usable]
        reason = (f"auto: min({MAX_AUTO_WORKERS_PER_NODE}, usable cores // 2) per node; AdamW is bound by "
                  "DRAM bandwidth, so more workers on one node add no throughput")
    else:
        per_node = _split_workers(int(workers), [len(u) for u in usable])
        reason = f"optimizer.workers={workers}, spread over nodes by their cores"
    slots, shared = [], False
    for node, cores, count in zip(nodes, usable, per_node):
        if count == 0:  # fewer workers than nodes: this node gets none
            continue
        if count > len(cores):
            shared = True
            core_sets = [(cores[w % len(cores)],) for w in range(count)]
        else:
            per = len(cores) // count
            core_sets = [cores[w * per:(w + 1) * per] for w in range(count)]
        slots.extend(WorkerSlot(len(slots), node.index, tuple(c)) for c in core_sets)
    worker_nodes = [s.node for s in slots]
    shard_nodes = tuple(worker_nodes[min(len(slots) - 1, (2 * k + 1) * len(slots) // (2 * num_shards))]
                        for k in range(num_shards))
    node, node_usable = next((n, u) for n, u in zip(nodes, usable) if n.index == gpu)
    if len(node_usable) < len(node.cpus):  # the node keeps cores for its GPU workers
        # The node's cores no optimizer worker got (a split that does not come out even) go to every
        # GPU worker as well: spare cores for its threads, still apart from AdamW's.
        taken = {c for s in slots for c in s.cores}
        spare = tuple(c for c in node_usable if c not in taken)
        gpu_cores = tuple(node.cpus[r * RESERVED_CORES:(r + 1) * RESERVED_CORES] + spare for r in range(gpu_ranks))
    else:
        gpu_cores = (node.cpus,) * gpu_ranks
    return Placement(topology, tuple(slots), shard_nodes, gpu, gpu_cores, reason, shared)


def node_cpus(placement: Placement, node: int) -> tuple[int, ...]:
    return next(n.cpus for n in placement.topology.nodes if n.index == node)


def shard_start_up_cores(placement: Placement, index: int) -> tuple[int, ...]:
    """The cores HostShard `index` fills its stages on at start-up: its share of its node's cores, split between the
    node's shards. No optimizer or GPU worker exists yet, so the whole node is free; the shard's own cores (the GPU
    workers' on the GPU's node: two) would leave a large store's start-up to two threads."""
    node = placement.shard_nodes[index]
    peers = [k for k, n in enumerate(placement.shard_nodes) if n == node]
    cpus = node_cpus(placement, node)
    share = max(1, len(cpus) // len(peers))
    position = peers.index(index) % max(1, len(cpus) // share)
    return tuple(cpus[position * share:(position + 1) * share])


def _threads() -> list[int]:
    """This process's thread ids (0, this thread, where /proc is missing)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def move_thread(cores: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Put the calling thread on `cores` (the threads and processes it starts from now on inherit them); returns the
    cores it had, to move it back. Nothing happens for no cores (in-process) or where affinity is not supported."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return ()
    before = tuple(sorted(os.sched_getaffinity(0)))
    try:
        os.sched_setaffinity(0, cores)
    except OSError as err:  # cores outside this process's cpuset (a node that differs from the driver's)
        log.warning("could not move to cores %s (%s): staying on %s", format_cpus(tuple(cores)), err,
                    format_cpus(before))
        return ()
    return before


MPOL_DEFAULT = 0  # from <numaif.h>: the kernel's default, local allocation
MPOL_PREFERRED = 1  # from <numaif.h>: allocate on the node, spill to others when it is full


def _libnuma():
    """libnuma through ctypes, or None where it is not installed."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("numa") or "libnuma.so.1", use_errno=True)
    except OSError:
        return None


def default_memory_policy() -> None:
    """Undo bind_process's preferred node for the calling thread (a kept actor process between runs)."""
    import ctypes

    libnuma = _libnuma()
    if libnuma is not None:
        libnuma.set_mempolicy(MPOL_DEFAULT, None, ctypes.c_ulong(0))


def bind_process(cores: tuple[int, ...] | list[int], node: int | None = None) -> str:
    """Pin this process to `cores` and prefer `node` for the memory it touches from now on.

    Call it first in an actor's __init__, before the actor touches its pages (Ray's num_cpus is
    bookkeeping, and a raylet-spawned actor escapes numactl). Every thread the process has is pinned
    (affinity is per thread, and Ray's threads exist before __init__ runs), so the threads any of them
    start later inherit the cores (AdamW's, NCCL's, CUDA's). The memory policy goes through
    libnuma's set_mempolicy (MPOL_PREFERRED rather than BIND, so a full node spills instead of
    killing the run); without libnuma, or for a node the kernel does not know (a simulated
    topology), first touch from the pinned cores places the pages. Returns which of the two happened.
    """
    if cores and hasattr(os, "sched_setaffinity"):
        for thread in _threads():
            try:
                os.sched_setaffinity(thread, cores)
            except OSError:  # the thread ended meanwhile
                pass
    if node is None:
        return "no memory policy"
    import ctypes

    libnuma = _libnuma()
    if libnuma is None:
        return f"first touch on node {node} (libnuma not found)"
    mask = (ctypes.c_ulong * 16)()  # 1024 nodes
    mask[node // 64] = 1 << (node % 64)
    if libnuma.set_mempolicy(MPOL_PREFERRED, mask, ctypes.c_ulong(1024 + 1)) != 0:
        err = ctypes.get_errno()
        return f"first touch on node {node} (set_mempolicy failed: {os.strerror(err)})"
    return f"memory preferred on node {node} (set_mempolicy)"
