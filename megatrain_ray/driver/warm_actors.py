"""Warm actor processes: a finished run's CPU actor processes kept for the next run of the same driver.

Each actor process of a run (HostShard, OptimizerWorker, a GPUWorker computing on the CPU) spends about
2 s of CPU before its constructor runs: Ray's worker start and the imports of torch and the engine. A
driver that starts several runs one after another (a sweep or a notebook in one Python process, the test
suite) pays that for every actor of every run. With `keep_actor_processes(True)` each such actor runs inside
an `ActorProcess`, a Ray actor that hosts one of our actor objects at a time; when the run ends normally its
object is shut down and dropped, the process put back to its starting state (cores, memory policy, torch
threads, log name, process group) and handed to the next run's spawn.

What stays fresh: an actor that asks for a GPU (its bundle reserves the device), every actor of a cluster of
several nodes (the placement group puts each actor on its node), every actor after a failure (a rank may be
stuck in a collective: teardown kills), and a process that does not answer its release within RELEASE_TIMEOUT_S. Kept processes sit outside the run's placement group (Ray would kill
them with the group); the cores each actor pins itself to are still the plan's (placement.py). Off by
default: a run started by the CLI is the only run of its driver.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from typing import Any

from megatrain_ray.observe.log import get_logger

log = get_logger(__name__)

RELEASE_TIMEOUT_S = 10.0
MAX_KEPT = 16  # idle processes (each ~0.3 GiB with torch imported); the largest run of the suite has 12 actors
ALIVE_TIMEOUT_S = 5.0

_state: dict[str, Any] = {"on": False, "session": None, "idle": []}
_lock = threading.Lock()


def keep_actor_processes(on: bool = True, end_kept: bool = True) -> None:
    """Keep (True) or stop keeping (False) this driver's CPU actor processes between its runs; False also ends
    the processes kept so far unless `end_kept` is False (they then wait, idle, for keeping to resume)."""
    _state["on"] = bool(on)
    if not on and end_kept:
        drain()


def keeping() -> bool:
    return bool(_state["on"])


def drain() -> None:
    """End every kept process (they are idle). Handles of a Ray that has shut down are only forgotten: any call
    on them would start a new, default Ray (Ray's auto-init)."""
    with _lock:
        idle, _state["idle"] = _state["idle"], []
        session = _state["session"]
    if idle and _connected_to(session):
        import ray

        for actor in idle:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass


class ActorProcess:
    """The Ray actor that hosts one megatrain actor object (`construct`) at a time; `call` runs its methods
    in this actor's single default thread, in order, as a dedicated actor would."""

    def __init__(self) -> None:
        import torch

        self.instance: Any = None
        self.init_error: BaseException | None = None
        self._affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        self._torch_threads = torch.get_num_threads()

    def alive(self) -> int:
        return os.getpid()

    def construct(self, cls: type, *args: Any, **kwargs: Any) -> None:
        # The megatrain log handler names the process once (observe/log.init_logger): drop the last one's.
        root = logging.getLogger("megatrain_ray")
        for handler in list(root.handlers):
            root.removeHandler(handler)
        self.instance, self.init_error = None, None
        try:
            self.instance = cls(*args, **kwargs)
        except BaseException as exc:  # raised again by every later call, as a failed actor's would be
            self.init_error = exc
            raise

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.instance is None:
            raise self.init_error or RuntimeError(f"no actor in this process for {method}")
        return getattr(self.instance, method)(*args, **kwargs)

    def heartbeat(self) -> Any:
        instance = self.instance
        if self.init_error is not None:  # a dedicated actor whose constructor raised is dead: so is this one's heartbeat
            raise self.init_error
        if instance is None:  # between runs: the process answers for itself
            from actors.base import ActorBase  # lazy: actors/ sits above the driver; only a worker process needs it

            return ActorBase().heartbeat()
        return instance.heartbeat()

    def release(self) -> int:
        """Drop the hosted object and put the process back as it started; its pid."""
        import torch

        self.instance, self.init_error = None, None
        gc.collect()  # the segments' maps close with the objects holding them
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        from megatrain_ray.system.topology import bind_process, default_memory_policy  # lazy: a worker process only

        if self._affinity is not None:
            bind_process(self._affinity)
        default_memory_policy()
        torch.set_num_threads(self._torch_threads)
        return os.getpid()


def _session() -> str | None:
    """The session directory of the Ray this driver is attached to (None: not attached): a kept handle is good
    within it only."""
    import ray

    if not ray.is_initialized():
        return None
    node = ray._private.worker._global_node
    return node.get_session_dir_path() if node is not None else None


def _connected_to(session: str | None) -> bool:
    return session is not None and _session() == session


def usable() -> bool:
    """Keeping is on and the cluster is one node: a kept process sits outside the run's placement group, which on
    several nodes is what puts each actor on its node."""
    if not _state["on"]:
        return False
    import ray

    session = _session()
    if _state.get("single_node_session") != session:
        _state["single_node"] = sum(1 for node in ray.nodes() if node.get("Alive")) == 1
        _state["single_node_session"] = session
    return bool(_state["single_node"])


def acquire(health_group: str) -> Any:
    """A live idle ActorProcess of this Ray session, or a new one."""
    import ray

    session = _session()
    with _lock:
        if _state["session"] != session:  # Ray restarted: the kept handles name a cluster that is gone
            _state["session"], _state["idle"] = session, []
        idle = _state["idle"]
        while idle:
            actor = idle.pop()
            try:
                ray.get(actor.alive.remote(), timeout=ALIVE_TIMEOUT_S)
                return actor
            except Exception:  # killed while idle (a test's kill -9, Ray's OOM killer): start another
                continue
    remote_cls = ray.remote(concurrency_groups={health_group: 1})(ActorProcess)
    return remote_cls.options(num_cpus=0, num_gpus=0, max_restarts=0, namespace="megatrain").remote()


def give_back(actor: Any, name: str) -> None:
    """Release `actor`'s object and keep its process for the next run; kill it if it does not answer."""
    import ray

    if not _connected_to(_state["session"]):  # Ray shut down: the process went with it
        return
    try:
        ray.get(actor.release.remote(), timeout=RELEASE_TIMEOUT_S)
    except Exception as exc:
        log.info("%s: its process did not release (%s); ending it", name, type(exc).__name__)
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass
        return
    with _lock:
        if _state["on"] and _state["session"] == _session() and len(_state["idle"]) < MAX_KEPT:
            _state["idle"].append(actor)
            return
    ray.kill(actor, no_restart=True)
