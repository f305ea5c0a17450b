"""Actor health from the driver: a background thread sends each actor a cheap heartbeat().

An actor that has not answered for `runtime.heartbeat_timeout_s` is logged as slow, by name (a
busy actor still answers: heartbeat runs in its own concurrency group, see runtime.py); one
whose process is gone is logged as dead, with Ray's reason, and listed by `dead_actors()` for
the trainer's fault handling. The age of each actor's last answer goes to `on_age` (the
`megatrain_actor_heartbeat_age_seconds` metric).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from megatrain_ray.exceptions import ActorFailedError
from megatrain_ray.observe.log import get_logger

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

    def _mark_dead(self, name: str, exc: ActorFailedError) -> None:
        reason = str(exc).splitlines()[0]
        with self._lock:
            self._dead[name] = reason
        log.error("actor %s is dead: %s", name, reason)


def monitor_actors(interval_s: float, timeout_s: float, handles: dict[str, Any],
                   on_age: Callable[[str, float], None] | None) -> HealthMonitor | None:
    """A started monitor of `handles`, or None when runtime.heartbeat_interval_s is 0."""
    if interval_s <= 0:
        return None
    return HealthMonitor(handles, interval_s, timeout_s, on_age).start()
