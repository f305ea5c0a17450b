"""Export of a LoRA run (finetune.method=lora): the adapter as PEFT saves it, and the merged model.

    <export_dir>/adapter/   adapter_config.json + adapter_model.safetensors (PEFT's key names): what
                            peft.PeftModel.from_pretrained(base, "<export_dir>/adapter") loads on the base
    <export_dir>/merged/    a Hugging Face model directory with W + scaling * B A in every adapted projection
                            (transformers' AutoModelForCausalLM loads it without peft)

The merged weights are computed one tensor at a time (in float32, then cast to the export dtype), from the
base as the host store holds it; with an NF4 base (finetune.lora.base_quantization=nf4) from the dequantized base,
the weights the adapters trained on (store/nf4_base.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatrain_ray.config.engine_sections import PrecisionConfig
from megatrain_ray.config.finetune_section import LoraConfig
from megatrain_ray.config.load import _build
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.engine.adapters import ADAPTER_STAGE
from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.model.hf_io import HFDirectory, export_hf, source_dtype
from megatrain_ray.model.layout import build_layout
from megatrain_ray.model.lora import (
    SAVED_MODULES,
    from_peft_name,
    is_adapter,
    merged_weight,
    peft_adapter_config,
    peft_saved_name,
)
from megatrain_ray.model.lora_moe import DOWN, EXPERTS, GATE_UP, INNER, ROUTER, adapted_weight, which_param
from megatrain_ray.model.moe import moe_mlp_tensors
from megatrain_ray.observe.log import get_logger
from megatrain_ray.store.checkpoint import MANIFEST, CheckpointInfo, model_config_of
from megatrain_ray.store.nf4_base import RequantizedBase
from megatrain_ray.store.tensor_maps import DerivedTensors
from megatrain_ray.system.files import atomic_directory, refuse_existing

log = get_logger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
PARAM_ADAPTER_MODULES = (ROUTER, INNER, EXPERTS)
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class MergedWeights(DerivedTensors):
    """The base's tensors by Hugging Face name, with each adapted projection's weight merged on lookup and the
    modules_to_save replaced by their trained matrices."""

    def __init__(self, base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], scaling: float,
                 expert_shapes: Mapping[str, tuple[int, ...]] | None = None):
        """`expert_shapes`: a MoE layer's fused expert tensors' shapes by name inside the layer (model/moe.py)."""
        super().__init__(base)
        self.scaling = scaling
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.replaced = {hf: adapters[peft_saved_name(hf)] for hf in SAVED_MODULES.values()
                         if peft_saved_name(hf) in adapters}
        by_module: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, value in adapters.items():
            if not is_adapter(key):
                continue
            layer, name = from_peft_name(key)
            module, _, which = name.rpartition(".lora_")
            by_module.setdefault((layer, module), {})[which[0]] = value
        for (layer, module), ab in by_module.items():
            prefix = f"model.layers.{layer}."
            if module in PARAM_ADAPTER_MODULES:  # a MoE router or fused experts: the tensor is told by the shapes
                target = prefix + which_param(module, ab["A"], ab["B"], expert_shapes or {})
            else:
                target = f"{prefix}{module}.weight"
            self.pairs[target] = (ab["A"], ab["B"])

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.replaced:
            return self.replaced[name]
        weight = self.base[name]
        if name not in self.pairs:
            return weight
        a, b = self.pairs[name]
        if name.endswith((GATE_UP, DOWN, f"{ROUTER}.weight")):  # as peft's ParamWrapper, in float32 (or wider)
            work = torch.promote_types(weight.dtype, torch.float32)
            return adapted_weight(weight.to(work), a.to(work), b.to(work), self.scaling)
        return merged_weight(weight, a, b, self.scaling)


def write_peft_adapter(adapters: Mapping[str, torch.Tensor], model: ModelConfig, lora: LoraConfig, out_dir: Path,
                       base: str) -> Path:
    """adapter_config.json and adapter_model.safetensors (float32, PEFT's names) into `out_dir`, atomically."""
    with atomic_directory(out_dir, CheckpointError, "adapter export directory") as tmp:
        config = peft_adapter_config(model, lora, base)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in adapters.items()},
                  str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out_dir


def export_lora(base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], model: ModelConfig,
                lora: LoraConfig, out_dir: str | Path, source_dir: str | None, dtype: str, shard_bytes: int) -> Path:
    """`out_dir`/adapter (PEFT) and `out_dir`/merged (Hugging Face); returns `out_dir`."""
    out = Path(out_dir)
    refuse_existing(out, CheckpointError, "export directory")
    out.mkdir(parents=True)
    write_peft_adapter(adapters, model, lora, out / "adapter", model.path or "")
    log.info("export: the adapter in PEFT's format: %s (%d tensors)", out / "adapter", len(adapters))
    experts = {name: shape for name, shape, _ in moe_mlp_tensors(model)} if model.is_moe else {}
    export_hf(MergedWeights(base, adapters, lora.scaling, experts), model, out / "merged", source_dir=source_dir, dtype=dtype,
              shard_bytes=shard_bytes)
    return out


def is_lora_checkpoint(info: CheckpointInfo) -> bool:
    return info.manifest.get("state_config", {}).get("finetune", {}).get("method") == "lora"


def export_lora_checkpoint(info: CheckpointInfo, out_dir: str | Path, dtype: str | None, shard_bytes: int) -> Path:
    """`megatrain export` of a LoRA checkpoint: its adapters (adapters.safetensors) over the base it records
    (model.path, which must still be a model directory: the checkpoint does not hold the base)."""
    model = model_config_of(info)
    saved = info.manifest.get("config", {}).get("finetune", {}).get("lora")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {info.directory}: {MANIFEST} holds no finetune.lora settings; it is corrupt")
    lora = _build(LoraConfig, dict(saved), "finetune.lora")
    if not model.path or not Path(model.path).is_dir():
        raise CheckpointError(f"checkpoint {info.directory} holds LoRA adapters over the base model.path="
                              f"{model.path or '(random init)'!r}, which is not a model directory here; a LoRA "
                              "checkpoint exports only with its base (export train.export_dir at the end of the run)")
    path = info.directory / info.entry_of(ADAPTER_STAGE)["path"]
    with safe_open(str(path), framework="pt") as f:
        adapters = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("optimizer.")}  # noqa: SIM118
    base: Mapping[str, torch.Tensor] = HFDirectory(model.path)
    if lora.base_quantization == "nf4":  # the adapters trained on the dequantized NF4 base: merge onto it
        precision = _build(PrecisionConfig, dict(info.manifest.get("config", {}).get("precision", {})), "precision")
        base = RequantizedBase(base, build_layout(model), precision.resolved_stream_dtype, precision.compute_dtype)
    return export_lora(base, adapters, model, lora, out_dir, model.path,
                       dtype or source_dtype(model.path) or "float32", shard_bytes)
