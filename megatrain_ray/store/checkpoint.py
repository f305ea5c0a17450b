"""Checkpoints: the whole training state on disk, written by the HostShards while training goes on.

    <checkpoint.dir>/step-00000010/
        stage-0000.safetensors   one file per stage (embedding, each layer, head): the master weights
                                 by Hugging Face name, then `optimizer.exp_avg.<name>` and
                                 `optimizer.exp_avg_sq.<name>` in their own dtype (F32, or BF16 with
                                 optimizer.moment_dtype=bfloat16); with optimizer.state=lean a BF16
                                 master, `optimizer.master_comp.<name>` (BF16), and the moments
                                 either BF16 by name or, 8-bit, whole (`optimizer.exp_avg`, U8) with
                                 their scales (`optimizer.exp_avg_scale`, F32)
        ...
        manifest.json            written last: step, updates applied, config, RNG states, and for
                                 each file its size and CRC-32

A checkpoint is written into `.partial-step-00000010-<run>` and renamed to its final name only
after every file and the manifest are on disk (fsync), so a directory named `step-*` with a
manifest whose files all match is complete; anything else is never loaded. The streaming copy is
not saved: it is the master weights cast to the streaming dtype, rebuilt on load.

Snapshot semantics without a second copy of the state: each HostShard marks its stages as held in
a small shared gate segment before the next step starts; an OptimizerWorker waits for a stage's
mark to clear before it updates that stage. The shard writes its stages in the order the updates
come (head, last layer ... first layer, embedding), so the writes usually finish before the
optimizer needs them and the step does not wait.

The files are plain safetensors (store/safetensors_io.py streams the bytes from shared memory to disk with
their checksum in one pass, and reads them back straight into the segments); any safetensors reader
opens them. Nothing is ever pickled. With the disk tier (host.moments_tier=disk) the moments stream
from and to their files in host.disk_dir through a bounce buffer (disk_tier.DiskTensor); the format
is the same, so a checkpoint resumes in either tier.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatrain_ray.config.load import _build
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.exceptions import CheckpointError, ConfigError, excerpt
from megatrain_ray.model.layout import ModelLayout, StageLayout
from megatrain_ray.observe.log import get_logger
from megatrain_ray.store.safetensors_io import read_safetensors_into, write_safetensors
from megatrain_ray.system.files import contained, read_json_object

log = get_logger(__name__)

FORMAT = "megatrain-checkpoint/1"
MANIFEST = "manifest.json"
OPTIMIZER_KINDS = ("exp_avg", "exp_avg_sq")
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def stage_file(stage: StageLayout) -> str:
    return f"stage-{stage.index:04d}.safetensors"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


LEAN_OPTIMIZER_KINDS = ("master_comp", "exp_avg_scale", "exp_avg_sq_scale")
"""The lean state's kinds beyond master and moments (optimizer.state=lean; store/segments.LEAN_KINDS)."""


