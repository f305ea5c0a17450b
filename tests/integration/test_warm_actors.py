"""Kept actor processes (driver/warm_actors.py): a second run of the same driver runs its CPU actors in the first
run's processes, and trains bit for bit as a run in fresh processes does; a process comes back with its cores,
memory policy and torch threads as it started, and one killed while kept is replaced."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatrain_ray.driver import warm_actors
from megatrain_ray.driver.trainer import Trainer
from tests.conftest import tiny_config

pytestmark = pytest.mark.ray


def _run(tmp_path, name: str, steps: int = 4) -> tuple[list[float], dict[str, int], dict]:
    cfg = tiny_config(tmp_path / name, optimizer={"workers": 2}, train={"steps": steps},
                     schedule={"warmup_steps": 0}, runtime={"mode": "ray"})
    with Trainer(cfg) as trainer:
        losses = [trainer.step(s)["loss"] for s in range(steps)]
        pids = dict(zip(trainer.actor_names, trainer.actor_pids))
        final = trainer.master_weights()
    return losses, pids, final


def _kept_pids() -> list[int]:
    import ray

    return sorted(ray.get([a.alive.remote() for a in warm_actors._state["idle"]]))


def test_a_second_run_reuses_the_processes_and_trains_as_fresh_ones_do(tmp_path, ray_session):
    assert warm_actors.keeping()
    losses_a, pids_a, final_a = _run(tmp_path, "a")
    kept = _kept_pids()
    assert sorted(pids_a.values()) == kept, (pids_a, kept)  # host0, optim0, optim1, gpu: all kept
    losses_b, pids_b, final_b = _run(tmp_path, "b")
    assert set(pids_b.values()) == set(pids_a.values())  # no process started for the second run

    warm_actors.keep_actor_processes(False)
    try:
        losses_c, pids_c, final_c = _run(tmp_path, "c")
    finally:
        warm_actors.keep_actor_processes(True)
    assert not set(pids_c.values()) & set(pids_a.values())  # fresh processes
    assert losses_a == losses_b == losses_c
    for name, value in final_c.items():
        assert (final_a[name] == value).all() and (final_b[name] == value).all(), name


def test_a_kept_process_is_given_back_as_it_started_and_a_dead_one_is_replaced(tmp_path, ray_session):
    import ray

    _run(tmp_path, "a", steps=1)
    idle = list(warm_actors._state["idle"])
    assert idle
    full = sorted(os.sched_getaffinity(0))
    for actor in idle:  # the optimizer workers pinned themselves to one core and one torch thread
        status = ray.get(actor.heartbeat.remote())
        assert list(status.cores) == full, status
    victim = ray.get(idle[0].alive.remote())
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            ray.get(idle[0].alive.remote(), timeout=1)
        except Exception:
            break
        time.sleep(0.1)
    losses, pids, _ = _run(tmp_path, "b", steps=1)
    assert victim not in pids.values()
    assert len(set(pids.values()) & {ray.get(a.alive.remote()) for a in idle[1:]}) == len(idle) - 1
