"""DPO in the head: sequence log-probabilities, the preference loss, and its gradients, in token chunks.

A DPO batch holds P pairs as 2P rows, the chosen rows first and then the rejected rows in the same pair
order (TRL's layout). A row's log-probability is the sum over its completion tokens (labels != -100) of
log softmax(logits)[label], as TRL's DPOTrainer sums `per_token_logps`. With the reference model's
log-probabilities of the same rows (computed once before training), the loss of pair p is a function of

    z_p = (logp_chosen_p - logp_rejected_p) - (ref_chosen_p - ref_rejected_p)

averaged over the pairs. Because the loss couples whole sequences, the head runs twice over the tokens:
once for each row's log-probability (no gradients), then, knowing d loss / d logp_s of every row s, once
more for the gradients: d loss / d logits_t = (d loss / d logp_s) * (onehot(label_t) - softmax_t) on the
completion tokens of row s (model/label_logps.py, shared with GRPO's head). Full logits never exist, only one chunk
of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megatrain_ray.messages import PreferenceRows
from megatrain_ray.model.head import HeadResult, HeadSpec
from megatrain_ray.model.label_logps import label_token_logps, normed_for_backward, token_grads_backward
from megatrain_ray.model.norms import rms_norm

LOSS_TYPES = ("sigmoid", "robust")


def dpo_losses(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
               beta: float, label_smoothing: float, loss_type: str) -> torch.Tensor:
    """Per-pair DPO losses. `sigmoid`: -(1 - e) logsigmoid(beta z) - e logsigmoid(-beta z) (conservative DPO's
    label smoothing; with e = 0, TRL's `sigmoid`); `robust`: TRL's robust DPO,
    (-(1 - e) logsigmoid(beta z) + e logsigmoid(-beta z)) / (1 - 2e)."""
    u = beta * ((chosen - rejected) - (ref_chosen - ref_rejected))
    if loss_type == "sigmoid":
        return -F.logsigmoid(u) * (1 - label_smoothing) - F.logsigmoid(-u) * label_smoothing
    if loss_type == "robust":
        return (-(1 - label_smoothing) * F.logsigmoid(u) + label_smoothing * F.logsigmoid(-u)) / \
            (1 - 2 * label_smoothing)
    raise ValueError(f"unknown DPO loss type {loss_type!r}; expected one of {', '.join(LOSS_TYPES)}")


def dpo_loss_and_row_grads(logps: torch.Tensor, pref: PreferenceRows) -> tuple[torch.Tensor, torch.Tensor,
                                                                              dict[str, torch.Tensor]]:
    """(mean loss over the pairs, d loss / d logps of every row, TRL's logged metrics) from the 2P rows'
    log-probabilities (chosen rows first). Autograd over P numbers: exact, and never a hand-derived formula
    to keep in step with `dpo_losses`. Loss and metrics are sums over the pairs divided by pref.total_pairs
    (when the ranks of a data-parallel run share a batch, their results add up to the means)."""
    ref = pref.reference_logps.to(device=logps.device, dtype=logps.dtype)
    pairs = logps.shape[0] // 2
    total = pref.total_pairs or pairs
    logps = logps.detach().requires_grad_(True)
    with torch.enable_grad():
        chosen, rejected = logps[:pairs], logps[pairs:]
        loss = dpo_losses(chosen, rejected, ref[:pairs], ref[pairs:], pref.beta, pref.label_smoothing,
                          pref.loss_type).sum() / total
        (grad,) = torch.autograd.grad(loss, logps)
    with torch.no_grad():
        chosen_rewards = pref.beta * (chosen - ref[:pairs])
        rejected_rewards = pref.beta * (rejected - ref[pairs:])
        metrics = {"rewards/chosen": chosen_rewards.sum() / total, "rewards/rejected": rejected_rewards.sum() / total,
                   "rewards/accuracies": (chosen_rewards > rejected_rewards).to(logps.dtype).sum() / total,
                   "rewards/margins": (chosen_rewards - rejected_rewards).sum() / total,
                   "logps/chosen": chosen.sum() / total, "logps/rejected": rejected.sum() / total}
    return loss.detach(), grad, metrics


@dataclass(slots=True)
class PreferenceHeadResult(HeadResult):
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """TRL's DPO metrics of the batch (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
    logps/chosen, logps/rejected) as 0-d tensors on the device."""


def sequence_logps(normed: torch.Tensor, lm_weight: torch.Tensor, labels: torch.Tensor, spec: HeadSpec,
                   chunk_tokens: int) -> torch.Tensor:
    """[rows] sums of log softmax(logits)[label] over each row's labels != -100 (`normed`: the final norm's
    output, [rows, seq_len, hidden]), in float32 (float64 when the model computes in it)."""
    return label_token_logps(normed, lm_weight, labels, spec, chunk_tokens).sum(dim=1)


def preference_logps(x: torch.Tensor, norm_weight: torch.Tensor, lm_weight: torch.Tensor, labels: torch.Tensor,
                     spec: HeadSpec, chunk_tokens: int) -> torch.Tensor:
    """Each row's completion log-probability from the last layer's output (forward only: the reference pass)."""
    return sequence_logps(rms_norm(x, norm_weight, spec.eps, spec.plus_one), lm_weight, labels, spec, chunk_tokens)


def preference_eval_loss(x: torch.Tensor, norm_weight: torch.Tensor, lm_weight: torch.Tensor, labels: torch.Tensor,
                         pref: PreferenceRows, spec: HeadSpec, chunk_tokens: int) -> torch.Tensor:
    """The DPO loss of the batch's pairs, forward only (evaluation)."""
    logps = preference_logps(x, norm_weight, lm_weight, labels, spec, chunk_tokens)
    return dpo_loss_and_row_grads(logps, pref)[0]


def preference_loss_and_grads(x: torch.Tensor, norm_weight: torch.Tensor, lm_weight: torch.Tensor,
                              labels: torch.Tensor, pref: PreferenceRows, spec: HeadSpec, chunk_tokens: int,
                              grad_lm_acc: torch.Tensor | None) -> PreferenceHeadResult:
    """The DPO loss of the batch's pairs and its gradients (x, the final norm's weight, the LM head into
    `grad_lm_acc`), the DPO counterpart of head.head_loss_and_grads; see the module docstring.
    `grad_lm_acc=None` (a frozen head, LoRA): the gradient of x only."""
    rows, seq_len = x.shape[:2]
    if rows != pref.reference_logps.shape[0] or rows % 2:
        raise ValueError(f"a DPO batch needs 2P rows with a reference log-probability each; got {rows} rows and "
                         f"{pref.reference_logps.shape[0]} reference values")
    x, norm_weight, normed = normed_for_backward(x, norm_weight, spec, grad_lm_acc is not None)
    logps = sequence_logps(normed, lm_weight, labels, spec, chunk_tokens)
    loss, row_grads, metrics = dpo_loss_and_row_grads(logps, pref)
    # Every labelled token of row s has d loss / d logp_t = d loss / d logp_s.
    token_grads = row_grads[:, None].expand(rows, seq_len)
    grad_x, grad_norm = token_grads_backward(x, norm_weight, normed, lm_weight, labels, token_grads, spec,
                                             chunk_tokens, grad_lm_acc)
    return PreferenceHeadResult(loss, grad_x, grad_norm, metrics)
