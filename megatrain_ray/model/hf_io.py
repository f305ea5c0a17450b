"""Hugging Face model directories in and out: config.json + safetensors (one file or sharded).

In: `HFDirectory` reads the index (or the single file's header) without touching tensor data,
`check_against_layout` proves before any allocation that every tensor the model needs is there
with the right shape and a float dtype (store/initial_values.load_hf_stage then copies one stage's
tensors, one tensor at a time, into the host store). No
torch model is built and nothing is unpickled: safetensors is a JSON header plus raw bytes.

Out: `export_hf` writes any mapping of Hugging Face names to tensors (the trainer's master
weights, a directory read lazily) as safetensors shards of at most `shard_bytes`, the index,
config.json and the tokenizer files of the source directory, into a temporary directory that
is renamed into place at the end: a reader never sees half an export.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatrain_ray.config.hf import hf_config_from_model, read_hf_config
from megatrain_ray.config.hf_generic import architecture
from megatrain_ray.config.hf_hybrid import MULTIMODAL, multimodal_names, text_part
from megatrain_ray.config.hf_vision import FAMILIES as VISION_FAMILIES
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.dtypes import TORCH_DTYPES
from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.model.hf_quant import MXFP4Pairs
from megatrain_ray.model.layout import ModelLayout, build_layout
from megatrain_ray.model.moe_io import ExpertStacks
from megatrain_ray.model.vision.names import split_names
from megatrain_ray.observe.log import get_logger
from megatrain_ray.system.files import (
    atomic_directory,
    contained,
    read_json_object,
    refuse_existing,
    shared_file_mode,
)
from megatrain_ray.system.model_sources import GGUF_ORIGIN

log = get_logger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files a model directory carries besides the weights, copied on export when the source has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "generation_config.json", "chat_template.jinja",
                   "chat_template.json")
# Qwen3-Next and Qwen3.5 checkpoints carry a multi-token-prediction head (`mtp.*`) that transformers' causal LM does
# not load (its _keys_to_ignore_on_load_unexpected): neither does megatrain, nor does its export write it.
MTP_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# safetensors header dtype codes of floating formats we convert from, and the torch dtypes we write.
FLOAT_CODES = {"F64", "F32", "F16", "BF16"}
EXPORT_DTYPES = ("bfloat16", "float32")


GGUF_FINER_THAN_BFLOAT16 = ("F16", "F32", "F64")
"""GGUF matrix types whose values bfloat16 (8 significant bits) would round: float16 keeps 11, float32 24. The
others are BF16 itself or quantized to 8 bits or fewer a value (plus a 16-bit scale per block), whose own error, a
step of the block's scale, is at least bfloat16's rounding of the dequantized value."""


def gguf_export_dtype(model_dir: str | Path) -> str | None:
    """For a directory converted from a GGUF file (system/model_sources.GGUF_ORIGIN beside its config.json):
    bfloat16 when every matrix of the file was BF16 or quantized (none of GGUF_FINER_THAN_BFLOAT16), else float32;
    None for any other directory."""
    path = Path(model_dir) / GGUF_ORIGIN
    if not path.is_file():
        return None
    types = read_json_object(path, str(path), CheckpointError).get("matrix_types")
    if not isinstance(types, dict) or not types:
        return "float32"
    return "float32" if any(t in GGUF_FINER_THAN_BFLOAT16 for t in types) else "bfloat16"


def source_dtype(model_dir: str | Path) -> str | None:
    """The dtype to export a model from `model_dir` in when none is asked: gguf_export_dtype for a converted GGUF
    file, else the dtype config.json declares (`dtype` in transformers 5, `torch_dtype` before), if one we export."""
    if (from_gguf := gguf_export_dtype(model_dir)) is not None:
        return from_gguf
    hf = read_hf_config(model_dir)
    found = hf.get("dtype") or hf.get("torch_dtype")
    return found if found in EXPORT_DTYPES else None


class HFDirectory(Mapping[str, torch.Tensor]):
    """The tensors of a Hugging Face model directory by name, read lazily (one tensor per lookup)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / INDEX_FILE
        if index.is_file():
            weight_map = read_json_object(index, str(index), CheckpointError).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map \
                    or not all(isinstance(f, str) for f in weight_map.values()):
                raise CheckpointError(f"{index} is not a safetensors index (a JSON object whose 'weight_map' maps "
                                      "tensor names to file names)")
        elif (self.dir / SINGLE_FILE).is_file():
            weight_map = None
        else:
            raise CheckpointError(f"{self.dir} holds neither {SINGLE_FILE} nor {INDEX_FILE}; only safetensors "
                                  "weights are read (convert .bin checkpoints with transformers' save_pretrained)")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        for name in files:
            if not contained(self.dir, name, str(index), CheckpointError).is_file():
                raise CheckpointError(f"shard {name} listed in {index} is missing from {self.dir}; "
                                      "copy the complete model directory")
        # Headers only: name -> (file, shape, dtype code). The tensor data stays on disk.
        self.entries: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for name in files:
            with self._open(name) as f:
                names = f.keys()  # safe_open is not a dict: its names come from keys()
                for key in names:
                    piece = f.get_slice(key)
                    self.entries[key] = (name, tuple(piece.get_shape()), piece.get_dtype())
        if weight_map:
            absent = sorted(k for k, f in weight_map.items() if self.entries.get(k, ("",))[0] != f)
            if absent:
                raise CheckpointError(f"{index} maps {absent[0]!r} to {weight_map[absent[0]]}, which does not "
                                      f"hold it ({len(absent)} such tensors); the directory is inconsistent")
        # MoE hub checkpoints keep one tensor per expert: seen here fused, as transformers 5 loads them.
        config = self.dir / "config.json"
        model_type = read_hf_config(self.dir).get("model_type") if config.is_file() else None
        self.on_disk = self.entries
        self.aliases: dict[str, str] = {}
        """A multimodal Qwen3.5 checkpoint's tensors: {the text model's name: the name on disk}."""
        self.ignored: set[str] = set()
        self.vision_names: dict[str, str] = {}
        """A vision-language checkpoint's tower and projector: {module name: name on disk} (model/vision/)."""
        self.transposed: set[str] = set()
        """Tensors read with dims 1 and 2 swapped (Qwen3-VL-MoE's experts in the hub's layout:
        model/vision/names.py)."""
        if model_type in MULTIMODAL:  # its language model read as the text model (transformers' text class does so)
            self.aliases, self.ignored = multimodal_names(list(self.entries))
            self.entries = {new: self.on_disk[old] for new, old in self.aliases.items()}
        elif model_type in VISION_FAMILIES:  # the text model streams; the vision modules read their own tensors
            self.aliases, self.vision_names, self.transposed = split_names(
                str(self.dir), list(self.entries), str(self.dir), {n: e[1] for n, e in self.entries.items()})
            self.ignored = set(self.vision_names.values())
            self.entries = {new: self._transposed_entry(new, self.on_disk[old]) for new, old in self.aliases.items()}
        elif model_type in MTP_MODEL_TYPES:
            self.ignored = {n for n in self.entries if n.startswith("mtp.")}
        if self.ignored and not self.vision_names:
            log.info("%s: %d tensors of a vision tower or a multi-token-prediction head (model.visual.*, mtp.*) are "
                     "not read, as transformers' text model does not load them", self.dir, len(self.ignored))
        self.stacks = ExpertStacks(self.entries, str(self.dir), model_type)
        if self.stacks:
            self.entries = self.stacks.fused_entries(self.entries, str(self.dir))
        # gpt-oss's released experts are MXFP4 pairs: seen here as the float tensors they dequantize to.
        self.mxfp4 = MXFP4Pairs(self.entries, str(self.dir))
        if self.mxfp4:
            self.entries = self.mxfp4.dequantized_entries(self.entries)

    def _open(self, file: str):
        try:
            return safe_open(str(self.dir / file), framework="pt")
        except SafetensorError as exc:
            raise CheckpointError(f"{self.dir / file} is corrupt or truncated ({exc}); copy it again") from exc

    def __getitem__(self, name: str) -> torch.Tensor:
        fused = self.stacks.read(name, self._read) if self.stacks else None
        dequantized = self.mxfp4.read(name, self._read) if self.mxfp4 and fused is None else None
        for found in (fused, dequantized):
            if found is not None:
                return found
        return self._read(name)

    def _read(self, name: str) -> torch.Tensor:
        disk = self.aliases.get(name, name)
        with self._open(self.on_disk[disk][0]) as f:
            tensor = f.get_tensor(disk)
        return tensor.transpose(1, 2).contiguous() if name in self.transposed else tensor

    def _transposed_entry(self, name: str, entry: tuple[str, tuple[int, ...], str]) -> tuple[str, tuple[int, ...], str]:
        if name not in self.transposed:
            return entry
        file, shape, code = entry
        return file, (shape[0], shape[2], shape[1]), code

    def read_vision(self, module_name: str) -> torch.Tensor:
        """A tensor of the vision tower or projector by its module name (HFDirectory.vision_names)."""
        disk = self.vision_names[module_name]
        with self._open(self.on_disk[disk][0]) as f:
            return f.get_tensor(disk)

    def __contains__(self, name: object) -> bool:  # Mapping's default reads (and dequantizes) the tensor
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def check_against_layout(self, layout: ModelLayout) -> None:
        """Every tensor of the layout present, with its shape and a float dtype, and no tensor the model does
        not have (weights for another shape, a layer more): raised before allocating."""
        wanted = {stage.hf_name(slot) for stage in layout.stages for slot in stage.slots}
        fixed = {*layout.buffers, *layout.frozen}  # a generic model's untrained tensors: read as transformers does
        extra = sorted(n for n in self.entries if n not in wanted and n not in fixed and n not in self.ignored
                       and not _derived(n, wanted))
        skipped = _ignored_on_load(self.dir, extra) if extra else []
        if skipped:
            log.info("%s: %d tensors its model class does not load (transformers' _keys_to_ignore_on_load_unexpected: "
                     "a multi-token-prediction layer) are not read, first %r", self.dir, len(skipped), skipped[0])
            extra = [n for n in extra if n not in set(skipped)]
        if extra:
            raise CheckpointError(f"{self.dir} holds {len(extra)} tensor(s) the model of its config.json does not have, "
                                  f"first {extra[0]!r}; the weights and config.json do not belong together")
        for stage in layout.stages:
            for slot in stage.slots:
                name = stage.hf_name(slot)
                if name not in self.entries:
                    raise CheckpointError(f"{self.dir} has no tensor {name!r}, which config.json's architecture "
                                          "needs; the weights and config.json do not belong together")
                _, shape, code = self.entries[name]
                if shape != slot.shape:
                    raise CheckpointError(f"{self.dir}: tensor {name!r} has shape {list(shape)} but config.json "
                                          f"implies {list(slot.shape)}; the weights and config.json disagree")
                if code not in FLOAT_CODES:
                    raise CheckpointError(f"{self.dir}: tensor {name!r} is stored as {code}, which cannot be "
                                          "converted to float master weights (of quantized checkpoints only "
                                          "gpt-oss's MXFP4 is read; float dtypes read: "
                                          f"{', '.join(sorted(FLOAT_CODES))})")

        for name in layout.frozen:
            if name not in self.entries:
                raise CheckpointError(f"{self.dir} has no tensor {name!r}, a parameter config.json's architecture "
                                      "holds untrained (transformers loads it from the checkpoint); the weights and "
                                      "config.json do not belong together")


