"""Per-step figures: model FLOPs, memory readings, metrics.jsonl and the console progress line."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO


def optimizer_hidden_fraction(optimizer_seconds: float, step_seconds: float, compute_seconds: float) -> float:
    """Share of the optimizer's time hidden behind GPU work. The GPU's idle time in the step
    (step - compute) bounds the optimizer time that was exposed; the rest was hidden."""
    if not optimizer_seconds:
        return 1.0
    exposed = min(optimizer_seconds, max(0.0, step_seconds - compute_seconds))
    return 1.0 - exposed / optimizer_seconds


def proc_status_bytes(field: str, pid: int | str = "self") -> int:
    """A memory figure of /proc/PID/status (e.g. RssAnon, VmRSS) in bytes; 0 when unreadable
    (a process gone, or on another node)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_anon_bytes(pid: int | str = "self") -> int:
    """Private resident memory of a process (shared segments excluded, so nothing counts twice)."""
    return proc_status_bytes("RssAnon", pid)


def shm_bytes(paths: list[str]) -> int:
    """Bytes actually allocated to the given shared-memory files (pages touched so far)."""
    total = 0
    for p in paths:
        try:
            total += os.stat(p).st_blocks * 512
        except FileNotFoundError:
            pass
    return total


class MetricsWriter:
    """Appends one JSON object per step to RUN_DIR/metrics.jsonl, flushed each line, and hands the
    same record to `exporter` (ray_metrics.RayMetrics in Ray mode): one source for both."""

    def __init__(self, path: Path, exporter: Any = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.exporter = exporter
        self._file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.exporter is not None:
            self.exporter.record_step(record)

    def close(self) -> None:
        self._file.close()


class Progress:
    """A one-line progress bar on a terminal, a log line every `every` steps otherwise."""

    def __init__(self, total: int, every: int, first: int = 0, stream: TextIO | None = None):
        self.total, self.every, self.first = total, every, first
        self.stream = stream or sys.stderr  # looked up now: tests and callers may have replaced it
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float, tok_per_s: float, tflops: float) -> None:
        done = step + 1
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(1, done - self.first) * (self.total - done)
        text = (f"step {done}/{self.total} loss {loss:.4f} {tok_per_s:,.0f} tok/s {tflops:.1f} TFLOPS "
                f"eta {eta:.0f}s")
        if self.tty:
            width = 24
            filled = int(width * done / self.total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}")
            if done == self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif done % self.every == 0 or done == self.total:
            self.stream.write(f"[megatrain] {text}\n")
            self.stream.flush()