def stage_tensors(stage: StageLayout, flats: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Named views into a stage's flat buffers (`master`, `exp_avg`, `exp_avg_sq`; with the lean state also
    `master_comp` and the scales), in file order. Per tensor by Hugging Face name, except what is blockwise: 8-bit
    moments (uint8, a block may span tensors) and their scales are saved whole, padding included, as
    `optimizer.<kind>`, so that a resumed run has every block as it was."""
    out = []
    for kind in ("master", "master_comp", *OPTIMIZER_KINDS, "exp_avg_scale", "exp_avg_sq_scale"):
        if kind not in flats and kind in LEAN_OPTIMIZER_KINDS:
            continue
        prefix = "" if kind == "master" else f"optimizer.{kind}."
        flat = flats[kind]
        if flat.dtype == torch.uint8 or kind.endswith("_scale"):
            out.append((f"optimizer.{kind}", flat))
            continue
        for slot in stage.slots:
            out.append((prefix + stage.hf_name(slot), flat[slot.offset:slot.offset + slot.numel].view(slot.shape)))
    return out


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- shard side


class StageWriter:
    """Writes a shard's stages of one checkpoint in a background thread, clearing each stage's gate
    mark once its file is on disk (see the module docstring)."""

    def __init__(self, stages: list[StageLayout], flats: Callable[[int], dict[str, torch.Tensor]],
                 gate: torch.Tensor, directory: Path, step: int, die_after_first: bool = False):
        self.stages = sorted(stages, key=lambda s: -s.index)  # the order the updates come in
        self.flats, self.gate, self.directory, self.step = flats, gate, directory, step
        self.die_after_first = die_after_first
        self.entries: list[dict] = []
        self.error: BaseException | None = None
        self.seconds = 0.0
        for stage in self.stages:
            gate[stage.index] = 1
        self.thread = threading.Thread(target=self._run, name=f"checkpoint-{step}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            for stage in self.stages:
                self.entries.append(write_stage(self.directory, stage, self.flats(stage.index), self.step))
                self.gate[stage.index] = 0
                if self.die_after_first:
                    log.warning("fault drill: this process dies in the middle of the checkpoint of step %d",
                                self.step)
                    os.kill(os.getpid(), 9)
        except BaseException as exc:  # reported by wait(); the gate is cleared so training never hangs
            self.error = exc
        finally:
            for stage in self.stages:
                self.gate[stage.index] = 0
            self.seconds = time.perf_counter() - t0

    def wait(self) -> list[dict]:
        self.thread.join()
        if self.error is not None:
            raise CheckpointError(f"writing the checkpoint of step {self.step} into {self.directory} failed: "
                                  f"{self.error}") from self.error
        return sorted(self.entries, key=lambda e: e["stage"])


def write_stage(directory: Path, stage: StageLayout, flats: dict[str, torch.Tensor], step: int) -> dict:
    """One stage's file of a checkpoint from its flat buffers (`master`, `exp_avg`, `exp_avg_sq`); its manifest
    entry. The shards write theirs with it, the GPU worker those of the GPU-resident stages."""
    entry = write_safetensors(directory / stage_file(stage), stage_tensors(stage, flats),
                              {"format": FORMAT, "step": str(step), "stage": stage.name})
    entry["stage"] = stage.index
    return entry


def wait_for_gate(gates: list[torch.Tensor], stage: int) -> float:
    """Block while a checkpoint holds `stage`; returns the seconds waited."""
    if not any(int(g[stage]) for g in gates):
        return 0.0
    t0 = time.perf_counter()
    while any(int(g[stage]) for g in gates):
        time.sleep(0.0005)
    return time.perf_counter() - t0


def load_stage(directory: Path, stage: StageLayout, flats: dict[str, torch.Tensor], entry: dict) -> None:
    path = contained(directory, entry["path"], f"checkpoint {directory}: {MANIFEST}", CheckpointError)
    read_safetensors_into(path, dict(stage_tensors(stage, flats)), entry)


# ----------------------------------------------------------------------------- driver side


@dataclass(frozen=True)
class CheckpointInfo:
    directory: Path
    manifest: dict

    @property
    def step(self) -> int:
        """Steps completed: training resumes at this step number."""
        return int(self.manifest["step"])

    def entry_of(self, stage: int) -> dict:
        for entry in self.manifest["files"]:
            if entry["stage"] == stage:
                return entry
        raise CheckpointError(f"checkpoint {self.directory} has no file for stage {stage}")


def rng_state() -> dict[str, Any]:
    """The driver's global generators. Training itself draws from none of them (batches and initial
    weights come from seeded generators of their own), but code around a run may."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
            "numpy": [name, keys.tolist(), pos, has_gauss, cached]}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


