"""`megatrain export`: a directory of safetensors weights, a run directory (its newest complete checkpoint) or a
megatrain checkpoint re-sharded and converted into a Hugging Face directory, one tensor at a time."""

from __future__ import annotations

from pathlib import Path

from megatrain_ray.config.generic_shape import model_config_for_template
from megatrain_ray.config.load import read_yaml
from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.model.hf_io import HFDirectory, export_hf, source_dtype
from megatrain_ray.model.layout import build_layout
from megatrain_ray.observe.log import get_logger
from megatrain_ray.store.checkpoint import MANIFEST, CheckpointDir, CheckpointWeights, model_config_of, read_manifest
from megatrain_ray.store.lora_export import export_lora_checkpoint, is_lora_checkpoint
from megatrain_ray.system.files import read_text_file

log = get_logger(__name__)


def run_source(run_dir: Path) -> Path:
    """What `megatrain export RUN_DIR` exports and `megatrain generate RUN_DIR` loads: the newest complete
    checkpoint of the run (its checkpoint.dir, from the run's config.yaml), else the run's train.export_dir."""
    what = f"run config {str(run_dir / 'config.yaml')!r}"
    saved = read_yaml(read_text_file(run_dir / "config.yaml", what, CheckpointError), what)
    section = (lambda name: saved.get(name) if isinstance(saved, dict) and isinstance(saved.get(name), dict) else {})
    checkpoint_dir = section("checkpoint").get("dir") or "checkpoints"  # empty: <train.output_dir>/checkpoints
    if isinstance(checkpoint_dir, str):
        root = run_dir / checkpoint_dir  # an absolute checkpoint_dir stays as it is
        newest = CheckpointDir(root).latest() if root.is_dir() else None
        if newest is not None:
            log.info("%s: the newest complete checkpoint, step %d (%s)", run_dir, newest.step, newest.directory)
            return newest.directory
    export_dir = section("train").get("export_dir")
    if isinstance(export_dir, str) and export_dir and (Path(export_dir) / "config.json").is_file():
        log.info("%s: no checkpoint; the weights it exported at the end of training, %s", run_dir, export_dir)
        return Path(export_dir)
    raise CheckpointError(f"run directory {str(run_dir)!r} has no complete checkpoint (in "
                          f"{checkpoint_dir}) and no exported weights (train.export_dir="
                          f"{export_dir or 'unset'}); a run writes one at its end (checkpoint.at_end) and every checkpoint.every steps")


def export_weights_dir(source: str | Path, out_dir: str | Path, dtype: str | None = None,
                       shard_bytes: int = 5 * 10**9) -> Path:
    """`megatrain export`: re-shard and convert a directory of safetensors weights or a megatrain
    checkpoint, one tensor at a time."""
    if not (Path(source) / "config.json").is_file() and (Path(source) / "config.yaml").is_file():
        source = run_source(Path(source))
    if (Path(source) / MANIFEST).is_file():
        info = read_manifest(source)
        if is_lora_checkpoint(info):  # adapter/ and merged/ over the base the checkpoint records
            return export_lora_checkpoint(info, out_dir, dtype, shard_bytes)
        model_cfg = model_config_of(info)
        origin = model_cfg.path if model_cfg.path and Path(model_cfg.path).is_dir() else None
        return export_hf(CheckpointWeights(info), model_cfg, out_dir, source_dir=origin,
                         dtype=dtype or (source_dtype(origin) if origin else None) or "float32",
                         shard_bytes=shard_bytes)
    src = Path(source)
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{str(src)!r} is neither a model directory (config.json + model.safetensors), a "
                              "checkpoint (manifest.json) nor a run directory (config.yaml)")
    model_cfg = model_config_for_template(src, "auto")
    tensors = HFDirectory(src)
    tensors.check_against_layout(build_layout(model_cfg))
    return export_hf(tensors, model_cfg, out_dir, source_dir=src, dtype=dtype or source_dtype(src) or "float32",
                     shard_bytes=shard_bytes)
