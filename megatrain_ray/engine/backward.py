"""The training step's loss head and backward (a base of StreamEngine, engine/step.py): the loss and its gradients
in token chunks, each layer's backward in reverse (recomputed from its kept input, or through its kept graph:
engine/kept_graphs.py), the embedding's scatter-add, and each stage's gradients to their home: the host (its
update ordered, engine/grads.py) or the GPU-resident tier (engine/resident.py), the embedding and LM head's too
where the tier holds them (RunSpec.resident_vocab)."""

from __future__ import annotations

from typing import Any

import torch

from megatrain_ray.engine.grads import GradSlot
from megatrain_ray.engine.kept_graphs import backward_kept
from megatrain_ray.engine.weights import WeightSlot
from megatrain_ray.messages import Batch
from megatrain_ray.model.attention import DocumentBucket
from megatrain_ray.model.generic_template import run_layer
from megatrain_ray.model.head import HeadResult, chunk_cross_entropy, head_loss_and_grads, loss_rows
from megatrain_ray.model.layout import StageLayout
from megatrain_ray.model.moe import RouterRecord, idle_expert_spans
from megatrain_ray.model.policy_head import policy_loss_and_grads
from megatrain_ray.model.preference import preference_loss_and_grads
from megatrain_ray.model.templates import decoder_layer_backward, embed_backward


