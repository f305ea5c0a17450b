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


def _head_reference(x, norm_w, lm_w, labels, eps):
    """Autograd through torch's RMSNorm-by-hand, full logits and cross-entropy: loss and the three gradients."""
    x, norm_w, lm_w = (t.detach().clone().requires_grad_(True) for t in (x, norm_w, lm_w))
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w
    logits = normed @ lm_w.t()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    return (loss.detach(), *torch.autograd.grad(loss, (x, norm_w, lm_w)))


@pytest.mark.parametrize("chunk", [4, 7, 16])
@pytest.mark.parametrize("bucket", [False, True], ids=["rows", "rows-in-whole-chunks"])
def test_the_head_computes_the_logits_of_counted_tokens_only_and_gives_the_full_gradients(chunk, bucket):
    """loss_rows picks the tokens whose label counts (a chat prompt's do not): the head computes only their logits
    (padded to whole chunks with tokens that do not count, for a compiled chunk loss), and the loss and every
    gradient equal the full computation's, in float64."""
    from megatrain_ray.model.head import head_loss_and_grads, loss_rows

    gen = torch.Generator().manual_seed(5)
    batch, seq, hidden, vocab, eps = 3, 11, 8, 29, 1e-6
    x = torch.randn(batch, seq, hidden, generator=gen, dtype=torch.float64)
    norm_w = 1 + 0.1 * torch.randn(hidden, generator=gen, dtype=torch.float64)
    lm_w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, :6], labels[1, 2:9], labels[2, :] = IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX  # prompts; a whole row
    n_valid = int((labels != IGNORE_INDEX).sum())
    rows = loss_rows(labels, chunk if bucket else None)
    assert rows is not None and rows.numel() < labels.numel()
    assert rows.numel() == (min(labels.numel(), -(-n_valid // chunk) * chunk) if bucket else n_valid)
    want_loss, want_x, want_norm, want_lm = _head_reference(x, norm_w, lm_w, labels, eps)
    acc = torch.zeros_like(lm_w)
    got = head_loss_and_grads(x, norm_w, lm_w, labels, n_valid, eps, chunk, acc, rows=rows)
    for got_t, want_t in ((got.loss_sum, want_loss), (got.grad_x, want_x), (got.grad_norm_weight, want_norm),
                          (acc, want_lm)):
        torch.testing.assert_close(got_t, want_t, rtol=1e-12, atol=1e-12)
    assert got.grad_x[2].abs().max().item() == 0  # a row with no counted token: no gradient
    loss_only = head_loss_and_grads(x, norm_w, lm_w, labels, n_valid, eps, chunk, None, rows=rows)
    torch.testing.assert_close(loss_only.loss_sum, want_loss, rtol=1e-12, atol=1e-12)


def test_loss_rows_leaves_every_row_where_nearly_all_count():
    from megatrain_ray.model.head import SKIP_WHEN_COUNTED_BELOW, loss_rows

    assert SKIP_WHEN_COUNTED_BELOW == 0.9
    labels = torch.arange(100)
    assert loss_rows(labels) is None
    labels[:10] = IGNORE_INDEX  # 90 of 100 count
    assert loss_rows(labels) is None
    labels[:11] = IGNORE_INDEX
    assert torch.equal(loss_rows(labels), torch.arange(11, 100))
    assert loss_rows(labels, bucket=64) is None  # in whole chunks it would be every row
    labels[:50] = IGNORE_INDEX  # 50 count: in chunks of 8, 56 rows, 6 of them not counting
    assert torch.equal(loss_rows(labels, bucket=8), torch.cat([torch.arange(6), torch.arange(50, 100)]))
