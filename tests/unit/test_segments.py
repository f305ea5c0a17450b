"""Host store: layout, segments, capacity checks, cleanup, sharding."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.exceptions import DataError, HostMemoryError
from megatrain_ray.model.layout import ALIGN_ELEMS, build_layout
from megatrain_ray.store.liveness import RunLock, sweep_stale_segments
from megatrain_ray.store.segments import shard_stages
from tests.conftest import tiny_config


def test_layout_offsets_are_aligned_disjoint_and_decay_first():
    cfg = ModelConfig(vocab_size=100, hidden_size=48, intermediate_size=80, num_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attention_bias=True, qk_norm=True)
    layout = build_layout(cfg)
    for stage in layout.stages:
        end = 0
        for slot in stage.slots:
            assert slot.offset % ALIGN_ELEMS == 0 and slot.offset >= end
            end = slot.offset + slot.numel
        decay = [s for s in stage.slots if s.decay]
        assert all(s.offset + s.numel <= stage.decay_numel for s in decay)
        assert all(s.offset >= stage.decay_numel for s in stage.slots if not s.decay)
        for slot in stage.slots:
            assert layout.stage_of(stage.hf_name(slot)) == (stage, slot)
    names = {stage.hf_name(s) for stage in layout.stages for s in stage.slots}
    assert "model.layers.1.self_attn.q_norm.weight" in names and "lm_head.weight" in names


def test_shards_split_stages_contiguously():
    layout = build_layout(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=6,
                                      num_attention_heads=4, num_key_value_heads=4))
    groups = shard_stages(layout, 3)
    assert sum(groups, []) == list(range(len(layout.stages)))
    assert all(groups)


def test_grad_home_follows_precision_and_clipping(tmp_path):
    def grad_home(cfg) -> str:
        return RunSpec.resolve(cfg).grad_home
    assert grad_home(tiny_config(tmp_path)) == "stage"  # fp32 streamed directly, clipping on
    assert grad_home(tiny_config(tmp_path, optimizer={"grad_clip": 0.0})) == "pool"
    assert grad_home(tiny_config(tmp_path, precision={"compute_dtype": "bfloat16"})) == "stream"


def test_capacity_check_refuses_before_allocating(tmp_path, monkeypatch):
    real = os.statvfs

    class Tiny:
        def __init__(self, st):
            self.f_bavail, self.f_frsize = 10, st.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda p: Tiny(real(p)))
    cfg = tiny_config(tmp_path, host={"shm_dir": str(tmp_path)})
    with pytest.raises(HostMemoryError, match="host.shm_dir"):
        Trainer(cfg)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("megatrain-")]


def test_bad_data_fails_before_any_segment(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    cfg = tiny_config(tmp_path, model={"vocab_size": 256}, data={"path": str(short)},
                      host={"shm_dir": str(tmp_path)})
    with pytest.raises(DataError, match="data.path"):
        Trainer(cfg)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("megatrain-")]


def test_segments_are_removed_on_close_and_after_errors(tmp_path):
    cfg = tiny_config(tmp_path, host={"shm_dir": str(tmp_path)})
    with Trainer(cfg) as trainer:
        trainer.step(0)
        files = [f for f in os.listdir(tmp_path) if f.startswith("megatrain-")]
        locks = [f for f in files if f.endswith(".lock")]
        assert len(files) == len(trainer.specs) + len(locks) and len(locks) == cfg.host.num_shards
    assert not [f for f in os.listdir(tmp_path) if f.startswith("megatrain-")]


def test_sweep_removes_the_files_of_runs_whose_lock_nobody_holds(tmp_path):
    """Liveness by lock, not pid: the live run's pid is one that does not exist here (as a run in another
    PID namespace), the dead run's is this process's own."""
    import socket

    host = socket.gethostname().replace("-", "_")
    live_prefix, dead_prefix = f"megatrain-{host}-999999999-aaaa1111-", f"megatrain-{host}-{os.getpid()}-bbbb2222-"
    lock = RunLock(str(tmp_path), live_prefix, 0)  # held as a HostShard holds it
    dead_lock = RunLock(str(tmp_path), dead_prefix, 0)
    os.close(dead_lock._fd)  # its process ended without removing it: the kernel dropped the lock
    live = [tmp_path / f"{live_prefix}layer0-master", tmp_path / f"{live_prefix}gate"]
    dead = [tmp_path / f"{dead_prefix}layer0-master"]
    unlocked = [tmp_path / f"megatrain-{host}-1-cccc3333-layer0-master"]  # a run with no lock file at all
    other = [tmp_path / "unrelated-file", tmp_path / "megatrain-otherhost-1-dddd4444-layer0-master"]
    for f in live + dead + unlocked + other:
        f.write_bytes(b"x")
    assert sweep_stale_segments(str(tmp_path)) == 3
    assert all(f.exists() for f in live + other) and Path(lock.path).exists()
    assert not any(f.exists() for f in dead + unlocked) and not Path(dead_lock.path).exists()
    lock.release()
    assert not Path(lock.path).exists()
    assert sweep_stale_segments(str(tmp_path)) == 2  # now the formerly live run is stale too
    assert all(f.exists() for f in other)


def test_initial_weights_do_not_depend_on_sharding(tmp_path):
    weights = []
    for shards in (1, 3):
        cfg = tiny_config(tmp_path / str(shards), host={"num_shards": shards})
        with Trainer(cfg) as trainer:
            weights.append(trainer.master_weights())
            losses = [trainer.step(s)["loss"] for s in range(3)]
            weights.append(losses)
    assert weights[0].keys() == weights[2].keys()
    assert all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])
    assert weights[1] == weights[3]
