"""The sections of where a run lives: the host store (`host`), how the actors launch (`runtime`) and data
parallelism (`parallel`). Each checks its own values; checks across sections are with Config
(config/sections.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from megatrain_ray.config.fields import refuse as _fail


@dataclass(kw_only=True, slots=True)
class HostConfig:
    """The host store: shared-memory segments owned by HostShard actors."""

    SECTION: ClassVar[str] = "host"
    num_shards: int = 1
    """HostShard actors; each owns a contiguous range of stages (one per NUMA node is the intent), so at most the
    model's stage count (its layers + 2: the embedding and the head); each is a process of its own (~0.35 GiB)."""
    shm_dir: str = "/dev/shm"
    """Directory of the shared-memory segments; must be a tmpfs large enough for the whole store."""
    moments_tier: Literal["ram", "disk"] = "ram"
    """Where the AdamW moments live. ram: shared-memory segments like the rest of the store. disk: files
    in host.disk_dir: 8 bytes of RAM per parameter fewer (4 with optimizer.moment_dtype=bfloat16). Each
    optimizer worker reads its share of a stage's moments ahead of the update, in update order, and
    writes them back behind it, through two buffers of its share of one decoder layer (the embedding and
    head go in layer-sized pieces): the staging RAM `megatrain plan` shows. Every step then reads and writes all
    moments on the disk (16 bytes per parameter, 8 with optimizer.moment_dtype=bfloat16): the disk's
    bandwidth bounds the optimizer (benchmarks/moment_tiers.py measures it). Results are bit-identical
    to ram; checkpoints move freely between the tiers. Master weights and the streaming copy stay in RAM."""
    disk_dir: str = ""
    """Directory for host.moments_tier=disk, on a fast local disk (NVMe), not a tmpfs or network share.
    Checked before allocating: it must exist, be writable and have room for both moments (the files are
    allocated in full at start and removed at the end)."""

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            _fail("host.num_shards", self.num_shards, "must be >= 1")
        if self.moments_tier == "disk" and not self.disk_dir:
            _fail("host.disk_dir", self.disk_dir, "is required with host.moments_tier=disk: a directory on a fast "
                  "local disk")


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    """How the actors are launched."""

    SECTION: ClassVar[str] = "runtime"
    mode: Literal["ray", "local"] = "ray"
    """ray: actors in a Ray cluster; local: the same classes in this process (debugging, fast tests)."""
    address: str = ""
    """Ray cluster to attach to. Empty: RAY_ADDRESS if set, else a cluster started with `ray start`
    on this machine, else a private local Ray bound to 127.0.0.1."""
    dashboard: bool = True
    """Start the Ray dashboard with a private local Ray (127.0.0.1 only)."""
    allow_unauthenticated: bool = False
    """Let a private local Ray start without token auth when RAY_AUTH_MODE says so (anyone who can reach
    its ports could then run code as you). By default that is refused before Ray starts."""
    object_store_mb: int = 512
    """Object store of a private local Ray. Bulk tensors never go through it, so it stays small."""
    heartbeat_interval_s: float = 5.0
    """Seconds between health checks of the actors (Ray mode); 0 turns them off."""
    heartbeat_timeout_s: float = 30.0
    """An actor that has not answered a heartbeat for this long is logged as slow, by name."""

    def __post_init__(self) -> None:
        if self.object_store_mb < 64:
            _fail("runtime.object_store_mb", self.object_store_mb, "must be >= 64")
        if self.heartbeat_interval_s < 0:
            _fail("runtime.heartbeat_interval_s", self.heartbeat_interval_s, "must be >= 0 (0 turns checks off)")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            _fail("runtime.heartbeat_timeout_s", self.heartbeat_timeout_s,
                  f"must exceed runtime.heartbeat_interval_s={self.heartbeat_interval_s}")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Data parallelism: one GPUWorker (rank) per GPU, each streaming its slice of the batch through the
    same layers of its node's host store; gradients are summed over the ranks layer by layer before the
    node's optimizer workers see them (megatrain_ray/engine/parallel.py). The global batch, the loss,
    the schedule and the checkpoints are the same whatever the number of GPUs."""

    SECTION: ClassVar[str] = "parallel"
    gpus: int | Literal["auto"] = 1
    """GPU workers (ranks) of the run, over all nodes; each takes data.batch_size / gpus sequences of every
    step, so data.batch_size must be divisible by it. auto: every GPU the Ray cluster offers on the nodes
    used (one rank per node on a CPU-only cluster). More than 1 needs runtime.mode=ray."""
    nodes: int = 1
    """Ray nodes the ranks are spread over, gpus / nodes on each. Every node keeps its own host store and
    optimizer workers (weights are stored once per node, never per GPU); each node's first rank orders the
    updates of its copy and the copies are compared by a checksum every step. Checkpoints are written by
    the first node and read by all: on several machines checkpoint.dir must be on a shared filesystem."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend of the gradient sums: auto = nccl on GPUs, gloo on the CPU."""
    gather_weights: bool = False
    """Several GPUs on a node: each copies only its 1/gpus-per-node piece of a stage's weights from host memory
    and the GPUs of the node exchange the pieces (an all-gather over NVLink), instead of each copying the
    whole stage. Host DRAM then serves every weight byte once per pass whatever the number of GPUs (the
    CPU optimizer shares that bandwidth), and each GPU's PCIe link carries 1/gpus of the weights. Training
    steps only: evaluation runs on the first GPU and copies whole stages. On two H200s (3.5B, 32k tokens per
    GPU): it helped while the GPU workers' threads ran on AdamW's cores (clipping on, 1.89x one GPU against
    1.83x, data-parallel-x2-h200-20261123-221348); with each GPU worker on cores of its own it gains nothing
    (1.98x and 1.99x against 2.00x and 1.99x, data-parallel-x2-h200-20261123-232913 and -233902). Off by
    default; measure it on more GPUs per node."""
    timeout_s: float = 600.0
    """Seconds a rank waits for the process group to form, for a collective, or for another rank's
    gradients or its node's update of a stage, before it stops the run with an error."""

    def __post_init__(self) -> None:
        s = self.SECTION
        if self.gpus != "auto" and self.gpus < 1:
            _fail(f"{s}.gpus", self.gpus, "must be >= 1, or auto for every GPU Ray offers")
        if self.nodes < 1:
            _fail(f"{s}.nodes", self.nodes, "must be >= 1")
        if self.gpus != "auto" and self.gpus % self.nodes:
            _fail(f"{s}.gpus", self.gpus, f"must be a multiple of parallel.nodes={self.nodes} (the same number "
                  "of GPUs on every node)")
        if not self.timeout_s > 0:
            _fail(f"{s}.timeout_s", self.timeout_s, "must be > 0")
