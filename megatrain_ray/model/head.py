"""The LM head: the final norm and the logits (full, for small inputs), and the chunked cross-entropy with its
gradients, which never holds the full logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.messages import IGNORE_INDEX
from megatrain_ray.model.norms import norm_dtype, rms_norm


@dataclass(frozen=True, slots=True)
class HeadSpec:
    """The static facts of the head: the final norm's epsilon and kind, the final logit soft-cap."""

    eps: float
    plus_one: bool = False
    """The (1 + weight) final norm of Gemma, Qwen3.5 and Qwen3-Next."""
    softcap: float = 0.0
    """Final logit soft-cap, cap * tanh(logit / cap) (Gemma 2); 0: off."""

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "HeadSpec":
        return cls(cfg.rms_norm_eps, cfg.zero_centered_norms, cfg.final_logit_softcapping)


def head_logits(x: torch.Tensor, norm_weight: torch.Tensor, lm_weight: torch.Tensor,
                eps: float | HeadSpec) -> torch.Tensor:
    """Full logits, for evaluation and tests on small inputs only (training uses the chunked loss).
    `eps`: a HeadSpec, or the final norm's epsilon alone (plain RMSNorm, no soft-cap)."""
    spec = eps if isinstance(eps, HeadSpec) else HeadSpec(eps)
    logits = F.linear(rms_norm(x, norm_weight, spec.eps, spec.plus_one), lm_weight)
    if spec.softcap:  # in the model's dtype, as transformers
        logits = torch.tanh(logits / spec.softcap) * spec.softcap
    return logits


@dataclass(slots=True)
class HeadResult:
    loss_sum: torch.Tensor
    """Sum over valid tokens of the cross-entropy, divided by `n_valid` (so it is the mean)."""
    grad_x: torch.Tensor | None
    grad_norm_weight: torch.Tensor | None
    """Both None for a forward-only loss (evaluation)."""


