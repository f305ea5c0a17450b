"""Kept actor processes (driver/warm_actors.py): a second run of the same driver runs its CPU actors in the first
run's processes, and trains bit for bit as a run in fresh processes does; a process comes back with its cores,
memory policy and torch threads as it started, and one killed while kept is replaced; a run that fails keeps
none of its processes. (A constructor's own error in a kept process: test_preflight's non-finite weight, [ray].)"""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatrain_ray.driver import warm_actors
from megatrain_ray.driver.trainer import Trainer
from tests.conftest import tiny_config

pytestmark = pytest.mark.ray


def _run(tmp_path, name: str, steps: int = 2) -> tuple[list[float], dict[str, int], dict]:
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
    assert set(pids_a.values()) <= set(kept), (pids_a, kept)  # host0, optim0, optim1, gpu: all kept
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


def test_a_failed_run_keeps_none_of_its_processes(tmp_path, ray_session):
    import ray

    cfg = tiny_config(tmp_path, optimizer={"workers": 2}, train={"steps": 1}, schedule={"warmup_steps": 0},
                      runtime={"mode": "ray"})
    with pytest.raises(ZeroDivisionError):
        with Trainer(cfg) as trainer:
            trainer.step(0)
            pids = set(trainer.actor_pids)
            1 / 0
    assert not pids & set(_kept_pids())
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if _alive(pid)], "the failed run's processes should have been killed"
    assert ray.is_initialized()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for the raylet to reap it is gone too
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
