"""model.path and prepare --tokenizer by hub name, offline: the test builds a hub cache in a temporary
HF_HOME as huggingface_hub lays it out (blobs, snapshots linking to them, refs) and resolves names from it
with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

from megatrain_ray.config.load import load_config
from megatrain_ray.exceptions import CheckpointError, ConfigError
from megatrain_ray.system.model_sources import fetch_weights
from tests.conftest import REPO
from tests.hub_cache import add_snapshot
from tests.integration.test_cli import megatrain, side_by_side

EXAMPLE = f"{REPO}/examples/finetune_qwen2"
NAME = "tiny-org/tiny-qwen2"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    sys.path.insert(0, EXAMPLE)
    from make_tiny_qwen2 import make_tiny_qwen2

    root = tmp_path_factory.mktemp("hub")
    main, v1 = make_tiny_qwen2(root / "main", seed=0), make_tiny_qwen2(root / "v1", seed=1)
    hf_home = root / "hf-home"
    snapshots = {"main": add_snapshot(hf_home, NAME, main, "main"), "v1": add_snapshot(hf_home, NAME, v1, "v1"),
                 "config-only": add_snapshot(hf_home, "tiny-org/no-weights", main, "main", with_weights=False)}
    return {"main": main, "hf_home": hf_home, **{f"snapshot-{k}": v for k, v in snapshots.items()}}


@pytest.fixture
def offline_hub(models, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(models["hf_home"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants  # read at import: point the running process at the test cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(models["hf_home"] / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return models["hf_home"]


def _model_raw(path: str, **model) -> dict:
    return {"model": {"path": path, **model}, "data": {"path": "synthetic", "seq_len": 8, "batch_size": 2},
            "runtime": {"mode": "local"}}


def test_hub_name_and_revision_resolve_from_the_cache(models, offline_hub):
    cfg = load_config(raw=_model_raw(NAME))
    assert Path(cfg.model.path) == models["snapshot-main"] and cfg.model.family == "qwen2"
    pinned = load_config(raw=_model_raw(NAME, revision="v1"))
    assert Path(pinned.model.path) == models["snapshot-v1"] and pinned.model.revision == "v1"
    with pytest.raises(ConfigError, match="no revision 'v2'|not in the hub cache at revision 'v2'"):
        load_config(raw=_model_raw(NAME, revision="v2"))
    with pytest.raises(ConfigError, match="is a local path; a revision"):
        load_config(raw=_model_raw(str(models["main"]), revision="v1"))


def test_a_config_only_snapshot_plans_and_a_run_names_the_download(models, offline_hub):
    cfg = load_config(raw=_model_raw("tiny-org/no-weights"))
    assert cfg.model.hidden_size == 64  # enough for `megatrain plan`
    with pytest.raises(CheckpointError, match="hf download tiny-org/no-weights"):
        fetch_weights(cfg.model.path)
    fetch_weights(str(models["snapshot-main"]))  # complete: nothing to do, no network asked


def test_uncached_name_is_one_clear_error(tmp_path, models):
    env_home = tmp_path / "empty-home"
    proc = _cli_offline(env_home, "plan", "--set", "model.path=nobody/missing-model", f"{REPO}/configs/tiny.yaml")
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert "nobody/missing-model" in errors[0] and "not in the hub cache" in errors[0]
    assert "HF_HUB_OFFLINE" in errors[0] and "hf download" in errors[0]


def _cli_offline(hf_home: Path, *args: str):
    return megatrain(*args, env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})


def test_prepare_and_train_by_hub_name_equal_the_local_directory(tmp_path, models):
    hub = models["hf_home"]
    by_name, by_dir = tmp_path / "data-name", tmp_path / "data-dir"
    prepared = side_by_side(
        lambda: _cli_offline(hub, "prepare", "--tokenizer", NAME, "--format", "alpaca", "--input",
                             f"{EXAMPLE}/alpaca_tiny.json", "--output", str(by_name)),
        lambda: megatrain("prepare", "--tokenizer", str(models["main"]), "--format", "alpaca", "--input",
                          f"{EXAMPLE}/alpaca_tiny.json", "--output", str(by_dir)))
    assert [p.returncode for p in prepared] == [0, 0], [p.stderr for p in prepared]
    shards = sorted(p.name for p in by_name.glob("*.parquet"))
    assert shards and all((by_name / s).read_bytes() == (by_dir / s).read_bytes() for s in shards)

    def train(label: str, model: str):
        return _cli_offline(hub, "train", f"{EXAMPLE}/config.yaml", "--local", "--set", f"model.path={model}",
                            "--set", f"data.path={by_dir}", "--set", f"train.output_dir={tmp_path / f'run-{label}'}",
                            "--set", "train.export_dir=", "--set", "train.steps=6", "--set", "train.eval_every=0")
    trained = side_by_side(lambda: train("name", NAME), lambda: train("dir", str(models["main"])))
    assert [p.returncode for p in trained] == [0, 0], [p.stderr for p in trained]
    losses = {label: [json.loads(line)["loss"] for line in (tmp_path / f"run-{label}" / "metrics.jsonl").read_text()
                      .splitlines()] for label in ("name", "dir")}
    resolved = yaml.safe_load((tmp_path / "run-name" / "config.yaml").read_text())
    assert Path(resolved["model"]["path"]) == models["snapshot-main"]
    assert len(losses["name"]) == 6 and losses["name"] == losses["dir"]


def test_a_file_that_is_no_model_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ConfigError, match="is a file but not a .gguf model"):
        load_config(raw=_model_raw(str(tmp_path / "weights.bin")))
    pytest.importorskip("gguf")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(ConfigError, match="transformers cannot read this GGUF file"):
        load_config(raw=_model_raw(str(tmp_path / "broken.gguf")))
    assert not any((tmp_path / "cache" / "gguf").iterdir())  # no half-converted directory stays
