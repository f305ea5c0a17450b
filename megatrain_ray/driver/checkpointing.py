"""The driver's side of checkpoints: which one a run resumes from, and the save protocol with the shards.

A save is asynchronous: every HostShard snapshots its stages and writes them in the background
(save_begin); the next step runs meanwhile, and the save completes when the shards' file entries are
back (save_wait) and the manifest commits the directory.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatrain_ray.config.sections import Config
from megatrain_ray.data.batches import DocumentBatches
from megatrain_ray.data.token_batches import TokenBatches
from megatrain_ray.driver.runtime import Handle
from megatrain_ray.config.hf_vision import vision_config_of_dir
from megatrain_ray.engine.adapters import ADAPTER_STAGE
from megatrain_ray.engine.vision_tier import VISION_STAGE
from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.model.layout import ModelLayout, StageLayout
from megatrain_ray.observe.log import get_logger
from megatrain_ray.store.checkpoint import CheckpointDir, CheckpointInfo, check_compatible, read_manifest, rng_state
from megatrain_ray.system.files import write_atomic

log = get_logger(__name__)


def truncate_metrics(path: Path, next_step: int) -> None:
    """Drop the records of steps >= next_step (written after the checkpoint a run resumes from)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", -1) < next_step]
    write_atomic(path, "".join(line + "\n" for line in kept))


def state_config(cfg: Config) -> dict[str, dict[str, Any]]:
    """The config keys that decide what the saved state means: a checkpoint only loads where they agree.
    host.moments_tier is not one of them: the files are the same from either tier, nor model.pad_token_id (which
    rows train, not what the tensors are; checkpoints from before it was read hold none)."""
    finetune = cfg.to_dict()["finetune"] if cfg.finetune.method == "lora" else {"method": "full"}
    model = {k: v for k, v in cfg.to_dict()["model"].items() if k != "pad_token_id"}
    o = cfg.optimizer
    optimizer: dict[str, Any] = {"moment_dtype": o.moment_dtype, "state": o.state}
    if o.state == "lean":  # the lean state's format (a full run's checkpoint is refused by `state` first)
        optimizer.update(lean_moments=o.lean_moments, **({"lean_block": o.lean_block} if o.lean_moments == "int8"
                                                         else {}))
    return {"model": model, "precision": {"master_dtype": cfg.precision.master_dtype},
            "optimizer": optimizer, "finetune": finetune}


def find_checkpoint(resume: str | None, checkpoints: CheckpointDir, layout: ModelLayout,
                    cfg: Config) -> CheckpointInfo | None:
    """The checkpoint `resume` names (a directory, or "auto": the newest complete one), checked against
    this config before anything is allocated; None to start at step 0."""
    if resume is None:
        return None
    info = checkpoints.latest() if resume == "auto" else read_manifest(resume)
    if info is None:
        log.info("--resume auto: no complete checkpoint under %s, starting from step 0", checkpoints.root)
        return None
    # A LoRA checkpoint holds the adapters' file only (its base is the model.path it records, loaded again).
    stages = {ADAPTER_STAGE} if cfg.finetune.method == "lora" else {s.index for s in layout.stages}
    if vision_config_of_dir(cfg.model.path) is not None:  # the vision tower and projector's file (engine/vision_tier.py)
        stages.add(VISION_STAGE)
    check_compatible(info, layout, state_config(cfg), stages)
    if info.step > cfg.train.steps:
        raise CheckpointError(f"checkpoint {info.directory} is at step {info.step}, beyond "
                              f"train.steps={cfg.train.steps}; raise train.steps to continue training")
    return info


