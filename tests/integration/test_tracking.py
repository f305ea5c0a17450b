"""Experiment tracking (train.report_to): each tracker's own reader gets back exactly the numbers of metrics.jsonl.

TensorBoard's event files are read with tensorboard's EventAccumulator, MLflow's run through MlflowClient on a
local file store, W&B's offline run from its .wandb file (its record log, parsed with wandb's own protobuf
classes). No test sends network traffic: W&B runs offline, MLflow writes a directory, telemetry is off.
A resume continues the same tracked runs, with every step exactly once.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from megatrain_ray.config.load import load_config
from megatrain_ray.driver.tracking import numeric_fields
from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.store.checkpoint import CheckpointDir
from tests.conftest import prepared_data, tiny_raw

STEPS, EVERY = 6, 2


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Every tracker local: MLflow's file store and W&B's offline mode under tmp_path, no telemetry."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 refuses file stores otherwise
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "megatrain-test")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_PROJECT", "megatrain-test")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


def tracked_config(tmp_path: Path, report_to: list[str], steps: int = STEPS, **sections):
    """The tiny model on prepared data (it has an eval split), evaluating every EVERY steps, in tmp_path/run."""
    raw = tiny_raw(**sections)
    raw["data"] = {**raw["data"], "path": str(prepared_data(tmp_path / "data")), "seq_len": 32}
    raw["train"] = {**raw["train"], "steps": steps, "eval_every": EVERY, "eval_batches": 1, "report_to": report_to,
                    "run_name": "tiny-run", "output_dir": str(tmp_path / "run")}
    return load_config(raw=raw)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def expected(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as key -> {step: value}, the numeric fields a tracker gets."""
    out: dict[str, dict[int, float]] = {}
    for record in metrics(run_dir):
        for key, value in numeric_fields(record).items():
            out.setdefault(key, {})[record["step"]] = value
    return out


def assert_same(got: dict[str, list[tuple[int, float]]], want: dict[str, dict[int, float]],
                keys: set[str] | None = None) -> None:
    """Every key of `want` (or `keys`) has exactly its steps, each once, equal within float32 rounding."""
    for key in keys if keys is not None else want:
        steps = [s for s, _ in got.get(key, [])]
        assert sorted(steps) == sorted(want[key]) and len(set(steps)) == len(steps), (key, steps, sorted(want[key]))
        for step, value in got[key]:
            ref = want[key][step]
            assert (math.isnan(value) and math.isnan(ref)) or value == pytest.approx(ref, rel=1e-6, abs=1e-12), \
                (key, step, value, ref)


# ----------------------------------------------------------------------------- the readers


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mlflow_metrics(run_id: str, keys) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    return {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in keys}


def wandb_records(path: Path):
    """The records of a .wandb file: W&B's LevelDB-style log (a 7-byte header, 32 KiB blocks of chunks with a
    7-byte header: CRC, length, type full/first/middle/last), each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), path
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0:  # block padding
            pos += left - 7
            continue
        parts = data[pos:pos + length] if kind in (1, 2) else parts + data[pos:pos + length]
        pos += length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def wandb_runs(wandb_dir: Path) -> dict[str, list[Path]]:
    """Run id -> its offline run files, oldest first (a resumed offline run writes a second directory)."""
    runs: dict[str, list[Path]] = {}
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        runs.setdefault(path.stem.removeprefix("run-"), []).append(path)
    return runs


def wandb_history(files: list[Path]) -> tuple[dict[str, list[tuple[int, float]]], dict]:
    """key -> [(step, value)] of the run's history records, and its config."""
    history: dict[str, list[tuple[int, float]]] = {}
    config: dict = {}
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                step = record.history.step.num
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        history.setdefault(key, []).append((step, float(json.loads(item.value_json))))
            elif kind in ("run", "config"):
                updates = record.run.config.update if kind == "run" else record.config.update
                config.update({u.key: json.loads(u.value_json) for u in updates})
    return history, config


# ----------------------------------------------------------------------------- tests


def run_tracked(tmp_path: Path, report_to: list[str]) -> Path:
    with Trainer(tracked_config(tmp_path, report_to)) as trainer:
        trainer.train()
    return tmp_path / "run"