def _ignored_on_load(model_dir: Path, names: list[str]) -> list[str]:
    """Those of `names` (tensors the model does not have) that the directory's transformers class skips on load
    by its _keys_to_ignore_on_load_unexpected patterns (re.search, as transformers matches them): GLM-4.5's and
    DeepSeek-V3's multi-token-prediction layer, one layer past the model's (`model.layers.46.*` in GLM-4.5-Air,
    `model.layers.61.*` in DeepSeek-V3). None where the class cannot be built here."""
    try:
        model = architecture(str(model_dir.resolve())).model
    except Exception:  # noqa: BLE001 (a class the generic path refuses: no patterns, the names stay extra)
        return []
    patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    return [n for n in names if any(p.search(n) for p in patterns)]


def _derived(name: str, wanted: set[str]) -> bool:
    """Tensors some checkpoints carry that hold nothing to train: RoPE inverse frequencies (recomputed from
    config.json) and an LM head saved beside tied embeddings (the embedding is the head)."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and "lm_head.weight" not in wanted)


def finite_or_refuse(tensor: torch.Tensor, name: str, source: str | Path) -> None:
    """A loaded weight must be finite: a NaN would make every step's loss NaN and every step skipped."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise CheckpointError(f"{source}: tensor {name!r} holds {bad} non-finite value(s) (NaN or inf); the "
                              "checkpoint is damaged: load another copy")


