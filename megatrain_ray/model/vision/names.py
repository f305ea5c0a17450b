"""A vision-language checkpoint's tensor names: what is on disk, what transformers' modules call it, and what the
streamed text model calls it.

transformers 5 writes the legacy names (`language_model.model.layers.0...`, `vision_tower.vision_model...` in older
hub checkpoints) and renames them on load by its conversion rules; the modules' names are `model.language_model.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*` and `lm_head.weight`. `module_names` applies transformers'
own rules (get_model_conversion_mapping: its renamings, and its one converter that only transposes, Qwen3-VL-MoE's
fused experts; a checkpoint whose tensors need another converter, a concatenation or a split, is refused), so every
spelling transformers loads is read. The text model's tensors are then the native layout's names:
`model.language_model.X` is `model.X`, as in the text class.

Qwen3-VL-MoE's hub checkpoints store each layer's experts as [experts, hidden, 2 x intermediate] and
[experts, intermediate, hidden], transposed from the modules' (and from what save_pretrained writes): transformers'
Transpose(1, 2, check_dims=True) transposes a tensor on load where its shape is not the module's, and so does the
read here (`transposed`).
"""

from __future__ import annotations

from typing import Any

from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.model.vision.modules import meta_model

LANGUAGE_PREFIX, TEXT_PREFIX = "model.language_model.", "model."
LM_HEAD = "lm_head.weight"


def module_names(model: Any, disk_names: list[str], where: str,
                 shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[dict[str, str], set[str]]:
    """({module name: name on disk} for every tensor of the checkpoint, by transformers' renamings of `model`'s
    class (a meta-device instance: only its names, shapes and config are read), the module names whose tensor is
    read transposed (dims 1 and 2: the disk shape `shapes[disk]` is not the module's, as transformers' check_dims
    decides))."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Transpose, WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    transposing = {c.source_patterns[0] for c in converters
                   if len(c.source_patterns) == 1 and c.source_patterns == c.target_patterns
                   and [type(op) for op in c.operations] == [Transpose]
                   and (c.operations[0].dim0, c.operations[0].dim1) == (1, 2)}
    known = model.state_dict()
    out: dict[str, str] = {}
    transposed: set[str] = set()
    for disk in disk_names:
        name, converted = rename_source_key(disk, renamings, converters, model.base_model_prefix, known)
        if converted is not None and converted not in transposing:
            raise CheckpointError(f"{where}: tensor {disk!r} is converted by transformers on load (not a rename); the "
                                  "vision path reads renamed (or transposed) tensors only")
        if name in out:
            raise CheckpointError(f"{where}: tensors {out[name]!r} and {disk!r} are both {name!r} to transformers")
        out[name] = disk
        if converted is not None and shapes is not None and name in known:
            shape, module = tuple(shapes[disk]), tuple(known[name].shape)
            if shape != module and len(shape) == 3 and (shape[0], shape[2], shape[1]) == module:
                transposed.add(name)
    return out, transposed


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


def split_names(model_dir: str, disk_names: list[str], where: str,
                shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[dict[str, str], dict[str, str], set[str]]:
    """A vision-language checkpoint's tensors: ({text model's name: name on disk}, {vision module name: name on
    disk} (the vision tower's and the projector's; model/vision/modules.py reads them), the text model's names whose
    tensor is read transposed (Qwen3-VL-MoE's experts in the hub's layout; `shapes`: the disk shapes by name))."""
    text, vision = {}, {}
    names, transposed = module_names(meta_model(model_dir), disk_names, where, shapes)
    for module, disk in names.items():
        name = text_name(module)
        if name is None:
            if module in transposed:
                raise CheckpointError(f"{where}: vision tensor {disk!r} is stored transposed; the vision path reads "
                                      "the tower's tensors as the modules hold them")
            vision[module] = disk
        else:
            text[name] = disk
    return text, vision, {text_name(m) for m in transposed}
