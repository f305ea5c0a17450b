"""Three device streams (H2D prefetch, compute, D2H gradients) and their events.

On CUDA these are real streams ordered by events, never by `synchronize()` on the hot path.
On the CPU every copy is synchronous, so streams and events become no-ops and the same
engine code runs unchanged (that is how CI tests the engine).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch


class NullEvent:
    """Stands in for torch.cuda.Event on the CPU, where work is already ordered; it keeps the
    host time it was recorded at, so that timings read the same way on both devices."""

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def record(self, stream: object = None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "NullEvent") -> float:
        return (end.at - self.at) * 1e3


class DeviceStreams:
    def __init__(self, device: torch.device, dequantizes: bool = False):
        """`dequantizes`: an NF4 base's dequantization runs on the H2D stream (engine/packed_stream.py), which then
        runs at high priority: at the default priority the compute kernels held the SMs and the next layer's
        weights came late (the 70B NF4 run's H2D stream was busy 8.5 s of an 8.75 s step, the GPU idle 0.77 s).
        Other runs keep the default (their H2D stream also casts and gathers, and was measured that way)."""
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.compute = torch.cuda.current_stream(device)
            self.h2d = torch.cuda.Stream(device, priority=-1 if dequantizes else 0)
            self.d2h = torch.cuda.Stream(device)
        else:
            self.compute = self.h2d = self.d2h = None

    def event(self, timing: bool = False, blocking: bool = False) -> "torch.cuda.Event | NullEvent":
        """`blocking`: a host thread that synchronizes on it sleeps instead of spinning on a core (for
        events a thread waits on for long, such as a stage's gradients reaching the host)."""
        return torch.cuda.Event(enable_timing=timing, blocking=blocking) if self.is_cuda else NullEvent()

    def record(self, stream: object, timing: bool = False, blocking: bool = False) -> "torch.cuda.Event | NullEvent":
        event = self.event(timing, blocking)
        if self.is_cuda:
            event.record(stream)
        return event

    def wait(self, stream: object, event: "torch.cuda.Event | NullEvent | None") -> None:
        """Make `stream` wait for `event` on the device; the host thread does not block."""
        if self.is_cuda and event is not None:
            stream.wait_event(event)

    @contextlib.contextmanager
    def on(self, stream: object) -> Iterator[None]:
        if self.is_cuda:
            with torch.cuda.stream(stream):
                yield
        else:
            yield

    def drain(self, stream: object) -> None:
        """Block the host until the work queued on `stream` so far is done, asleep in an event's
        synchronize: it lets go of the GIL, so the process's other threads run meanwhile."""
        if self.is_cuda:
            self.record(stream, blocking=True).synchronize()

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
