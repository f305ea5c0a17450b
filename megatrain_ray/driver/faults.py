"""Faults: actor health, the drills that cause faults on purpose, restarts after a death, non-finite steps.

Health is the one liveness source: a HealthMonitor sends each actor a cheap heartbeat(), from a
background thread every `runtime.heartbeat_interval_s` (Ray mode) and on demand (`check_now`, which the
trainer runs every step and after a failed collective). An actor that has not answered for
`runtime.heartbeat_timeout_s` is logged as slow, by name (a busy actor still answers: heartbeat runs in
its own concurrency group, see runtime.py); one whose process is gone is logged as dead, with Ray's
reason, and listed by `dead_actors()`. The age of each actor's last answer goes to `on_age` (the
`megatrain_actor_heartbeat_age_seconds` metric).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from megatrain_ray.config.loop_sections import parse_drill
from megatrain_ray.config.sections import Config
from megatrain_ray.exceptions import ActorFailedError, ConfigError, NonFiniteError
from megatrain_ray.observe.log import get_logger
from megatrain_ray.store.checkpoint import CheckpointDir, CheckpointInfo

log = get_logger(__name__)


class HealthMonitor:
    def __init__(self, handles: dict[str, Any], interval_s: float, timeout_s: float,
                 on_age: Callable[[str, float], None] | None = None):
        """`handles` maps short actor names (gpu, host0, optim1) to runtime handles."""
        self.handles = dict(handles)
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.on_age = on_age
        now = time.monotonic()
        self.last_answer = dict.fromkeys(self.handles, now)
        self._pending: dict[str, Any] = {}
        self._slow: set[str] = set()
        self._dead: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megatrain-health", daemon=True)

    def start(self) -> HealthMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 5)

    def dead_actors(self) -> dict[str, str]:
        """Actors found dead so far: name -> Ray's reason."""
        with self._lock:
            return dict(self._dead)

    def ages(self) -> dict[str, float]:
        """Seconds since each live actor last answered."""
        now = time.monotonic()
        with self._lock:
            return {name: now - t for name, t in self.last_answer.items() if name not in self._dead}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()

    def check(self) -> None:
        """One round: collect answers, send new heartbeats, report slow and dead actors."""
        now = time.monotonic()
        for name, handle in self.handles.items():
            if name in self._dead:
                continue
            future = self._pending.get(name)
            if future is not None and future.done():
                del self._pending[name]
                try:
                    future.result()
                except ActorFailedError as exc:
                    self._mark_dead(name, exc)
                    continue
                with self._lock:
                    self.last_answer[name] = now
                if name in self._slow:
                    self._slow.discard(name)
                    log.info("actor %s answers again", name)
            if name not in self._pending:
                self._pending[name] = handle.heartbeat()
            age = now - self.last_answer[name]
            if age > self.timeout_s and name not in self._slow:
                self._slow.add(name)
                log.warning("actor %s is slow: no heartbeat answer for %.0f s (runtime.heartbeat_timeout_s=%g)",
                            name, age, self.timeout_s)
            if self.on_age:
                self.on_age(name, age)

    def check_now(self, during: str, cause: BaseException | None = None, names: list[str] | None = None) -> None:
        """Heartbeat the actors (`names`, by default all) and wait for the answers; ActorFailedError naming
        those that no longer answer, so that the run restarts as after any death. `cause`: the error that
        prompted the check (a surviving rank's failed collective), kept as the reason."""
        sent = [(self.handles[name], self.handles[name].heartbeat()) for name in names or self.handles]
        dead: dict[str, BaseException] = {}
        for handle, future in sent:
            try:
                future.result(timeout=30)
            except ActorFailedError as exc:
                dead[handle.name] = exc
            except Exception:  # noqa: BLE001 (slow, not dead)
                continue
        if dead:
            reason = cause if cause is not None else next(iter(dead.values()))
            raise ActorFailedError(f"{', '.join(dead)} died during {during} ({reason})", dead) from reason

    def _mark_dead(self, name: str, exc: ActorFailedError) -> None:
        reason = str(exc).splitlines()[0]
        with self._lock:
            self._dead[name] = reason
        log.error("actor %s is dead: %s", name, reason)


def monitor_actors(interval_s: float, timeout_s: float, handles: dict[str, Any],
                   on_age: Callable[[str, float], None] | None) -> HealthMonitor:
    """A monitor of `handles`, its background heartbeats started unless runtime.heartbeat_interval_s is 0."""
    monitor = HealthMonitor(handles, interval_s, timeout_s, on_age)
    return monitor.start() if interval_s > 0 else monitor


