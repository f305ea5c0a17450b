"""GRPO's rewards, advantages, importance-sampling weights, loss and d loss / d logp of model/policy_gradient.py
against TRL 1.16's own GRPOTrainer code on the same fixed completions, rewards and log-probabilities
(tests/reference_grpo.py drives _generate_and_score_completions and _compute_loss without a model).

Tolerances (docs/testing.md): float64 on both sides, bound EXACT (1e-10 relative). TRL computes its clip-ratio
shares and frac_reward_zero_std in float32 (`.float()`; at sequence level the clip shares in float64); those are
ratios of small integers, so ours must equal TRL's exactly, in float64 or rounded to float32.
"""

from __future__ import annotations

import pytest
import torch

from megatrain_ray.exceptions import RewardFunctionError
from megatrain_ray.model.policy_gradient import (
    NEGLIGIBLE_IS_WEIGHT,
    ZERO_FRACTION,
    GRPOLossSettings,
    group_advantages,
    grpo_loss_and_token_grads,
    rollout_importance_weights,
    score_completions,
)
from tests.numerics import assert_exact
from tests.reference_grpo import Rollout, first_reward, second_reward, trl_grpo, trl_zero_fraction

pytest.importorskip("trl")

G = 4
FLOAT32_SHARES = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                  "clip_ratio/high_max", "frac_reward_zero_std")


def make_rollout(seed: int = 0) -> Rollout:
    """3 prompts x 4 completions of 1 to 7 tokens. Rewards are multiples of 1/8 (exact in TRL's float32 cast);
    second_reward is None for some completions, both are None for completion 5 (unscorable), and prompt 2's group
    has equal rewards (zero std)."""
    g = torch.Generator().manual_seed(seed)
    n, t = 3 * G, 7
    lengths = [3, 7, 1, 5, 6, 2, 7, 4, 3, 3, 5, 7]
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3 - 0.1
    logps = old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3  # ratios about 0.6 to 1.6: clipping
    ref = logps + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.4
    sampling = old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.25
    sampling[4, 2] = float("nan")  # a token the rollout could not score
    r1 = [1.0, 0.0, 0.5, 1.0, 0.25, None, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5]
    r2 = [0.125, None, -0.5, 0.0, None, None, 0.375, 1.0, None, None, None, None]
    return Rollout(prompts=[f"p{i // G}" for i in range(n)], completions=[f"c{i}" for i in range(n)],
                   lengths=lengths, old_logps=old, logps=logps, ref_logps=ref, sampling_logps=sampling,
                   reward_funcs=[first_reward, second_reward], columns={"r1": r1, "r2": r2})


def ours(rollout: Rollout, *, loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=None, scale_rewards="group",
         aggregation="sum_then_normalize", reward_weights=None, importance_sampling_level="token",
         use_bias_correction_kl=True, max_completion_length=16, is_mode=None, is_clip_min=None, is_clip_max=3.0):
    funcs = rollout.reward_funcs
    rewards = score_completions(funcs, rollout.prompts, rollout.completions,
                                completion_ids=[[5] * n for n in rollout.lengths], columns=rollout.columns)
    weights = torch.tensor(reward_weights if reward_weights is not None else [1.0] * len(funcs), dtype=torch.float64)
    adv = group_advantages(rewards, weights, G, scale_rewards, aggregation, [f.__name__ for f in funcs])
    mask = rollout.mask
    is_w, is_metrics = (None, {})
    if is_mode is not None:
        is_w, is_metrics = rollout_importance_weights(rollout.old_logps, rollout.sampling_logps, mask, is_mode,
                                                      is_clip_min, is_clip_max)
    settings = GRPOLossSettings(loss_type=loss_type, beta=beta, epsilon=epsilon, epsilon_high=epsilon_high,
                                importance_sampling_level=importance_sampling_level,
                                use_bias_correction_kl=use_bias_correction_kl,
                                max_completion_length=max_completion_length)
    loss, grad, metrics = grpo_loss_and_token_grads(rollout.logps, rollout.old_logps, mask, adv.advantages, settings,
                                                    ref_logps=rollout.ref_logps if beta else None, is_weights=is_w)
    return adv.advantages, is_w, loss, grad, {**adv.metrics, **is_metrics, **metrics}


def check_against_trl(**settings) -> dict[str, float]:
    """Every quantity against TRL's; returns the relative errors (for the record)."""
    rollout = make_rollout()
    ref = trl_grpo(rollout, num_generations=G, **settings)
    advantages, is_w, loss, grad, metrics = ours(rollout, **settings)
    errors = {"advantages": assert_exact("advantages", advantages, ref.advantages),
              "loss": assert_exact("loss", loss, ref.loss), "grad": assert_exact("d loss / d logp", grad, ref.grad)}
    assert grad.abs().sum() > 0 and ref.grad.abs().sum() > 0
    if is_w is not None:
        errors["is_ratio"] = assert_exact("importance sampling ratio", is_w, ref.is_ratio)
    for key, value in metrics.items():
        if key == ZERO_FRACTION:  # ours, from TRL's ratio
            errors[key] = assert_exact(key, value, trl_zero_fraction(ref.is_ratio, rollout.mask,
                                                                     NEGLIGIBLE_IS_WEIGHT))
            continue
        assert key in ref.metrics, f"TRL logs no {key}; it logged {sorted(ref.metrics)}"
        if key in FLOAT32_SHARES:
            assert ref.metrics[key] in (float(value), float(value.float())), (key, float(value), ref.metrics[key])
        else:
            errors[key] = assert_exact(key, value, torch.tensor(ref.metrics[key], dtype=torch.float64))
    expected = {"kl"} if settings.get("beta") else set()
    expected |= {k for k in ref.metrics if k.startswith(("clip_ratio/", "rewards/", "sampling/", "reward"))}
    assert expected <= set(metrics), expected - set(metrics)
    return errors


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
def test_loss_and_gradient_match_trl(loss_type, beta):
    """Off-policy (num_iterations 2: old != current log-probs), asymmetric clipping (epsilon 0.2, epsilon_high
    0.28), with and without the KL term to the reference."""
    check_against_trl(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28)


