"""A vision-language run's export: a directory AutoModelForImageTextToText.from_pretrained loads with no missing or
unexpected key.

The text model's tensors (the master weights, by the text layout's names) are written under the vision-language
model's module names (`model.X` as `model.language_model.X`, `lm_head.weight` as it is; none for a tied head), the
tower's and projector's (trained or frozen, with their persistent buffers) under theirs, both as transformers 5's
modules name them (its loader takes them as they are). config.json is the source's own (its class and every key; the
shapes never change), with the export's dtype; the tokenizer's and the processor's files are copied.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from megatrain_ray.config.hf import read_hf_config
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.model.hf_io import TOKENIZER_FILES, _plan_shards, checked_export, write_shards
from megatrain_ray.model.vision.names import vision_module_name
from megatrain_ray.observe.log import get_logger
from megatrain_ray.system.files import atomic_directory

log = get_logger(__name__)

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def export_vision_hf(text: Mapping[str, torch.Tensor], vision: Mapping[str, torch.Tensor], model_cfg: ModelConfig,
                     out_dir: str | Path, dtype: str = "float32", shard_bytes: int = 5 * 10**9) -> Path:
    """Write `text` (the text layout's names) and `vision` (module names) as model_cfg.path's vision-language model."""
    out, layout, text_names, torch_dtype, element = checked_export(model_cfg, out_dir, dtype, text)
    source = Path(model_cfg.path)
    shapes = {stage.hf_name(slot): slot.shape for stage in layout.stages for slot in stage.slots}
    # export name -> (where, name there)
    plan = {vision_module_name(n): ("text", n) for n in text_names} | {n: ("vision", n) for n in vision}
    sizes = {n: (vision[src].numel() if where == "vision" else torch.Size(shapes[src]).numel()) * element
             for n, (where, src) in plan.items()}
    groups = _plan_shards(list(plan), sizes, shard_bytes)

    def tensor_of(name: str) -> torch.Tensor:
        where, src = plan[name]
        tensor = vision[src] if where == "vision" else text[src]
        if where == "text" and tuple(tensor.shape) != shapes[src]:
            raise CheckpointError(f"cannot export {src!r}: shape {list(tensor.shape)}, model needs "
                                  f"{list(shapes[src])}")
        return tensor

    with atomic_directory(out, CheckpointError, "export directory") as tmp:
        total = write_shards(tmp, groups, tensor_of, torch_dtype)
        hf = read_hf_config(source)
        hf.pop("quantization_config", None)
        hf.update(dtype=dtype, torch_dtype=dtype)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
        for name in (*TOKENIZER_FILES, *PROCESSOR_FILES):
            if (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
    log.info("export: %s (%d tensors, %.2f GB %s, %d shard(s); the vision-language model %s)", out, len(plan),
             total / 1e9, dtype, len(groups), hf.get("architectures"))
    return out
