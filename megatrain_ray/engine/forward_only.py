"""The layer stream's passes without gradients: full logits, the evaluation loss, DPO's reference log-probabilities
and GRPO's per-token ones, each the forward of a training step with its own head at the end."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from megatrain_ray.messages import IGNORE_INDEX, Batch
from megatrain_ray.model.head import head_logits, head_loss_and_grads, loss_rows
from megatrain_ray.model.policy_head import policy_eval_loss, policy_token_logps
from megatrain_ray.model.preference import preference_eval_loss, preference_logps


class ForwardOnlyPasses:
    """A base of StreamEngine: these passes run its forward (`_forward`, `_begin`), read its weights, head spec,
    generic template and engine config, and update nothing."""

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Full logits of a small batch through the same layer stream (tests, small inputs)."""
        def head(x: torch.Tensor, head_w: dict, embed_w: torch.Tensor) -> torch.Tensor:
            if self.generic is not None:
                return self.generic.head_logits(x, head_w, embed_w).float().cpu()
            return head_logits(x, head_w["model.norm.weight"], self._lm_weight(head_w, embed_w),
                               self.head_spec).float().cpu()

        return self._forward_only(Batch(ids, torch.full_like(ids, IGNORE_INDEX)), head)

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> tuple[float, int]:
        """Mean loss over the batch's loss tokens, and their number, without gradients or updates (DPO: the mean
        loss over the batch's pairs, and their number; GRPO: the loss of the batch's completions, and their number)."""
        n_valid = max(1, batch.loss_tokens)
        labels = batch.labels.to(self.device, non_blocking=True)
        if self.generic is not None:
            self.refuse_objective_on_generic(batch)
        if batch.policy is not None:
            def grpo(x: torch.Tensor, head_w: dict, embed_w: torch.Tensor) -> torch.Tensor:
                return policy_eval_loss(x, head_w["model.norm.weight"], self._lm_weight(head_w, embed_w), labels,
                                        batch.policy, self.head_spec, self.engine_cfg.loss_chunk_tokens)

            return float(self._forward_only(batch, grpo)), batch.input_ids.shape[0]
        if batch.preference is not None:
            def dpo(x: torch.Tensor, head_w: dict, embed_w: torch.Tensor) -> torch.Tensor:
                return preference_eval_loss(x, head_w["model.norm.weight"], self._lm_weight(head_w, embed_w), labels,
                                            batch.preference, self.head_spec, self.engine_cfg.loss_chunk_tokens)

            return float(self._forward_only(batch, dpo)), batch.input_ids.shape[0] // 2

        rows = loss_rows(batch.labels, device=self.device)  # the eager chunk loss: any row count

        def head(x: torch.Tensor, head_w: dict, embed_w: torch.Tensor) -> torch.Tensor:
            if self.generic is not None:
                return self.generic.head_loss(x, head_w, embed_w, labels, n_valid, self.engine_cfg.loss_chunk_tokens,
                                              None)[0].loss_sum
            return head_loss_and_grads(x, head_w["model.norm.weight"], self._lm_weight(head_w, embed_w), labels,
                                       n_valid, self.head_spec, self.engine_cfg.loss_chunk_tokens,
                                       grad_lm_acc=None, rows=rows).loss_sum

        return float(self._forward_only(batch, head)), batch.loss_tokens

    @torch.no_grad()
    def sequence_logps(self, batch: Batch) -> torch.Tensor:
        """[rows] float64 sums of each row's label log-probabilities (labels != -100), forward only: DPO's
        reference pass over the initial weights."""
        labels = batch.labels.to(self.device, non_blocking=True)

        def head(x: torch.Tensor, head_w: dict, embed_w: torch.Tensor) -> torch.Tensor:
            return preference_logps(x, head_w["model.norm.weight"], self._lm_weight(head_w, embed_w), labels,
                                    self.head_spec, self.engine_cfg.loss_chunk_tokens).double().cpu()

        return self._forward_only(batch, head)

    @torch.no_grad()
    def token_logps(self, batch: Batch, temperature: float = 1.0, reference: bool = False) -> torch.Tensor:
        """[rows, seq_len] log-probability of each label (0 where labels == -100) at `temperature`, forward only, on
        the host: GRPO's old (generating policy's) log-probabilities, or with `reference` the reference model's
        (reference_weights). float32 (float64 when computing in it)."""
        labels = batch.labels.to(self.device, non_blocking=True)
        if self.generic is not None:
            raise ValueError("per-token log-probabilities (GRPO) need a native layer template (model.template "
                             "generic computes cross-entropy only)")

        def head(x: torch.Tensor, head_w: dict, embed_w: torch.Tensor) -> torch.Tensor:
            return policy_token_logps(x, head_w["model.norm.weight"], self._lm_weight(head_w, embed_w), labels,
                                      self.head_spec, self.engine_cfg.loss_chunk_tokens, temperature).cpu()

        with self.reference_weights() if reference else nullcontext():
            return self._forward_only(batch, head)

    @contextmanager
    def reference_weights(self) -> Iterator[None]:
        """Passes inside read GRPO's KL reference, the initial weights: full fine-tuning streams every stage from the
        host's frozen `reference` copy (RunSpec.reference_copy; no stage may be GPU-resident) in place of the
        trained one (LoRA's engine: the base without its adapters)."""
        if not self.weights.store.has("reference", self.layout.embed.index):
            raise ValueError("the reference pass needs the host's reference copy of the initial weights "
                             "(RunSpec.reference_copy: finetune.objective=grpo with finetune.grpo.beta > 0)")
        if self.resident.stages:
            raise ValueError("the reference pass streams every layer; GPU-resident layers hold trained weights only")
        self.weights.invalidate()  # the slots hold trained weights
        self.weights.reading = "reference"
        try:
            yield
        finally:
            self.weights.reading = None
            self.weights.invalidate()

    def refuse_objective_on_generic(self, batch: Batch) -> None:
        """The DPO and GRPO heads work on the native final norm; the generic template's head is cross-entropy only."""
        if batch.preference is not None or batch.policy is not None:
            raise ValueError(f"a {'DPO' if batch.preference is not None else 'GRPO'} batch needs a native layer "
                             "template (model.template generic computes cross-entropy only)")

    def _forward_only(self, batch: Batch, head: Any) -> Any:
        """The forward of train_step (same stream, same templates) with `head(x, head_weights, embed_w)` at the end."""
        self._begin(training=False)
        x, embed_slot, embed_w, _, _ = self._forward(batch.input_ids.to(self.device), batch, None)
        head_slot = self._vocab_slot(self.layout.head)  # None where the GPU-resident tier holds it
        out = head(x, self._vocab_weights(self.layout.head, head_slot), embed_w)
        self._vocab_release(head_slot)
        self._vocab_release(embed_slot)
        self.weights.end_step()
        return out