@pytest.mark.parametrize("mode,clip_min,clip_max", [("token_truncate", None, 1.2), ("token_mask", 0.8, 1.25),
                                                    ("sequence_truncate", 0.5, 1.5), ("sequence_mask", None, 1.5)])
def test_importance_sampling_correction_matches_trl(mode, clip_min, clip_max):
    """The rollout/trainer gap weights (TRL's vllm_importance_sampling_*), clipped or masked in each mode."""
    check_against_trl(loss_type="dapo", beta=0.04, epsilon_high=0.28, is_mode=mode, is_clip_min=clip_min,
                      is_clip_max=clip_max)
    r = make_rollout()
    w, metrics = rollout_importance_weights(r.old_logps, r.sampling_logps, r.mask, mode, clip_min, clip_max)
    assert (metrics[ZERO_FRACTION] > 0) == mode.endswith("mask")  # masked tokens (0.43 and 0.42 of them) count
    bounded = w[r.mask.bool()] if mode.startswith("token") else w
    assert ((bounded == 0) | (bounded >= (clip_min or 0)) & (bounded <= clip_max)).all()
    assert (bounded != 1).any() and (bounded != bounded.flatten()[0]).any()  # the weights do vary


@pytest.mark.parametrize("level,bias_correction", [("sequence", True), ("token", False)])
def test_sequence_level_ratio_and_plain_kl_match_trl(level, bias_correction):
    check_against_trl(loss_type="grpo", beta=0.1, epsilon_high=0.28, importance_sampling_level=level,
                      use_bias_correction_kl=bias_correction)


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_rewards_and_advantages_match_trl(scale_rewards, aggregation):
    """Weighted rewards with None (NaN) entries and an unscorable completion, normalised each way."""
    check_against_trl(scale_rewards=scale_rewards, aggregation=aggregation, reward_weights=[1.0, -0.5])
    advantages = ours(make_rollout(), scale_rewards=scale_rewards, aggregation=aggregation,
                      reward_weights=[1.0, -0.5])[0]
    assert advantages[5] == 0  # every function returned None: no learning signal
    assert advantages.abs().sum() > 0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
def test_parts_of_a_batch_add_up_to_the_batch(loss_type):
    """Two calls on halves of the rows with the whole batch's totals (ranks sharing a step) sum to one call."""
    r = make_rollout()
    adv = torch.linspace(-1, 1, r.logps.shape[0], dtype=torch.float64)
    settings = GRPOLossSettings(loss_type=loss_type, beta=0.05, epsilon_high=0.28, max_completion_length=16)
    whole = grpo_loss_and_token_grads(r.logps, r.old_logps, r.mask, adv, settings, ref_logps=r.ref_logps)
    halves = [slice(0, 5), slice(5, None)]
    parts = [grpo_loss_and_token_grads(r.logps[s], r.old_logps[s], r.mask[s], adv[s], settings,
                                       ref_logps=r.ref_logps[s], total_rows=r.logps.shape[0],
                                       total_tokens=r.mask.sum()) for s in halves]
    assert_exact("loss", sum(p[0] for p in parts), whole[0])
    assert_exact("grad", torch.cat([p[1] for p in parts]), whole[1])
    for key in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert_exact(key, sum(p[2][key] for p in parts), whole[2][key])


def test_reward_function_errors_name_the_function():
    def short(prompts, completions, **kwargs):
        return [1.0]

    def text(prompts, completions, **kwargs):
        return ["high"] * len(prompts)

    def nan(prompts, completions, **kwargs):
        return [None, float("nan")]

    def raises(prompts, completions, **kwargs):
        return {}["missing"]

    with pytest.raises(RewardFunctionError, match="'short' returned 1 rewards, but 2"):
        score_completions([short], ["a", "b"], ["x", "y"])
    with pytest.raises(RewardFunctionError, match="'text' returned a value that is not a number"):
        score_completions([text], ["a", "b"], ["x", "y"])
    with pytest.raises(RewardFunctionError, match="'nan' returned nan for completion 1; return a finite number"):
        score_completions([nan], ["a", "b"], ["x", "y"])
    with pytest.raises(RewardFunctionError, match="'raises' raised KeyError: 'missing'") as caught:
        score_completions([raises], ["a", "b"], ["x", "y"])
    assert isinstance(caught.value.__cause__, KeyError)  # the user's traceback is kept
    none = score_completions([lambda prompts, completions, **kw: [None, 1.0]], ["a", "b"], ["x", "y"])
    assert torch.isnan(none[0, 0]) and none[1, 0] == 1.0  # None: the function does not apply (TRL's NaN)
