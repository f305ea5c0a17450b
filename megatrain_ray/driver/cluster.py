"""The actors of one incarnation of a run, on every node, from spawning to teardown.

    per node (parallel.nodes, 1 by default):
    shards     = HostShard x host.num_shards        (own the segments, initialise weights)
    optimizers = OptimizerWorker x optimizer.workers (map the segments, AdamW on their share)
    gpus       = GPUWorker x parallel.gpus / nodes   (map the segments, run the layer stream; the
                                                      first orders the node's updates itself)
    rollout    = RolloutWorker, node 0 only, with rl.rollout: separate (GRPO's generation on a GPU of its own)

A restart after an actor died tears the whole cluster down and spawns a new one under a new run id.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.base import DeferredList
from actors.gpu_worker import GPUWorker
from actors.host_shard import HostShard
from actors.optimizer_worker import OptimizerWorker
from actors.rollout_worker import RolloutWorker
from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.driver.faults import HealthMonitor, monitor_actors
from megatrain_ray.driver.parallel import ParallelPlan
from megatrain_ray.driver.placement import ROLLOUT_ACTOR, RunPlacement, gpu_actor
from megatrain_ray.driver.runtime import Handle, gather, spawn
from megatrain_ray.model.layout import ModelLayout
from megatrain_ray.observe.log import get_logger
from megatrain_ray.observe.metrics import rss_anon_bytes, shm_bytes
from megatrain_ray.store.checkpoint import CheckpointInfo
from megatrain_ray.store.segments import SegmentSpec, segment_prefix, unlink_segment

log = get_logger(__name__)


def new_run_id() -> str:
    """host-pid-random: segment names start with megatrain-<run id> (host: a later run sweeps only its own
    host's dead runs, store/liveness.py; random: unique across PID namespaces)."""
    return f"{socket.gethostname().replace('-', '_')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(slots=True)
class NodeActors:
    """One node's actors and host store: its shards' segments, its optimizer workers, its GPU workers
    (local rank order), and its placement."""

    shards: list[Handle] = field(default_factory=list)
    optimizers: list[Handle] = field(default_factory=list)
    gpus: list[Handle] = field(default_factory=list)
    rollout: Handle | None = None
    """GRPO's separate rollout worker (rl.rollout: separate; node 0 only)."""
    specs: list[SegmentSpec] = field(default_factory=list)
    placement: RunPlacement | None = None
    prefix: str = ""
    """Prefix of the short names of its actors: "" on node 0 (host0, optim0, gpu), "node<k>-" elsewhere."""

    def handles(self) -> dict[str, Handle]:
        out: dict[str, Handle] = {f"{self.prefix}host{k}": h for k, h in enumerate(self.shards)}
        out.update({f"{self.prefix}optim{w}": h for w, h in enumerate(self.optimizers)})
        out.update({f"{self.prefix}{gpu_actor(r)}": h for r, h in enumerate(self.gpus)})
        if self.rollout is not None:
            out[f"{self.prefix}{ROLLOUT_ACTOR}"] = self.rollout
        return out

    @property
    def device_workers(self) -> list[Handle]:
        """The GPU workers and, where there is one, the rollout worker."""
        return [*self.gpus, *([self.rollout] if self.rollout is not None else [])]


class Cluster:
    """Every node's actors under one run id; node 0's shards write the checkpoints and its segments
    serve the inspection methods, its first GPU worker (rank 0) runs evaluation and logits."""

    def __init__(self, cfg: Config, layout: ModelLayout, run_id: str):
        self.cfg, self.layout, self.run_id = cfg, layout, run_id
        self.nodes: list[NodeActors] = []
        self.parallel = ParallelPlan()
        self.run: RunSpec | None = None
        self.actor_names: list[str] = []
        self.actor_pids: list[int] = []
        self.device_name = ""
        self.health: HealthMonitor | None = None
        """The one liveness source: heartbeats in the background (Ray mode) and checks on demand."""

    @property
    def gpu(self) -> Handle | None:
        return self.nodes[0].gpus[0] if self.nodes and self.nodes[0].gpus else None

    @property
    def gpus(self) -> list[Handle]:
        """Every rank, in rank order."""
        return [g for node in self.nodes for g in node.gpus]

    @property
    def rollout(self) -> Handle | None:
        """GRPO's separate rollout worker (rl.rollout: separate), else None."""
        return self.nodes[0].rollout if self.nodes else None

    def actor_handles(self) -> dict[str, Handle]:
        """Every actor by its short name: host<k>, optim<w>, gpu, gpu<r> (node 0), node<k>-... (others)."""
        return {name: h for node in self.nodes for name, h in node.handles().items()}

    def shard_names(self) -> list[str]:
        """The short names of every node's HostShards."""
        return [f"{node.prefix}host{k}" for node in self.nodes for k in range(len(node.shards))]

    def spawn(self, plan: ParallelPlan, run: RunSpec, stage_groups: list[list[int]], restore: CheckpointInfo | None,
              on_heartbeat_age: Callable[[str, float], None] | None) -> None:
        """Every node's actors (each given the run's RunSpec), the process group joined, and the health monitor
        that knows them all."""
        cfg, mode = self.cfg, self.cfg.runtime.mode
        self.parallel, self.run = plan, run
        t0 = time.perf_counter()
        tag = f"megatrain-{self.run_id}"
        for k in range(plan.nodes):  # what was spawned before an error is in self.nodes, for teardown()
            self.nodes.append(NodeActors(prefix="" if k == 0 else f"node{k}-"))
            self._spawn_node(k, tag, stage_groups, restore)
        if plan.world > 1:
            self._join_process_group()
        specs = self.nodes[0].specs
        log.info("host store ready: %.2f GiB in %d segments per node, %s (%.1f s)",
                 sum(s.nbytes for s in specs) / 2**30, len(specs), plan.describe(), time.perf_counter() - t0)
        assert self.gpu is not None
        self.device_name = self.gpu.device_name().result()
        handles = self.actor_handles()
        self.actor_names = list(handles)
        self.actor_pids = [h.pid().result() for h in handles.values()]
        self.health = monitor_actors(cfg.runtime.heartbeat_interval_s if mode == "ray" else 0,
                                     cfg.runtime.heartbeat_timeout_s, handles, on_heartbeat_age)

    def _spawn_node(self, k: int, tag: str, stage_groups: list[list[int]], restore: CheckpointInfo | None) -> None:
        """Node k's host store, optimizer workers and GPU workers (each node its own copy of the state)."""
        cfg, mode, plan, node = self.cfg, self.cfg.runtime.mode, self.parallel, self.nodes[k]
        run_id = self.run_id if k == 0 else f"{self.run_id}-node{k}"  # segment names differ per node
        ranks = plan.ranks_per_node
        node.placement = placement = RunPlacement(cfg, use_gpu=plan.use_gpu, ranks=ranks, node_id=plan.node_ids[k],
                                                  node_resources=plan.node_resources[k],
                                                  frozen_base=self.run.frozen_base, rollout=self._rollout_on(k))
        name = f"{tag}-{node.prefix}"
        node.shards = [spawn(mode, HostShard, cfg, self.run, self.layout, run_id, s, stages,
                             *placement.shard_binding(s), restore=restore, name=f"{name}host{s}",
                             ray_options=placement.options(f"host{s}"))
                       for s, stages in enumerate(stage_groups)]
        segments = [shard.segments() for shard in node.shards]
        if mode == "ray":  # the others' processes start beside the shards'; they wait for the specs in there
            specs: list[SegmentSpec] | DeferredList = DeferredList(segments)
        else:
            specs = node.specs = [spec for f in segments for spec in f.result()]
        workers = 0 if self.run.frozen_base else placement.num_workers  # LoRA: no CPU optimizer work
        node.optimizers = [spawn(mode, OptimizerWorker, cfg, self.run, self.layout, specs, w, workers,
                                 placement.worker_cores(w), name=f"{name}optim{w}",
                                 ray_options=placement.options(f"optim{w}")) for w in range(workers)]
        node.gpus = [spawn(mode, GPUWorker, cfg, self.run, self.layout, specs,
                           node.optimizers if r == 0 else [],
                           plan.rank(k, r), placement.gpu_cores(r), restore=restore, name=f"{name}{gpu_actor(r)}",
                           num_gpus=1 if plan.use_gpu else 0, ray_options=placement.options(gpu_actor(r)))
                     for r in range(ranks)]
        if self._rollout_on(k):
            node.rollout = spawn(mode, RolloutWorker, cfg, self.run, self.layout, specs, placement.rollout_cores(),
                                 restore=restore, name=f"{name}{ROLLOUT_ACTOR}", num_gpus=1 if plan.use_gpu else 0,
                                 ray_options=placement.options(ROLLOUT_ACTOR))
        if mode == "ray":
            try:
                node.specs = [spec for f in segments for spec in f.result()]
            except BaseException:  # a shard's own error (a bad weight, no room), raised here as before; the others
                for handle in [*node.device_workers, *node.optimizers]:
                    handle.kill()  # they wait for specs that never come (DeferredList)
                node.gpus, node.optimizers, node.rollout = [], [], None
                raise

    def _rollout_on(self, node: int) -> bool:
        """Node `node` runs GRPO's separate rollout worker (node 0, with rl.rollout: separate)."""
        return node == 0 and self.cfg.rl.separate  # GRPO only (config/sections.check_rl)

    def _join_process_group(self) -> None:
        """Every rank joins one torch.distributed group: through a file in shared memory when all ranks are
        on this host (no socket), else through rank 0's address on its node."""
        plan = self.parallel
        assert self.gpu is not None
        if plan.same_host:
            init_method = f"file://{self._store_file()}"
        else:
            init_method = self.gpu.rendezvous().result()
        gather([g.join(init_method, plan.backend, self.cfg.parallel.timeout_s, plan.same_host) for g in self.gpus])

    def _store_file(self) -> str:
        return os.path.join(self.cfg.host.shm_dir, f"{segment_prefix(self.run_id)}pgstore")

    def segment_dirs(self) -> list[str]:
        """The directories that hold this run's files on this node: shared memory, and the disk tier's."""
        host = self.cfg.host
        return [host.shm_dir, *([host.disk_dir] if host.moments_tier == "disk" else [])]

    def flush(self) -> None:
        """Every ordered update applied: the segments hold the state after the steps run so far."""
        gather([g.flush() for g in self.gpus])

    def sync_moments(self) -> None:
        """With the disk tier: wait until the moments the optimizers wrote back behind are in their files."""
        if self.cfg.host.moments_tier == "disk":
            optimizers = self.nodes[0].optimizers if self.nodes else []
            for done in [worker.sync() for worker in optimizers]:
                done.result()

    def pid_of(self, name: str) -> int:
        """The process of the actor with this short name (host0, optim1, gpu, ...)."""
        return self.actor_pids[self.actor_names.index(name)]

    def host_memory_bytes(self) -> int:
        """Shared segments actually allocated, plus the private memory of the driver and of every actor on
        this node (a process on another node reads as 0); the segments of every node whose files are on
        this host (all of them when the nodes share a machine, as in tests)."""
        private = {os.getpid(), *self.actor_pids}
        return shm_bytes([s.path for node in self.nodes for s in node.specs if not s.on_disk]) + \
            sum(rss_anon_bytes(pid) for pid in private)

    def teardown(self, after_failure: bool = False) -> None:
        """Stop the actors and remove the segments, tolerating actors that already died. `after_failure`:
        an actor died, so a rank may be blocked in a collective with it and never answer; it is killed
        after a short wait instead of the collective's timeout."""
        if self.health is not None:
            self.health.stop()
            self.health = None
        # All ranks at once: the leaders' last updates release the others' waits.
        patience = self.cfg.parallel.timeout_s
        if after_failure and self.parallel.world > 1:
            patience = min(patience, 30.0)
        deadline = time.monotonic() + patience
        for name, future in [(n, g.shutdown()) for n, g in self._rank_names()]:
            try:
                future.result(timeout=max(0.1, deadline - time.monotonic()))
            except Exception as exc:  # a dead optimizer makes the last flush fail; keep closing
                log.warning("%s shutdown: %s", name, exc)
        for node in self.nodes:
            for handle in node.optimizers:  # their disk-tier writes finish, their threads stop
                try:
                    handle.shutdown().result(timeout=max(0.1, deadline - time.monotonic()))
                except Exception as exc:
                    log.warning("optimizer shutdown: %s", exc)
            for handle in node.shards:
                try:
                    handle.shutdown().result()
                except Exception as exc:
                    log.warning("shard shutdown: %s", exc)
            if node.rollout is not None:
                try:
                    node.rollout.shutdown().result(timeout=max(0.1, deadline - time.monotonic()))
                except Exception as exc:
                    log.warning("rollout worker shutdown: %s", exc)
            for handle in [*node.device_workers, *node.optimizers, *node.shards]:
                handle.kill() if after_failure else handle.retire()
            for spec in node.specs:  # segments of a shard that died
                unlink_segment(spec)
            if node.placement is not None:
                node.placement.close()
        if os.path.exists(self._store_file()):
            os.unlink(self._store_file())
        self.nodes = []

    def _rank_names(self) -> list[tuple[str, Handle]]:
        return [(f"{node.prefix}{gpu_actor(r)}", g) for node in self.nodes for r, g in enumerate(node.gpus)]


class ClusterView:
    """A part of `Trainer` (driver/trainer.py): its actors as its cluster (`self.cluster`) holds them."""

    cluster: Cluster

    @property
    def nodes(self) -> list[NodeActors]:
        """Every node's actors; node 0's shards write the checkpoints and serve the inspection methods."""
        return self.cluster.nodes

    @property
    def shards(self) -> list[Handle]:
        """Node 0's HostShards: they write the checkpoints."""
        return self.nodes[0].shards if self.nodes else []

    @property
    def optimizers(self) -> list[Handle]:
        return self.nodes[0].optimizers if self.nodes else []

    @property
    def specs(self) -> list[SegmentSpec]:
        """Node 0's segments: what the inspection methods (master_weights, export) read."""
        return self.nodes[0].specs if self.nodes else []

    @property
    def placement(self) -> RunPlacement | None:
        return self.nodes[0].placement if self.nodes else None

    @property
    def gpus(self) -> list[Handle]:
        """Every rank, in rank order."""
        return self.cluster.gpus

    @property
    def gpu(self) -> Handle | None:
        """Rank 0: evaluation and logits run there, on node 0's copy."""
        return self.cluster.gpu

    @property
    def actor_names(self) -> list[str]:
        return self.cluster.actor_names

    @property
    def actor_pids(self) -> list[int]:
        return self.cluster.actor_pids

    @property
    def device_name(self) -> str:
        return self.cluster.device_name

    def actor_handles(self) -> dict[str, Handle]:
        """Every actor by its short name: host<k>, optim<w>, gpu, gpu<r> (node 0), node<k>-... (others)."""
        return self.cluster.actor_handles()

    def host_memory_bytes(self) -> int:
        return self.cluster.host_memory_bytes()
