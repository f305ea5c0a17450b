"""What every actor answers besides its own work: its pid and a cheap heartbeat; and DeferredList, an actor's
constructor argument that other actors are still making."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from megatrain_ray.messages import ActorStatus


class ActorBase:
    _resources: dict[str, float] | None = None

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this actor runs on ("" in-process)."""
        ray = sys.modules.get("ray")
        in_worker = ray is not None and ray.is_initialized() and ray.get_runtime_context().worker.mode == 1
        return ray.get_runtime_context().get_node_id() if in_worker else ""

    def heartbeat(self) -> ActorStatus:
        """Cheap on purpose: the health monitor calls it every few seconds (megatrain_ray/driver/faults.py)."""
        if self._resources is None:  # fixed for the actor's life: read once
            ray = sys.modules.get("ray")
            in_worker = ray is not None and ray.is_initialized() and ray.get_runtime_context().worker.mode == 1
            self._resources = dict(ray.get_runtime_context().get_assigned_resources()) if in_worker else {}
        return ActorStatus(os.getpid(), tuple(sorted(os.sched_getaffinity(0))), self._resources)


def _concatenated_results(refs: tuple[Any, ...]) -> list[Any]:
    """A DeferredList unpickled in the actor's process: the lists its refs name, once they are made, concatenated.
    Where one of them failed (a HostShard that could not make its segments), the driver raises that error itself
    and kills this actor (driver/cluster.py): it waits for that rather than report the same error a second time."""
    import ray

    try:
        return [item for part in ray.get(list(refs)) for item in part]
    except ray.exceptions.RayError:
        threading.Event().wait()
        raise


class DeferredList:
    """A list argument of a Ray actor's constructor whose parts other actors' calls are still computing (their
    futures' object refs): the actor's constructor gets the concatenated list. Ray resolves an ObjectRef given as
    an argument before it starts the actor's process; refs inside this object it leaves, so the process starts and
    imports its modules (torch, the engine: 2 to 3 s each on a 2-core machine) while the parts are made, and the
    wait happens as its arguments are unpickled. The GPU and optimizer workers take the HostShards' segment specs
    so, the shards' start overlapping theirs."""

    def __init__(self, futures: Sequence[Any]):
        self.refs = tuple(f.ref for f in futures)

    def __reduce__(self) -> tuple[Any, ...]:
        return _concatenated_results, (self.refs,)
