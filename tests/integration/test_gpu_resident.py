"""The GPU-resident tier (engine.gpu_resident) on the CPU device: resident layers train exactly as streamed
ones (same AdamW math, same clipping, same step order); they have no host segments, and checkpoints, resume,
export, fine-tuning, restarts and the driver's weight reads and writes reach their state on the device.

Tolerances (tests/numerics.py): float64 within 1e-12 (the same AdamW formula; measured bit-identical at lr 1e-3).
float32: a resident layer's AdamW is the device's (torch's fused kernel), a streamed one's the CPU optimizer's
(its native kernel), rounding apart; AdamW amplifies that, and MKL's float32 GEMMs round by CPU, so the bound is
4x the streamed float32 run's own noise, its distance from the same run in float64 (shared with the float64 test).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatrain_ray.config.load import load_config
from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.store.checkpoint import CheckpointDir
from tests.conftest import learnable_tokens, tiny_config, tiny_raw
from tests.numerics import assert_all_within_noise

FLOAT64 = {"master_dtype": "float64", "compute_dtype": "float64"}


def train(cfg, steps: int | None = None, resume=None):
    """Per-step records, final master weights and moments of a run."""
    with Trainer(cfg, resume=resume) as trainer:
        records = trainer.train() if steps is None else [trainer.step(s) for s in range(steps)]
        state = {f"master/{k}": v for k, v in trainer.master_weights().items()}
        for kind in ("exp_avg", "exp_avg_sq"):
            state.update({f"{kind}/{k}": v for k, v in trainer.read_moments(kind).items()})
        return trainer, records, state


def assert_same_run(a, b, rel: float) -> None:
    (_, records_a, state_a), (_, records_b, state_b) = a, b
    assert len(records_a) == len(records_b)
    for ra, rb in zip(records_a, records_b):
        assert ra["skipped"] == rb["skipped"]
        for key in ("loss",) if ra["skipped"] else ("loss", "grad_norm"):
            assert abs(ra[key] - rb[key]) <= rel * abs(rb[key]), f"step {ra['step']}: {key} {ra[key]!r} vs {rb[key]!r}"
    for name, value in state_b.items():
        err = (state_a[name] - value).norm() / max(value.norm(), 1e-30)
        assert err <= rel, f"{name}: relative error {err:.2e}"


def state_series(run) -> tuple[dict, dict]:
    """(every step's loss and gradient norm by name, the final masters and moments by name) of a run."""
    _, records, state = run
    return {f"{key} at step {r['step']}": r[key] for r in records for key in ("loss", "grad_norm")}, state


@pytest.fixture(scope="module")
def streamed64(tmp_path_factory):
    """The streamed float64 run of 10 steps at lr 1e-3 by grad_clip, made once: the reference of the float64 test
    and the float64 twin that measures the float32 test's noise."""
    runs = {}

    def get(clip: float):
        if clip not in runs:
            runs[clip] = train(tiny_config(tmp_path_factory.mktemp("none"), train={"steps": 10},
                                           optimizer={"grad_clip": clip}, precision=FLOAT64))
        return runs[clip]
    return get


@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clip", "noclip"])
def test_resident_layers_train_exactly_like_streamed_ones_in_float64(tmp_path, streamed64, clip):
    streamed = streamed64(clip)
    resident = train(tiny_config(tmp_path / "two", engine={"gpu_resident": 2}, train={"steps": 10},
                                 optimizer={"grad_clip": clip}, precision=FLOAT64))
    assert_same_run(resident, streamed, rel=1e-12)
    # The two resident layers (the first two) never cross host<->device: only the embedding, the last layer
    # (loaded once: its slot still holds it when the backward starts) and the head come in.
    layout = resident[0].layout
    layer = layout.layers[0].numel * 8
    assert {r["h2d_bytes"] for r in resident[1]} == {(layout.embed.numel + layout.head.numel) * 8 + layer}
    # The resident layers' updates run on the device, so they count in gpu_busy (device_update_seconds); a streamed
    # run has none.
    assert all(r["device_update_seconds"] > 0 for r in resident[1])
    assert all(r["device_update_seconds"] == 0 for r in streamed[1])
    for r in resident[1]:
        assert r["gpu_busy"] == min(1.0, (r["compute_seconds"] + r["device_update_seconds"]) / r["step_seconds"])
    assert [r["d2h_bytes"] for r in resident[1]] == [r["d2h_bytes"] - 2 * layer for r in streamed[1]]


@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clip", "noclip"])
def test_every_stage_resident_with_kept_graphs_trains_exactly_like_the_streamed_run_in_float64(tmp_path, streamed64,
                                                                                                clip):
    """engine.gpu_resident=all: the embedding and LM head on the device with the layers (their update there too),
    and engine.kept_activations: the last two layers' backward through their forward graph, no recompute. Nothing
    crosses host<->device; the run is the streamed one's to rounding."""
    streamed = streamed64(clip)
    resident = train(tiny_config(tmp_path / "all", engine={"gpu_resident": "all", "kept_activations": 2},
                                 train={"steps": 10}, optimizer={"grad_clip": clip}, precision=FLOAT64))
    run = resident[0].run_spec
    assert (run.resident_layers, run.resident_vocab, run.kept_layers) == (3, True, 2)
    assert_same_run(resident, streamed, rel=1e-12)
    assert {(r["h2d_bytes"], r["d2h_bytes"]) for r in resident[1]} == {(0, 0)}


def test_the_one_pass_update_trains_exactly_like_the_streamed_run_in_float64(tmp_path, streamed64, monkeypatch):
    """engine/resident_update.adamw_span in the tier (what a GPU that compiles runs, through torch.compile), here
    eagerly on the CPU in float64 with clipping on: every stage resident, the run is the streamed one's to
    rounding."""
    import megatrain_ray.engine.step as step_module
    from megatrain_ray.engine.resident_update import adamw_span

    updated = []

    def one_pass(master, *args):
        updated.append(master.numel())
        adamw_span(master, *args)
    monkeypatch.setattr(step_module, "resident_update_function", lambda *args: one_pass)
    resident = train(tiny_config(tmp_path / "all", engine={"gpu_resident": "all"}, train={"steps": 10},
                                 optimizer={"grad_clip": 1.0}, precision=FLOAT64))
    assert sum(updated) == 10 * sum(stage.numel for stage in resident[0].layout.stages)  # every update took it
    assert_same_run(resident, streamed64(1.0), rel=1e-12)


def test_passes_without_gradients_read_the_resident_embedding_and_head(tmp_path):
    """Logits after two steps with every stage resident are the streamed run's, bit for bit (float64)."""
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, engine in (("none", {}), ("all", {"gpu_resident": "all"})):
        with Trainer(tiny_config(tmp_path / name, engine=engine, precision=FLOAT64, train={"steps": 4})) as trainer:
            trainer.step(0), trainer.step(1)
            logits[name] = trainer.logits(ids)
    assert torch.equal(logits["all"], logits["none"])


def test_kept_graphs_beside_recomputed_and_streamed_layers_in_float64(tmp_path, streamed64):
    """Layer 0 resident and recomputed, layer 1 resident with its graph kept, layer 2 streamed (clipping on)."""
    resident = train(tiny_config(tmp_path / "mixed", engine={"gpu_resident": 2, "kept_activations": 1},
                                 train={"steps": 10}, precision=FLOAT64))
    run, layout = resident[0].run_spec, resident[0].layout
    assert [s.index for s in layout.kept_stages(run.resident_layers, run.kept_layers)] == [2] and not run.resident_vocab
    assert_same_run(resident, streamed64(1.0), rel=1e-12)


@pytest.mark.float32_parity
@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clip", "noclip"])
def test_resident_layers_in_float32_and_bf16_compute_track_streamed_ones(tmp_path, streamed64, clip):
    """float32: within 4x the streamed float32 run's noise (its distance from the streamed float64 run; measured
    on an AVX-512 Xeon: 4.5e-7 to 5.5e-7 for the losses and gradient norms, 4.4e-6 to 4.9e-6 for masters and
    moments, the resident run 0.2x and 0.14x that from the streamed one; the resident layers' lr off by 1e-3:
    40x to 120x the bound). bf16 compute from a float32 master (the GPU default: a bf16
    compute copy, bf16 gradients): bf16 rounds by 2**-8 whatever the CPU, so a fixed 2 %."""
    common = {"train": {"steps": 10}, "optimizer": {"grad_clip": clip}}
    resident, streamed = (state_series(train(tiny_config(tmp_path / "two", engine={"gpu_resident": 3}, **common))),
                          state_series(train(tiny_config(tmp_path / "none", **common))))
    reference64 = state_series(streamed64(clip))
    for what, k in (("record", 0), ("state", 1)):
        assert_all_within_noise(what, resident[k], streamed[k], reference64[k])
    bf16 = {"precision": {"compute_dtype": "bfloat16"}, **common}
    assert_same_run(train(tiny_config(tmp_path / "bf16-two", engine={"gpu_resident": 2}, **bf16)),
                    train(tiny_config(tmp_path / "bf16-none", **bf16)), rel=2e-2)


def test_a_dropped_step_drops_the_resident_updates_too(tmp_path):
    """nan_grad puts the NaN into the first layer's gradients: a resident layer's here."""
    common = {"train": {"steps": 8}, "precision": FLOAT64, "fault": {"drill": "nan_grad@3"}}
    streamed = train(tiny_config(tmp_path / "none", **common))
    resident = train(tiny_config(tmp_path / "one", engine={"gpu_resident": 1}, **common))
    assert [r["skipped"] for r in resident[1]] == [s == 3 for s in range(8)]
    assert_same_run(resident, streamed, rel=1e-12)


def test_resume_from_a_checkpoint_is_bit_identical_with_the_tier(tmp_path):
    engine = {"gpu_resident": 2}
    _, reference, final = train(tiny_config(tmp_path / "ref", engine=engine, train={"steps": 10}))
    cfg = tiny_config(tmp_path / "cut", engine=engine, checkpoint={"every": 5}, train={"steps": 10})
    with Trainer(cfg) as trainer:  # stops after 7 steps: the last checkpoint is step 5
        for step in range(7):
            trainer.step(step)
            trainer.next_step = step + 1
            if trainer.next_step % 5 == 0:
                trainer.save(wait=True)
    _, resumed, state = train(cfg, resume="auto")
    assert [r["step"] for r in resumed] == list(range(5, 10))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference[5:]]
    assert all(torch.equal(final[k], state[k]) for k in final)