def chunk_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, n_valid: torch.Tensor, softcap: float,
                        with_grads: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's cross-entropy summed over its valid labels and divided by `n_valid` (a 0-d tensor of the loss
    dtype: a tensor, so that a compiled version of this function serves every step), and with `with_grads` its
    gradient with respect to `logits` [tokens, vocab], in their dtype. The logits are upcast to float32 (float64
    when computing in it) as Hugging Face's loss does; a final soft-cap (Gemma 2) is applied to the upcast logits
    and its derivative, 1 - tanh^2, to their gradient. Eagerly the float32 tensor is reused in place; through
    torch.compile (engine.compile) the upcast, softmax and gradient fuse into a few passes over the chunk."""
    in_dtype, logits = logits.dtype, logits.to(n_valid.dtype)
    capped = None
    if softcap:  # tanh kept (as `capped`) for the derivative; logits become cap * tanh
        capped = logits.div_(softcap).tanh_()
        logits = capped * softcap
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, 0)
    lse = torch.logsumexp(logits, dim=-1)
    target = logits.gather(1, safe[:, None]).squeeze(1)
    loss = torch.where(valid, lse - target, 0).sum() / n_valid
    if not with_grads:
        return loss, None
    # d(loss)/d(logits) = (softmax - onehot) / n_valid on valid rows, 0 elsewhere; built in place.
    grad_logits = logits.sub_(lse[:, None]).exp_()
    grad_logits.scatter_add_(1, safe[:, None], -torch.ones_like(lse[:, None]))
    grad_logits.mul_((valid.to(n_valid.dtype) / n_valid)[:, None])
    if capped is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh^2
        grad_logits.mul_(capped.square_().neg_().add_(1.0))
    return loss, grad_logits.to(in_dtype)


SKIP_WHEN_COUNTED_BELOW = 0.9
"""loss_rows picks rows only where fewer than this share of the tokens count: else gathering them costs more than
the logits it saves."""


def loss_rows(labels: torch.Tensor, bucket: int | None = None,
              device: torch.device | str | None = None) -> torch.Tensor | None:
    """The flat indices, ascending, of the tokens whose label counts, for head_loss_and_grads to compute the logits
    of those rows only (a prompt's tokens, masked out of the loss, need none: their loss and gradients are zero);
    None: every row, where nearly all count. Call it on the host's labels (nonzero would make a GPU synchronise).
    `bucket`: the number of rows is rounded up to a multiple of it (or to all of them) with rows that do not count,
    so a compiled chunk loss sees no new shape from step to step. `device`: where the rows go (non-blocking)."""
    flat = labels.reshape(-1)
    counted = flat != IGNORE_INDEX
    total, n = flat.numel(), int(counted.sum())
    keep = n if bucket is None else min(total, -(-n // bucket) * bucket)
    if keep >= SKIP_WHEN_COUNTED_BELOW * total:
        return None
    rows = counted.nonzero().squeeze(1)
    if keep > n:  # padding rows whose label does not count: zero loss, zero gradient
        rows = torch.cat([rows, (~counted).nonzero().squeeze(1)[:keep - n]]).sort().values
    return rows if device is None else rows.to(device, non_blocking=True)


def head_loss_and_grads(x: torch.Tensor, norm_weight: torch.Tensor | None, lm_weight: torch.Tensor,
                        labels: torch.Tensor, n_valid: int, eps: float | HeadSpec, chunk_tokens: int,
                        grad_lm_acc: torch.Tensor | None, input_grad_only: bool = False,
                        chunk_loss=chunk_cross_entropy, rows: torch.Tensor | None = None) -> HeadResult:
    """Mean cross-entropy over the valid labels and its gradients, in chunks of tokens.

    Logits exist for one chunk at a time (chunk_tokens x vocab, upcast to float32 as in Hugging
    Face's loss). The gradient of the LM head matrix is added into `grad_lm_acc` (float32 or
    float64), which with tied embeddings also collects the embedding's gradient later. With
    `grad_lm_acc=None` only the loss is computed (evaluation). `eps`: a HeadSpec, or the final norm's
    epsilon alone; `norm_weight=None`: x is normed already (no norm here). A final soft-cap (Gemma 2) is
    applied to the upcast logits, and its derivative, 1 - tanh^2, to their gradient (one more chunk-sized float32
    tensor while it is on). `input_grad_only` (a frozen head, LoRA): only the gradient of x, none of the weights
    (grad_lm_acc unused). `chunk_loss`: chunk_cross_entropy, or a compiled version of it. `rows` (loss_rows, on
    x's device): the logits of these tokens only, every other token's loss and gradients being zero; None: all.
    """
    spec = eps if isinstance(eps, HeadSpec) else HeadSpec(eps)
    batch, seq_len, hidden = x.shape
    with_grads = grad_lm_acc is not None or input_grad_only
    x = x.detach().requires_grad_(with_grads)
    if norm_weight is None:  # x is normed already (the generic path's own norm module): grad_x is of the logits' input
        normed = x
    else:
        norm_weight = norm_weight.detach().requires_grad_(with_grads and not input_grad_only)
        with torch.set_grad_enabled(with_grads):
            normed = rms_norm(x, norm_weight, spec.eps, spec.plus_one)
    flat = normed.detach().reshape(-1, hidden)
    flat_labels = labels.reshape(-1)
    # Without rows every row is written below; with them, the rows left out keep a zero gradient.
    grad_flat = torch.empty_like(flat) if rows is None else torch.zeros_like(flat)
    loss_dtype = norm_dtype(x.dtype)
    loss = torch.zeros((), dtype=loss_dtype, device=x.device)
    n_valid_t = torch.full((), n_valid, dtype=loss_dtype, device=x.device)  # a fill: no host-to-device copy
    for start in range(0, flat.shape[0] if rows is None else rows.numel(), chunk_tokens):
        if rows is None:
            h, lab = flat[start:start + chunk_tokens], flat_labels[start:start + chunk_tokens]
        else:
            picked = rows[start:start + chunk_tokens]
            h, lab = flat.index_select(0, picked), flat_labels.index_select(0, picked)
        chunk_sum, grad_logits = chunk_loss(F.linear(h, lm_weight), lab, n_valid_t, spec.softcap, with_grads)
        loss += chunk_sum
        if not with_grads:
            continue
        if rows is None:
            grad_flat[start:start + chunk_tokens] = grad_logits @ lm_weight
        else:
            grad_flat.index_copy_(0, picked, grad_logits @ lm_weight)
        if not input_grad_only:
            grad_lm_acc.add_((grad_logits.t() @ h).to(grad_lm_acc.dtype))
    if not with_grads:
        return HeadResult(loss, None, None)
    if norm_weight is None:
        return HeadResult(loss, grad_flat.view(batch, seq_len, hidden), None)
    if input_grad_only:
        (grad_x,) = torch.autograd.grad(normed, (x,), grad_flat.view(batch, seq_len, hidden))
        return HeadResult(loss, grad_x, None)
    grad_x, grad_norm = torch.autograd.grad(normed, (x, norm_weight), grad_flat.view(batch, seq_len, hidden))
    return HeadResult(loss, grad_x, grad_norm)
