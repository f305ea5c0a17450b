"""The vision tower and projector's training state on the GPU worker (finetune.vision).

The modules (model/vision/modules.py) live on the compute device in the run's master dtype (float32; float64 in a
float64 run), with torch.optim.AdamW's state over the trained ones (the run's betas, eps; weight decay on matrices
only, as the streamed layout decays them; each step's learning rate from the schedule). finetune.vision:

- frozen (default): the tower is frozen, the projector trains (LLaMA-Factory's default: freeze_vision_tower,
  train the projector);
- full: tower and projector train;
- lora: refused for now (config/sections.py says so).

A step computes the image features once (`splice`, before the first streamed layer, with autograd on for what trains),
keeps their graph through the layer stream, and takes their gradient from the first layer's input gradient at the
image-token positions (`backward`, beside the embedding's). Qwen3-VL's deepstack features are added to the first
layers' outputs at the image tokens (`add_deepstack`); their gradients are those outputs' gradients there
(`deepstack_grad`, kept as the backward passes each layer), taken in the same one backward through the tower. Their
squared norm joins the step's global norm; the update (`step`) is clipped by the same coefficient as the streamed
stages', or dropped with them.

Checkpoints: vision.safetensors, the trained tensors by module name, their moments as
`optimizer.exp_avg.<name>` / `optimizer.exp_avg_sq.<name>` and AdamW's step count in the metadata (the file LoRA's
adapters are saved in too: engine/device_adam_state.py); the frozen tower is read again from model.path on resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatrain_ray.config.engine_sections import OptimizerConfig
from megatrain_ray.config.hf_vision import trained_parts
from megatrain_ray.engine.device_adam_state import adam_step, load_adam_state, save_adam_state
from megatrain_ray.messages import ImageInputs
from megatrain_ray.model.attention import ExplicitMask
from megatrain_ray.model.vision.modules import VisionModules
from megatrain_ray.model.vision.mrope import mrope_positions, mrope_tables
from megatrain_ray.model.vision.splice import check_count, image_block_mask, image_positions, lookup_ids

VISION_FILE = "vision.safetensors"
VISION_STAGE = -2
"""The `stage` of the vision state's file in a checkpoint manifest."""


