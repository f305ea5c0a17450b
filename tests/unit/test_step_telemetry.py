"""The step's device timeline (engine/telemetry.py): the updates queued after the step's last read are counted in
the step that finds them done, never twice and never lost; gpu_busy counts them beside the stages' compute."""

from __future__ import annotations

from megatrain_ray.engine.telemetry import StepTelemetry
from megatrain_ray.messages import StepResult
from megatrain_ray.observe.metrics import step_record


class FakeEvent:
    """A timing event at `at` milliseconds, done once `done` is set (torch.cuda.Event's query / elapsed_time)."""

    def __init__(self, at: float, done: bool = True):
        self.at, self.done = at, done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.done and end.done, "read before the device finished it"
        return end.at - self.at


class FakeStreams:
    """Hands out the events a test lines up, in order."""

    def __init__(self, events: list[FakeEvent]):
        self.events = iter(events)

    def record(self, stream, timing: bool = False, blocking: bool = False) -> FakeEvent:
        return next(self.events)


def test_an_update_not_done_at_the_steps_end_counts_in_the_next_step():
    late_end = FakeEvent(30.0, done=False)
    streams = FakeStreams([FakeEvent(0.0), FakeEvent(10.0),  # step 1: compute 10 ms
                           FakeEvent(10.0), FakeEvent(14.0),  # an update done in the step: 4 ms
                           FakeEvent(14.0), late_end,  # an update still running when the step reads: 16 ms
                           FakeEvent(40.0), FakeEvent(45.0)])  # step 2: compute 5 ms
    telemetry = StepTelemetry(streams, trace=None)
    telemetry.timeline.stop("compute", None, telemetry.timeline.start(None))
    for _ in range(2):
        with telemetry.device_update(None):
            pass
    first = telemetry.timeline.seconds()
    assert first["compute"] == 10e-3 and abs(first["update"] - 4e-3) < 1e-12
    late_end.done = True  # the device got to it while the next step ran
    telemetry.new_step()
    telemetry.timeline.stop("compute", None, telemetry.timeline.start(None))
    second = telemetry.timeline.seconds()
    assert second["compute"] == 5e-3 and abs(second["update"] - 16e-3) < 1e-12
    telemetry.new_step()
    assert telemetry.timeline.seconds()["update"] == 0.0  # counted once


def test_gpu_busy_counts_the_device_updates_beside_the_compute():
    result = StepResult(loss=1.0, grad_norm=1.0, tokens=8, valid_tokens=8, seconds=0.2, update_wait_seconds=0.0,
                        optimizer_seconds=0.0, optimizer_bytes=0, h2d_bytes=0, d2h_bytes=0, compute_seconds=0.12,
                        h2d_seconds=0.0, d2h_seconds=0.0, device_update_seconds=0.05)
    record = step_record(0, 1e-3, result, seconds=0.2, flops_per_token=1.0, params=1, gpus=1, host_memory_bytes=0,
                         epoch=0.0)
    assert abs(record["gpu_busy"] - 0.85) < 1e-12 and record["device_update_seconds"] == 0.05


def test_an_update_pending_across_a_timeline_never_read_still_counts_once():
    """A forward-only pass between two steps (evaluation, GRPO's and DPO's log-probabilities: engine/forward_only.py
    starts a timeline and never reads it), or a step that failed before its end, must not drop the update that the
    step before left running."""
    late_end = FakeEvent(14.0, done=False)
    streams = FakeStreams([FakeEvent(10.0), late_end,  # step 1's update, still running when the step reads: 4 ms
                           FakeEvent(20.0), FakeEvent(25.0)])  # the forward-only pass: compute 5 ms, never read
    telemetry = StepTelemetry(streams, trace=None)
    with telemetry.device_update(None):
        pass
    assert telemetry.timeline.seconds()["update"] == 0.0
    telemetry.new_step()  # the forward-only pass
    telemetry.timeline.stop("compute", None, telemetry.timeline.start(None))
    late_end.done = True
    telemetry.new_step()  # the next training step
    assert abs(telemetry.timeline.seconds()["update"] - 4e-3) < 1e-12
    telemetry.new_step()
    assert telemetry.timeline.seconds()["update"] == 0.0
