"""GRPO in the head: each completion token's log-probability, TRL 1.16's GRPO loss on them, and its gradients, in
token chunks.

A GRPO batch's rows are prompt + completion sequences; their labels hold the next token where it is a completion
token, -100 elsewhere (messages.PolicyRows). The loss (model/policy_gradient.py) depends on each completion token's
log-probability only, so the head runs twice over the tokens (model/label_logps.py, as DPO's): once for the
log-probabilities, then, knowing d loss / d logp_t from autograd over those [rows, seq_len] numbers, once more for the
gradients. With the importance-sampling correction on, each token's (or row's) loss is weighted as TRL weighs it: by
exp(old - sampling), old being the generating policy's log-probabilities (on-policy: the head's own, detached).
Full logits never exist, only one chunk of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatrain_ray.messages import IGNORE_INDEX, PolicyRows
from megatrain_ray.model.head import HeadResult, HeadSpec
from megatrain_ray.model.label_logps import label_token_logps, normed_for_backward, token_grads_backward
from megatrain_ray.model.norms import rms_norm
from megatrain_ray.model.policy_gradient import grpo_loss_and_token_grads, rollout_importance_weights


@dataclass(slots=True)
class PolicyHeadResult(HeadResult):
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """TRL's GRPO metrics of the batch as 0-d tensors on the device: clip_ratio/low_mean, high_mean, region_mean,
    low_min, high_max; kl (beta > 0); sampling/sampling_logp_difference/mean, max and
    sampling/importance_sampling_ratio/min, mean, max (the importance-sampling correction on), and ours beside them,
    sampling/importance_sampling_ratio/zero_fraction (model/policy_gradient.py: ZERO_FRACTION)."""
    token_logps: torch.Tensor | None = None
    """[rows, seq_len] each label's log-probability (0 where labels == -100), detached, float32 (float64 when the
    model computes in it), on the device."""


def _on_labels(t: torch.Tensor, valid: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-token input read where labels != -100 only: elsewhere 0, so that whatever the caller left there (NaN,
    inf) cannot reach the loss through masked products (0 * NaN is NaN)."""
    return torch.where(valid, t.to(device=like.device, dtype=like.dtype), 0)


def policy_loss_and_token_grads(logps: torch.Tensor, labels: torch.Tensor, rows: PolicyRows
                                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, d loss / d logps [rows, seq_len], TRL's metrics) from each label's log-probability `logps` (0 where
    labels == -100), in the dtype of `logps`."""
    if labels.shape != logps.shape or rows.advantages.shape[0] != labels.shape[0]:
        raise ValueError(f"a GRPO batch needs one advantage per row; got labels {tuple(labels.shape)} and "
                         f"{rows.advantages.shape[0]} advantages")
    for name in ("sampling_logps", "old_logps", "ref_logps"):
        t = getattr(rows, name)
        if t is not None and t.shape != labels.shape:
            raise ValueError(f"PolicyRows.{name} is {tuple(t.shape)}; it must be aligned with the labels, "
                             f"{tuple(labels.shape)}")
    valid = labels != IGNORE_INDEX
    mask = valid.to(logps.dtype)
    old = None if rows.old_logps is None else _on_labels(rows.old_logps, valid, logps)
    ref = None if rows.ref_logps is None else _on_labels(rows.ref_logps, valid, logps)
    is_weights, is_metrics = None, {}
    if rows.vllm_importance_sampling_correction:
        if rows.sampling_logps is None:
            raise ValueError("vllm_importance_sampling_correction needs the rollout's log-probabilities "
                             "(PolicyRows.sampling_logps)")
        # NaN stays where labels count (the rollout could not score the token: no correction, as TRL).
        sampling = torch.where(valid, rows.sampling_logps.to(device=logps.device, dtype=logps.dtype), 0)
        is_weights, is_metrics = rollout_importance_weights(
            logps.detach() if old is None else old, sampling, mask, rows.vllm_importance_sampling_mode,
            rows.vllm_importance_sampling_clip_min, rows.vllm_importance_sampling_clip_max,
            total_tokens=rows.total_tokens or None)
    loss, grads, metrics = grpo_loss_and_token_grads(
        logps, old, mask, rows.advantages.to(logps.device), rows.loss, ref, is_weights,
        total_rows=rows.total_rows or None, total_tokens=rows.total_tokens or None)
    return loss, grads, {**metrics, **is_metrics}


def policy_loss_and_grads(x: torch.Tensor, norm_weight: torch.Tensor, lm_weight: torch.Tensor, labels: torch.Tensor,
                          rows: PolicyRows, spec: HeadSpec, chunk_tokens: int,
                          grad_lm_acc: torch.Tensor | None) -> PolicyHeadResult:
    """The GRPO loss of the batch's completions and its gradients (x, the final norm's weight, the LM head into
    `grad_lm_acc`), the GRPO counterpart of head.head_loss_and_grads; see the module docstring. `grad_lm_acc=None`
    (a frozen head, LoRA): the gradient of x only."""
    x, norm_weight, normed = normed_for_backward(x, norm_weight, spec, grad_lm_acc is not None)
    logps = label_token_logps(normed, lm_weight, labels, spec, chunk_tokens, rows.temperature)
    loss, token_grads, metrics = policy_loss_and_token_grads(logps, labels, rows)
    grad_x, grad_norm = token_grads_backward(x, norm_weight, normed, lm_weight, labels, token_grads, spec,
                                             chunk_tokens, grad_lm_acc, rows.temperature)
    return PolicyHeadResult(loss, grad_x, grad_norm, metrics, logps)


def policy_token_logps(x: torch.Tensor, norm_weight: torch.Tensor, lm_weight: torch.Tensor, labels: torch.Tensor,
                       spec: HeadSpec, chunk_tokens: int, temperature: float = 1.0) -> torch.Tensor:
    """Each label's log-probability at `temperature` from the last layer's output, forward only (old or reference
    log-probs)."""
    return label_token_logps(rms_norm(x, norm_weight, spec.eps, spec.plus_one), lm_weight, labels, spec, chunk_tokens,
                             temperature)


def policy_eval_loss(x: torch.Tensor, norm_weight: torch.Tensor, lm_weight: torch.Tensor, labels: torch.Tensor,
                     rows: PolicyRows, spec: HeadSpec, chunk_tokens: int) -> torch.Tensor:
    """The GRPO loss of the batch's completions, forward only (evaluation)."""
    logps = policy_token_logps(x, norm_weight, lm_weight, labels, spec, chunk_tokens, rows.temperature)
    return policy_loss_and_token_grads(logps, labels, rows)[0]
