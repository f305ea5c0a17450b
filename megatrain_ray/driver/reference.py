"""DPO's reference log-probabilities: one forward-only pass of the initial model before the first step.

Every sequence of the training split (and of the evaluation pairs) goes once through the same layer stream as training (GPU worker
`sequence_logps`, forward only, data.batch_size rows at a time), and each one's completion log-probability
is stored beside the prepared data, in `<directory>/reference/<split>-<key>.safetensors` (float64, by
document index), so the reference model is never held beside the trained one. The key hashes what the
values depend on: the model (architecture; its weight files' names, sizes and modification times, or
the seed of a random initialisation), the compute dtype and the prepared data (manifest and shard sizes).
A file with another key is another model's or data's and is left alone; a run, or a resume, with the
same key reuses the file. A resumed run cannot recompute it (its weights are no longer the initial ones),
so a missing file then stops it with a message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from megatrain_ray.config.sections import Config
from megatrain_ray.data.preference import PreferenceBatches
from megatrain_ray.exceptions import ConfigError, DataError
from megatrain_ray.observe.log import get_logger

log = get_logger(__name__)

PROGRESS_SECONDS = 5.0
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def reference_key(cfg: Config, compute_dtype: str, directory: str) -> str:
    """What the reference log-probabilities depend on, hashed (see the module docstring)."""
    digest = hashlib.sha256()
    model: dict[str, Any] = {"config": dataclasses.asdict(cfg.model), "compute_dtype": compute_dtype}
    if cfg.model.path and Path(cfg.model.path).is_dir():
        model["weights"] = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                  for p in Path(cfg.model.path).iterdir() if p.suffix in WEIGHT_SUFFIXES)
    elif not cfg.model.path:
        model["init_seed"] = cfg.train.seed
    digest.update(json.dumps(model, sort_keys=True, default=str).encode())
    root = Path(directory)
    digest.update((root / "manifest.json").read_bytes())
    for shard in sorted(root.glob("*.parquet")):
        digest.update(f"{shard.name}:{shard.stat().st_size}".encode())
    return digest.hexdigest()[:20]


def reference_path(data: PreferenceBatches, key: str) -> Path:
    return Path(data.directory) / "reference" / f"{data.split}-{key}.safetensors"


def load_or_compute(cfg: Config, data: PreferenceBatches, gpu: Any, compute_dtype: str, resuming: bool) -> torch.Tensor:
    """The reference log-probabilities of `data`'s sequences: from their file, or computed now by `gpu` (which must
    hold the initial weights) and written there."""
    from safetensors.torch import load_file, save_file

    key = reference_key(cfg, compute_dtype, data.directory)
    path = reference_path(data, key)
    if path.is_file():
        logps = load_file(path)["logps"]
        if logps.shape == (len(data.docs),):
            log.info("DPO reference log-probabilities: %d sequences from %s", len(data.docs), path)
            return logps
        log.warning("%s holds %d values for %d sequences; computing them again", path, logps.shape[0], len(data.docs))
    if resuming:
        raise ConfigError(f"resuming a DPO run needs the reference log-probabilities computed at its start, "
                          f"{path}, which is missing (or the model or data.path changed since); restore the file, or "
                          "start the run again from step 0")
    try:
        path.parent.mkdir(exist_ok=True)
    except OSError as exc:
        raise DataError(f"{data.docs.where}: cannot create {path.parent} for the DPO reference "
                        f"log-probabilities ({exc}); copy the prepared directory somewhere writable") from None
    logps = torch.empty(len(data.docs), dtype=torch.float64)
    t0 = last = time.perf_counter()
    log.info("DPO reference log-probabilities: one forward pass over %d sequences", len(data.docs))
    for documents, batch in data.reference_batches():
        logps[documents] = gpu.sequence_logps(batch).result().to(torch.float64)
        now = time.perf_counter()
        if now - last >= PROGRESS_SECONDS:
            last, done = now, documents[-1] + 1
            log.info("DPO reference log-probabilities: %d/%d sequences (%.0f%%), ETA %.0f s", done, len(data.docs),
                     100 * done / len(data.docs), (now - t0) / done * (len(data.docs) - done))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({"logps": logps}, str(tmp), metadata={"key": key, "sequences": str(len(data.docs))})
    os.replace(tmp, path)
    log.info("DPO reference log-probabilities: %d sequences in %.1f s, written to %s", len(data.docs),
             time.perf_counter() - t0, path)
    return logps
