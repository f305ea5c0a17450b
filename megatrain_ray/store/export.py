"""`megatrain export`: a directory of safetensors weights, a run directory or a megatrain checkpoint
re-sharded and converted into a Hugging Face directory, one tensor at a time."""

from __future__ import annotations

from pathlib import Path

from megatrain_ray.config.hf import model_config_of_dir
from megatrain_ray.config.load import read_yaml
from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.model.hf_io import HFDirectory, export_hf, source_dtype
from megatrain_ray.model.layout import build_layout
from megatrain_ray.store.checkpoint import MANIFEST, CheckpointWeights, model_config_of, read_manifest
from megatrain_ray.system.files import read_text_file


def weights_dir_of(source: str | Path) -> Path:
    """The directory holding safetensors weights: `source` itself, or the train.export_dir of a run directory."""
    src = Path(source)
    if (src / "config.json").is_file():
        return src
    if (src / "config.yaml").is_file():  # a run directory: its resolved config names the export
        what = f"run config {str(src / 'config.yaml')!r}"
        saved = read_yaml(read_text_file(src / "config.yaml", what, CheckpointError), what)
        train = saved.get("train") if isinstance(saved, dict) else None
        export_dir = train.get("export_dir") if isinstance(train, dict) else None
        if export_dir and isinstance(export_dir, str) and (Path(export_dir) / "config.json").is_file():
            return Path(export_dir)
        raise CheckpointError(f"run directory {str(src)!r} holds no exported weights (train.export_dir was "
                              f"{export_dir or 'unset'}); set train.export_dir and train again")
    raise CheckpointError(f"{str(src)!r} is neither a model directory (config.json + model.safetensors), a "
                          "checkpoint (manifest.json) nor a run directory (config.yaml)")


def export_weights_dir(source: str | Path, out_dir: str | Path, dtype: str | None = None,
                       shard_bytes: int = 5 * 10**9) -> Path:
    """`megatrain export`: re-shard and convert a directory of safetensors weights or a megatrain
    checkpoint, one tensor at a time."""
    if (Path(source) / MANIFEST).is_file():
        info = read_manifest(source)
        model_cfg = model_config_of(info)
        origin = model_cfg.path if model_cfg.path and Path(model_cfg.path).is_dir() else None
        return export_hf(CheckpointWeights(info), model_cfg, out_dir, source_dir=origin,
                         dtype=dtype or (source_dtype(origin) if origin else None) or "float32",
                         shard_bytes=shard_bytes)
    src = weights_dir_of(source)
    model_cfg = model_config_of_dir(src)
    tensors = HFDirectory(src)
    tensors.check_against_layout(build_layout(model_cfg))
    return export_hf(tensors, model_cfg, out_dir, source_dir=src, dtype=dtype or source_dtype(src) or "float32",
                     shard_bytes=shard_bytes)
