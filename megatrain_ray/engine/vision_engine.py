"""The layer stream of a vision-language model: StreamEngine (or the LoRA engine) with its vision tier.

The text model streams exactly as for the text class; the vision tower and projector (engine/vision_tier.py) run once
per step on the compute device around it, through four of the engine's own steps:

- the embedding looks up the image tokens as transformers does (an id outside the vocabulary as 0);
- before the first layer, the image features replace the embeddings at the image tokens, and Gemma 3's image-block
  mask replaces causal attention for every layer, its recompute included (model/vision/splice.py); Qwen3-VL's
  deepstack features are added to the first layers' outputs at the image tokens (before the next layer keeps its
  input, so its recompute reads the sum), their gradients taken from those outputs' gradients in the backward;
- beside the embedding's gradient, the features take theirs from the first layer's input gradient at the image
  tokens (those rows then give the embedding none), and their squared norm joins the step's global norm;
- after the step's norm is known, the tower and projector take their AdamW step with the streamed stages' clipping
  coefficient, or are dropped with them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatrain_ray.config.hf_vision import vision_config_of_dir
from megatrain_ray.dtypes import TORCH_DTYPES
from megatrain_ray.engine.lora_engine import LoraStreamEngine
from megatrain_ray.engine.step import StreamEngine
from megatrain_ray.engine.vision_tier import VISION_STAGE, VisionTier
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.messages import IGNORE_INDEX, Batch, ImageInputs
from megatrain_ray.model.head import head_logits
from megatrain_ray.model.hf_io import HFDirectory
from megatrain_ray.model.vision.modules import VisionModules


class VisionPasses:
    """The overrides; `self.vision` is the VisionTier (attached after construction by `with_vision`)."""

    vision: Any
    _vision_inputs: tuple[torch.Tensor, torch.Tensor, ImageInputs | None, bool] | None = None

    def _begin(self, training: bool) -> None:
        super()._begin(training)  # type: ignore[misc]
        self.vision.begin_step()

    def _forward(self, ids: torch.Tensor, batch: Batch, keep: Any) -> Any:
        images = batch.images
        if images is not None and batch.segments is not None:
            raise ValueError("a batch with images cannot be packed (data.packing): one document per row")
        # The batch's ids as the driver sent them (on the host): the image-token count and M-RoPE's positions are
        # read from them there, so the step waits for the device at none of them.
        self._vision_inputs = (ids, batch.input_ids.cpu(), images, keep is not None)
        try:
            return super()._forward(self.vision.lookup_ids(ids), batch, keep)  # type: ignore[misc]
        finally:
            self._vision_inputs = None

    def _forward_layers(self, x: torch.Tensor, rope: dict, documents: Any, keep: Any) -> torch.Tensor:
        if self._vision_inputs is not None:
            ids, host_ids, images, training = self._vision_inputs
            timeline = self.telemetry.timeline
            start = timeline.start(self.streams.compute)
            x, mask = self.vision.splice(x, ids, host_ids, images, training)
            timeline.stop("vision", self.streams.compute, start)
            documents = mask if mask is not None else documents
            self._vision_documents = documents
            rope = self.vision.rope(host_ids, images, x.dtype, rope.keys()) or rope  # M-RoPE: three position axes
            self._vision_rope = rope
        return super()._forward_layers(x, rope, documents, keep)  # type: ignore[misc]

    def _layer_output(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.vision.add_deepstack(i, x)  # Qwen3-VL: its deepstack features after the first layers

    def _layer_output_grad(self, i: int, grad_y: torch.Tensor) -> None:
        self.vision.deepstack_grad(i, grad_y)

    def _backward(self, head: Any, rope: dict, documents: Any, inject_nan: bool) -> torch.Tensor:
        # The recompute takes the forward's mask (Gemma 3's image blocks), which _forward did not return.
        documents = getattr(self, "_vision_documents", documents)
        rope = getattr(self, "_vision_rope", None) or rope  # and its M-RoPE tables
        self._vision_documents = self._vision_rope = None
        return super()._backward(head, rope, documents, inject_nan)  # type: ignore[misc]

    def _embedding(self, ids: torch.Tensor, grad_y: torch.Tensor, embed_slot: Any) -> None:
        timeline = self.telemetry.timeline
        start = timeline.start(self.streams.compute)
        grad_y = self.vision.backward(ids, grad_y)
        timeline.stop("vision", self.streams.compute, start)
        grads = getattr(self, "grads", None)
        if grads is not None:
            grads.sqnorm += self.vision.sqnorm.to(grads.sqnorm.dtype)
        else:  # LoRA: the adapters' norm is the step's
            self.adapters.sqnorm = self.adapters.sqnorm + self.vision.sqnorm.to(self.adapters.sqnorm.dtype)
        super()._embedding(self.vision.lookup_ids(ids), grad_y, embed_slot)  # type: ignore[misc]

    def _order_deferred_updates(self, loss: float, grad_norm: float) -> bool:
        skipped = super()._order_deferred_updates(loss, grad_norm)  # type: ignore[misc]
        clips = self.clip > 0 or getattr(self, "grads", None) is None  # LoRA always clips (a finite norm)
        coef = min(1.0, self.clip / (grad_norm + 1e-6)) if self.clip > 0 and math.isfinite(grad_norm) else 1.0
        with self.telemetry.device_update(self.streams.compute):  # the tower's update runs on the device
            self.vision.step(self.updates.lr, coef, not skipped if clips else True)
        return skipped

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, images: ImageInputs | None = None) -> torch.Tensor:
        """Full logits of a small batch with its images (tests): float32, float64 in a float64 run."""
        def head(x: torch.Tensor, head_w: dict, embed_w: torch.Tensor) -> torch.Tensor:
            logits = head_logits(x, head_w["model.norm.weight"], self._lm_weight(head_w, embed_w), self.head_spec)
            return logits.to(torch.promote_types(x.dtype, torch.float32)).cpu()

        return self._forward_only(Batch(ids, torch.full_like(ids, IGNORE_INDEX), images=images), head)


class VisionStreamEngine(VisionPasses, StreamEngine):
    pass


class VisionLoraStreamEngine(VisionPasses, LoraStreamEngine):
    pass


def engine_classes(vision: bool) -> tuple[type, type]:
    """(the full engine's class, the LoRA engine's) for a vision-language model or a text one."""
    return (VisionStreamEngine, VisionLoraStreamEngine) if vision else (StreamEngine, LoraStreamEngine)


def attach_vision(engine: Any, cfg: Any, run: Any, restore: Any = None) -> None:
    """Build the vision tier of cfg.model.path on the engine's device (its weights from model.path, its trained
    state from the checkpoint `restore` when resuming) and attach it."""
    model = cfg.model
    modules = VisionModules(model.path, engine.device, TORCH_DTYPES[run.master_dtype], HFDirectory(model.path))
    sliding = any(model.layer_slides(i) for i in range(model.num_layers))
    engine.vision = VisionTier(modules, cfg.finetune.vision, cfg.optimizer, engine.compute_dtype,
                               model.sliding_window, sliding)
    engine.vision.rope_shape = (model.rope_theta, model.resolved_head_dim)
    if modules.vision.family.attention == "image_blocks":
        engine._compiled = None  # the layers take an explicit mask: eager
    if restore is not None:
        engine.vision.load(restore.directory, restore.entry_of(VISION_STAGE))


def check_vision_run(cfg: Any) -> None:
    """A vision-language run's settings, refused before Ray starts with the key named (model/vision/)."""
    if vision_config_of_dir(cfg.model.path) is None:
        return
    if cfg.finetune.vision == "lora":
        raise ConfigError("finetune.vision=lora: LoRA on the vision tower is not implemented yet; use frozen (the "
                          "projector trains) or full")
    if cfg.finetune.method == "lora":
        raise ConfigError("finetune.method=lora: LoRA on a vision-language model's language model is not tested yet; "
                          "use finetune.method=full")
    if cfg.model.template == "generic":
        raise ConfigError("model.template=generic: a vision-language model's language model runs on its native "
                          "template only (set model.template to auto or native)")
    if cfg.data.packing:
        raise ConfigError("data.packing=true: samples with images are not packed yet (one document per row)")
    if (isinstance(cfg.parallel.gpus, int) and cfg.parallel.gpus > 1) or cfg.parallel.nodes > 1:
        raise ConfigError("parallel.gpus / parallel.nodes > 1: a vision-language model trains on one GPU worker for "
                          "now (its images are not split over ranks yet)")
    if cfg.finetune.objective != "sft":
        raise ConfigError(f"finetune.objective={cfg.finetune.objective}: a vision-language model trains with sft only "
                          "for now")
