"""What a run leaves on disk, in figures a user can act on: the export's format (train.export_dtype resolved as
the export resolves it) and size, and at the end of a run the bytes its directories take.

    megatrain plan    one checkpoint, what checkpoint.keep keeps, the export     (planning/plan_text.disk_lines)
    end of a run      the run directory, its checkpoints, the export             (run_disk_summary)
"""

from __future__ import annotations

from pathlib import Path

from megatrain_ray.dtypes import DTYPE_BYTES
from megatrain_ray.model.hf_io import gguf_export_dtype, source_dtype
from megatrain_ray.store.checkpoint import CheckpointDir
from megatrain_ray.system.files import tree_bytes
from megatrain_ray.units import human_bytes


def export_dtype(setting: str, source: str | None) -> tuple[str, str]:
    """train.export_dtype (or `megatrain export --dtype`) resolved, and why: an explicit value as it is; auto the
    dtype `source`'s config.json names (`dtype`, `torch_dtype` before transformers 5), bfloat16 for a GGUF file whose
    matrices are quantized or bfloat16 (model/hf_io.gguf_export_dtype), else float32."""
    if setting != "auto":
        return setting, f"train.export_dtype={setting}"
    if source and (from_gguf := gguf_export_dtype(source)) is not None:
        kinds = "quantized or bfloat16 matrices" if from_gguf == "bfloat16" else "float16 or float32 matrices"
        return from_gguf, f"train.export_dtype=auto: model.path's GGUF file has {kinds}"
    named = source_dtype(source) if source else None
    if named:
        return named, f"train.export_dtype=auto: the dtype {Path(source) / 'config.json'} names"
    why = "model.path's config.json names no bfloat16 or float32" if source else "model.path is empty (random init)"
    return "float32", f"train.export_dtype=auto: {why}"


def export_bytes(num_params: int, dtype: str, adapter_params: int = 0) -> int:
    """The export's size: every weight in `dtype`; a LoRA run's adds its adapter (float32, PEFT's format) beside
    the merged model."""
    return num_params * DTYPE_BYTES[dtype] + 4 * adapter_params


def _within(path: Path, directory: Path) -> bool:
    return path.resolve().is_relative_to(directory.resolve())


def run_disk_summary(run_dir: Path, checkpoint_root: Path, keep: int, export_dir: str = "",
                     export_format: tuple[str, str] | None = None) -> str:
    """The line the end of a run prints: what its directory takes, how much of it the checkpoints (how many,
    checkpoint.keep), and the export's size with its format and why (`export_format`: export_dtype's answer)."""
    checkpoints = CheckpointDir(checkpoint_root).complete()
    sizes = [tree_bytes(info.directory) for info in checkpoints]
    kept = (f"{len(sizes)} checkpoint(s) of {human_bytes(max(sizes))} (checkpoint.keep={keep})" if sizes
            else "no checkpoint")
    text = f"disk: {run_dir} takes {human_bytes(tree_bytes(run_dir))}"
    if _within(checkpoint_root, run_dir):
        text += f", {human_bytes(sum(sizes))} of it {kept}"
    else:
        text += f"; checkpoint.dir={checkpoint_root} {human_bytes(sum(sizes))} in {kept}"
    if export_dir and Path(export_dir).exists():
        dtype, why = export_format or ("", "")
        text += f"; the export {export_dir} {human_bytes(tree_bytes(Path(export_dir)))}"
        if dtype:
            text += f" ({dtype}: {why}" + ("; train.export_dtype=bfloat16 halves it)" if dtype == "float32" else ")")
    return text
