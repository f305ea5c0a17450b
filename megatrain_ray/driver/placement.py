"""The core map of `topology.plan_placement` as Ray resources and one placement group.

A private Ray declares one custom resource per NUMA node (`numa_node_<i>`: its cores). A run
reserves one bundle per actor in a STRICT_PACK placement group (the actors share /dev/shm
segments, so they must share a node):

    bundles 0..G-1    GPU workers    {GPU: 1, CPU: share}            (no GPU on a CPU run)
    bundles G..       host shards    {CPU: share, numa_node_<n>: share}
    bundles ..        optim workers  {CPU: share, numa_node_<n>: share}

G is parallel.gpus / parallel.nodes (one GPU worker per GPU, all sharing the node's host store).
With several nodes each node gets a placement group of its own, pinned to its Ray node by the
`ray.io/node-id` label of every bundle.

Ray's CPU count is bookkeeping, not pinning (each actor pins itself to the plan's cores), so the
shares only have to add up to the cores the plan uses: every core's one CPU is split evenly
among the actors the plan lets run on it. A cluster that lacks the `numa_node_*` resources
(started without `--resources`) gets the same bundles without them, and the log says so.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from megatrain_ray.config.sections import Config
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.observe.log import get_logger
from megatrain_ray.system.topology import (
    Placement,
    Topology,
    detect_topology,
    node_cpus,
    plan_placement,
    shard_start_up_cores,
)

log = get_logger(__name__)

READY_TIMEOUT_S = 120.0

LORA_UPDATES = ("finetune.method=lora: the GPU worker updates the adapters itself, AdamW on its own device; the "
                "frozen base has no optimizer state")
"""What a LoRA run's placement says in place of its optimizer workers (it spawns none: driver/cluster.py)."""
FORWARD_ONLY = "forward only: megatrain generate/chat hold the weights once and update nothing"
"""What a generation session's placement says in place of them (driver/session.forward_only: none spawned)."""


def numa_resource(node: int) -> str:
    return f"numa_node_{node}"


def numa_resources(topology: Topology) -> dict[str, float]:
    """Custom resources a Ray node declares for its NUMA nodes (`ray start --resources=...`)."""
    return {numa_resource(n.index): float(len(n.cpus)) for n in topology.nodes}


@dataclass(frozen=True, slots=True)
class ActorSlot:
    """Where one actor runs: its cores and node (from the plan) and its Ray bundle."""

    name: str
    cores: tuple[int, ...]
    node: int
    bundle: dict[str, float]


def gpu_actor(local_rank: int) -> str:
    """Short name of a node's GPU worker of local rank `local_rank`: gpu, gpu1, gpu2, ..."""
    return "gpu" if local_rank == 0 else f"gpu{local_rank}"


ROLLOUT_ACTOR = "rollout"
"""Short name of GRPO's separate rollout worker (rl.rollout: separate): a GPU of its own, cores like a GPU worker's."""


def actor_slots(placement: Placement, use_gpu: bool, ranks: int = 1, rollout: bool = False) -> list[ActorSlot]:
    """One slot per actor in bundle order: the GPU workers (and the rollout worker: `rollout`), the host shards, the
    optimizer workers."""
    gpu_node = placement.gpu_node
    members = [(gpu_actor(r), placement.gpu_cores[r], gpu_node) for r in range(ranks)]
    if rollout:  # plan_placement reserved cores for one GPU worker more
        members.append((ROLLOUT_ACTOR, placement.gpu_cores[ranks], gpu_node))
    members += [(f"host{k}", placement.reserved_cores if node == gpu_node else node_cpus(placement, node), node)
                for k, node in enumerate(placement.shard_nodes)]
    members += [(f"optim{w.index}", w.cores, w.node) for w in placement.workers]
    users = Counter(core for _, cores, _ in members for core in cores)
    slots = []
    for name, cores, node in members:
        # Round down to Ray's resource granularity so the shares never add up to more than the cores.
        share = math.floor(sum(1.0 / users[c] for c in cores) * 1e4) / 1e4
        bundle = {"CPU": share, numa_resource(node): share}
        if (name.startswith("gpu") or name == ROLLOUT_ACTOR) and use_gpu:
            bundle["GPU"] = 1.0
        slots.append(ActorSlot(name, cores, node, bundle))
    return slots


