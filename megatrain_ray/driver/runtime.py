"""Two launch modes, one set of classes: Ray actors, or the same classes in this process.

`spawn` returns a handle whose methods are the actor's: `handle.flush()` gives a future with
`.result()`. In Ray mode the future wraps an ObjectRef; in local mode each actor is an object with
one thread of its own, so calls to one actor run in order, as Ray runs them, and calls to different
actors run concurrently, as they do in Ray.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from megatrain_ray import exceptions
from megatrain_ray.config.runtime_sections import RuntimeConfig
from megatrain_ray.driver import warm_actors
from megatrain_ray.driver.placement import numa_resources
from megatrain_ray.driver.ray_setup import (
    agent_ports,
    auth_wanted,
    ensure_private_token,
    private_temp_dir,
    ray_init_ports,
    set_token_auth_mode,
)
from megatrain_ray.exceptions import ActorFailedError, MegatrainError
from megatrain_ray.observe.log import get_logger
from megatrain_ray.system.topology import detect_topology

log = get_logger(__name__)

# Set before Ray is imported for a private single-box Ray: every Ray socket (GCS, raylets,
# dashboard, metrics) then binds 127.0.0.1 instead of the host's routable address. An internal
# Ray switch, guarded by tests/integration/test_runtime.py, which lists the listening sockets.
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Concurrency group of every actor's heartbeat(), apart from its default group (one thread, so
# the calls that touch its state run in order): a health check answers during a long step.
HEALTH_GROUP = "health"
REPO_ROOT = str(Path(__file__).resolve().parent.parent)


class ActorHandle(ABC):
    """A spawned actor: `handle.train_step(...)` sends it that call and returns a future with `.result()`.
    A name the actor's class does not define fails here, at once, rather than inside the actor."""

    def __init__(self, actor_class: type, name: str):
        self.actor_class, self.name = actor_class, name

    def __getattr__(self, method: str) -> Callable[..., Any]:
        # Read through __dict__: unpickling looks names up before the attributes are restored.
        actor_class = self.__dict__.get("actor_class")
        if actor_class is None or method.startswith("_") or not callable(getattr(actor_class, method, None)):
            raise AttributeError(f"{getattr(actor_class, '__name__', 'actor')} ({self.__dict__.get('name')}) "
                                 f"has no method {method!r}")
        return functools.partial(self._send, method)

    def retire(self) -> None:
        """End of a run that went well: as kill() (a kept Ray process is put back instead: KeptRayHandle)."""
        self.kill()

    @abstractmethod
    def _send(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Start `method` on the actor; a future of its result."""


class LocalHandle(ActorHandle):
    def __init__(self, instance: Any, name: str):
        super().__init__(type(instance), name)
        self.instance = instance
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=name)

    def _send(self, method: str, *args: Any, **kwargs: Any) -> Future:
        return self._thread.submit(getattr(self.instance, method), *args, **kwargs)

    def heartbeat(self) -> Future:
        """Answered at once, beside whatever the actor's thread is doing (as Ray's health group)."""
        future: Future = Future()
        future.set_result(self.instance.heartbeat())
        return future

    def kill(self) -> None:
        self._thread.shutdown(wait=True)


class RayFuture:
    def __init__(self, ref: Any, actor: str, method: str):
        self.ref, self.actor, self.method = ref, actor, method

    def done(self) -> bool:
        import ray

        return bool(ray.wait([self.ref], timeout=0)[0])

    def result(self, timeout: float | None = None) -> Any:
        import ray

        try:
            return ray.get(self.ref, timeout=timeout)
        except ray.exceptions.RayActorError as exc:
            own = _own_error_of_failed_init(exc)
            if own is not None:
                raise own from None  # the constructor's own error (a bad weight, no shared memory), unwrapped
            raise ActorFailedError(f"actor {self.actor} died during {self.method}: {exc}",
                                   {self.actor: exc}) from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
                raise cause from None  # the actor's own error, e.g. a ConfigError, unwrapped
            raise ActorFailedError(f"actor {self.actor} failed in {self.method}: {exc}", {self.actor: exc}) from exc


_OWN_ERROR = re.compile(r"^megatrain_ray\.exceptions\.(\w+): ", re.MULTILINE)


def _own_error_of_failed_init(exc: Exception) -> MegatrainError | None:
    """An actor whose constructor raised one of our errors dies with that error only as text (Ray keeps no
    cause for a failed creation task): the error, rebuilt from its class name and message."""
    if not getattr(exc, "actor_init_failed", False):
        return None
    text = str(getattr(exc, "error_msg", "") or "")
    found = list(_OWN_ERROR.finditer(text))
    cls = getattr(exceptions, found[-1].group(1), None) if found else None
    if not (isinstance(cls, type) and issubclass(cls, MegatrainError)) or cls is ActorFailedError:
        return None
    return cls(text[found[-1].end():].strip())


class RayHandle(ActorHandle):
    def __init__(self, actor: Any, name: str, actor_class: type):
        super().__init__(actor_class, name)
        self.actor = actor

    def _send(self, method: str, *args: Any, **kwargs: Any) -> RayFuture:
        return RayFuture(getattr(self.actor, method).remote(*args, **kwargs), self.name, method)

    def heartbeat(self) -> RayFuture:
        """Runs in the actor's `health` concurrency group: it answers while a long call is busy."""
        ref = self.actor.heartbeat.options(concurrency_group=HEALTH_GROUP).remote()
        return RayFuture(ref, self.name, "heartbeat")

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