class VisionTier:
    def __init__(self, modules: VisionModules, mode: str, optimizer: OptimizerConfig, compute_dtype: torch.dtype,
                 sliding_window: int = 0, any_sliding: bool = False):
        self.modules, self.mode = modules, mode
        self.vision = modules.vision
        self.compute_dtype = compute_dtype
        self.sliding_window, self.any_sliding = sliding_window, any_sliding
        params = modules.parameters()
        parts = trained_parts(self.vision.family, mode)
        self.trained = {n: p for n, p in params.items() if modules.trains(n, parts)}
        for name, p in params.items():
            p.requires_grad_(name in self.trained)
        decay = [p for p in self.trained.values() if p.ndim >= 2]
        other = [p for p in self.trained.values() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": optimizer.weight_decay}, {"params": other, "weight_decay": 0.0}],
            lr=optimizer.lr, betas=(optimizer.beta1, optimizer.beta2), eps=optimizer.eps, foreach=False)
        self.sqnorm: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None = None
        """A training step's (features, image-token positions, deepstack features) with their graphs."""
        self._deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        """(image-token positions, deepstack features) the layers add (Qwen3-VL)."""
        self._deepstack_grads: dict[int, torch.Tensor] = {}
        self._image_tokens = 0
        """The image tokens of the step's rows (counted on the host in `splice`)."""
        self.rope_shape: tuple[float, int] = (0.0, 0)
        """M-RoPE (Qwen-VL): the text model's (rope_theta, head_dim); attach_vision sets it."""

    # ------------------------------------------------------------------ the step

    def lookup_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return lookup_ids(ids, self.vision.image_token_id, self.vision.text_vocab_size)

    def splice(self, x: torch.Tensor, ids: torch.Tensor, host_ids: torch.Tensor, images: ImageInputs | None,
               training: bool) -> tuple[torch.Tensor, ExplicitMask | None]:
        """The token embeddings x [B, T, hidden] with the image features at the image tokens, and the attention mask
        the family needs (None: causal); `training` keeps the features' graph for `backward`. `host_ids`: the same
        ids on the host, where the image tokens are counted (no wait for the device)."""
        self._image_tokens = int(image_positions(host_ids, self.vision.image_token_id).sum())
        self._pending, self._deepstack, self._deepstack_grads = None, None, {}
        if images is None:
            if self._image_tokens:
                check_count(self._image_tokens, x.new_empty(0, 1), 0)
            return x, None
        positions = image_positions(ids, self.vision.image_token_id)
        track = training and bool(self.trained)
        with torch.enable_grad() if track else torch.no_grad(), self._autocast():
            features, deepstack = self.modules.features(images.pixel_values, images.extra)
        check_count(self._image_tokens, features, images.count)
        x = x.clone() if x.requires_grad else x
        x[positions] = features.detach().to(x.dtype)
        if deepstack:
            self._deepstack = (positions, [d.detach() for d in deepstack])
        if track:
            self._pending = (features, positions, deepstack)
        mask = image_block_mask(positions, self.sliding_window, self.any_sliding) \
            if self.vision.family.attention == "image_blocks" else None
        return x, mask

    def add_deepstack(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s output x [B, T, hidden] with the deepstack feature of that layer added at the image
        tokens (Qwen3-VL: after each of its first decoder layers, as transformers' _deepstack_process); x itself
        where the layer takes none."""
        if self._deepstack is None or layer >= len(self._deepstack[1]):
            return x
        positions, features = self._deepstack
        x = x.clone()
        x[positions] = x[positions] + features[layer].to(x.dtype)
        return x

    def deepstack_grad(self, layer: int, grad_y: torch.Tensor) -> None:
        """Keep the gradient of layer `layer`'s output grad_y at the image tokens: its deepstack feature's (the
        addition passes the gradient on unchanged), for `backward`."""
        if self._pending is not None and layer < len(self._pending[2]):
            self._deepstack_grads[layer] = grad_y[self._pending[1]]

    def rope(self, ids: torch.Tensor, images: ImageInputs | None, dtype: torch.dtype,
             keys: Any) -> dict | None:
        """The text layers' RoPE tables by LayerSpec.local_rope for M-RoPE families (model/vision/mrope.py); None:
        the text model's own. `ids` on the host: transformers' get_rope_index walks them in Python (each read of a
        device tensor there would wait for the device); the tables are made on the device from its positions."""
        if self.vision.family.rope == "standard":
            return None
        grid = images.extra.get("image_grid_thw") if images is not None else None
        positions = mrope_positions(self.modules.base, ids, self.vision.image_token_id, grid)
        tables = mrope_tables(positions, self.vision.mrope_section, *self.rope_shape, dtype, self.modules.device,
                              interleaved=self.vision.family.rope == "mrope_interleaved")
        return {k: tables for k in keys}

    def _autocast(self) -> Any:
        device = self.modules.device
        if device.type == "cuda" and self.compute_dtype in (torch.bfloat16, torch.float16):
            return torch.autocast("cuda", dtype=self.compute_dtype)
        return torch.autocast(device.type, enabled=False)

    def begin_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.sqnorm = None
        self._pending, self._deepstack, self._deepstack_grads = None, None, {}

    def backward(self, ids: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor:
        """The features' backward from the first layer's input gradient grad_y [B, T, hidden]; returns grad_y with
        zeros at the image tokens (their embedding rows take none, as transformers' masked_scatter gives none)."""
        positions = image_positions(ids, self.vision.image_token_id)
        if self._pending is not None:  # one backward through the tower: the features' and deepstack features'
            features, kept, deepstack = self._pending
            self._pending = None
            outputs, grads = [features], [grad_y[kept].to(features.dtype)]
            for layer, feature in enumerate(deepstack):
                if feature.requires_grad:  # a frozen tower's deepstack mergers give features without a graph
                    outputs.append(feature)
                    grads.append(self._deepstack_grads.pop(layer).to(feature.dtype))
            self._deepstack_grads = {}
            torch.autograd.backward(outputs, grads)
        grads = [p.grad for p in self.trained.values() if p.grad is not None]
        acc = torch.promote_types(self.modules.dtype, torch.float32)
        self.sqnorm = sum((torch.linalg.vector_norm(g, dtype=acc).square() for g in grads),
                          torch.zeros((), dtype=acc, device=self.modules.device))
        return grad_y.masked_fill(positions.unsqueeze(-1), 0) if self._image_tokens else grad_y

    def step(self, lr: float, coef: float, apply: bool) -> None:
        """AdamW on the trained tensors, their gradients times the clipping coefficient; `apply` False drops it."""
        if not apply or not self.trained:
            return
        if coef < 1.0:
            for p in self.trained.values():
                if p.grad is not None:
                    p.grad.mul_(coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    # ------------------------------------------------------------------ state in and out

    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor of the tower and projector by module name, copied to the CPU (the export's)."""
        return {n: t.detach().to("cpu", copy=True) for n, t in self.modules.state().items()}

    def adam_step(self) -> int:
        return adam_step(self.trained, self.optimizer)

    def save(self, directory: Path, step: int) -> dict:
        entry = save_adam_state(directory / VISION_FILE, self.trained, self.optimizer,
                                {"format": "megatrain-vision/1", "step": str(step)})
        entry["stage"] = VISION_STAGE
        return entry

    def load(self, directory: Path, entry: dict) -> None:
        load_adam_state(directory, entry, self.trained, self.optimizer)