class FaultDrills:
    """The faults fault.drill asks for (megatrain_ray/config/loop_sections.py parse_drill); each fires once
    per process, at its step."""

    def __init__(self, cfg: Config):
        self.drills = parse_drill(cfg.fault.drill)
        if cfg.runtime.mode == "local" and any(a == "kill" and t != "driver" for a, t, _ in self.drills):
            raise ConfigError("fault.drill: killing an actor needs runtime.mode=ray (in local mode every actor is "
                              "this process); use kill:driver")

    def due(self, action: str, step: int) -> str | None:
        """The target of a drill of `action` due now ("" when it has none), or None; it will not fire again."""
        for drill in self.drills:
            if drill[0] == action and drill[2] == step:
                self.drills.remove(drill)
                return drill[1]
        return None

    @staticmethod
    def kill(target: str, pid_of: Callable[[str], int]) -> None:
        """SIGKILL to the driver or to the actor with this short name."""
        pid = os.getpid() if target == "driver" else pid_of(target)
        log.warning("fault drill: SIGKILL to %s (pid %d)", target, pid)
        os.kill(pid, signal.SIGKILL)


class RestartableRun(Protocol):
    """What recovery needs of a run (the Trainer)."""

    run_id: str
    next_step: int
    checkpoints: CheckpointDir

    def finish_save_after_failure(self) -> None: ...

    def restart_from(self, last: CheckpointInfo | None) -> None: ...


class Recovery:
    """Restarts the actors from the last checkpoint when one dies, at most fault.max_restarts times;
    past that, one error naming the dead actor, the last good checkpoint and how to resume."""

    def __init__(self, max_restarts: int, resume_command: str):
        self.max_restarts, self.resume_command = max_restarts, resume_command
        self.restarts = 0
        self.events: list[dict[str, Any]] = []
        """One entry per automatic restart: who died, when it was noticed, how long the restart took."""

    def recover(self, exc: ActorFailedError, run: RestartableRun) -> None:
        dead = ", ".join(n.removeprefix(f"megatrain-{run.run_id}-") for n in exc.failures) or "an actor"
        run.finish_save_after_failure()  # its snapshot predates the failure: complete it if its writers live
        last = run.checkpoints.latest()
        where = f"{last.directory} (step {last.step})" if last else "none yet (a restart begins at step 0)"
        noticed = run.next_step
        if self.restarts >= self.max_restarts:
            raise ActorFailedError(f"{dead} died, noticed at step {noticed} ({str(exc).splitlines()[0]}). "
                                   f"Last good checkpoint: {where}. "
                                   f"Resume with: {self.resume_command}", exc.failures) \
                from exc
        self.restarts += 1
        log.error("%s died, noticed at step %d; restart %d of %d from checkpoint %s", dead, noticed, self.restarts,
                  self.max_restarts, where)
        t0 = time.perf_counter()
        run.restart_from(last)
        seconds = time.perf_counter() - t0
        self.events.append({"dead": dead, "noticed_at_step": noticed, "resumed_at_step": run.next_step,
                            "restart_seconds": seconds})
        log.info("restarted in %.1f s; continuing at step %d", seconds, run.next_step)


def stop_or_skip_nonfinite(cfg: Config, step: int, loss: float, grad_norm: float, checkpoints: CheckpointDir,
                           resume_command: str, save_before: Callable[[int], Path | None]) -> None:
    """A step whose loss or gradient norm is not finite: with clipping, dropped (fault.nonfinite=skip) or
    the state before it saved by `save_before(step)` and the run stopped; without clipping part of it was
    already applied, so the run stops pointing at the last good checkpoint."""
    what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
    if cfg.optimizer.grad_clip <= 0:
        last = checkpoints.latest()
        raise NonFiniteError(f"non-finite {what}. With optimizer.grad_clip=0 the updates stream layer by layer, "
                             "so part of this step was applied; the last good state is "
                             f"{last.directory if last else 'the initial one (no checkpoint yet)'}. Resume with "
                             f"`{resume_command}` after lowering the lr")
    if cfg.fault.nonfinite == "skip":
        log.warning("non-finite %s: step dropped, weights and moments unchanged", what)
        return
    saved = save_before(step)
    raise NonFiniteError(f"non-finite {what}; fault.nonfinite=stop. The state before this step is saved in "
                         f"{saved}; resume with `{resume_command}` after "
                         "lowering the lr or fixing the data")