# ----------------------------------------------------------------------------- export


def _plan_shards(names: list[str], nbytes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    """Names in order, cut into groups of at most shard_bytes (a larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        if shards[-1] and size + nbytes[name] > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes[name]
    return shards


def generic_fixed(model_cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A generic model's persistent buffers and frozen parameters for an export, as transformers' save_pretrained
    writes them: their values in the weights given where those hold them (a directory), else in model.path (what
    the run loaded), else (a buffer) as the model's constructor computes it."""
    arch = architecture(str(Path(model_cfg.path).resolve()))
    source = HFDirectory(model_cfg.path)
    return {n: tensors[n] if n in tensors else source.get(n, b)
            for n, b in {**arch.persistent_buffers, **arch.frozen_parameters}.items()}


def checked_export(model_cfg: ModelConfig, out_dir: str | Path, dtype: str,
                   tensors: Mapping[str, torch.Tensor]) -> tuple[Path, ModelLayout, list[str], torch.dtype, int]:
    """What an export checks before it writes: the dtype, that out_dir does not exist, that `tensors` holds every
    tensor of model_cfg's layout. Returns (out_dir, the layout, its Hugging Face names, the export dtype, its
    element size)."""
    if dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"export dtype {dtype!r} is not supported; use one of {', '.join(EXPORT_DTYPES)}")
    out = Path(out_dir)
    refuse_existing(out, CheckpointError, "export directory")
    layout = build_layout(model_cfg)
    names = [stage.hf_name(slot) for stage in layout.stages for slot in stage.slots]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise CheckpointError(f"cannot export: no tensor {missing[0]!r} among the weights given "
                              f"({len(missing)} missing)")
    torch_dtype = TORCH_DTYPES[dtype]
    return out, layout, names, torch_dtype, torch.empty((), dtype=torch_dtype).element_size()


