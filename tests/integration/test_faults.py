"""Faults: dead actors (restarts from the last good checkpoint, or one clear stop), non-finite numbers."""

from __future__ import annotations

import zlib

import pytest
import torch

from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.exceptions import ActorFailedError, NonFiniteError
from megatrain_ray.store.checkpoint import CheckpointDir
from megatrain_ray.store.segments import HostStore
from tests.conftest import tiny_config


def run(cfg, resume=None):
    with Trainer(cfg, resume=resume) as trainer:
        history = trainer.train()
        return trainer, [r["loss"] for r in history], trainer.master_weights()


def state(trainer: Trainer) -> dict[str, torch.Tensor]:
    trainer.flush()
    out = {}
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        store = HostStore([s for s in trainer.specs if s.kind == kind])
        out.update({f"{kind}/{k}": v for k, v in store.read_tensors(trainer.layout, kind).items()})
    return out


@pytest.mark.ray
def test_dead_actors_are_restarted_and_the_run_ends_as_if_nothing_happened(tmp_path, ray_session):
    """An optimizer worker killed in step 5, then a host shard in step 8 of the same run: each death restarts
    the run from its newest checkpoint (every 3 steps), and the losses and weights are the uninterrupted run's
    (made in-process: the same actors' code, bit for bit the run through Ray, without its actors' start-up)."""
    common = {"optimizer": {"workers": 2}, "train": {"steps": 10}, "checkpoint": {"every": 3}}
    _, ref_losses, ref_weights = run(tiny_config(tmp_path / "ref", **common))
    cfg = tiny_config(tmp_path / "cut", fault={"max_restarts": 2, "drill": "kill:optim1@5,kill:host0@8"},
                      runtime={"mode": "ray"}, **common)
    trainer, losses, weights = run(cfg)
    assert trainer.restarts == 2
    assert losses == ref_losses
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)
    for done in CheckpointDir(tmp_path / "cut" / "run" / "checkpoints").complete():  # none corrupted
        for entry in done.manifest["files"]:
            assert zlib.crc32((done.directory / entry["path"]).read_bytes()) == entry["crc32"]


@pytest.mark.ray
def test_without_restarts_the_run_stops_naming_the_dead_actor(tmp_path, ray_session):
    cfg = tiny_config(tmp_path, optimizer={"workers": 2}, runtime={"mode": "ray"}, checkpoint={"every": 2},
                      fault={"drill": "kill:optim1@3"})
    # The kill lands while step 3 runs; updates run behind the steps, so the death surfaces a step or two later.
    with pytest.raises(ActorFailedError, match=r"optim1 died, noticed at step \d.*step-0000000[24].*--resume auto"):
        run(cfg)


def test_nan_gradient_with_skip_leaves_weights_and_moments_bit_identical(tmp_path):
    cfg = tiny_config(tmp_path, fault={"drill": "nan_grad@4"})
    with Trainer(cfg) as trainer:
        for step in range(4):
            trainer.step(step)
        before = state(trainer)
        record = trainer.step(4)
        after = state(trainer)
        assert record["skipped"] and not torch.isfinite(torch.tensor(record["grad_norm"]))
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert trainer.updates_applied == 4
        assert not trainer.step(5)["skipped"]


def test_nan_gradient_with_stop_exits_with_a_checkpoint_that_resumes(tmp_path):
    steps = {"train": {"steps": 8}}
    _, ref_losses, _ = run(tiny_config(tmp_path / "ref", **steps))
    cfg = tiny_config(tmp_path / "cut", fault={"nonfinite": "stop", "drill": "nan_grad@5"}, **steps)
    with pytest.raises(NonFiniteError, match=r"step 5.*step-00000005"):
        run(cfg)
    _, losses, _ = run(tiny_config(tmp_path / "cut", fault={"nonfinite": "stop"}, **steps), resume="auto")
    assert losses == ref_losses[5:]


def test_with_clipping_off_a_nan_gradient_stops_the_run(tmp_path):
    cfg = tiny_config(tmp_path, optimizer={"grad_clip": 0.0}, fault={"drill": "nan_grad@2"})
    with pytest.raises(NonFiniteError, match="grad_clip=0"):
        run(cfg)