class KeptRayHandle(RayHandle):
    """An actor object inside a kept process (driver/warm_actors.py): calls go through its `call`; retire()
    gives the process back for the next run instead of ending it."""

    def _send(self, method: str, *args: Any, **kwargs: Any) -> RayFuture:
        return RayFuture(self.actor.call.remote(method, *args, **kwargs), self.name, method)

    def retire(self) -> None:
        warm_actors.give_back(self.actor, self.name)


Handle = LocalHandle | RayHandle


def gather(futures: list[Future | RayFuture]) -> list[Any]:
    """The results of calls to several actors, raising the first failure as soon as it happens: the
    ranks of a data-parallel step wait for each other in collectives, so a rank whose peer died would
    otherwise hold the driver until the collective's timeout."""
    local = [f for f in futures if isinstance(f, Future)]
    remote = [f for f in futures if isinstance(f, RayFuture)]
    if local:
        from concurrent.futures import FIRST_EXCEPTION, wait

        wait(local, return_when=FIRST_EXCEPTION)
        for future in local:
            if future.done() and future.exception() is not None:
                future.result()
    if remote:
        import ray

        by_ref = {f.ref: f for f in remote}
        pending = list(by_ref)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                by_ref[ref].result()  # raises ActorFailedError, or the actor's own error
    return [f.result() for f in futures]


def _running_cluster_address(cfg: RuntimeConfig) -> str | None:
    """The cluster to attach to, or None when a private one should be started."""
    if cfg.address:
        return cfg.address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    # `ray start` writes the address of the newest local cluster here.
    current = Path("/tmp/ray/ray_current_cluster")
    if current.is_file() and current.read_text().strip():
        return "auto"
    return None


def _warn_if_open(gcs_address: str) -> None:
    """A cluster anyone may reach, or reach without a token, runs code for them as its owner: said once."""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    host = gcs_address.rsplit(":", 1)[0].strip("[]")
    problems = []
    if not (host.startswith("127.") or host in ("::1", "localhost")):
        problems.append(f"it listens on {host}, beyond loopback (fine for several nodes on a private network)")
    if get_authentication_mode() != AuthenticationMode.TOKEN:
        problems.append("it runs without token auth")
    if problems:
        log.warning("the Ray cluster at %s is open: %s. On one box, start it with `megatrain cluster start` "
                    "(127.0.0.1 only, token auth)", gcs_address, "; ".join(problems))