def write_shards(directory: Path, groups: list[list[str]], tensor_of: Callable[[str], torch.Tensor],
                 dtype: torch.dtype) -> int:
    """Write `groups` (_plan_shards: the names of each shard) into `directory` as a Hugging Face model's weights: one
    model.safetensors, or model-0000k-of-0000n.safetensors and their index; each tensor `tensor_of(name)` on the CPU
    in `dtype` (integer tensors as they are). Returns the bytes written."""
    weight_map, total = {}, 0
    for k, group in enumerate(groups):
        file = SINGLE_FILE if len(groups) == 1 else f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name in group:
            tensor = tensor_of(name)
            cast = dtype if tensor.is_floating_point() else tensor.dtype
            shard[name] = tensor.detach().to(device="cpu", dtype=cast).contiguous()
            weight_map[name] = file
            total += shard[name].numel() * shard[name].element_size()
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        os.chmod(directory / file, shared_file_mode())  # readable as the export's other files are
        log.info("export: wrote %s (%d tensors, %d/%d)", file, len(group), k + 1, len(groups))
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    return total


def export_hf(tensors: Mapping[str, torch.Tensor], model_cfg: ModelConfig, out_dir: str | Path,
              source_dir: str | Path | None = None, dtype: str = "float32", shard_bytes: int = 5 * 10**9) -> Path:
    """Write a directory that transformers' AutoModelForCausalLM.from_pretrained loads.

    `tensors` maps Hugging Face names to tensors of the model `model_cfg` describes; it is read one
    tensor at a time (a lazy mapping keeps peak RAM at one shard). `source_dir`, when given, is the
    model directory the run started from: its config.json provides the keys megatrain does not model
    (token ids, ...), and its tokenizer files are copied. The result appears at `out_dir` atomically.
    """
    out, layout, names, torch_dtype, element = checked_export(model_cfg, out_dir, dtype, tensors)
    slots = {stage.hf_name(slot): slot for stage in layout.stages for slot in stage.slots}
    buffers = generic_fixed(model_cfg, tensors) if layout.buffers or layout.frozen else {}
    sizes = {n: slots[n].numel * element for n in names} | {n: b.numel() * element for n, b in buffers.items()}
    names += list(buffers)
    groups = _plan_shards(names, sizes, shard_bytes)

    def tensor_of(name: str) -> torch.Tensor:
        tensor = buffers[name] if name in buffers else tensors[name]
        if name not in buffers and tuple(tensor.shape) != slots[name].shape:
            raise CheckpointError(f"cannot export {name!r}: shape {list(tensor.shape)}, model needs "
                                  f"{list(slots[name].shape)}")
        return tensor.to(torch_dtype)  # every tensor of a text model in the export's dtype, as before

    with atomic_directory(out, CheckpointError, "export directory") as tmp:
        total = write_shards(tmp, groups, tensor_of, torch_dtype)
        hf = read_hf_config(source_dir) if source_dir and (Path(source_dir) / "config.json").is_file() else {}
        hf = text_part(hf)  # a multimodal Qwen3.5 source: the text model is what was trained and is written
        if model_cfg.template == "generic":  # the model's own config.json: its class and every key as it was
            hf = read_hf_config(model_cfg.path)
        else:
            hf.update(hf_config_from_model(model_cfg))
        hf.pop("quantization_config", None)  # the weights written are plain floats (MXFP4 sources dequantized)
        # `dtype` for transformers 5, `torch_dtype` for readers on transformers 4 (serving stacks lag behind).
        hf.update(dtype=dtype, torch_dtype=dtype)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
        copied = [name for name in (TOKENIZER_FILES if source_dir else ()) if (Path(source_dir) / name).is_file()]
        for name in copied:
            shutil.copyfile(Path(source_dir) / name, tmp / name)
    size = f"{total / 1e9:.2f} GB" if total >= 10**8 else f"{total / 1e6:.1f} MB"
    log.info("export: %s (%d tensors, %s %s, %d shard(s))", out, len(names), size, dtype, len(groups))
    # say so: a user loading the export with AutoTokenizer would otherwise find out only there
    if not any(name.startswith(("tokenizer", "vocab")) for name in copied):
        log.info("export: no tokenizer files written: %s", f"{source_dir} has none" if source_dir else
                 f"the run's model.path {model_cfg.path} is no directory here" if model_cfg.path else
                 "the run has no model.path (a byte-level model: token id = byte value, no tokenizer)")
    return out