def test_tensorboard_event_files_hold_the_metrics_jsonl_values(offline):
    pytest.importorskip("tensorboard")
    run_dir = run_tracked(offline, ["tensorboard"])
    want = expected(run_dir)
    assert {"loss", "lr", "grad_norm", "tok_per_s", "eval_loss"} <= set(want)
    assert sorted(want["eval_loss"]) == [1, 3, 5]
    got = tensorboard_scalars(run_dir / "tensorboard")
    assert set(got) == set(want)
    assert_same(got, want)
    manifest = CheckpointDir(run_dir / "checkpoints").latest().manifest
    assert manifest["tracking"] == {"tensorboard": {"log_dir": str(run_dir / "tensorboard")}}


def test_mlflow_run_holds_the_metrics_jsonl_values_and_the_config(offline):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    run_dir = run_tracked(offline, ["mlflow"])
    run_id = CheckpointDir(run_dir / "checkpoints").latest().manifest["tracking"]["mlflow"]["run_id"]
    run = MlflowClient().get_run(run_id)
    assert run.info.run_name == "tiny-run" and run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == str(STEPS) and run.data.params["model.hidden_size"] == "64"
    want = expected(run_dir)
    assert set(run.data.metrics) == set(want)
    assert_same(mlflow_metrics(run_id, want), want)


def test_wandb_offline_run_holds_the_metrics_jsonl_values_and_the_config(offline):
    pytest.importorskip("wandb")
    run_dir = run_tracked(offline, ["wandb"])
    state = CheckpointDir(run_dir / "checkpoints").latest().manifest["tracking"]["wandb"]
    assert state["project"] == "megatrain-test"
    runs = wandb_runs(offline / "wandb")
    assert list(runs) == [state["run_id"]]
    history, config = wandb_history(runs[state["run_id"]])
    want = expected(run_dir)
    assert set(history) == set(want)
    assert_same(history, want)
    assert config["train"]["steps"] == STEPS and config["model"]["hidden_size"] == 64


def test_resume_continues_the_same_tracked_runs_with_every_step_once(offline):
    """Train 4 steps (checkpoint at 2), lose the process after step 4 without a checkpoint there, resume
    from step 2 to 8: each tracker has one run holding steps 0..7 once. TensorBoard replaced steps 2-3 with the
    rerun's values (all of metrics.jsonl); MLflow and W&B kept theirs, equal to the rerun's but for timings."""
    for package in ("tensorboard", "mlflow", "wandb"):
        pytest.importorskip(package)
    trackers = ["tensorboard", "mlflow", "wandb"]
    run_dir = offline / "run"
    with Trainer(tracked_config(offline, trackers, steps=4, checkpoint={"every": 2})) as trainer:  # like a run killed after step 3: the last checkpoint is the one of step 2
        for step in range(4):
            trainer.step(step)
            trainer.next_step = step + 1
            if trainer.next_step == 2:
                trainer.save(wait=True)
        first = trainer._tracking.state()
    before = {r["step"]: r for r in metrics(run_dir)}
    assert sorted(before) == [0, 1, 2, 3]

    with Trainer(tracked_config(offline, trackers, steps=8, checkpoint={"every": 2}), resume="auto") as trainer:
        assert trainer.next_step == 2
        trainer.train()
    manifest = CheckpointDir(run_dir / "checkpoints").latest().manifest
    assert manifest["step"] == 8 and manifest["tracking"] == first  # the same runs, start to end

    want = expected(run_dir)
    assert sorted(want["loss"]) == list(range(8)) and sorted(want["eval_loss"]) == [1, 3, 5, 7]
    for step in (2, 3):  # the resume reran steps 2 and 3 bit-identically
        assert metrics(run_dir)[step]["loss"] == before[step]["loss"]
    exact = {"loss", "lr", "grad_norm", "eval_loss", "tokens", "epoch"}  # what a rerun reproduces

    assert_same(tensorboard_scalars(Path(first["tensorboard"]["log_dir"])), want)

    from mlflow.tracking import MlflowClient

    assert MlflowClient().get_run(first["mlflow"]["run_id"]).info.status == "FINISHED"
    assert_same(mlflow_metrics(first["mlflow"]["run_id"], want), want, exact)

    runs = wandb_runs(offline / "wandb")
    assert list(runs) == [first["wandb"]["run_id"]] and len(runs[first["wandb"]["run_id"]]) == 2
    history, _ = wandb_history(runs[first["wandb"]["run_id"]])
    assert_same(history, want, exact)


