"""The LoRA adapters' training state on the compute device (finetune.method=lora).

Every targeted projection of every layer has A [r, in] and B [out, r] in float32 on the device, a gradient
buffer of each, and torch.optim.AdamW's state over all of them (the run's betas, eps and weight decay; the
learning rate of each step from the schedule). The backward writes each layer's adapter gradients once
(autograd computed no base-weight gradient) and adds their squared norm to the step's total; after the
backward the step clips by the exact global norm (as torch.nn.utils.clip_grad_norm_: coef = min(1, clip /
(norm + 1e-6))) and runs AdamW, or drops the step when the norm or loss is not finite.

Checkpoints: one file, adapters.safetensors, with the adapters under PEFT's names, their moments under
`optimizer.exp_avg.<name>` / `optimizer.exp_avg_sq.<name>` and AdamW's step count in the metadata.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatrain_ray.config.sections import LoraConfig, ModelConfig, OptimizerConfig
from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.model.lora import from_peft_name, initial_adapters, peft_name
from megatrain_ray.store.safetensors_io import read_safetensors_into, write_safetensors

ADAPTER_FILE = "adapters.safetensors"
ADAPTER_STAGE = -1
"""The `stage` of the adapters' file in a checkpoint manifest (the base's stages are not saved with LoRA)."""
_MOMENTS = ("exp_avg", "exp_avg_sq")


class AdapterTier:
    def __init__(self, model: ModelConfig, lora: LoraConfig, optimizer: OptimizerConfig, seed: int,
                 device: torch.device):
        """The adapters at step 0 (model/lora.initial_adapters, from the run `seed`); `put` replaces them."""
        self.scaling = lora.scaling
        self.device = device
        self.layers = [{n: t.to(device) for n, t in initial_adapters(model, lora, seed, i).items()}
                       for i in range(model.num_layers)]
        self.params = [t for layer in self.layers for t in layer.values()]
        for t in self.params:
            t.grad = torch.zeros_like(t)
        self.optimizer = torch.optim.AdamW(self.params, lr=optimizer.lr, betas=(optimizer.beta1, optimizer.beta2),
                                           eps=optimizer.eps, weight_decay=optimizer.weight_decay)
        self.sqnorm = torch.zeros((), dtype=torch.float32, device=device)

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.params)

    @property
    def bytes(self) -> int:
        """Device memory: adapters, gradients and both moments (once AdamW made them)."""
        return 4 * self.numel * self.params[0].element_size()

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Decoder layer i's adapters by their names inside the layer (bound beside its weights)."""
        return self.layers[i]

    def begin_step(self) -> None:
        self.sqnorm = torch.zeros((), dtype=torch.float32, device=self.device)

    def set_grads(self, i: int, grads: dict[str, torch.Tensor]) -> None:
        """Layer i's adapter gradients of this step (by name), counted in the global norm."""
        for name, t in self.layers[i].items():
            t.grad.copy_(grads[name])
            self.sqnorm += torch.linalg.vector_norm(t.grad, dtype=torch.float32).square()

    def step(self, lr: float, clip: float, grad_norm: float, apply: bool) -> None:
        """Clip by the global norm (clip > 0) and take AdamW's step; `apply` False drops the step."""
        if not apply:
            return
        if clip > 0:
            coef = min(1.0, clip / (grad_norm + 1e-6))
            if coef < 1.0:
                torch._foreach_mul_([t.grad for t in self.params], coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    # ------------------------------------------------------------------ state in and out

    def named(self) -> dict[str, torch.Tensor]:
        """The adapters by PEFT name, copied to the CPU."""
        return {peft_name(i, n): t.detach().to("cpu", copy=True) for i, layer in enumerate(self.layers)
                for n, t in layer.items()}

    def put_named(self, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite adapters by PEFT name (tests, loading a saved adapter)."""
        for key, value in tensors.items():
            i, name = from_peft_name(key)
            self.layers[i][name].copy_(value)

    def adam_step(self) -> int:
        state = self.optimizer.state.get(self.params[0])
        return int(state["step"]) if state else 0

    def save(self, directory: Path, step: int) -> dict:
        """Write adapters.safetensors of a checkpoint; its manifest entry."""
        tensors, adam_step = [], self.adam_step()
        for i, layer in enumerate(self.layers):
            for name, t in layer.items():
                tensors.append((peft_name(i, name), t.detach().cpu()))
        for kind in _MOMENTS:
            for i, layer in enumerate(self.layers):
                for name, t in layer.items():
                    state = self.optimizer.state.get(t)
                    moment = state[kind] if state else torch.zeros_like(t)
                    tensors.append((f"optimizer.{kind}.{peft_name(i, name)}", moment.detach().cpu()))
        entry = write_safetensors(directory / ADAPTER_FILE, tensors,
                                  {"format": "megatrain-lora/1", "step": str(step), "adam_step": str(adam_step)})
        entry["stage"] = ADAPTER_STAGE
        entry["adam_step"] = adam_step
        return entry

    def load(self, directory: Path, entry: dict) -> None:
        """Restore adapters, moments and AdamW's step count from a checkpoint's adapters.safetensors."""
        targets: dict[str, torch.Tensor] = {}
        staged: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
        for i, layer in enumerate(self.layers):
            for name, t in layer.items():
                key = peft_name(i, name)
                flats = {"param": torch.empty(t.shape, dtype=t.dtype),
                         **{kind: torch.empty(t.shape, dtype=t.dtype) for kind in _MOMENTS}}
                targets[key] = flats["param"]
                for kind in _MOMENTS:
                    targets[f"optimizer.{kind}.{key}"] = flats[kind]
                staged.append((t, flats))
        path = directory / entry["path"]
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory} has no {ADAPTER_FILE}")
        read_safetensors_into(path, targets, entry)
        adam_step = int(entry.get("adam_step", 0))
        self.optimizer.state.clear()
        for t, flats in staged:
            t.copy_(flats["param"])
            if adam_step:
                self.optimizer.state[t] = {"step": torch.tensor(float(adam_step)),
                                           **{kind: flats[kind].to(self.device) for kind in _MOMENTS}}

    def close(self) -> None:
        self.layers, self.params = [], []
        self.optimizer = None
