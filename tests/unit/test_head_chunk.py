"""The loss head's chunk (model/head.chunk_cross_entropy), eager and through torch.compile (engine.compile),
against autograd of torch's own cross-entropy: the loss and its gradient with respect to the logits, with
ignored labels, for bfloat16 logits (upcast to float32) and float64 ones, with and without a final soft-cap."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatrain_ray.messages import IGNORE_INDEX
from megatrain_ray.model.head import chunk_cross_entropy


def _reference(logits: torch.Tensor, labels: torch.Tensor, n_valid: int, softcap: float, loss_dtype: torch.dtype):
    z = logits.detach().to(loss_dtype).requires_grad_(True)
    capped = torch.tanh(z / softcap) * softcap if softcap else z
    loss = F.cross_entropy(capped, labels, ignore_index=IGNORE_INDEX, reduction="sum") / n_valid
    (grad,) = torch.autograd.grad(loss, z)
    return loss.detach(), grad


@pytest.mark.parametrize("softcap", [0.0, 3.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_chunk_cross_entropy_matches_torch(dtype, softcap):
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(37, 203, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, 203, (37,), generator=gen)
    labels[::5] = IGNORE_INDEX
    n_valid = 53  # the whole batch's valid labels, more than this chunk's
    loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    want_loss, want_grad = _reference(logits, labels, n_valid, softcap, loss_dtype)
    n = torch.full((), n_valid, dtype=loss_dtype)
    torch._dynamo.reset()
    compiled = torch.compile(chunk_cross_entropy, dynamic=False)
    for fn in (chunk_cross_entropy, compiled):
        loss, grad = fn(logits.clone(), labels, n, softcap, True)
        assert grad.dtype == dtype and loss.dtype == loss_dtype
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        torch.testing.assert_close(loss, want_loss, rtol=tol, atol=tol)
        # bfloat16: the gradient is rounded to the logits' dtype (its step: 2^-8 relative)
        grad_tol = 1e-12 if dtype == torch.float64 else 2 ** -8 * want_grad.abs().max().item()
        torch.testing.assert_close(grad.to(loss_dtype), want_grad, rtol=0, atol=grad_tol)
        assert grad[::5].abs().max().item() == 0  # ignored labels: no gradient
        loss_only, none = fn(logits.clone(), labels, n, softcap, False)
        assert none is None
        torch.testing.assert_close(loss_only, loss, rtol=tol, atol=tol)
    torch._dynamo.reset()
