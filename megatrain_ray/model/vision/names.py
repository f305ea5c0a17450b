"""A vision-language checkpoint's tensor names: what is on disk, what transformers' modules call it, and what the
streamed text model calls it.

transformers 5 writes the legacy names (`language_model.model.layers.0...`, `vision_tower.vision_model...` in older
hub checkpoints) and renames them on load by its conversion rules; the modules' names are `model.language_model.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*` and `lm_head.weight`. `module_names` applies transformers'
own rules (get_model_conversion_mapping: its renamings only; a checkpoint whose vision tensors need a converter, a
concatenation or a split, is refused), so every spelling transformers loads is read. The text model's tensors are
then the native layout's names: `model.language_model.X` is `model.X`, as in the text class.
"""

from __future__ import annotations

from typing import Any

from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.model.vision.modules import meta_model

LANGUAGE_PREFIX, TEXT_PREFIX = "model.language_model.", "model."
LM_HEAD = "lm_head.weight"


def module_names(model: Any, disk_names: list[str], where: str) -> dict[str, str]:
    """{module name: name on disk} for every tensor of the checkpoint, by transformers' renamings of `model`'s class
    (a meta-device instance: only its names and config are read)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    known = model.state_dict()
    out: dict[str, str] = {}
    for disk in disk_names:
        name, converted = rename_source_key(disk, renamings, converters, model.base_model_prefix, known)
        if converted is not None:
            raise CheckpointError(f"{where}: tensor {disk!r} is converted by transformers on load (not a rename); the "
                                  "vision path reads renamed tensors only")
        if name in out:
            raise CheckpointError(f"{where}: tensors {out[name]!r} and {disk!r} are both {name!r} to transformers")
        out[name] = disk
    return out


def text_name(module_name: str) -> str | None:
    """The text model's name of a module name (None: a vision tensor)."""
    if module_name.startswith(LANGUAGE_PREFIX):
        return TEXT_PREFIX + module_name.removeprefix(LANGUAGE_PREFIX)
    if module_name == LM_HEAD:
        return LM_HEAD
    return None


def vision_module_name(text: str) -> str:
    """The vision-language model's module name of a text model's tensor (the export's names)."""
    return text if text == LM_HEAD else LANGUAGE_PREFIX + text.removeprefix(TEXT_PREFIX)


def split_names(model_dir: str, disk_names: list[str], where: str) -> tuple[dict[str, str], dict[str, str]]:
    """A vision-language checkpoint's tensors: ({text model's name: name on disk}, {vision module name: name on
    disk}) (the vision tower's and the projector's; model/vision/modules.py reads them)."""
    text, vision = {}, {}
    for module, disk in module_names(meta_model(model_dir), disk_names, where).items():
        name = text_name(module)
        if name is None:
            vision[module] = disk
        else:
            text[name] = disk
    return text, vision