class CheckpointDir:
    """The checkpoints of a run: partial directories, atomic commit, pruning, finding the newest good one."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def partial(self, step: int, run_id: str) -> Path:
        path = self.root / f".partial-{step_dir_name(step)}-{run_id}"
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        return path

    def commit(self, partial: Path, step: int, manifest: dict, keep: int) -> Path:
        """Write the manifest, make everything durable, rename into place, prune to `keep`."""
        manifest = {"format": FORMAT, "step": step, "created": time.time(), **manifest}
        with open(partial / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(partial)
        final = self.root / step_dir_name(step)
        if final.exists():  # a checkpoint of the same step from an earlier attempt: replace it
            stale = self.root / f".stale-{final.name}-{os.getpid()}"
            os.replace(final, stale)
            shutil.rmtree(stale)
        os.replace(partial, final)
        fsync_dir(self.root)
        self.prune(keep)
        return final

    def complete(self) -> list[CheckpointInfo]:
        """Checkpoints whose manifest parses and whose files all exist with their recorded sizes,
        oldest first (CRCs are checked when the shards read them)."""
        found = []
        if not self.root.is_dir():
            return found
        for path in sorted(self.root.iterdir()):
            if not _STEP_DIR.match(path.name):
                continue
            try:
                found.append(read_manifest(path))
            except CheckpointError as exc:
                log.warning("ignoring %s: %s", path, exc)
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> CheckpointInfo | None:
        done = self.complete()
        return done[-1] if done else None

    def prune(self, keep: int) -> None:
        for info in self.complete()[:-keep]:
            shutil.rmtree(info.directory, ignore_errors=True)
        for path in self.root.iterdir():  # partial directories of writers that died
            if path.name.startswith(".partial-") and not _owner_alive(path.name):
                shutil.rmtree(path, ignore_errors=True)


def _owner_alive(name: str) -> bool:
    """Partial directories end in the writer's run id, whose middle part is the driver's pid."""
    parts = name.rsplit("-", 3)
    try:
        os.kill(int(parts[-2]), 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def read_manifest(directory: str | Path) -> CheckpointInfo:
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory} has no {MANIFEST}: it is incomplete")
    where = f"checkpoint {directory}: {MANIFEST}"
    try:
        manifest = read_json_object(path, where, CheckpointError)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc} (the manifest is corrupt)") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a {FORMAT} manifest")
    files = manifest.get("files")
    if not isinstance(files, list) or not isinstance(manifest.get("step"), int) or manifest["step"] < 0:
        raise CheckpointError(f"{where} is corrupt: it needs a whole-number 'step' and a list of 'files'")
    for entry in files:
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool)
                                                  for k in ("bytes", "crc32", "stage")):
            raise CheckpointError(f"{where} is corrupt: file entry {excerpt(entry)} needs path, bytes, crc32 and "
                                  "stage")
        file = contained(directory, entry.get("path"), where, CheckpointError)
        if not file.is_file() or file.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"checkpoint {directory}: {entry['path']} is missing or has the wrong size")
    return CheckpointInfo(directory, manifest)


# State-defining keys added after checkpoints already existed: what those checkpoints hold.
_STATE_KEYS_BEFORE = {("optimizer", "moment_dtype"): "float32", ("finetune", "method"): "full",
                      ("optimizer", "state"): "full"}


def check_compatible(info: CheckpointInfo, layout: ModelLayout, state_config: dict,
                     stages: set[int] | None = None) -> None:
    """Refuse a checkpoint of another model shape or precision, naming the first key that differs. `stages`: the
    file entries a checkpoint of this run holds (None: one per stage of the model)."""
    saved = info.manifest.get("state_config", {})
    for section, values in state_config.items():
        for key, value in values.items():
            old = saved.get(section, {}).get(key, _STATE_KEYS_BEFORE.get((section, key)))
            if old != value:
                raise CheckpointError(f"checkpoint {info.directory} was written with {section}.{key}={old!r}, "
                                      f"this config has {value!r}: resume with the config of that run")
    held = {e["stage"] for e in info.manifest.get("files", [])}
    expected = stages if stages is not None else {s.index for s in layout.stages}
    if held != expected:
        raise CheckpointError(f"checkpoint {info.directory} holds {len(held)} stage files, this run expects "
                              f"{len(expected)}")


class CheckpointWeights(Mapping[str, torch.Tensor]):
    """The master weights of a checkpoint by Hugging Face name, read one tensor per lookup (for export)."""

    def __init__(self, info: CheckpointInfo):
        from safetensors import safe_open

        self._open = safe_open
        self.files: dict[str, Path] = {}
        for entry in info.manifest["files"]:
            path = contained(info.directory, entry["path"], f"checkpoint {info.directory}: {MANIFEST}",
                             CheckpointError)
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if not name.startswith("optimizer."):
                        self.files[name] = path

    def __getitem__(self, name: str) -> torch.Tensor:
        with self._open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def model_config_of(info: CheckpointInfo) -> ModelConfig:
    """The model a checkpoint holds, from the config saved in its manifest."""
    saved = info.manifest.get("config")
    model = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(model, dict):
        raise CheckpointError(f"checkpoint {info.directory}: {MANIFEST} holds no model config; it is corrupt")
    try:
        return _build(ModelConfig, dict(model), "model")
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint {info.directory}: {MANIFEST} holds a model config this version cannot "
                              f"read ({exc})") from None
