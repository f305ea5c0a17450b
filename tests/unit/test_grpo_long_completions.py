"""The importance-sampling correction of the rollout/trainer gap over a long completion (issue 49: the
Qwen2.5-32B-shape LoRA step at 12,288 completion tokens logged loss and grad_norm exactly 0).

A tiny model's head (RMSNorm + LM head, vocabulary 32, float64) scores 2 completions of 12,288 tokens that a
"rollout" sampled from slightly other probabilities: its logits are the trainer's plus N(0, 0.21^2) noise per entry,
which gives a mean |trainer - rollout| log-probability gap of 0.156 nats a token (max 0.81; the benchmark measured
0.156 and 0.91). Tokens drawn from the rollout's distribution make the signed gap's expectation -KL(rollout ||
trainer), so its sum over a completion is far below 0 (-205 and -281 here).

TRL 1.16's own code (tests/reference_grpo.py) and the chunked head agree (float64, EXACT) in both modes:
- sequence_mask (TRL's default): one weight per completion, exp of that sum, 9e-90 and 1e-122 in float64 and
  exactly 0 in float32 (the benchmark's exact zeros); the step trains on nothing, and the driver says so
  (driver/grpo.py: vanished_weights_warning);
- token_truncate: one ratio per token, clamped at 3; mean about 1, the loss and gradients those of a real step.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatrain_ray.config.grpo_section import GRPOConfig
from megatrain_ray.driver.grpo import vanished_weights_warning, warn_vanished_weights
from megatrain_ray.messages import IGNORE_INDEX, PolicyRows
from megatrain_ray.model.head import HeadSpec
from megatrain_ray.model.policy_gradient import (
    NEGLIGIBLE_IS_WEIGHT,
    ZERO_FRACTION,
    GRPOLossSettings,
    grpo_loss_and_token_grads,
    rollout_importance_weights,
)
from megatrain_ray.model.policy_head import policy_loss_and_grads
from tests.numerics import assert_exact
from tests.reference_grpo import Rollout, first_reward, trl_grpo

pytest.importorskip("trl")

T, PROMPT, HIDDEN, VOCAB, NOISE = 12_288, 2, 8, 32, 0.21
S = PROMPT - 1 + T  # the rows' positions: the prompt's last predicts the first completion token


def long_rollout() -> dict:
    """The head's inputs, the completion tokens sampled from the rollout's distribution, and each token's trainer
    and rollout log-probabilities ([2, T])."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, S, HIDDEN, generator=g, dtype=torch.float64)
    norm_w = 1 + 0.1 * torch.randn(HIDDEN, generator=g, dtype=torch.float64)
    lm_w = 0.5 * torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    logits = (norm_w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) @ lm_w.t()
    rollout_logits = logits + NOISE * torch.randn(logits.shape, generator=g, dtype=torch.float64)
    positions = slice(PROMPT - 1, PROMPT - 1 + T)
    rollout_logps = torch.log_softmax(rollout_logits[:, positions], -1)
    tokens = torch.multinomial(rollout_logps.exp().reshape(-1, VOCAB), 1, generator=g).view(2, T)
    labels = torch.full((2, S), IGNORE_INDEX)
    labels[:, positions] = tokens
    pick = lambda lp: lp.gather(-1, tokens[..., None]).squeeze(-1)  # noqa: E731
    return {"x": x, "norm_w": norm_w, "lm_w": lm_w, "labels": labels,
            "trainer": pick(torch.log_softmax(logits[:, positions], -1)), "sampling": pick(rollout_logps)}


@pytest.fixture(scope="module")
def inputs() -> dict:
    return long_rollout()


def trl_reference(inputs: dict, mode: str):
    """TRL's on-policy step (num_iterations 1: old = the trainer's log-probs) with its default clip_max 3, and the
    gradient of the head's input x back through the full logits."""
    current = inputs["trainer"]
    rollout = Rollout(prompts=["p", "p"], completions=["a", "b"], lengths=[T, T], old_logps=current, logps=current,
                      ref_logps=current, sampling_logps=inputs["sampling"], reward_funcs=[first_reward],
                      columns={"r1": [1.0, 0.0]})
    trl = trl_grpo(rollout, num_generations=2, num_iterations=1, max_completion_length=T, is_mode=mode)
    x = inputs["x"].clone().requires_grad_(True)
    normed = inputs["norm_w"] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    logps = torch.log_softmax(normed @ inputs["lm_w"].t(), -1)[:, PROMPT - 1:]
    logps = logps.gather(-1, inputs["labels"][:, PROMPT - 1:, None]).squeeze(-1)
    (grad_x,) = torch.autograd.grad(logps, x, trl.grad)
    return trl, grad_x


def head(inputs: dict, grpo: GRPOConfig, advantages: torch.Tensor):
    sampling = torch.full((2, S), float("nan"), dtype=torch.float64)
    sampling[:, PROMPT - 1:] = inputs["sampling"]
    rows = PolicyRows.from_config(grpo, advantages, sampling_logps=sampling)
    return policy_loss_and_grads(inputs["x"], inputs["norm_w"], inputs["lm_w"], inputs["labels"], rows,
                                 HeadSpec(1e-6), 4096, None)


def test_the_rollout_gap_is_the_benchmarks(inputs):
    gap = inputs["trainer"] - inputs["sampling"]
    assert 0.14 < gap.abs().mean() < 0.17 and 0.7 < gap.abs().max() < 1.0  # the benchmark: 0.156 and 0.908
    assert (gap.sum(-1) < -150).all()  # -KL x 12,288 per completion