class BackwardPasses:
    """A base of StreamEngine: these methods read its layout, weights, gradient sink, resident tier and settings."""

    def _vocab_slot(self, stage: StageLayout) -> WeightSlot | None:
        """The embedding's or LM head's weight slot; None where the GPU-resident tier holds the stage."""
        return None if self.resident.holds(stage) else self.weights.slot_for(stage)

    def _vocab_weights(self, stage: StageLayout, slot: WeightSlot | None) -> dict[str, torch.Tensor]:
        """The embedding's or LM head's tensors: the tier's, or the slot's once loaded."""
        return self.resident.weights(stage) if slot is None else self.weights.bind(stage, slot)

    def _vocab_release(self, slot: WeightSlot | None) -> None:
        if slot is not None:
            self.weights.release(slot)

    def _loss_head(self, x: torch.Tensor, norm_w: torch.Tensor, lm_w: torch.Tensor, labels: torch.Tensor,
                   n_valid: int, batch: Batch, lm_grads: torch.Tensor | None,
                   input_grad_only: bool = False) -> HeadResult:
        """The batch's loss (cross-entropy, DPO for preference pairs, GRPO for policy rows) and its gradients, the
        LM head's into `lm_grads` (None with `input_grad_only`: a frozen head, the gradient of x only)."""
        chunk = self.engine_cfg.loss_chunk_tokens
        if batch.preference is not None:
            return preference_loss_and_grads(x, norm_w, lm_w, labels, batch.preference, self.head_spec, chunk,
                                             lm_grads)
        if batch.policy is not None:
            return policy_loss_and_grads(x, norm_w, lm_w, labels, batch.policy, self.head_spec, chunk, lm_grads)
        return head_loss_and_grads(x, norm_w, lm_w, labels, n_valid, self.head_spec, chunk, lm_grads,
                                   input_grad_only=input_grad_only, chunk_loss=self._chunk_loss,
                                   rows=self._loss_rows(batch, labels))

    def _loss_rows(self, batch: Batch, labels: torch.Tensor) -> torch.Tensor | None:
        """head.loss_rows of the batch, from its labels on the host, on the device; in whole chunks where the chunk
        loss is compiled (a new row count would be a new shape to compile)."""
        if batch.labels.shape != labels.shape:
            return None
        compiled = self._chunk_loss is not chunk_cross_entropy
        return loss_rows(batch.labels, self.engine_cfg.loss_chunk_tokens if compiled else None, labels.device)

    def _head(self, x: torch.Tensor, embed_w: torch.Tensor, labels: torch.Tensor, n_valid: int,
              batch: Batch) -> HeadResult:
        """The loss and its gradients in token chunks (the LM head's weights were loaded after the last layer):
        cross-entropy, or DPO for a batch of preference pairs; the head's weight gradients go out at once."""
        layout, compute = self.layout, self.streams.compute
        head_slot = self._vocab_slot(layout.head)
        head_w = self._vocab_weights(layout.head, head_slot)
        lm_w = self._lm_weight(head_w, embed_w)
        start = self.telemetry.timeline.start(compute)
        self.vocab_acc.zero_()
        if self.generic is not None:  # the final norm's gradients and an untied LM head's (vocab_acc) by name
            self.refuse_objective_on_generic(batch)
            head, head_grads = self.generic.head_loss(x, head_w, embed_w, labels, n_valid,
                                                      self.engine_cfg.loss_chunk_tokens, self.vocab_acc)
        else:
            head = self._loss_head(x, head_w["model.norm.weight"], lm_w, labels, n_valid, batch, self.vocab_acc)
            head_grads = {"model.norm.weight": head.grad_norm_weight}
            if not layout.tied:
                head_grads["lm_head.weight"] = self.vocab_acc
        self._vocab_release(head_slot)
        self._vocab_grads_out(layout.head, self.grads.head_slot, head_grads, start)
        return head

    def _vocab_grads_out(self, stage: StageLayout, grad_slot: GradSlot, grads: dict[str, torch.Tensor],
                         start: Any) -> None:
        """The embedding's or LM head's gradients to the host through `grad_slot`, or into the resident tier (its
        update on the device, as a resident layer's). `start`: the stage's compute timing, stopped here."""
        compute, timeline = self.streams.compute, self.telemetry.timeline
        if self.resident.holds(stage):
            buf = self.resident.write(stage, grads)
            timeline.stop("compute", compute, start)
            self.grads.count(buf[:stage.numel])
            self.resident.ready(stage, self.clip > 0, self.updates.lr, self.updates.adam_step)
            return
        self.grads.write(stage, grad_slot, grads)
        timeline.stop("compute", compute, start)
        self.grads.emit(stage, grad_slot)

    def _backward(self, head: HeadResult, rope: dict, documents: tuple[DocumentBucket, ...] | None,
                  inject_nan: bool) -> torch.Tensor:
        """Each layer's backward in reverse, through its kept graph or recomputed from its kept input, and its
        weight gradients out; returns the gradient of the first layer's input. `inject_nan`: the nan_grad drill."""
        # The head's own reference to its input gradient would hold a [tokens, hidden] tensor through the
        # whole backward (8 GiB at 512K tokens of an 8B model).
        grad_y, head.grad_x = head.grad_x, None
        layers, acts, timeline = self.layout.layers, self.activations, self.telemetry.timeline
        compute = self.streams.compute
        upcoming = self._load(layers[-1])
        acts.prefetch(len(layers) - 1, self.device)
        for i in range(len(layers) - 1, -1, -1):
            self._layer_output_grad(i, grad_y)
            stage, slot = layers[i], upcoming
            if i > 0:
                upcoming = self._load(layers[i - 1])
                acts.prefetch(i - 1, self.device)
            w = self._bind(stage, slot)
            x_in = acts.take(i, self.device)
            start = timeline.start(compute)
            routing = None
            kept = self.kept_graphs.pop(i, None)
            if kept is not None:  # a resident layer's forward graph: no recompute
                grad_x, weight_grads = backward_kept(kept, grad_y, self.router_aux.layer_grad(i))
                del kept
            elif self.generic is not None:  # the model's own layer, recomputed in one piece
                grad_x, weight_grads = decoder_layer_backward(x_in, w, rope[i], self.generic.layers[i], None, grad_y,
                                                              0, run_layer, router_grad=self.router_aux.layer_grad(i))
            else:
                spec = self.specs[i]
                # A streamed MoE layer (one rank) records its routing: its experts without tokens have zero
                # gradients, which are not copied to the host. From the recompute, whose routing the gradients follow.
                if spec.moe is not None and slot is not None and self._comm is None:
                    routing = RouterRecord()
                grad_x, weight_grads = decoder_layer_backward(x_in, w, rope[spec.local_rope], spec, documents,
                                                              grad_y, self.mlp_chunk, self._layer(x_in, documents, w, spec),
                                                              self.trainable, router_grad=self.router_aux.layer_grad(i),
                                                              router=routing)
            del x_in
            self._release(slot)
            # The counts' copy waits for the recompute's routing only; its backward is queued already.
            idle = idle_expert_spans(stage.slots, routing.counts.tolist()) if routing is not None else []
            self._layer_grads_out(i, stage, slot, weight_grads, inject_nan and i == 0, start, idle)
            del weight_grads  # else the float32 MLP sums of this layer live through the next layer's backward
            grad_y = grad_x
        return grad_y

    def _layer_output_grad(self, i: int, grad_y: torch.Tensor) -> None:
        """Sees the gradient of layer i's output before its backward (a vision-language model takes its deepstack
        features' gradients here: engine/vision_engine.py)."""

    def _layer_grads_out(self, i: int, stage: StageLayout, slot: WeightSlot | None,
                         weight_grads: dict[str, torch.Tensor], inject_nan: bool, start: Any,
                         idle: list[tuple[int, int]] = ()) -> None:
        """Layer i's weight gradients to their home: the host (its update ordered), or the resident tier. `start`:
        the timing of the layer's backward, stopped here once its gradients are written; `idle`: spans known to
        hold zeros (a MoE layer's experts without tokens), not copied to the host."""
        compute, timeline = self.streams.compute, self.telemetry.timeline
        # A resident stage's gradients stay on the device; they count in the norm where a streamed one's would.
        if slot is None:
            grad_buf = self.resident.write(stage, weight_grads)
        else:
            grad_slot = self.grads.layer_slot(i)
            self.grads.write(stage, grad_slot, weight_grads)
            grad_buf = grad_slot.buf
        if inject_nan:
            grad_buf[:1].fill_(float("nan"))
        timeline.stop("compute", compute, start)
        if slot is None:
            self.grads.count(grad_buf[:stage.numel])
            self.resident.ready(stage, self.clip > 0, self.updates.lr, self.updates.adam_step)
        else:
            self.grads.emit(stage, grad_slot, idle)

    def _embedding(self, ids: torch.Tensor, grad_y: torch.Tensor, embed_slot: WeightSlot | None) -> None:
        """The embedding's gradients: a scatter-add of the input gradients (onto the LM head's part when tied), none
        onto the padding token's row (model.pad_token_id), as transformers'."""
        layout, compute = self.layout, self.streams.compute
        start = self.telemetry.timeline.start(compute)
        if not layout.tied:
            self.vocab_acc.zero_()
        if self.generic is not None:  # through the embedding module's own backward
            self.generic.embed_grad(ids, grad_y, self._vocab_weights(layout.embed, embed_slot), self.vocab_acc)
        else:
            embed_backward(self.vocab_acc, ids, grad_y, self.embed_scale, self.model_cfg.pad_token_id)
        self._vocab_release(embed_slot)
        self._vocab_grads_out(layout.embed, self.grads.embed_slot, {layout.embed.slots[0].name: self.vocab_acc},
                              start)