def test_an_unknown_tracker_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.report_to.*'tensorbord'.*tensorboard, mlflow, wandb"):
        tracked_config(tmp_path, ["tensorbord"])
    with pytest.raises(ConfigError, match=r"train\.report_to.*expected a list"):
        tracked_config(tmp_path, "wandb")


def test_a_missing_tracker_package_is_refused_before_the_run_starts(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = tracked_config(tmp_path, ["wandb"])
    with pytest.raises(ConfigError, match=r"train\.report_to.*wandb package is not installed.*pip install .*\[track\]"):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()


def test_sigterm_closes_the_tracked_runs_as_killed_and_the_cli_resume_continues_them(offline):
    """The CLI path: SIGTERM saves a checkpoint and exits 143, MLflow's run is KILLED; `--resume auto` goes on
    in the same tracked runs (FINISHED at the end) with every step of the whole run once, equal to metrics.jsonl."""
    for package in ("tensorboard", "mlflow", "wandb"):
        pytest.importorskip(package)
    import signal

    import yaml
    from mlflow.tracking import MlflowClient

    from tests.integration.test_checkpoint import cli_args, megatrain_popen, run_to_end, wait_for_steps

    config = offline / "tracked.yaml"
    config.write_text(yaml.safe_dump(tracked_config(offline, ["tensorboard", "mlflow", "wandb"], steps=16).to_dict()))
    run_dir = offline / "run"
    proc = megatrain_popen(*cli_args(config, run_dir))
    wait_for_steps(run_dir, 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    stopped = CheckpointDir(run_dir / "checkpoints").latest()
    ids = stopped.manifest["tracking"]
    assert stopped.step < 16 and set(ids) == {"tensorboard", "mlflow", "wandb"}, err
    assert MlflowClient().get_run(ids["mlflow"]["run_id"]).info.status == "KILLED"

    resumed = run_to_end(*cli_args(config, run_dir, "--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at step {stopped.step}" in resumed.stderr
    assert CheckpointDir(run_dir / "checkpoints").latest().manifest["tracking"] == ids
    want = expected(run_dir)
    assert sorted(want["loss"]) == list(range(16))
    assert_same(tensorboard_scalars(Path(ids["tensorboard"]["log_dir"])), want)
    assert MlflowClient().get_run(ids["mlflow"]["run_id"]).info.status == "FINISHED"
    assert_same(mlflow_metrics(ids["mlflow"]["run_id"], want), want)
    runs = wandb_runs(offline / "wandb")
    assert list(runs) == [ids["wandb"]["run_id"]]
    assert_same(wandb_history(runs[ids["wandb"]["run_id"]])[0], want)


@pytest.mark.ray
def test_an_automatic_restart_rewinds_the_tracked_runs_in_process(offline, ray_session):
    """An optimizer worker dies at step 5 (checkpoint at 3) and the run restarts its actors by itself: the same
    tracked runs go on, each with steps 0..9 once (TensorBoard with the rerun's values of steps 3-4)."""
    for package in ("tensorboard", "mlflow", "wandb"):
        pytest.importorskip(package)
    cfg = tracked_config(offline, ["tensorboard", "mlflow", "wandb"], steps=10, runtime={"mode": "ray"},
                         checkpoint={"every": 3}, fault={"max_restarts": 1, "drill": "kill:optim0@5"})
    with Trainer(cfg) as trainer:
        trainer.train()
        assert trainer.restarts == 1
        ids = trainer._tracking.state()
    run_dir = offline / "run"
    assert CheckpointDir(run_dir / "checkpoints").latest().manifest["tracking"] == ids
    want = expected(run_dir)
    assert sorted(want["loss"]) == list(range(10))
    exact = {"loss", "lr", "grad_norm", "eval_loss", "tokens", "epoch"}
    assert_same(tensorboard_scalars(Path(ids["tensorboard"]["log_dir"])), want)
    assert_same(mlflow_metrics(ids["mlflow"]["run_id"], want), want, exact)
    runs = wandb_runs(offline / "wandb")
    assert list(runs) == [ids["wandb"]["run_id"]]
    assert_same(wandb_history(runs[ids["wandb"]["run_id"]])[0], want, exact)
