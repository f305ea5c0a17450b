"""engine.update_trace: when each stage's update passed each hand-off, one JSON line per event and rank.

Whether the CPU optimizer overlaps the backward depends on a chain of hand-offs between threads,
processes and actors; a step's totals (update_wait_seconds) say how long the GPU waited, not which
link was late. Each rank appends to `<dir>/update-trace-g<ranks>-rank<r>-<pid>.jsonl` lines
{"step", "stage", "event", "t"}, `t` in seconds of time.perf_counter(), which on Linux is
CLOCK_MONOTONIC: one clock for every process of a host, so the optimizer workers' times line up.

    step_start, backward_end, device_idle, step_end
                  main thread (stage -1); backward_end: the backward queued, device_idle: done on the device
    emit          main thread queued the D2H of this rank's piece of the stage's gradients
    gpu_drained   that D2H finished on the device (from timing events, placed on the host clock by
                  an event recorded at step_start, when the device is idle: exact to a few microseconds)
    drained       a dispatcher thread saw the D2H complete
    landed        leader: every rank's piece is on the host; other ranks: its own piece announced
    sent          leader: the update ordered from the optimizer workers
    run_start, run_end    the optimizer workers' first start and last end of the update
    applied       leader: the node's other ranks told the update is done
    wait_start, wait_end  main thread blocked for the stage's update (a load, or a gradient slab)

benchmarks/update_trace.py reads the files and says where the time goes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class UpdateTrace:
    def __init__(self, directory: str, rank: int, ranks: int):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"update-trace-g{ranks}-rank{rank}-{os.getpid()}.jsonl"
        self.events: list[tuple[int, int, str, float]] = []
        self.lock = threading.Lock()  # the main thread, the dispatcher and the publisher all mark
        self.device_marks: list[tuple[int, int, Any]] = []
        """(step, stage, timing event) to place on the host clock at the end of the step."""

    def mark(self, event: str, stage: int, step: int, at: float | None = None) -> None:
        at = time.perf_counter() if at is None else at
        with self.lock:
            self.events.append((step, stage, event, at))

    def on_device(self, stage: int, step: int, timing_event: Any) -> None:
        self.device_marks.append((step, stage, timing_event))

    def write(self, origin: tuple[float, Any] | None) -> None:
        """Append the events so far; `origin`: (host time, timing event) recorded together at the step's start,
        which places the device marks (their events complete: the step synchronised) on the host clock."""
        if origin is not None:
            host, start = origin
            for step, stage, event in self.device_marks:
                self.mark("gpu_drained", stage, step, host + start.elapsed_time(event) / 1e3)
        self.device_marks = []
        with self.lock:
            events, self.events = self.events, []
        with open(self.path, "a") as f:
            f.writelines(json.dumps({"step": s, "stage": i, "event": e, "t": round(t, 6)}) + "\n"
                         for s, i, e, t in events)