class ResidentTensors(Mapping[str, torch.Tensor]):
    """One kind of the GPU-resident stages' tensors by Hugging Face name, fetched from the GPU worker that holds
    them one stage at a time (export reads tensors in layout order: each stage crosses once, and only one
    stage's copy is in the driver at a time)."""

    def __init__(self, gpu: Handle, stages: tuple[StageLayout, ...], kind: str = "master"):
        self.gpu, self.kind = gpu, kind
        self.stage_of = {stage.hf_name(s): stage.index for stage in stages for s in stage.slots}
        self._fetched: tuple[int, dict[str, torch.Tensor]] = (-1, {})

    def __getitem__(self, name: str) -> torch.Tensor:
        index = self.stage_of[name]
        if self._fetched[0] != index:
            self._fetched = (index, self.gpu.resident_tensors(self.kind, index).result())
        return self._fetched[1][name]

    def __contains__(self, name: object) -> bool:  # without fetching anything
        return name in self.stage_of

    def __iter__(self) -> Iterator[str]:
        return iter(self.stage_of)

    def __len__(self) -> int:
        return len(self.stage_of)


@dataclass(frozen=True, slots=True)
class SaveInFlight:
    """A save the shards are writing: the state after `step` steps, `updates` of them applied."""

    step: int
    updates: int
    partial: Path
    started: float
    resident_files: list[dict]
    """The entries of the GPU-resident stages' files (engine.gpu_resident), written by the GPU worker."""
    extra: dict
    """The driver's own entries of the manifest (GRPO: a num_iterations group's batch, driver/grpo.py)."""


class Checkpointer:
    """Begins saves on node 0's shards and completes them; at most one is in flight."""

    def __init__(self, cfg: Config, checkpoints: CheckpointDir, data: TokenBatches | DocumentBatches):
        self.cfg, self.checkpoints, self.data = cfg, checkpoints, data
        self.in_flight: SaveInFlight | None = None
        self.tracking: Callable[[], dict[str, Any]] = dict
        """The experiment trackers' run ids (observe/tracking.Tracking.state), kept in each manifest."""

    def begin(self, shards: list[Handle], step: int, updates: int, partial: Path, die: bool,
              resident: Handle | None = None, driver_state: Callable[[int, Path], dict] | None = None) -> None:
        """Every shard holds its stages and starts writing them; `die` arms the kill_during_checkpoint drill.
        `resident`: the GPU worker holding GPU-resident stages, which writes their files before the next step
        changes them (meanwhile the shards write theirs). `driver_state(step, partial)`: writes the driver's own
        files into the directory now and returns their manifest entries."""
        for begun in [shard.save_begin(step, str(partial), die) for shard in shards]:
            begun.result()
        started = time.perf_counter()
        files = resident.save_resident(step, str(partial)).result() if resident is not None else []
        extra = driver_state(step, partial) if driver_state is not None else {}
        self.in_flight = SaveInFlight(step, updates, partial, started, files, extra)

    def finish(self, shards: list[Handle], run_id: str) -> Path:
        """Wait for the shards' files and commit the save in flight; its directory."""
        assert self.in_flight is not None
        save, self.in_flight = self.in_flight, None
        files = sorted([entry for shard in shards for entry in shard.save_wait().result()] + save.resident_files,
                       key=lambda entry: entry["stage"])
        manifest = {"updates_applied": save.updates, "state_config": state_config(self.cfg),
                    "config": self.cfg.to_dict(), "rng": rng_state(),
                    "data": {"seed": self.cfg.data.seed, "epoch": self.data.epoch_of(save.step)},
                    "run_id": run_id, "tracking": self.tracking(), "files": files, **save.extra}
        final = self.checkpoints.commit(save.partial, save.step, manifest, self.cfg.checkpoint.keep)
        log.info("checkpoint of step %d: %s (%.2f GiB, %.1f s)", save.step, final,
                 sum(e["bytes"] for e in files) / 2**30, time.perf_counter() - save.started)
        return final

    def finish_or_lose(self, shards: list[Handle], run_id: str) -> None:
        """After an actor died: complete the save in flight if its writers live (its snapshot predates the
        failure); else it is lost and the previous checkpoint stands."""
        if self.in_flight is not None:
            try:
                self.finish(shards, run_id)
            except Exception as failed:  # noqa: BLE001 (a dead shard)
                log.warning("the checkpoint in flight is lost: %s", str(failed).splitlines()[0])
                self.in_flight = None
