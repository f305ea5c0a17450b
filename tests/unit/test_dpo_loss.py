"""The DPO loss of model/preference.py against TRL 1.16's own DPOTrainer._compute_loss on the same log-probs,
and the chunked DPO head against torch autograd through full logits.

Tolerances: float64 throughout, so both sides agree to rounding (1e-12 relative); the head's chunked
two-pass gradient differs from autograd's only in summation order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatrain_ray.messages import IGNORE_INDEX, PreferenceRows
from megatrain_ray.model.head import HeadSpec
from megatrain_ray.model.norms import rms_norm
from megatrain_ray.model.preference import dpo_loss_and_row_grads, preference_logps, preference_loss_and_grads
from tests.reference_dpo import trl_loss

pytest.importorskip("trl")


@pytest.mark.parametrize("loss_type,label_smoothing", [("sigmoid", 0.0), ("robust", 0.0), ("robust", 0.2)])
def test_loss_gradient_and_metrics_match_trl(loss_type, label_smoothing):
    torch.manual_seed(0)
    pairs, seq_len, beta = 4, 9, 0.3
    per_token = (torch.randn(2 * pairs, seq_len - 1, dtype=torch.float64) - 2).requires_grad_(True)
    mask = (torch.rand(2 * pairs, seq_len) > 0.3).long()
    mask[:, 1] = 1  # every row has a completion token
    ref = torch.randn(2 * pairs, dtype=torch.float64) * 3 - 6
    expected, metrics = trl_loss(per_token, mask, ref, beta, label_smoothing, loss_type)
    (expected_grad,) = torch.autograd.grad(expected, per_token)

    logps = (per_token.detach() * mask[:, 1:]).sum(1)
    pref = PreferenceRows(ref, beta, label_smoothing, loss_type)
    loss, row_grads, ours = dpo_loss_and_row_grads(logps, pref)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)
    # TRL's gradient of a completion token's log-prob is its row's d loss / d logp.
    torch.testing.assert_close(row_grads[:, None] * mask[:, 1:], expected_grad, rtol=1e-12, atol=1e-15)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert float(ours[key]) == pytest.approx(metrics[key], rel=1e-6, abs=1e-12), key  # TRL: float32 accuracies


def test_label_smoothing_is_conservative_dpo():
    """sigmoid with label smoothing e (TRL 1.16's sigmoid ignores it; this is conservative DPO, TRL 0.x's sigmoid):
    -(1 - e) logsigmoid(beta z) - e logsigmoid(-beta z), mean over pairs; its gradient by autograd."""
    torch.manual_seed(1)
    logps = torch.randn(6, dtype=torch.float64) * 4 - 10
    ref = torch.randn(6, dtype=torch.float64) * 4 - 10
    beta, e = 0.5, 0.15
    leaf = logps.clone().requires_grad_(True)
    z = (leaf[:3] - leaf[3:]) - (ref[:3] - ref[3:])
    expected = (-(1 - e) * F.logsigmoid(beta * z) - e * F.logsigmoid(-beta * z)).mean()
    (expected_grad,) = torch.autograd.grad(expected, leaf)
    loss, grads, _ = dpo_loss_and_row_grads(logps, PreferenceRows(ref, beta, e, "sigmoid"))
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-13, atol=0)
    torch.testing.assert_close(grads, expected_grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_chunked_head_matches_autograd_through_full_logits(softcap):
    torch.manual_seed(2)
    pairs, seq_len, hidden, vocab = 3, 11, 16, 37
    rows = 2 * pairs
    spec = HeadSpec(1e-6, False, softcap)
    x = torch.randn(rows, seq_len, hidden, dtype=torch.float64)
    norm_w = 1 + 0.1 * torch.randn(hidden, dtype=torch.float64)
    lm_w = torch.randn(vocab, hidden, dtype=torch.float64) * 0.3
    labels = torch.randint(0, vocab, (rows, seq_len))
    labels[torch.rand(rows, seq_len) < 0.4] = IGNORE_INDEX
    labels[:, 0] = 5  # a completion token in every row
    pref = PreferenceRows(torch.randn(rows, dtype=torch.float64) - 20, 0.2, 0.1, "sigmoid")

    leaves = [t.clone().requires_grad_(True) for t in (x, norm_w, lm_w)]
    logits = F.linear(rms_norm(leaves[0], leaves[1], spec.eps), leaves[2])
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    token_logps = torch.log_softmax(logits, -1).gather(2, labels.clamp(min=0)[..., None]).squeeze(2)
    logps = torch.where(labels != IGNORE_INDEX, token_logps, 0).sum(1)
    ref = pref.reference_logps
    z = (logps[:pairs] - logps[pairs:]) - (ref[:pairs] - ref[pairs:])
    expected = (-(0.9) * F.logsigmoid(0.2 * z) - 0.1 * F.logsigmoid(-0.2 * z)).mean()
    expected_grads = torch.autograd.grad(expected, leaves)

    acc = torch.zeros(vocab, hidden, dtype=torch.float64)
    head = preference_loss_and_grads(x, norm_w, lm_w, labels, pref, spec, chunk_tokens=7, grad_lm_acc=acc)
    torch.testing.assert_close(head.loss_sum, expected.detach(), rtol=1e-12, atol=0)
    for ours, theirs in zip((head.grad_x, head.grad_norm_weight, acc), expected_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(preference_logps(x, norm_w, lm_w, labels, spec, 5), logps.detach(), rtol=1e-12, atol=0)
