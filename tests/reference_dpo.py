"""Independent references for DPO: TRL 1.16's own loss (DPOTrainer._compute_loss, called unbound on the
log-probabilities) and a plain transformers forward for the sequences' log-probabilities."""

from __future__ import annotations

import types
from collections import defaultdict

import torch

IGNORE_INDEX = -100


def trl_loss(per_token_logps: torch.Tensor, completion_mask: torch.Tensor, ref: torch.Tensor, beta: float,
             label_smoothing: float, loss_type: str) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's DPOTrainer._compute_loss, called unbound on an object holding only what it reads, with a model
    whose output's `log_probs` are the given per-token log-probabilities ([rows, seq_len - 1]; TRL's fused head
    returns 0 where the label is -100, so they are masked by completion_mask[:, 1:] here). Rows: the chosen
    sequences, then the rejected ones; `ref`: their reference log-probabilities in the same order."""
    import trl

    rows, seq_len = completion_mask.shape

    class Model:
        training = True

        def __call__(self, **kwargs):
            return types.SimpleNamespace(
                log_probs=per_token_logps * completion_mask[:, 1:], entropy=torch.zeros(rows, seq_len - 1),
                mean_logits=torch.zeros(rows, seq_len - 1),
                is_top1=torch.zeros(rows, seq_len - 1, dtype=torch.bool))

    accelerator = types.SimpleNamespace(device="cpu", gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = types.SimpleNamespace(
        model=Model(), accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=label_smoothing, use_weighting=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1)
    pairs = rows // 2
    inputs = {"input_ids": torch.zeros(rows, seq_len, dtype=torch.long),
              "attention_mask": torch.ones(rows, seq_len, dtype=torch.long), "completion_mask": completion_mask,
              "ref_chosen_logps": ref[:pairs], "ref_rejected_logps": ref[pairs:]}
    loss = trl.DPOTrainer._compute_loss(trainer, trainer.model, inputs, False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def hf_token_logps(model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[rows, seq_len] log-probability of each label under a transformers causal LM (0 where the label is -100), in
    float32 (float64 for a float64 model)."""
    logits = model(input_ids=input_ids, use_cache=False).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logps = torch.log_softmax(logits, -1).gather(2, labels.clamp(min=0)[..., None]).squeeze(2)
    return torch.where(labels != IGNORE_INDEX, logps, 0)
