"""Engine behaviours beyond parity: dropped steps, the stream's copy counts."""

from __future__ import annotations

import time

import pytest
import torch

from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.store.segments import HostStore
from tests.conftest import tiny_config


def test_non_finite_gradients_drop_the_step_and_restore_the_streaming_copy(tmp_path):
    """Gradients land in the streaming copy; a dropped step must rewrite it from the master weights."""
    cfg = tiny_config(tmp_path, precision={"master_dtype": "float64", "compute_dtype": "float32"})
    with Trainer(cfg) as trainer:
        trainer.step(0)
        weights = trainer.master_weights()
        poisoned = dict(weights)
        name = "model.layers.1.mlp.up_proj.weight"
        poisoned[name] = weights[name].clone()
        poisoned[name][0, 0] = float("inf")
        trainer.load_weights({name: poisoned[name]})
        record = trainer.step(1)
        assert record["skipped"]
        after = trainer.master_weights()
        assert all(torch.equal(after[k], poisoned[k]) for k in weights)  # nothing updated
        stream = HostStore([s for s in trainer.specs if s.kind == "stream"]).read_tensors(trainer.layout, "stream")
        for k, v in stream.items():  # the copies hold weights again, not gradients
            assert torch.equal(v, poisoned[k].to(v.dtype)), k
        trainer.load_weights({name: weights[name]})
        record = trainer.step(2)
        assert not record["skipped"] and torch.isfinite(torch.tensor(record["loss"]))


def test_each_layer_crosses_to_the_device_at_most_twice_per_step(tmp_path):
    """Forward loads every stage once; backward reuses the two layers still resident."""
    cfg = tiny_config(tmp_path, model={"num_layers": 5})
    with Trainer(cfg) as trainer:
        trainer.step(0)
        record = trainer.step(1)
    layout = trainer.layout
    layer_bytes = layout.layers[0].numel * 4
    expected = (layout.embed.numel + layout.head.numel) * 4 + layer_bytes * (5 + 3)
    assert record["h2d_bytes"] == expected
    assert record["d2h_bytes"] == sum(s.numel for s in layout.stages) * 4  # every gradient once


def _slow_updates(monkeypatch, seconds: float) -> None:
    from actors.optimizer_worker import OptimizerWorker

    real = OptimizerWorker.apply

    def slow(self, order):
        time.sleep(seconds)
        return real(self, order)
    monkeypatch.setattr(OptimizerWorker, "apply", slow)


@pytest.mark.parametrize("slabs", [2, 7])
def test_waits_for_updates_are_split_by_what_they_wait_for(tmp_path, monkeypatch, slabs):
    """Clipping off, gradients through the slab pool, updates slower than the backward: with 2 slabs the
    backward waits for the update that last read a slab before copying into it (slab_wait_seconds, part of
    update_wait_seconds); with a slab per stage (7) a stage's slab was last read by its own update of the step
    before, which the forward already waited for, and the slab waits are none."""
    _slow_updates(monkeypatch, 0.05)
    cfg = tiny_config(tmp_path, model={"num_layers": 5}, optimizer={"grad_clip": 0.0},
                      engine={"grad_slabs": slabs})
    with Trainer(cfg) as trainer:
        trainer.step(0)
        record = trainer.step(1)
    stages = 5 + 2
    if slabs == 2:
        # Stage k's slab is free once the update of stage k+2 is done: at least (stages - 2) updates of 50 ms
        # minus the backward's own time are waited for in the backward.
        assert record["slab_wait_seconds"] > 0.05 * (stages - 2) * 0.5
    else:
        assert record["slab_wait_seconds"] == 0.0
    assert record["update_wait_seconds"] >= record["slab_wait_seconds"]
    assert record["update_wait_seconds"] > 0.05  # the forward waited for the last updates of step 0