def start_ray(cfg: RuntimeConfig, num_gpus: int | None = None, resources: dict[str, float] | None = None) -> bool:
    """Attach to a running cluster, or start a private one on 127.0.0.1 with token auth.

    A private Ray declares `resources`, by default one `numa_node_<i>` resource per NUMA node
    of this machine (megatrain_ray/driver/placement.py). Returns True when this call started Ray (the
    caller then shuts it down).
    """
    address = _running_cluster_address(cfg)
    if "ray" not in sys.modules and address is None:
        os.environ.setdefault(_LOOPBACK_ENV, "0")
    import ray

    if ray.is_initialized():
        return False
    if address is not None:
        try:
            ray.init(address=address, log_to_driver=True)
            log.info("attached to Ray cluster at %s", address)
            _warn_if_open(ray.get_runtime_context().gcs_address)
            return False
        except ConnectionError:
            if cfg.address or os.environ.get("RAY_ADDRESS"):
                raise
            log.info("no Ray cluster answers at the address in /tmp/ray; starting a private one")
    os.environ[_LOOPBACK_ENV] = "0"
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # if Ray was imported before the switch was set
    # Private to this user (driver/ray_setup.py): the token 0600 before Ray reads it, a 0700 temporary tree,
    # free ports for everything, token auth unless explicitly declined.
    if auth_wanted(cfg.allow_unauthenticated):
        ensure_private_token()
        # Said explicitly, so that Ray does not warn "Token authentication is enabled for this Ray cluster. Set
        # RAY_AUTH_MODE=disabled to opt out" on every run (it warns when the mode is unset, and turns it on anyway).
        set_token_auth_mode()
    if resources is None:
        resources = numa_resources(detect_topology())
    pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    ports = agent_ports("dashboard_port")
    dashboard_port = ports.pop("dashboard_port")
    with ray_init_ports(ports):
        ray.init(
            address="local", include_dashboard=cfg.dashboard, dashboard_host="127.0.0.1", dashboard_port=dashboard_port,
            object_store_memory=cfg.object_store_mb * 2**20, num_gpus=num_gpus, log_to_driver=True,
            resources=resources, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
            _temp_dir=str(private_temp_dir()),
        )
    from ray._raylet import AuthenticationMode, get_authentication_mode

    auth = "token auth on" if get_authentication_mode() == AuthenticationMode.TOKEN else "token auth OFF"
    log.info("started a private Ray on 127.0.0.1 (%s), resources %s", auth, resources)
    return True


def ray_session_dir() -> str | None:
    """The session directory of the Ray this driver is attached to, as seen on this machine."""
    import ray

    node = ray._private.worker._global_node
    return node.get_session_dir_path() if node is not None else None


def private_ray_pids() -> list[int]:
    """The processes `ray.init` started for a private Ray (GCS, raylet, dashboard, monitors); the raylet's
    children (agents, workers) are found below them."""
    import ray

    node = ray._private.worker._global_node
    return [info.process.pid for infos in (node.all_processes if node else {}).values() for info in infos
            if info.process is not None]


def spawn(mode: str, cls: type, *args: Any, name: str, num_gpus: float = 0, ray_options: dict[str, Any] | None = None,
          **kwargs: Any) -> Handle:
    """Create an actor of `cls` in Ray or in this process.

    `ray_options` (from placement.RayPlacement.options) places it in its bundle; without them it
    asks for no CPU: Ray's CPU count is bookkeeping, not pinning, and workers pin their own cores.
    With warm_actors.keep_actor_processes(True), an actor that asks for no GPU runs in a kept process.
    """
    if mode == "local":
        return LocalHandle(cls(*args, **kwargs), name)
    import ray

    options = {"num_cpus": 0, "num_gpus": num_gpus, **(ray_options or {})}
    if not options.get("num_gpus") and warm_actors.usable():
        process = warm_actors.acquire(HEALTH_GROUP)
        process.construct.remote(cls, *args, **kwargs)
        return KeptRayHandle(process, name, cls)
    remote_cls = ray.remote(concurrency_groups={HEALTH_GROUP: 1})(cls)
    actor = remote_cls.options(name=name, max_restarts=0, namespace="megatrain", **options).remote(*args, **kwargs)
    return RayHandle(actor, name, cls)
