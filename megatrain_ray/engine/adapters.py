"""The LoRA adapters' training state on the compute device (finetune.method=lora).

Every targeted projection of every layer has A [r, in] and B [out, r] in float32 on the device (float64 in a
float64 run, where the tests prove the math exact against peft; drawn in float32 either way), a gradient
buffer of each, and torch.optim.AdamW's state over all of them (the run's betas, eps and weight decay; the
learning rate of each step from the schedule). The backward writes each layer's adapter gradients once
(autograd computed no base-weight gradient) and adds their squared norm to the step's total; after the
backward the step clips by the exact global norm (as torch.nn.utils.clip_grad_norm_: coef = min(1, clip /
(norm + 1e-6))) and runs AdamW, or drops the step when the norm or loss is not finite.

finetune.lora.modules_to_save (embed_tokens, lm_head): those matrices too, trained in full in float32 from the
base's values, beside the adapters in the same optimizer and norm.

Checkpoints: one file, adapters.safetensors, with the adapters under PEFT's names, their moments under
`optimizer.exp_avg.<name>` / `optimizer.exp_avg_sq.<name>` and AdamW's step count in the metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatrain_ray.config.engine_sections import OptimizerConfig
from megatrain_ray.config.finetune_section import LoraConfig
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.engine.device_adam_state import adam_step, load_adam_state, save_adam_state
from megatrain_ray.model.lora import initial_adapters, peft_name, peft_saved_name, saved_names

ADAPTER_FILE = "adapters.safetensors"
ADAPTER_STAGE = -1
"""The `stage` of the adapters' file in a checkpoint manifest (the base's stages are not saved with LoRA)."""


class AdapterTier:
    def __init__(self, model: ModelConfig, lora: LoraConfig, optimizer: OptimizerConfig, seed: int,
                 device: torch.device, base: dict[str, torch.Tensor] | None = None, dtype: torch.dtype = torch.float32):
        """The adapters at step 0 (model/lora.initial_adapters, from the run `seed`); `load` or `put_named` replace
        them. `base`: the base's matrices of the modules_to_save by Hugging Face name, their starting values.
        `dtype`: of the adapters, their gradients and moments (float32; float64 in a float64 run)."""
        self.scaling = lora.scaling
        self.device, self.dtype = device, dtype
        self.layers = [{n: t.to(device, dtype) for n, t in initial_adapters(model, lora, seed, i).items()}
                       for i in range(model.num_layers)]
        self.saved = {name: (base or {})[name].to(device, dtype, copy=True) for name in saved_names(lora)}
        """The modules_to_save by Hugging Face name (trained in full)."""
        self.by_name = {**{peft_name(i, n): t for i, layer in enumerate(self.layers) for n, t in layer.items()},
                        **{peft_saved_name(name): t for name, t in self.saved.items()}}
        """Every trained tensor by its name in PEFT's adapter_model.safetensors."""
        self.params = list(self.by_name.values())
        # Every gradient is a view of one flat buffer: several GPU workers sum them in one all-reduce.
        self.flat_grad = torch.zeros(sum(t.numel() for t in self.params), dtype=dtype, device=device)
        offset = 0
        for t in self.params:
            t.grad = self.flat_grad[offset:offset + t.numel()].view_as(t)
            offset += t.numel()
        self.optimizer = torch.optim.AdamW(self.params, lr=optimizer.lr, betas=(optimizer.beta1, optimizer.beta2),
                                           eps=optimizer.eps, weight_decay=optimizer.weight_decay)
        self.sqnorm = torch.zeros((), dtype=dtype, device=device)

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
        self.sqnorm = torch.zeros((), dtype=self.dtype, device=self.device)

    def set_grads(self, i: int, grads: dict[str, torch.Tensor]) -> None:
        """Layer i's adapter gradients of this step (by name), counted in the global norm."""
        for name, t in self.layers[i].items():
            self._set_grad(t, grads[name])

    def set_saved_grad(self, hf_name: str, grad: torch.Tensor) -> None:
        """A module_to_save's gradient of this step, counted in the global norm."""
        self._set_grad(self.saved[hf_name], grad)

    def _set_grad(self, t: torch.Tensor, grad: torch.Tensor) -> None:
        t.grad.copy_(grad)
        self.sqnorm += torch.linalg.vector_norm(t.grad, dtype=self.dtype).square()

    def sum_over_ranks(self, comm: Any) -> None:
        """Several GPU workers: sum the gradients over the ranks (each computed its rows' part of the loss) and
        count the norm of the sum."""
        comm.all_reduce(self.flat_grad)
        self.sqnorm = torch.linalg.vector_norm(self.flat_grad, dtype=self.dtype).square()

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
        """The adapters (and modules_to_save) by PEFT name, copied to the CPU."""
        return {key: t.detach().to("cpu", copy=True) for key, t in self.by_name.items()}

    def put_named(self, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite adapters (and modules_to_save) by PEFT name (tests, loading a saved adapter)."""
        for key, value in tensors.items():
            if key not in self.by_name:
                raise KeyError(f"{key!r} is not an adapter of this run")
            self.by_name[key].copy_(value)

    def adam_step(self) -> int:
        return adam_step(self.by_name, self.optimizer)

    def save(self, directory: Path, step: int) -> dict:
        """Write adapters.safetensors of a checkpoint; its manifest entry."""
        entry = save_adam_state(directory / ADAPTER_FILE, self.by_name, self.optimizer,
                                {"format": "megatrain-lora/1", "step": str(step)})
        entry["stage"] = ADAPTER_STAGE
        return entry

    def load(self, directory: Path, entry: dict) -> None:
        """Restore adapters, moments and AdamW's step count from a checkpoint's adapters.safetensors."""
        load_adam_state(directory, entry, self.by_name, self.optimizer)

    def close(self) -> None:
        self.layers, self.params, self.saved, self.by_name = [], [], {}, {}
        self.flat_grad = None
        self.optimizer = None