def test_sequence_mask_the_default_weighs_long_completions_zero_as_trl(inputs):
    grpo = GRPOConfig(max_completion_length=T)
    assert grpo.vllm_importance_sampling_mode == "sequence_mask"  # TRL 1.16's default, kept
    trl, _ = trl_reference(inputs, grpo.vllm_importance_sampling_mode)
    ours = head(inputs, grpo, trl.advantages)
    assert (trl.is_ratio < 1e-60).all() and 0 < abs(float(trl.loss)) < 1e-60  # TRL: vanishing in float64
    assert_exact("loss", ours.loss_sum, trl.loss)
    assert ours.metrics[ZERO_FRACTION] == 1
    assert_exact("importance ratio max", ours.metrics["sampling/importance_sampling_ratio/max"],
                 trl.is_ratio.max())
    # In float32 (the GPU head's log-probabilities) the weights underflow: loss and gradient exactly 0.
    mask = torch.ones(2, T, dtype=torch.float32)
    old, sampling = inputs["trainer"].float(), inputs["sampling"].float()
    w, metrics = rollout_importance_weights(old, sampling, mask, "sequence_mask", None, 3.0)
    assert torch.equal(w, torch.zeros(2, 1)) and metrics[ZERO_FRACTION] == 1
    loss, grad, _ = grpo_loss_and_token_grads(old, None, mask, trl.advantages.float(), GRPOLossSettings.of(grpo),
                                              is_weights=w)
    assert loss == 0 and torch.equal(grad, torch.zeros_like(grad))
    message = vanished_weights_warning({"step": 0, "loss": 0.0, "grad_norm": 0.0, **ours.metrics}, grpo)
    for words in ("finetune.grpo.vllm_importance_sampling_mode=sequence_mask", "clip_min=None, clip_max=3.0",
                  "trains on nothing", "=token_truncate", "mean |gap| 0.156"):
        assert words in message, (words, message)


def test_token_truncate_trains_on_long_completions_as_trl(inputs):
    grpo = GRPOConfig(max_completion_length=T, vllm_importance_sampling_mode="token_truncate")
    trl, grad_x = trl_reference(inputs, "token_truncate")
    ours = head(inputs, grpo, trl.advantages)
    assert abs(float(trl.loss)) > 1e-3 and grad_x.abs().max() > 1e-6
    assert_exact("loss", ours.loss_sum, trl.loss)
    assert_exact("grad x", ours.grad_x, grad_x)
    assert_exact("importance ratio mean", ours.metrics["sampling/importance_sampling_ratio/mean"],
                 trl.is_ratio.mean())
    assert 0.95 < ours.metrics["sampling/importance_sampling_ratio/mean"] < 1.05
    assert ours.metrics[ZERO_FRACTION] == 0
    assert vanished_weights_warning({"step": 0, **ours.metrics}, grpo) is None


def test_the_zero_fraction_counts_tokens_and_adds_up_over_ranks():
    """Sequence weights cover their row's tokens; ranks dividing by the whole batch's tokens sum to its share."""
    old = torch.zeros(3, 4, dtype=torch.float64)
    sampling = torch.tensor([[0.0] * 4, [20.0] * 4, [0.1] * 4], dtype=torch.float64)  # row 1: exp(-20) vanishes
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    for mode, expected in (("sequence_truncate", 2 / 9), ("sequence_mask", 2 / 9), ("token_mask", 2 / 9)):
        whole = rollout_importance_weights(old, sampling, mask, mode, None, 3.0)[1][ZERO_FRACTION]
        parts = sum(rollout_importance_weights(old[cut], sampling[cut], mask[cut], mode, None, 3.0,
                                               total_tokens=9)[1][ZERO_FRACTION] for cut in (slice(0, 1), slice(1, 3)))
        assert_exact(mode, whole, torch.tensor(expected, dtype=torch.float64))
        assert_exact(f"{mode} over ranks", parts, whole)
    assert rollout_importance_weights(old, sampling, mask, "token_truncate", 1e-3, 3.0)[1][ZERO_FRACTION] == 0
    assert NEGLIGIBLE_IS_WEIGHT < 1.0


def test_the_warning_names_the_mode_and_the_bounds():
    token = GRPOConfig(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=2.0)
    message = vanished_weights_warning({"step": 4, "loss": 0.0, "grad_norm": 0.0, ZERO_FRACTION: 1.0}, token)
    assert "step 4" in message and "token_mask, clip_min=2.0, clip_max=3.0" in message and "widen" in message
    assert vanished_weights_warning({ZERO_FRACTION: 0.999}, token) is None  # some tokens still train
    # beta > 0: TRL adds beta x KL after the weighting, so the step still trains, towards the reference alone.
    logps, ref, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2)
    with_kl = GRPOConfig(vllm_importance_sampling_mode="token_mask", beta=0.04)
    loss, grad, _ = grpo_loss_and_token_grads(logps, None, mask, torch.tensor([1.0]), GRPOLossSettings.of(with_kl),
                                              ref, is_weights=torch.zeros(1, 2))
    assert loss != 0 and (grad != 0).all()
    message = vanished_weights_warning({"step": 4, ZERO_FRACTION: 1.0}, with_kl)
    assert "trains on the KL penalty alone (beta=0.04)" in message and "on nothing" not in message, message
    off = GRPOConfig(vllm_importance_sampling_correction=False)
    assert vanished_weights_warning({ZERO_FRACTION: 1.0}, off) is None
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append((record.levelno, record.getMessage()))
    logger = logging.getLogger("megatrain_ray.driver.grpo")
    logger.addHandler(handler)
    try:
        assert warn_vanished_weights({"step": 4, ZERO_FRACTION: 1.0}, token) == seen[0][1]
    finally:
        logger.removeHandler(handler)
    assert seen[0][0] == logging.WARNING
