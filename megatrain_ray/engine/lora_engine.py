"""The layer stream with a frozen base and LoRA adapters (finetune.method=lora).

The same forward, head and recompute-backward as StreamEngine, with three differences:

- each decoder layer's adapters (engine/adapters.py, on the device) are bound beside its streamed weights,
  and the templates' projections add them (model/lora.py project); the modules_to_save (embedding, LM head)
  are read from their trained float32 copies instead of the streamed ones, and get their gradients;
- the backward binds the base weights without requires_grad: autograd computes the input gradients and the
  adapters' gradients only. The head computes only its input gradient, the embedding none. No gradient
  leaves the device, no update is ordered from the CPU optimizer workers (a LoRA run has none);
- after the backward the adapters take their AdamW step on the device, clipped by the exact global norm of
  their gradients (a non-finite norm or loss drops the step, whatever optimizer.grad_clip is).

With engine.gpu_resident the first N layers' base stays on the device (engine/resident_base.py; an NF4 base's
packed, engine/packed_stream.py): no copy for them.
The embedding's and LM head's weights stay in their slots from one step to the next (the base never changes).

With lora_dropout > 0 each training step gives every layer a dropout seed (model/lora.layer_dropout_seed, from
the run seed, the AdamW step and the layer), from which the forward and the recompute draw the same masks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from megatrain_ray.config.engine_sections import EngineConfig, OptimizerConfig
from megatrain_ray.config.finetune_section import LoraConfig
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.runtime_sections import ParallelConfig
from megatrain_ray.engine.adapters import AdapterTier
from megatrain_ray.engine.collective import Collectives, RankInfo
from megatrain_ray.engine.resident_base import ResidentBase
from megatrain_ray.engine.step import StreamEngine
from megatrain_ray.engine.weights import WeightSlot
from megatrain_ray.messages import Batch, StepResult
from megatrain_ray.model.head import HeadResult
from megatrain_ray.model.layout import ModelLayout, StageLayout
from megatrain_ray.model.lora import SAVED_MODULES, is_adapter, layer_dropout_seed, saved_names
from megatrain_ray.model.templates import embed_backward
from megatrain_ray.store.segments import HostStore


class LoraStreamEngine(StreamEngine):
    binds_adapters = True
    adapters_off = False
    """Inside reference_weights: the base alone."""

    def __init__(self, model: ModelConfig, engine: EngineConfig, parallel: ParallelConfig, optimizer: OptimizerConfig,
                 run: RunSpec, layout: ModelLayout, store: HostStore, device: torch.device, lora: LoraConfig,
                 seed: int, rank: RankInfo | None = None):
        """StreamEngine's arguments (a RunSpec with frozen_base; no optimizer workers), the adapters' settings and
        the run seed that draws their initial values (the same on every rank)."""
        super().__init__(model, engine, parallel, optimizer, run, layout, store, [], device, rank)
        # The modules_to_save start as the base's matrices (the host holds the base as its `master`).
        base = {}
        for name in saved_names(lora):
            stage, slot = layout.stage_of(name)
            base[name] = store.get("master", stage.index)[slot.offset:slot.offset + slot.numel].view(slot.shape)
        self.adapters = AdapterTier(model, lora, optimizer, seed, device, base, self.acc_dtype)
        self.base = ResidentBase(layout, run.resident_layers, store, self.compute_dtype, device)
        if self.adapters.saved:  # their gradients: float32 sums of the vocabulary's size, as a full run's
            self.vocab_acc = torch.zeros((model.vocab_size, model.hidden_size), dtype=self.acc_dtype, device=device)
        self.seed = seed
        self.eval_specs = self.specs = tuple(replace(spec, lora_scaling=self.adapters.scaling,
                                                     lora_dropout=lora.lora_dropout) for spec in self.specs)
        self.trainable = is_adapter
        if lora.lora_dropout:  # the masks come from seeded generators, which torch.compile does not trace
            self._compiled = None

    def train_step(self, batch: Batch, lr: float, adam_step: int, loss_tokens: int) -> StepResult:
        """StreamEngine.train_step with this step's dropout seeds in the layers' specs (lora_dropout > 0): the
        forward and the recompute draw the same masks, and a resumed run the same as an uninterrupted one."""
        if self.adapters_dropout:
            self.specs = tuple(replace(spec, lora_seed=layer_dropout_seed(self.seed, adam_step, i))
                               for i, spec in enumerate(self.eval_specs))
        try:
            return super().train_step(batch, lr, adam_step, loss_tokens)
        finally:
            self.specs = self.eval_specs

    @property
    def adapters_dropout(self) -> bool:
        return bool(self.eval_specs and self.eval_specs[0].lora_dropout)

    def _begin_gradients(self) -> None:
        self.adapters.begin_step()  # the frozen base has no gradient sinks

    def _load(self, stage: StageLayout) -> WeightSlot | None:
        return None if self.base.holds(stage) else self.weights.load(stage)

    def _bind(self, stage: StageLayout, slot: WeightSlot | None) -> dict[str, torch.Tensor]:
        weights = self.base.weights(stage) if slot is None else self.weights.bind(stage, slot)
        return weights if self.adapters_off else {**weights, **self.adapters.layer(stage.index - 1)}

    @contextmanager
    def reference_weights(self) -> Iterator[None]:
        """Passes inside read the base alone (GRPO's KL reference, as TRL's under peft's disable_adapter()): the
        layers bind no adapters, the embedding and LM head are the base's even where modules_to_save trains them."""
        self.adapters_off = True
        try:
            yield
        finally:
            self.adapters_off = False

    @property
    def resident_base_bytes(self) -> int:
        """Device memory of the resident layers' base: dense, or packed (an NF4 base)."""
        packed = self.weights.packed
        return self.base.bytes + (packed.resident_bytes if packed is not None else 0)

    def reload_base(self) -> None:
        """The host's base was overwritten (Trainer.load_weights): copy the resident layers again, load the rest."""
        self.base.reload()
        self.weights.invalidate()

    def _embed_weight(self, bound: dict[str, torch.Tensor]) -> torch.Tensor:
        saved = None if self.adapters_off else self.adapters.saved.get(SAVED_MODULES["embed_tokens"])
        return bound["embed_tokens.weight"] if saved is None else saved.to(self.compute_dtype)

    def _lm_weight(self, head_w: dict[str, torch.Tensor], embed_w: torch.Tensor) -> torch.Tensor:
        saved = None if self.adapters_off else self.adapters.saved.get(SAVED_MODULES["lm_head"])
        return super()._lm_weight(head_w, embed_w) if saved is None else saved.to(self.compute_dtype)

    def _head(self, x: torch.Tensor, embed_w: torch.Tensor, labels: torch.Tensor, n_valid: int,
              batch: Batch) -> HeadResult:
        """The loss (cross-entropy, or DPO for a batch of preference pairs) and the gradient of the last hidden
        state; the LM head's gradient only where it is trained (modules_to_save), into the float32 vocabulary
        sums."""
        layout, compute = self.layout, self.streams.compute
        head_slot = self.weights.slot_for(layout.head)
        head_w = self.weights.bind(layout.head, head_slot)
        trained = SAVED_MODULES["lm_head"] in self.adapters.saved
        start = self.telemetry.timeline.start(compute)
        if trained:
            self.vocab_acc.zero_()
        lm_w, lm_grads = self._lm_weight(head_w, embed_w), self.vocab_acc if trained else None
        head = self._loss_head(x, head_w["model.norm.weight"], lm_w, labels, n_valid, batch, lm_grads,
                               input_grad_only=not trained)
        self.weights.release(head_slot)
        if trained:
            self.adapters.set_saved_grad(SAVED_MODULES["lm_head"], self.vocab_acc)
        self.telemetry.timeline.stop("compute", compute, start)
        return head

    def _layer_grads_out(self, i: int, stage: StageLayout, slot: WeightSlot | None,
                         weight_grads: dict[str, torch.Tensor], inject_nan: bool, start: Any,
                         idle: list[tuple[int, int]] = ()) -> None:
        """Layer i's adapter gradients into their device buffers (the global norm counts them)."""
        if inject_nan:
            next(iter(weight_grads.values())).view(-1)[:1].fill_(float("nan"))
        self.adapters.set_grads(i, weight_grads)
        self.telemetry.timeline.stop("compute", self.streams.compute, start)

    def _embedding(self, ids: torch.Tensor, grad_y: torch.Tensor, embed_slot: WeightSlot) -> None:
        """A frozen embedding: no gradient; a trained one (modules_to_save): the scatter-add of a full run."""
        self.weights.release(embed_slot)
        if SAVED_MODULES["embed_tokens"] not in self.adapters.saved:
            return
        compute = self.streams.compute
        start = self.telemetry.timeline.start(compute)
        self.vocab_acc.zero_()
        # As peft's copy of the embedding (its padding_idx): no gradient onto the padding token's row.
        embed_backward(self.vocab_acc, ids, grad_y, self.embed_scale, self.model_cfg.pad_token_id)
        self.adapters.set_saved_grad(SAVED_MODULES["embed_tokens"], self.vocab_acc)
        self.telemetry.timeline.stop("compute", compute, start)

    @property
    def comm(self) -> Collectives | None:
        return self._comm

    @comm.setter
    def comm(self, comm: Collectives | None) -> None:
        self._comm = self.weights.comm = comm

    def _totals(self, loss_sum: torch.Tensor, step: int) -> tuple[float, float]:
        """The loss and the adapters' gradient norm; several GPU workers first sum the gradients (each then
        holds the whole sum and takes the same step) and the loss over the ranks."""
        if self._comm is None:
            return float(loss_sum), float(self.adapters.sqnorm.sqrt())
        self.adapters.sum_over_ranks(self._comm)
        loss = loss_sum.to(torch.float64).reshape(1)
        self._comm.all_reduce(loss)
        return float(loss), float(self.adapters.sqnorm.sqrt())

    def _order_deferred_updates(self, loss: float, grad_norm: float) -> bool:
        """The adapters' clipped AdamW step; returns whether the step is dropped (a non-finite norm or loss)."""
        skipped = not (torch.isfinite(torch.tensor(grad_norm)) and torch.isfinite(torch.tensor(loss)))
        with self.telemetry.device_update(self.streams.compute):
            self.adapters.step(self.updates.lr, self.clip, grad_norm, apply=not skipped)
        return skipped

    def close(self) -> None:
        super().close()
        self.adapters.close()
        self.base.close()