def test_export_with_the_tier_equals_export_without(tmp_path):
    exported = {}
    for name, engine in (("none", {}), ("two", {"gpu_resident": 2})):
        cfg = tiny_config(tmp_path / name, engine=engine, precision=FLOAT64, train={
            "steps": 6, "export_dir": str(tmp_path / name / "export")})
        with Trainer(cfg) as trainer:
            trainer.train()
        exported[name] = load_file(str(tmp_path / name / "export" / "model.safetensors"))
    assert exported["two"].keys() == exported["none"].keys()
    assert all(torch.equal(exported["two"][k], exported["none"][k]) for k in exported["none"])


def test_resident_stages_have_no_host_segments_and_checkpoint_the_same_files(tmp_path):
    """The tier's stages own no shared memory; the GPU worker writes their checkpoint files, which hold what
    a streamed run's shards write (float64: the same bits)."""
    saved = {}
    for name, engine in (("none", {}), ("two", {"gpu_resident": 2})):
        cfg = tiny_config(tmp_path / name, engine=engine, precision=FLOAT64, train={"steps": 4})
        with Trainer(cfg) as trainer:
            trainer.train()
            kinds = {(s.kind, s.stage) for s in trainer.specs}
            layout = trainer.layout
        assert {("master", 1), ("exp_avg", 2)} <= kinds if name == "none" else \
            not kinds & {(k, i) for k in ("master", "exp_avg", "exp_avg_sq", "stream", "grad") for i in (1, 2)}
        last = CheckpointDir(tmp_path / name / "run" / "checkpoints").latest()
        assert sorted(e["stage"] for e in last.manifest["files"]) == [s.index for s in layout.stages]
        saved[name] = {k: v for e in last.manifest["files"] for k, v in load_file(str(last.directory / e["path"])).items()}
    assert saved["two"].keys() == saved["none"].keys()
    assert all(torch.equal(saved["two"][k], saved["none"][k]) for k in saved["none"])


