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

Besides the trace, every step measures itself (StepTelemetry): device time per activity from timing
events (Timeline) and host-side counters (STEP_STATS), both returned in the step's StepResult.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatrain_ray.engine.streams import DeviceStreams


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


STEP_STATS = ("optimizer_seconds", "optimizer_bytes", "update_wait_seconds", "slab_wait_seconds", "h2d_bytes",
              "d2h_bytes")
"""The host-side counters of a step, summed over its loads, copies and waits."""


class Timeline:
    """Device time of each activity in a step (compute, H2D, D2H, comm; vision: a vision-language model's tower and
    projector, forward and backward, engine/vision_engine.py; update: the optimizer updates that run on the device,
    the GPU-resident tier's and the LoRA adapters'), from timing events that are read once at the end of the step:
    no synchronisation inside it. The updates ordered once the global norm is known (clipping on) are queued
    after the step's last read, so the end of the step does not wait for them: a span not yet done there is
    counted in the next step's timeline (`pending`), where the device runs it."""

    def __init__(self, streams: DeviceStreams, pending: list | None = None):
        self.streams = streams
        self.spans: dict[str, list] = {"compute": [], "h2d": [], "d2h": [], "comm": [], "vision": [],
                                       "update": list(pending or [])}
        self.pending: list | None = None
        """The update spans not done at this timeline's read (`seconds`); None while it has not been read."""

    def carried(self) -> list:
        """The update spans the next timeline counts: those not done at this one's read; every one of them where
        it was never read (a forward-only pass between two steps, a step that failed before its end), else
        those carried into it would be lost."""
        return self.spans["update"] if self.pending is None else self.pending

    def start(self, stream: Any) -> Any:
        return self.streams.record(stream, timing=True)

    def stop(self, kind: str, stream: Any, start: Any) -> Any:
        """Close a span of `kind` on `stream`; returns its end event."""
        end = self.streams.record(stream, timing=True)
        self.spans[kind].append((start, end))
        return end

    def seconds(self) -> dict[str, float]:
        out = {}
        for kind, spans in self.spans.items():
            if kind == "update":
                finished = [span[1].query() for span in spans]  # one look each: a span is done or pending
                self.pending = [span for span, done in zip(spans, finished) if not done]
                spans = [span for span, done in zip(spans, finished) if done]
            elif spans:
                spans[-1][1].synchronize()
            out[kind] = sum(a.elapsed_time(b) for a, b in spans) / 1e3
        return out


class StepTelemetry:
    """What the engine's parts measure in a step, in one object they share: the timeline, the counters
    and the update trace (None unless engine.update_trace). Each step starts both afresh."""

    def __init__(self, streams: DeviceStreams, trace: UpdateTrace | None):
        self.streams = streams
        self.trace = trace
        self.timeline = Timeline(streams)
        self.stats: dict[str, float] = dict.fromkeys(STEP_STATS, 0.0)

    def new_step(self) -> None:
        self.timeline = Timeline(self.streams, pending=self.timeline.carried())
        self.reset_stats()

    @contextlib.contextmanager
    def device_update(self, stream: Any) -> Iterator[None]:
        """Around an optimizer update queued on `stream` on the device: its time goes to the "update" span."""
        start = self.timeline.start(stream)
        yield
        self.timeline.stop("update", stream, start)

    def reset_stats(self) -> None:
        self.stats = dict.fromkeys(STEP_STATS, 0.0)

    def mark(self, event: str, stage: int, step: int, at: float | None = None) -> None:
        if self.trace is not None:
            self.trace.mark(event, stage, step, at)

    def on_device(self, stage: int, step: int, timing_event: Any) -> None:
        if self.trace is not None:
            self.trace.on_device(stage, step, timing_event)

    def copied(self, kind: str, stream: Any, start: Any, nbytes: int) -> None:
        """A copy outside the weight and gradient streams (the activation stash's): into the timeline and
        the byte counts with them."""
        self.timeline.stop(kind, stream, start)
        self.stats[f"{kind}_bytes"] += nbytes
