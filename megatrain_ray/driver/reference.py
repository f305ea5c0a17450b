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

The file is checked before Ray starts (`check_reference`, from the Trainer): readable safetensors, one float64
`logps` tensor of one value per sequence, every value finite. A damaged one (a truncated write, an edit, NaN) is
set aside as `<name>.damaged` with a warning naming it, and computed again; a resumed run stops instead, naming
the file. A reference pass that gives non-finite values stops the run before it writes the file.
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
from megatrain_ray.exceptions import ConfigError, DataError, NonFiniteError, excerpt
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


def read_reference(path: Path, sequences: int) -> tuple[torch.Tensor | None, str]:
    """The log-probabilities stored in `path`, or None and what is wrong with the file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            if "logps" not in names:
                return None, f"it holds no 'logps' tensor (it holds {excerpt(names)})"
            logps = f.get_tensor("logps")
    except Exception as exc:  # a truncated or overwritten file: safetensors raises its own errors and OSError
        return None, f"it cannot be read as safetensors ({excerpt(str(exc), 120)})"
    if logps.dtype != torch.float64 or tuple(logps.shape) != (sequences,):
        return None, (f"its 'logps' is {str(logps.dtype).removeprefix('torch.')} of shape {list(logps.shape)}, not "
                      f"float64 of shape [{sequences}] (one value per sequence)")
    bad = (~torch.isfinite(logps)).nonzero().flatten()
    if len(bad):
        return None, f"{len(bad)} of its values are not finite, the first that of sequence {int(bad[0])}"
    return logps, ""


def _missing_on_resume(path: Path, why: str) -> ConfigError:
    return ConfigError(f"resuming a DPO run needs the reference log-probabilities computed at its start, {path}, "
                       f"which {why}; restore the file, or start the run again from step 0")


def check_reference(cfg: Config, data: PreferenceBatches, compute_dtype: str, resuming: bool) -> None:
    """Before Ray starts: a reference file that is there is read, checked and attached to `data`; a damaged one is
    set aside (`<name>.damaged`, with a warning) so that the run computes it again, or stops a resumed run, which
    cannot. A resumed run without its file stops here too."""
    path = reference_path(data, reference_key(cfg, compute_dtype, data.directory))
    if not path.is_file():
        if resuming:
            raise _missing_on_resume(path, "is missing (or the model or data.path changed since)")
        return
    logps, problem = read_reference(path, len(data.docs))
    if logps is not None:
        log.info("DPO reference log-probabilities: %d sequences from %s", len(data.docs), path)
        data.attach_reference(logps)
        return
    if resuming:
        raise _missing_on_resume(path, f"is damaged: {problem}")
    aside = path.with_name(path.name + ".damaged")
    try:
        os.replace(path, aside)
    except OSError as exc:
        raise DataError(f"the DPO reference log-probabilities {path} are damaged: {problem}; they cannot be moved "
                        f"aside ({exc.strerror or exc}): remove the file, and the run computes them again") from None
    log.warning("the DPO reference log-probabilities %s are damaged: %s; moved to %s, computing them again", path,
                problem, aside)


def load_or_compute(cfg: Config, data: PreferenceBatches, gpu: Any, compute_dtype: str, resuming: bool) -> torch.Tensor:
    """The reference log-probabilities of `data`'s sequences: from their file, or computed now by `gpu` (which must
    hold the initial weights) and written there. `check_reference` has set a damaged file aside."""
    from safetensors.torch import save_file

    key = reference_key(cfg, compute_dtype, data.directory)
    path = reference_path(data, key)
    if path.is_file():
        logps, problem = read_reference(path, len(data.docs))
        if logps is not None:
            log.info("DPO reference log-probabilities: %d sequences from %s", len(data.docs), path)
            return logps
        log.warning("the DPO reference log-probabilities %s are damaged: %s; computing them again", path, problem)
    if resuming:
        raise _missing_on_resume(path, "is missing or damaged (or the model or data.path changed since)")
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
    bad = (~torch.isfinite(logps)).nonzero().flatten()
    if len(bad):
        raise NonFiniteError(f"the DPO reference pass gave {len(bad)} non-finite log-probabilities (sequence "
                             f"{int(bad[0])} of {data.docs.where} first): the initial model's forward overflows on "
                             "them; check model.path's weights, or compute in precision.compute_dtype=float32")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({"logps": logps}, str(tmp), metadata={"key": key, "sequences": str(len(data.docs))})
    os.replace(tmp, path)
    log.info("DPO reference log-probabilities: %d sequences in %.1f s, written to %s", len(data.docs),
             time.perf_counter() - t0, path)
    return logps
