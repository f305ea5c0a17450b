"""Where a run writes: its output, checkpoint and export directories, placed and checked before anything starts.

A relative path is taken under `train.storage_root`. With `auto` that is the working directory, except in
a directory Ray made (a job's `--working-dir` copy, under Ray's session tree): Ray deletes it when the
cluster stops, and every submit of an edited checkout gets another one, so a run written there would be
lost and `--resume auto` would find nothing. There `auto` is `~/megatrain`, as Ray Train keeps its results
under the home directory. A path that still lies in Ray's session tree is refused.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.model.lora import lora_params
from megatrain_ray.store.disk_use import export_bytes, export_dtype
from megatrain_ray.system.files import check_output_dir

HOME_STORAGE = "~/megatrain"


def ray_session_tree(path: Path) -> Path | None:
    """The Ray session directory (`<ray temp>/session_<date>_<pid>`) that holds `path`, if one does: Ray
    writes a `session_latest` link beside every session directory."""
    for parent in [path, *path.parents]:
        if parent.name.startswith("session_") and os.path.lexists(parent.parent / "session_latest"):
            return parent
    return None


def storage_root(setting: str) -> Path:
    """`train.storage_root` as a directory: a path as given, or for `auto` the working directory outside
    Ray's session tree and ~/megatrain inside it."""
    if setting != "auto":
        return Path(setting).expanduser().absolute()
    cwd = Path.cwd()
    return Path(HOME_STORAGE).expanduser() if ray_session_tree(cwd.resolve()) else cwd


def place_outputs(cfg: Config) -> Config:
    """The config with its output, checkpoint and export directories absolute (relative ones under the
    storage root), each refused when it lies in Ray's session tree."""
    root = storage_root(cfg.train.storage_root)

    def placed(key: str, value: str) -> str:
        if not value:
            return value
        path = Path(value).expanduser()
        path = path if path.is_absolute() else root / path
        session = ray_session_tree(path.resolve())
        if session is not None:
            raise ConfigError(f"{key}={value!r} lies in Ray's temporary session directory {session}, which Ray "
                              "deletes when the cluster stops; choose a path outside it (a relative path is taken "
                              "under train.storage_root)")
        return str(path)

    train = dataclasses.replace(cfg.train, output_dir=placed("train.output_dir", cfg.train.output_dir),
                                export_dir=placed("train.export_dir", cfg.train.export_dir))
    checkpoint = dataclasses.replace(cfg.checkpoint, dir=placed("checkpoint.dir", cfg.checkpoint.dir))
    return dataclasses.replace(cfg, train=train, checkpoint=checkpoint)


def check_outputs(cfg: Config, run_dir: Path, checkpoint_dir: Path, num_params: int, run: RunSpec) -> None:
    """Every directory the run writes can be written, with room for a checkpoint and the export, before
    anything starts: a run never fails at its first checkpoint or after hours at its export."""
    check_output_dir(run_dir, "train.output_dir", ConfigError)
    saves = cfg.checkpoint.every or cfg.checkpoint.at_end
    check_output_dir(checkpoint_dir, "checkpoint.dir", ConfigError, run.checkpoint_bytes(num_params, lora_params(cfg)) if saves else 0)
    if cfg.train.export_dir:
        dtype, _ = export_dtype(cfg.train.export_dtype, cfg.model.path or None)
        size = export_bytes(num_params, dtype, lora_params(cfg) if run.frozen_base else 0)
        check_output_dir(Path(cfg.train.export_dir), "train.export_dir", ConfigError, size)