class RayPlacement:
    """The placement group of a run and the `.options()` of each actor in it."""

    def __init__(self, placement: Placement, use_gpu: bool, ranks: int = 1, node_id: str | None = None,
                 node_resources: dict[str, float] | None = None, rollout: bool = False):
        """`node_id`: the Ray node every bundle must land on (several nodes), with its `node_resources`; `rollout`:
        a bundle for the separate rollout worker too."""
        import ray
        from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group

        self.slots = actor_slots(placement, use_gpu, ranks, rollout)
        cluster = node_resources if node_resources is not None else ray.cluster_resources()
        missing = sorted({k for s in self.slots for k in s.bundle if k.startswith("numa_node_")} - set(cluster))
        if missing:
            log.info("the Ray cluster declares no %s resources (start it with `ray start --head --resources="
                     "'$(megatrain resources)'` to add them): placing actors with plain CPU bundles, still pinned "
                     "to the planned cores", ", ".join(missing))
            self.slots = [ActorSlot(s.name, s.cores, s.node, {k: v for k, v in s.bundle.items()
                                                               if not k.startswith("numa_node_")})
                          for s in self.slots]
        self._fit_cpus(cluster.get("CPU", 0.0))
        self.bundles = [{k: v for k, v in s.bundle.items() if v > 0} or {"CPU": 0.0001} for s in self.slots]
        labels = [{NODE_ID_LABEL_KEY: node_id}] * len(self.bundles) if node_id else None
        self.group = placement_group(self.bundles, strategy="STRICT_PACK",
                                     name=f"megatrain-{node_id[:12]}" if node_id else "megatrain",
                                     bundle_label_selector=labels)
        ready, _ = ray.wait([self.group.ready()], timeout=READY_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(self.group)
            raise ConfigError(
                f"Ray could not place the run's actors on {f'node {node_id}' if node_id else 'one node'} within "
                f"{READY_TIMEOUT_S:.0f} s: bundles "
                f"{self.bundles}, cluster resources {cluster}. Lower optimizer.workers or host.num_shards, or "
                "give the cluster more CPUs (ray start --num-cpus)")
        self.index = {s.name: i for i, s in enumerate(self.slots)}

    def _fit_cpus(self, cluster_cpus: float) -> None:
        """A cluster declaring fewer CPUs than the plan uses (ray start --num-cpus=N) scales the
        bookkeeping down rather than waiting forever; the pinning stays as planned."""
        total = sum(s.bundle["CPU"] for s in self.slots)
        if total <= cluster_cpus or total == 0:
            return
        scale = cluster_cpus / total
        log.info("the Ray cluster declares %.0f CPUs, the plan uses %.0f: scaling the CPU bookkeeping by %.2f",
                 cluster_cpus, total, scale)
        self.slots = [ActorSlot(s.name, s.cores, s.node, {k: (math.floor(v * scale * 1e4) / 1e4 if k != "GPU" else v)
                                                          for k, v in s.bundle.items()}) for s in self.slots]

    def options(self, name: str) -> dict[str, Any]:
        """`.options()` for the actor `name` (gpu, gpu<r>, host<k>, optim<w>): exactly its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        i = self.index[name]
        bundle = self.bundles[i]
        return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0),
                "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i)}

    def remove(self) -> None:
        import ray

        ray.util.remove_placement_group(self.group)


class RunPlacement:
    """A run's core map and, in Ray mode, its placement group: what the trainer asks per actor.

    In-process (runtime.mode=local) the plan is only logged: pinning or binding memory there
    would pin the driver itself.
    """

    def __init__(self, cfg: Config, use_gpu: bool, topology: Topology | None = None, ranks: int = 1,
                 node_id: str | None = None, node_resources: dict[str, float] | None = None,
                 frozen_base: bool = False, rollout: bool = False):
        """`ranks`: GPU workers on the node; `node_id`: the Ray node of this placement (several nodes; its
        cores are taken to look like the driver's, as a cluster's nodes usually do); `frozen_base`: the run
        updates no host weights (RunSpec.frozen_base: a LoRA base, or a generation session), so no workers;
        `rollout`: GRPO's separate rollout worker runs on the node too, with cores and a GPU as a GPU worker's."""
        self.plan = plan_placement(topology or detect_topology(), cfg.optimizer.workers, cfg.host.num_shards,
                                   gpu_ranks=ranks + rollout)
        self.rollout = rollout
        if cfg.finetune.method == "lora" or frozen_base:  # no optimizer workers, no bundles or cores for them
            self.plan = replace(self.plan, workers=(), shared_cores=False,
                                workers_reason=LORA_UPDATES if cfg.finetune.method == "lora" else FORWARD_ONLY)
        log.info("%s%s", f"node {node_id[:12]}: " if node_id else "", self.plan.summary())
        if self.plan.shared_cores:
            log.warning("optimizer.workers=%s exceeds the usable cores: workers share cores (slower); lower it or "
                        "use auto", cfg.optimizer.workers)
        self.in_ray = cfg.runtime.mode == "ray"
        self.ray = RayPlacement(self.plan, use_gpu, ranks, node_id, node_resources, rollout) if self.in_ray else None

    @property
    def num_workers(self) -> int:
        return len(self.plan.workers)

    def options(self, name: str) -> dict[str, Any] | None:
        """Ray `.options()` of actor `name` (gpu, gpu<r>, host<k>, optim<w>); None in-process."""
        return self.ray.options(name) if self.ray else None

    def worker_cores(self, index: int) -> list[int]:
        return list(self.plan.workers[index].cores) if self.in_ray else []

    def gpu_cores(self, local_rank: int) -> list[int]:
        """Cores the GPU worker of `local_rank` pins itself to; none in-process."""
        return list(self.plan.gpu_cores[local_rank]) if self.in_ray else []

    def rollout_cores(self) -> list[int]:
        """Cores the separate rollout worker pins itself to (after the GPU workers'); none in-process."""
        return list(self.plan.gpu_cores[-1]) if self.in_ray and self.rollout else []

    def shard_binding(self, index: int) -> tuple[tuple[int, ...], int | None, tuple[int, ...]]:
        """(cores, NUMA node, start-up cores: topology.shard_start_up_cores) of HostShard `index`; nothing
        in-process."""
        if not self.in_ray:
            return (), None, ()
        slot = self.ray.slots[self.ray.index[f"host{index}"]]
        return slot.cores, slot.node, shard_start_up_cores(self.plan, index)

    def close(self) -> None:
        if self.ray:
            self.ray.remove()
            self.ray = None