def test_fine_tuning_fills_the_resident_layers_from_the_model_directory(tmp_path):
    cfg = tiny_config(tmp_path / "source", precision=FLOAT64, train={"steps": 3,
                                                                    "export_dir": str(tmp_path / "model")})
    with Trainer(cfg) as trainer:
        trainer.train()
    runs = {}
    for name, engine in (("none", {}), ("two", {"gpu_resident": 2})):
        raw = tiny_raw(engine={"device": "cpu", "poison_buffers": True, **engine}, precision=FLOAT64,
                       train={"steps": 4, "seed": 7, "log_every": 100, "output_dir": str(tmp_path / name / "run")})
        raw["model"] = {"path": str(tmp_path / "model")}
        raw["data"]["path"] = learnable_tokens(tmp_path / "tokens.npy", 96)
        runs[name] = train(load_config(raw=raw))
    assert_same_run(runs["two"], runs["none"], rel=1e-12)
    assert runs["two"][1][0]["loss"] < 4.5  # it started from the trained weights, not a fresh initialisation


def test_weights_written_by_the_driver_reach_the_resident_layers(tmp_path):
    cfg = tiny_config(tmp_path, engine={"gpu_resident": 3}, train={"steps": 4})
    with Trainer(cfg) as trainer:
        weights = {k: torch.full_like(v, 0.01) if ".layers.1." in k else v for k, v in trainer.master_weights().items()}
        trainer.load_weights(weights)
        assert torch.equal(trainer.master_weights()["model.layers.1.mlp.up_proj.weight"],
                           weights["model.layers.1.mlp.up_proj.weight"])
        engine = trainer.gpu.instance.engine
        resident = engine.resident.weights(trainer.layout.layers[1])
        assert torch.equal(resident["mlp.up_proj.weight"], weights["model.layers.1.mlp.up_proj.weight"])


