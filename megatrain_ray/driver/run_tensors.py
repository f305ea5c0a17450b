"""The run's tensors by name, read and written through the host shards (and the GPU worker that holds any
GPU-resident stages or the LoRA adapters): the master weights, the AdamW moments, the adapters, the logits, and the
export. A part of `Trainer` (driver/trainer.py), which starts the actors these methods reach."""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping
from pathlib import Path

import torch

from megatrain_ray.driver.checkpointing import ResidentTensors
from megatrain_ray.driver.runtime import Handle
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.model.hf_io import export_hf
from megatrain_ray.store.disk_use import export_dtype
from megatrain_ray.model.vision.export import export_vision_hf
from megatrain_ray.store.lora_export import export_lora
from megatrain_ray.store.nf4_base import NF4_KIND, DequantizedBase
from megatrain_ray.store.segments import HostStore, StoreTensors, specs_of


class RunTensors:
    """Trainer's tensor access; it reads the Trainer's cfg, run_spec, layout, specs, nodes, gpus, gpu and flush."""

    def read_moments(self, kind: str) -> dict[str, torch.Tensor]:
        """A copy of one AdamW moment (`exp_avg` or `exp_avg_sq`) by Hugging Face name, from RAM or disk."""
        self.flush()
        self.cluster.sync_moments()
        host = HostStore(specs_of(self.specs, (kind,))).read_tensors(self.layout, kind)  # type: ignore[arg-type]
        return self._with_resident(host, kind)

    def master_weights(self) -> dict[str, torch.Tensor]:
        """A copy of the master weights by Hugging Face name (after the pending updates)."""
        self.flush()
        if self.run_spec.base_quantization == "nf4":  # the base as the layers compute with it (dequantized)
            return {name: t.clone() for name, t in self._base_tensors().items()}
        store = HostStore(specs_of(self.specs, ("master",)))
        return self._with_resident(store.read_tensors(self.layout), "master")

    def _base_tensors(self) -> Mapping[str, torch.Tensor]:
        """A frozen NF4 base by Hugging Face name, its decoder layers dequantized (store/nf4_base.py)."""
        store = HostStore(specs_of(self.specs, ("master", NF4_KIND)))
        return DequantizedBase(store, self.layout, self.run_spec.compute_dtype)

    @property
    def _resident_holder(self) -> Handle | None:
        """The GPU worker that holds the GPU-resident stages (engine.gpu_resident; none on the host), if any."""
        return self.gpu if self.run_spec.resident_layers and not self.run_spec.frozen_base else None

    def _with_resident(self, host: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
        """`host` (the shards' tensors) with the GPU-resident stages' `kind`, in layout order."""
        if self._resident_holder is None:
            return host
        both = {**host, **self._resident_holder.resident_tensors(kind).result()}
        return {stage.hf_name(s): both[stage.hf_name(s)] for stage in self.layout.stages for s in stage.slots}

    def export(self, out_dir: str | Path, dtype: str = "auto", shard_bytes: int = 5 * 10**9) -> Path:
        """Write the master weights as a Hugging Face directory (see megatrain_ray/model/hf_io.py), one
        tensor at a time straight from the shared segments."""
        self.flush()
        source = self.cfg.model.path or None
        dtype = export_dtype(dtype, source)[0]  # auto: config.json's dtype, else float32
        store = HostStore(specs_of(self.specs, ("master",)))
        tensors: Mapping[str, torch.Tensor] = StoreTensors(store, self.layout)
        if self.run_spec.base_quantization == "nf4":  # merged onto the dequantized base (docs/fine-tuning.md)
            tensors = self._base_tensors()
        if self.run_spec.frozen_base:  # LoRA: the adapter in PEFT's format and the merged model
            return export_lora(tensors, self.adapters(), self.cfg.model, self.cfg.finetune.lora, out_dir, source, dtype,
                               shard_bytes)
        if self._resident_holder is not None:  # the GPU-resident stages' weights come from the GPU worker
            tensors = ChainMap(tensors, ResidentTensors(self._resident_holder,
                                                        self.layout.resident_stages(self.run_spec.resident_layers,
                                                                                    self.run_spec.resident_vocab)))
        if getattr(self, "vision", None) is not None:  # a vision-language model: its tower and projector too
            return export_vision_hf(tensors, self.vision_state(), self.cfg.model, out_dir, dtype, shard_bytes)
        return export_hf(tensors, self.cfg.model, out_dir, source_dir=source, dtype=dtype, shard_bytes=shard_bytes)

    def vision_state(self) -> dict[str, torch.Tensor]:
        """(A vision-language model) The vision tower's and projector's tensors by module name, after the steps."""
        assert self.gpu is not None
        return self.gpu.vision_state().result()

    def load_weights(self, tensors: dict[str, torch.Tensor], nodes: list[int] | None = None) -> None:
        """Overwrite master weights (and the streaming copy; GRPO's reference copy too, as the weights before
        training) by Hugging Face name, before training, on every node (or on `nodes`: tests that make the copies
        disagree)."""
        self.flush()
        if self.run_spec.base_quantization == "nf4":  # its layers have no dense segment to write into
            raise ConfigError("Trainer.load_weights: the base of finetune.lora.base_quantization=nf4 is quantized "
                              "once when the run starts; put the weights in model.path instead")
        for k in nodes if nodes is not None else range(len(self.nodes)):
            store = HostStore(specs_of(self.nodes[k].specs, ("master", "stream", "master_comp", "reference")))
            store.write_tensors(self.layout, tensors)  # the stages with segments there
        if self._resident_holder is not None:
            self._resident_holder.write_resident(tensors).result()
        if self.run_spec.frozen_base:  # the base each GPU worker holds on its device is copied again
            rollout = [self.cluster.rollout] if getattr(self.cluster, "rollout", None) is not None else []
            for done in [gpu.reload_base() for gpu in [*self.gpus, *rollout]]:  # rl.rollout=separate's worker too
                done.result()

    def adapters(self) -> dict[str, torch.Tensor]:
        """(finetune.method=lora) The adapters by PEFT name, after the steps run so far."""
        assert self.gpu is not None
        return self.gpu.adapters().result()

    def set_adapters(self, tensors: dict[str, torch.Tensor]) -> None:
        """(finetune.method=lora) Overwrite adapters by PEFT name on every rank, before training (tests)."""
        assert self.gpu is not None
        for done in [gpu.set_adapters(tensors) for gpu in self.gpus]:
            done.result()

    def logits(self, ids: torch.Tensor, images=None) -> torch.Tensor:
        """Full logits of `ids` (tests, small inputs); `images`: a vision-language model's ImageInputs of the rows."""
        assert self.gpu is not None
        self.flush()
        return (self.gpu.logits(ids) if images is None else self.gpu.logits(ids, images)).result()
