"""Export of a LoRA run (finetune.method=lora): the adapter as PEFT saves it, and the merged model.

    <export_dir>/adapter/   adapter_config.json + adapter_model.safetensors (PEFT's key names): what
                            peft.PeftModel.from_pretrained(base, "<export_dir>/adapter") loads on the base
    <export_dir>/merged/    a Hugging Face model directory with W + scaling * B A in every adapted projection
                            (transformers' AutoModelForCausalLM loads it without peft)

The merged weights are computed one tensor at a time (in float32, then cast to the export dtype), from the
base as the host store holds it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatrain_ray.config.sections import Config
from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.model.hf_io import export_hf
from megatrain_ray.model.lora import from_peft_name, merged_weight, peft_adapter_config
from megatrain_ray.system.files import atomic_directory, refuse_existing

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class MergedWeights(Mapping[str, torch.Tensor]):
    """The base's tensors by Hugging Face name, with each adapted projection's weight merged on lookup."""

    def __init__(self, base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], scaling: float):
        self.base, self.scaling = base, scaling
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, value in adapters.items():
            layer, name = from_peft_name(key)
            module, _, which = name.rpartition(".lora_")
            target = f"model.layers.{layer}.{module}.weight"
            a, b = self.pairs.get(target, (None, None))
            self.pairs[target] = (value, b) if which.startswith("A") else (a, value)

    def __getitem__(self, name: str) -> torch.Tensor:
        weight = self.base[name]
        if name not in self.pairs:
            return weight
        a, b = self.pairs[name]
        return merged_weight(weight, a, b, self.scaling)

    def __contains__(self, name: object) -> bool:
        return name in self.base

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


def write_peft_adapter(adapters: Mapping[str, torch.Tensor], cfg: Config, out_dir: Path, base: str) -> Path:
    """adapter_config.json and adapter_model.safetensors (float32, PEFT's names) into `out_dir`, atomically."""
    with atomic_directory(out_dir, CheckpointError, "adapter export directory") as tmp:
        config = peft_adapter_config(cfg.model, cfg.finetune.lora, base)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in adapters.items()},
                  str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out_dir


def export_lora(base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], cfg: Config,
                out_dir: str | Path, source_dir: str | None, dtype: str, shard_bytes: int) -> Path:
    """`out_dir`/adapter (PEFT) and `out_dir`/merged (Hugging Face); returns `out_dir`."""
    out = Path(out_dir)
    refuse_existing(out, CheckpointError, "export directory")
    out.mkdir(parents=True)
    write_peft_adapter(adapters, cfg, out / "adapter", cfg.model.path or "")
    export_hf(MergedWeights(base, adapters, cfg.finetune.lora.scaling), cfg.model, out / "merged",
              source_dir=source_dir, dtype=dtype, shard_bytes=shard_bytes)
    return out
