"""The part of the DPO and GRPO heads (model/preference.py, model/policy_head.py) that is the same: each label's
log-probability, log softmax(logits)[label], in token chunks, and the gradients of a loss that depends on those
log-probabilities only.

Given d loss / d logp_t of every token t (0 where labels == -100), d loss / d logits_t = g_t (onehot(label_t) -
softmax_t); one more pass over the chunks turns it into the gradients of the final norm's input, its weight and the
LM head. Full logits never exist, only one chunk of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain_ray.messages import IGNORE_INDEX
from megatrain_ray.model.head import HeadSpec
from megatrain_ray.model.norms import norm_dtype, rms_norm


def chunk_logits(h: torch.Tensor, lm_weight: torch.Tensor, spec: HeadSpec, dtype: torch.dtype,
                 temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's logits upcast to `dtype` (soft-capped when the model caps, then divided by `temperature`: GRPO's
    log-probabilities are the sampling distribution's, as TRL's), and tanh for the cap's derivative."""
    logits = F.linear(h, lm_weight).to(dtype)
    capped = None
    if spec.softcap:
        capped = logits.div_(spec.softcap).tanh_()
        logits = capped * spec.softcap
    return (logits if temperature == 1.0 else logits.div_(temperature)), capped


def label_token_logps(normed: torch.Tensor, lm_weight: torch.Tensor, labels: torch.Tensor, spec: HeadSpec,
                      chunk_tokens: int, temperature: float = 1.0) -> torch.Tensor:
    """[rows, seq_len] log softmax(logits / temperature)[label] of each token, 0 where labels == -100 (`normed`: the
    final norm's output, [rows, seq_len, hidden]), in float32 (float64 when the model computes in it); no
    gradients."""
    rows, seq_len, hidden = normed.shape
    flat, flat_labels = normed.detach().reshape(-1, hidden), labels.reshape(-1)
    out = torch.zeros(flat.shape[0], dtype=norm_dtype(normed.dtype), device=normed.device)
    for start in range(0, flat.shape[0], chunk_tokens):
        lab = flat_labels[start:start + chunk_tokens]
        logits, _ = chunk_logits(flat[start:start + chunk_tokens], lm_weight, spec, out.dtype, temperature)
        valid = lab != IGNORE_INDEX
        target = logits.gather(1, torch.where(valid, lab, 0)[:, None]).squeeze(1)
        out[start:start + lab.shape[0]] = torch.where(valid, target - torch.logsumexp(logits, dim=-1), 0)
    return out.view(rows, seq_len)


def normed_for_backward(x: torch.Tensor, norm_weight: torch.Tensor, spec: HeadSpec,
                        weight_grads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, norm_weight, the final norm's output) as autograd leaves and their graph, for
    token_grads_backward; `weight_grads` False (a frozen head): the norm's weight gets none."""
    x = x.detach().requires_grad_(True)
    norm_weight = norm_weight.detach().requires_grad_(weight_grads)
    with torch.enable_grad():
        normed = rms_norm(x, norm_weight, spec.eps, spec.plus_one)
    return x, norm_weight, normed


def token_grads_backward(x: torch.Tensor, norm_weight: torch.Tensor, normed: torch.Tensor, lm_weight: torch.Tensor,
                         labels: torch.Tensor, token_grads: torch.Tensor, spec: HeadSpec, chunk_tokens: int,
                         grad_lm_acc: torch.Tensor | None, temperature: float = 1.0
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad of x, grad of the norm's weight) of a loss whose gradient with respect to each label's log-probability
    is `token_grads` [rows, seq_len] (read where labels != -100 only); the LM head's gradient is added into
    `grad_lm_acc`. `grad_lm_acc=None` (a frozen head, LoRA): the gradient of x only (None for the norm's weight).
    x, norm_weight, normed: from normed_for_backward. `temperature`: the log-probabilities' (label_token_logps)."""
    rows, seq_len, hidden = x.shape
    flat, flat_labels = normed.detach().reshape(-1, hidden), labels.reshape(-1)
    flat_grads = token_grads.reshape(-1)
    dtype = norm_dtype(normed.dtype)
    grad_flat = torch.empty_like(flat)
    for start in range(0, flat.shape[0], chunk_tokens):
        h, lab = flat[start:start + chunk_tokens], flat_labels[start:start + chunk_tokens]
        logits, capped = chunk_logits(h, lm_weight, spec, dtype, temperature)
        valid = lab != IGNORE_INDEX
        # d loss / d logits = g_t (onehot - softmax) / T = -g_t (softmax - onehot) / T, on the labelled tokens only.
        weight = torch.where(valid, -flat_grads[start:start + lab.shape[0]], 0).to(dtype)
        if temperature != 1.0:
            weight = weight / temperature
        grad_logits = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True)).exp_()
        grad_logits.scatter_add_(1, torch.where(valid, lab, 0)[:, None], -torch.ones_like(weight[:, None]))
        grad_logits.mul_(weight[:, None])
        if capped is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh^2
            grad_logits.mul_(capped.square_().neg_().add_(1.0))
            del capped
        grad_logits = grad_logits.to(h.dtype)
        grad_flat[start:start + chunk_tokens] = grad_logits @ lm_weight
        if grad_lm_acc is not None:
            grad_lm_acc.add_((grad_logits.t() @ h).to(grad_lm_acc.dtype))
    grad_normed = grad_flat.view(rows, seq_len, hidden)
    if grad_lm_acc is None:
        (grad_x,) = torch.autograd.grad(normed, (x,), grad_normed)
        return grad_x, None
    grad_x, grad_norm = torch.autograd.grad(normed, (x, norm_weight), grad_normed)
    return grad_x, grad_norm
