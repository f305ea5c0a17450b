"""DPO in the head: sequence log-probabilities, the preference loss, and its gradients, in token chunks.

A DPO batch holds P pairs as 2P rows, the chosen rows first and then the rejected rows in the same pair
order (TRL's layout). A row's log-probability is the sum over its completion tokens (labels != -100) of
log softmax(logits)[label], as TRL's DPOTrainer sums `per_token_logps`. With the reference model's
log-probabilities of the same rows (computed once before training), the loss of pair p is a function of

    z_p = (logp_chosen_p - logp_rejected_p) - (ref_chosen_p - ref_rejected_p)

averaged over the pairs. Because the loss couples whole sequences, the head runs twice over the tokens:
once for each row's log-probability (no gradients), then, knowing d loss / d logp_s of every row s, once
more for the gradients: d loss / d logits_t = (d loss / d logp_s) * (onehot(label_t) - softmax_t) on the
completion tokens of row s. Full logits never exist, only one chunk of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megatrain_ray.messages import IGNORE_INDEX, PreferenceRows
from megatrain_ray.model.head import HeadResult, HeadSpec
from megatrain_ray.model.norms import norm_dtype, rms_norm

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


def _chunk_logits(h: torch.Tensor, lm_weight: torch.Tensor, spec: HeadSpec,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's logits upcast to `dtype` (soft-capped when the model caps), and tanh for the cap's derivative."""
    logits = F.linear(h, lm_weight).to(dtype)
    if not spec.softcap:
        return logits, None
    capped = logits.div_(spec.softcap).tanh_()
    return capped * spec.softcap, capped


def _rows_of(start: int, count: int, seq_len: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + count, device=device) // seq_len


def sequence_logps(normed: torch.Tensor, lm_weight: torch.Tensor, labels: torch.Tensor, spec: HeadSpec,
                   chunk_tokens: int) -> torch.Tensor:
    """[rows] sums of log softmax(logits)[label] over each row's labels != -100 (`normed`: the final norm's
    output, [rows, seq_len, hidden]), in float32 (float64 when the model computes in it)."""
    rows, seq_len, hidden = normed.shape
    flat, flat_labels = normed.reshape(-1, hidden), labels.reshape(-1)
    dtype = norm_dtype(normed.dtype)
    out = torch.zeros(rows, dtype=dtype, device=normed.device)
    for start in range(0, flat.shape[0], chunk_tokens):
        lab = flat_labels[start:start + chunk_tokens]
        logits, _ = _chunk_logits(flat[start:start + chunk_tokens], lm_weight, spec, dtype)
        valid = lab != IGNORE_INDEX
        target = logits.gather(1, torch.where(valid, lab, 0)[:, None]).squeeze(1)
        token_logps = torch.where(valid, target - torch.logsumexp(logits, dim=-1), 0)
        out.index_add_(0, _rows_of(start, lab.shape[0], seq_len, out.device), token_logps)
    return out


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
    rows, seq_len, hidden = x.shape
    if rows != pref.reference_logps.shape[0] or rows % 2:
        raise ValueError(f"a DPO batch needs 2P rows with a reference log-probability each; got {rows} rows and "
                         f"{pref.reference_logps.shape[0]} reference values")
    head_grads = grad_lm_acc is not None
    x = x.detach().requires_grad_(True)
    norm_weight = norm_weight.detach().requires_grad_(head_grads)
    with torch.enable_grad():
        normed = rms_norm(x, norm_weight, spec.eps, spec.plus_one)
    flat, flat_labels = normed.detach().reshape(-1, hidden), labels.reshape(-1)
    logps = sequence_logps(normed.detach(), lm_weight, labels, spec, chunk_tokens)
    loss, row_grads, metrics = dpo_loss_and_row_grads(logps, pref)
    dtype = logps.dtype
    grad_flat = torch.empty_like(flat)
    for start in range(0, flat.shape[0], chunk_tokens):
        h, lab = flat[start:start + chunk_tokens], flat_labels[start:start + chunk_tokens]
        logits, capped = _chunk_logits(h, lm_weight, spec, dtype)
        valid = lab != IGNORE_INDEX
        safe = torch.where(valid, lab, 0)
        # d loss / d logits = g_s (onehot - softmax) = -g_s (softmax - onehot), on completion tokens only.
        weight = torch.where(valid, -row_grads[_rows_of(start, lab.shape[0], seq_len, logits.device)], 0)
        grad_logits = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True)).exp_()
        grad_logits.scatter_add_(1, safe[:, None], -torch.ones_like(weight[:, None]))
        grad_logits.mul_(weight[:, None].to(dtype))
        if capped is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh^2
            grad_logits.mul_(capped.square_().neg_().add_(1.0))
            del capped
        grad_logits = grad_logits.to(h.dtype)
        grad_flat[start:start + chunk_tokens] = grad_logits @ lm_weight
        if head_grads:
            grad_lm_acc.add_((grad_logits.t() @ h).to(grad_lm_acc.dtype))
    if not head_grads:
        (grad_x,) = torch.autograd.grad(normed, (x,), grad_flat.view(rows, seq_len, hidden))
        return PreferenceHeadResult(loss, grad_x, None, metrics)
    grad_x, grad_norm = torch.autograd.grad(normed, (x, norm_weight), grad_flat.view(rows, seq_len, hidden))
    return PreferenceHeadResult(loss, grad_x, grad_norm, metrics)
