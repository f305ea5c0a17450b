"""Where a run writes: relative paths under the storage root, never inside Ray's session tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrain_ray.config.load import load_config
from megatrain_ray.driver.outputs import place_outputs, ray_session_tree
from megatrain_ray.exceptions import ConfigError
from tests.conftest import REPO

TINY = str(Path(REPO) / "configs" / "tiny.yaml")


def fake_ray_tree(tmp_path: Path) -> Path:
    """Ray's temp layout: <temp>/session_<date>/runtime_resources/working_dir_files/_ray_pkg_<hash>, and the
    session_latest link beside the session."""
    session = tmp_path / "ray" / "session_2026-11-25_03-00-00_123"
    workdir = session / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    workdir.mkdir(parents=True)
    (tmp_path / "ray" / "session_latest").symlink_to(session)
    return workdir


def test_relative_outputs_go_under_the_working_directory_outside_ray(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = place_outputs(load_config(TINY, ["train.output_dir=runs/a", "train.export_dir=exp"]))
    assert cfg.train.output_dir == str(tmp_path / "runs" / "a")
    assert cfg.train.export_dir == str(tmp_path / "exp") and cfg.checkpoint.dir == ""


def test_in_a_job_working_dir_copy_relative_outputs_go_to_the_home_storage(tmp_path, monkeypatch):
    workdir = fake_ray_tree(tmp_path)
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ray_session_tree(workdir) is not None and ray_session_tree(tmp_path) is None
    cfg = place_outputs(load_config(TINY, ["train.output_dir=runs/a", "checkpoint.dir=ck"]))
    assert cfg.train.output_dir == str(tmp_path / "home" / "megatrain" / "runs" / "a")
    assert cfg.checkpoint.dir == str(tmp_path / "home" / "megatrain" / "ck")
    chosen = place_outputs(load_config(TINY, ["train.output_dir=runs/a", f"train.storage_root={tmp_path}/store"]))
    assert chosen.train.output_dir == str(tmp_path / "store" / "runs" / "a")


def test_an_output_inside_rays_session_tree_is_refused_naming_the_key(tmp_path, monkeypatch):
    workdir = fake_ray_tree(tmp_path)
    for key in ("train.output_dir", "checkpoint.dir", "train.export_dir"):
        with pytest.raises(ConfigError, match=f"{key}=.*lies in Ray's temporary session directory"):
            place_outputs(load_config(TINY, [f"{key}={workdir / 'out'}"]))
    monkeypatch.chdir(workdir)
    with pytest.raises(ConfigError, match="train.output_dir"):
        place_outputs(load_config(TINY, ["train.output_dir=runs/a", "train.storage_root=."]))


def test_an_attached_cluster_beyond_loopback_or_without_auth_is_warned_about_once(monkeypatch, caplog):
    import ray._raylet

    from megatrain_ray.driver import runtime

    monkeypatch.setattr(ray._raylet, "get_authentication_mode", lambda: ray._raylet.AuthenticationMode.TOKEN)
    with caplog.at_level("WARNING"):
        runtime._warn_if_open("127.0.0.1:6379")
    assert not caplog.records
    monkeypatch.setattr(ray._raylet, "get_authentication_mode", lambda: ray._raylet.AuthenticationMode.DISABLED)
    with caplog.at_level("WARNING"):
        runtime._warn_if_open("10.1.2.3:6379")
    assert len(caplog.records) == 1
    text = caplog.records[0].getMessage()
    assert "beyond loopback" in text and "without token auth" in text and "megatrain cluster start" in text


def test_the_export_room_checked_before_a_run_is_that_of_the_dtype_config_json_names(tmp_path, monkeypatch):
    """train.export_dtype=auto exports in model.path's config.json dtype (Qwen2.5-7B-Instruct's: bfloat16): the check
    before the run asks for 2 bytes a parameter, not float32's 4; an explicit float32 still gets 4."""
    from megatrain_ray.config.resolved import RunSpec
    from megatrain_ray.driver import outputs
    from megatrain_ray.store.disk_use import export_dtype

    model = str(Path(REPO) / "tests" / "fixtures" / "hub_configs" / "Qwen--Qwen2.5-7B-Instruct")
    asked: dict[str, int] = {}
    monkeypatch.setattr(outputs, "check_output_dir", lambda path, key, error, nbytes=0: asked.__setitem__(key, nbytes))
    for setting, per_param in (("auto", 2), ("float32", 4), ("bfloat16", 2)):
        raw = {"model": {"path": model}, "data": {"path": "synthetic", "seq_len": 16, "batch_size": 1},
               "train": {"export_dir": str(tmp_path / "exp"), "export_dtype": setting}}
        cfg = load_config(raw=raw)
        outputs.check_outputs(cfg, tmp_path / "run", tmp_path / "ck", 1000, RunSpec.resolve(cfg))
        assert asked["train.export_dir"] == 1000 * per_param, setting
    assert export_dtype("auto", None) == ("float32", "train.export_dtype=auto: model.path is empty (random init)")
