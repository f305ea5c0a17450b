"""What every actor answers besides its own work: its pid and a cheap heartbeat."""

from __future__ import annotations

import os
import sys

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