def test_the_tier_refuses_what_it_does_not_support(tmp_path):
    assert RunSpec.resolve(tiny_config(tmp_path, engine={"gpu_resident": 3})).resident_layers == 3
    assert RunSpec.resolve(tiny_config(tmp_path)).resident_layers == 0
    for sections, message in (({"engine": {"gpu_resident": 4}}, "has 3 layers"),
                              ({"optimizer": {"moment_dtype": "bfloat16"}}, "moment_dtype=float32")):
        engine = {"gpu_resident": 2, **sections.pop("engine", {})}
        with pytest.raises(ConfigError, match=message):
            RunSpec.resolve(tiny_config(tmp_path, engine=engine, **sections))
    with pytest.raises(ConfigError, match="one GPU worker"):
        RunSpec.resolve(tiny_config(tmp_path, engine={"gpu_resident": 1}), ranks_per_node=2)
    with pytest.raises(ConfigError, match="gpu_resident"):
        tiny_config(tmp_path, engine={"gpu_resident": -1})
    with pytest.raises(ConfigError, match="kept_activations"):
        tiny_config(tmp_path, engine={"kept_activations": -1})
    every = RunSpec.resolve(tiny_config(tmp_path, engine={"gpu_resident": "all", "kept_activations": 5}))
    assert (every.resident_layers, every.resident_vocab, every.kept_layers) == (3, True, 3)  # clamped to the layers
    default = RunSpec.resolve(tiny_config(tmp_path))
    assert (default.resident_layers, default.resident_vocab, default.kept_layers) == (0, False, 0)  # auto: the plan's


@pytest.mark.ray
def test_through_ray_with_two_optimizer_workers_and_a_restart(tmp_path, ray_session):
    """Ray actors, two optimizer workers, clipping on, the GPU worker killed at step 5: the run restarts from
    the checkpoint of step 3 (its resident layers refilled from the host segments) and ends as a local
    run without the tier does."""
    common = {"optimizer": {"workers": 2, "lr": 1e-2}, "train": {"steps": 8}, "precision": FLOAT64,
              "checkpoint": {"every": 3}}
    streamed = train(tiny_config(tmp_path / "none", **common))
    cfg = tiny_config(tmp_path / "ray", engine={"gpu_resident": 2}, runtime={"mode": "ray"},
                      fault={"max_restarts": 1, "drill": "kill:gpu@5"}, **common)
    resident = train(cfg)
    assert resident[0].restarts == 1
    assert_same_run(resident, streamed, rel=1e-12)
