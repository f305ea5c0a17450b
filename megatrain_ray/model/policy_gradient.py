"""GRPO (finetune.objective=grpo): rewards, group-normalised advantages and the token-level policy loss, as TRL
1.16's GRPOTrainer computes them (`_calculate_rewards`, `_generate_and_score_completions`, `_compute_loss`).

A GRPO batch holds N = P * G completions: G (num_generations) consecutive rows per prompt. Each reward function
scores every completion; their weighted sum, normalised within each group of G (or over the batch), is the
completion's advantage A. With the per-token log-probabilities of the completion tokens under the policy being
trained (logp), under the policy that generated them (old; on-policy, logp itself) and optionally under the
reference model (ref, when beta > 0), the loss of token t of row i is

    -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) * w + beta * k3,   r = exp(logp - old)

(w: the importance-sampling weight of the rollout/trainer gap; k3 = exp(ref - logp) - (ref - logp) - 1, times r
with use_bias_correction_kl), summed over the completion tokens and divided as loss_type says. The loss depends on
each token's log-probability only, so the streamed engine's chunked head needs just d loss / d logp per token
(`grpo_loss_and_token_grads`, by autograd over [N, T] numbers); d loss / d logits then follows per chunk as in
model/preference.py. Full logits never exist.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatrain_ray.exceptions import RewardFunctionError
from megatrain_ray.messages import IS_LEVELS, LOSS_TYPES, GRPOLossSettings  # noqa: F401 (this module's names)

SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
STD_EPS = 1e-4
"""Added to the standard deviation before dividing by it (TRL's constant)."""
NEGLIGIBLE_IS_WEIGHT = 1e-6
"""An importance-sampling weight below this (0 when masked, or an exp that underflowed) leaves the token less than a
millionth of its share of the update: counted in ZERO_FRACTION."""
ZERO_FRACTION = "sampling/importance_sampling_ratio/zero_fraction"
"""Ours, not TRL's: the share of the batch's completion tokens whose importance-sampling weight is below
NEGLIGIBLE_IS_WEIGHT. 1 means the step trains on nothing (driver/grpo.py: warn_vanished_weights)."""


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Standard deviation with Bessel's correction, NaN entries left out; NaN where fewer than two remain
    (as TRL's trainer/utils.nanstd)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True).to(var.dtype)
    var = var * torch.where(count > 1, count / (count - 1), torch.full_like(var, math.nan))
    std = var.sqrt()
    if keepdim:
        return std
    return std.squeeze() if dim is None else std.squeeze(dim)


def _nan_extreme(x: torch.Tensor, fn: Callable) -> torch.Tensor:
    keep = x[~torch.isnan(x)]
    return fn(keep) if keep.numel() else torch.tensor(math.nan, dtype=x.dtype, device=x.device)


# ------------------------------------------------------------------ rewards


def reward_name(fn: Callable) -> str:
    """A reward function's name in the metrics (rewards/<name>/mean), as TRL's get_callable_name."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def score_completions(functions: Sequence[Callable], prompts: Sequence[Any], completions: Sequence[Any],
                      completion_ids: Sequence[Sequence[int]] | None = None,
                      columns: Mapping[str, Sequence[Any]] | None = None,
                      dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """[N, F] rewards: function f called once as f(prompts=..., completions=..., completion_ids=..., **columns)
    (TRL's signature; `columns`: the batch's other dataset columns, one value per completion). A None reward is
    NaN (the function does not apply to that completion); a wrong count is an error naming the function."""
    rewards = torch.empty(len(prompts), len(functions), dtype=dtype)
    for i, fn in enumerate(functions):
        try:
            out = fn(prompts=list(prompts), completions=list(completions), completion_ids=completion_ids,
                     **dict(columns or {}))
        except Exception as exc:  # the user's code: name it, keep its traceback as the cause
            raise RewardFunctionError(f"reward function {reward_name(fn)!r} raised {type(exc).__name__}: {exc}") \
                from exc
        if inspect.isawaitable(out):
            raise RewardFunctionError(f"reward function {reward_name(fn)!r} is async; only plain functions are "
                                      "supported")
        out = list(out)
        if len(out) != len(prompts):
            raise RewardFunctionError(f"reward function {reward_name(fn)!r} returned {len(out)} rewards, but "
                                      f"{len(prompts)} were expected (one per prompt-completion pair)")
        try:
            values = [math.nan if r is None else float(r) for r in out]
        except (TypeError, ValueError) as exc:
            raise RewardFunctionError(f"reward function {reward_name(fn)!r} returned a value that is not a number "
                                      f"or None: {exc}") from exc
        bad = next((k for k, (r, v) in enumerate(zip(out, values)) if r is not None and not math.isfinite(v)), None)
        if bad is not None:  # None says "does not apply"; a NaN or infinity is a bug that would poison the step
            raise RewardFunctionError(f"reward function {reward_name(fn)!r} returned {out[bad]!r} for completion "
                                      f"{bad}; return a finite number, or None where the function does not apply")
        rewards[:, i] = torch.tensor(values, dtype=dtype)
    return rewards


def weighted_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[N] sum over the functions of weight * reward, NaN rewards left out; NaN where every function gave None
    (the completion is unscorable)."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.to(rewards_per_func)[None]).nansum(dim=1)
    return rewards.masked_fill(unscorable, math.nan)


@dataclass(slots=True)
class Advantages:
    advantages: torch.Tensor
    """[N] one per completion; 0 for an unscorable one."""
    metrics: dict[str, torch.Tensor]
    """TRL's: rewards/<name>/mean and /std per function, reward, reward_std, frac_reward_zero_std."""


def group_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str = "group", aggregation: str = "sum_then_normalize",
                     names: Sequence[str] | None = None) -> Advantages:
    """Advantages of N = P * num_generations completions (each prompt's group consecutive) from their [N, F]
    rewards, as TRL 1.16's _generate_and_score_completions. sum_then_normalize: the weighted sum minus its group
    mean, divided by (std + 1e-4) of the group (scale_rewards=group), of the whole batch (batch) or not at all
    (none). normalize_then_sum: each function's rewards normalised within the group first, their weighted sum then
    normalised over the batch. NaN rewards are left out of every mean and std; an unscorable completion gets 0."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; expected one of {', '.join(SCALE_REWARDS)}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {', '.join(AGGREGATIONS)}")
    n, funcs = rewards_per_func.shape
    if n % num_generations:
        raise ValueError(f"{n} completions are not whole groups of num_generations={num_generations}")
    weights = weights.to(rewards_per_func)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    g = num_generations
    if aggregation == "sum_then_normalize":
        rewards = weighted_rewards(rewards_per_func, weights)
        mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
        if scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if n > 1 else torch.zeros_like(rewards)
        else:  # group; with none, only for frac_reward_zero_std
            std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g) if g > 1 else torch.zeros_like(rewards)
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + STD_EPS)
    else:
        grouped = rewards_per_func.view(-1, g, funcs)
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if g > 1 else torch.zeros_like(mean_k)
        normalised = ((grouped - mean_k) / (std_k + STD_EPS)).view(-1, funcs)
        rewards = (normalised * weights[None]).nansum(dim=1).masked_fill(unscorable, math.nan)
        std = nanstd(rewards).expand_as(rewards) if n > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + STD_EPS)
    advantages = torch.nan_to_num(advantages, nan=0.0)

    metrics: dict[str, torch.Tensor] = {}
    for i, name in enumerate(names if names is not None else [f"reward_{i}" for i in range(funcs)]):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i])
        metrics[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i])
    total = weighted_rewards(rewards_per_func, weights)
    metrics["reward"] = torch.nanmean(total)
    metrics["reward_std"] = nanstd(total)
    metrics["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).to(std.dtype).mean()
    return Advantages(advantages, metrics)


# ------------------------------------------------------------------ importance sampling of the rollout/trainer gap


def rollout_importance_weights(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                               mode: str = "sequence_mask", clip_min: float | None = None,
                               clip_max: float | None = 3.0, total_tokens: float | torch.Tensor | None = None,
                               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weight w of each token ([N, T], token modes) or row ([N, 1], sequence modes) that corrects for the
    rollout engine sampling from slightly other probabilities than the trainer computes (TRL's
    vllm_importance_sampling_*): ratio = exp(old - sampling), per token or summed over the row's completion
    tokens; *_truncate clamps it to [clip_min, clip_max], *_mask sets it to 0 outside. A NaN sampling
    log-probability (the rollout could not score the token) counts as no gap. Returns (w, TRL's sampling/...
    metrics, plus ZERO_FRACTION: the completion tokens weighed below NEGLIGIBLE_IS_WEIGHT over `total_tokens`, the
    whole step's when ranks share it, else this call's).

    A sequence mode's ratio is exp of a sum over the whole completion. Tokens drawn from the rollout's distribution
    make that sum's expectation -T x KL(rollout || trainer) for T tokens, so long completions drive it far below 0:
    over 12,288 tokens at a mean |gap| of 0.156 nats a token (what the Qwen2.5-32B-shape benchmark measured;
    tests/unit/test_grpo_long_completions.py) it is -205 and -281, and the weights underflow to 0 in float32 (1e-89
    and 1e-122 in float64); a positive sum above log(clip_max) is masked. The token modes weigh each token by its
    own ratio, near 1 on average."""
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance sampling mode {mode!r}; expected one of {', '.join(IS_MODES)}")
    mask = mask.to(old_logps.dtype)
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    sequence = mode.startswith("sequence")
    ratio = torch.exp(diff.sum(dim=-1, keepdim=True) if sequence else diff)
    if mode.endswith("truncate"):
        if clip_min is None and clip_max is None:
            raise ValueError(f"importance sampling mode {mode} needs clip_min or clip_max")
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)

    keep = mask.bool()
    delta = (old_logps - sampling_logps).abs()
    delta = delta[keep & ~torch.isnan(delta)]
    flat = ratio.flatten() if sequence else ratio[keep]
    zero = torch.zeros((), dtype=old_logps.dtype, device=old_logps.device)
    metrics = {
        "sampling/sampling_logp_difference/mean": delta.mean() if delta.numel() else zero,
        "sampling/sampling_logp_difference/max": delta.max() if delta.numel() else zero,
        "sampling/importance_sampling_ratio/min": flat.min() if flat.numel() else zero,
        "sampling/importance_sampling_ratio/mean": flat.mean() if flat.numel() else zero,
        "sampling/importance_sampling_ratio/max": flat.max() if flat.numel() else zero,
    }
    negligible = ((ratio < NEGLIGIBLE_IS_WEIGHT).to(mask.dtype) * mask).sum()  # a row's ratio covers its tokens
    tokens = mask.sum() if total_tokens is None else torch.as_tensor(total_tokens, dtype=mask.dtype)
    metrics[ZERO_FRACTION] = negligible / tokens.clamp(min=1.0)
    return ratio, metrics


# ------------------------------------------------------------------ the loss


def grpo_token_losses(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                      settings: GRPOLossSettings, ref_logps: torch.Tensor | None = None,
                      is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """[N, T] (or [N, 1]: sequence level, no KL, no token weights) per-token losses before masking, and the
    intermediate tensors the metrics read (coef_1, kl). Differentiable in `logps`."""
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    log_ratio = logps - old_logps
    if settings.importance_sampling_level == "token":
        log_weights = log_ratio
    else:  # GSPO: the mean log-ratio of the row's completion tokens
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    coef_1 = torch.exp(log_weights)
    parts = {"coef_1": coef_1, "advantages": advantages}
    if settings.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference model's per-token log-probabilities")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if settings.use_bias_correction_kl:
            kl = kl * coef_1
        parts["kl"] = kl
    coef_2 = torch.clamp(coef_1, 1 - settings.epsilon_low, 1 + settings.epsilon_upper)
    losses = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if is_weights is not None:
        losses = losses * is_weights
    if settings.beta != 0.0:
        losses = losses + settings.beta * parts["kl"]
    return losses, parts


def grpo_loss_and_token_grads(logps: torch.Tensor, old_logps: torch.Tensor | None, mask: torch.Tensor,
                              advantages: torch.Tensor, settings: GRPOLossSettings,
                              ref_logps: torch.Tensor | None = None, is_weights: torch.Tensor | None = None,
                              total_rows: int | None = None, total_tokens: float | torch.Tensor | None = None,
                              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, d loss / d logps [N, T], TRL's metrics) of N completion rows: `logps`, `old_logps` (None: on-policy,
    logps itself, as TRL when nothing is reused), `ref_logps` [N, T] log-probabilities of the completion tokens
    (`mask` 1 on completion tokens, 0 on padding), `advantages` [N], `is_weights` from
    rollout_importance_weights. The per-token losses, masked, are divided by
    - grpo: each row by its completion tokens, then by the rows (TRL: mean over the rows);
    - dapo and bnpo: the completion tokens of the batch;
    - dr_grpo: rows * max_completion_length.
    `total_rows` / `total_tokens` replace the rows / tokens of this call when several calls (ranks, or parts of a
    batch) share one step: their losses, gradients and mean metrics then add up to the whole batch's. (TRL's bnpo
    divides by the tokens of each process's micro-batch, which is dapo's count when the step is one micro-batch.)
    Metrics: kl (beta > 0), clip_ratio/low_mean, high_mean, region_mean (shares of the tokens; at sequence level
    of the rows), clip_ratio/low_min and high_max (over the rows of this call)."""
    mask = mask.to(logps.dtype)
    rows = logps.shape[0] if total_rows is None else total_rows
    tokens = mask.sum() if total_tokens is None else torch.as_tensor(total_tokens, dtype=logps.dtype)
    leaf = logps.detach().requires_grad_(True)
    old = leaf.detach() if old_logps is None else old_logps.to(logps.dtype)
    with torch.enable_grad():
        losses, parts = grpo_token_losses(leaf, old, mask, advantages.to(logps.dtype), settings, ref_logps,
                                          is_weights)
        masked = losses * mask
        if settings.loss_type == "grpo":
            loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / rows
        elif settings.loss_type == "dr_grpo":
            loss = masked.sum() / (rows * settings.max_completion_length)
        else:  # dapo, bnpo
            loss = masked.sum() / tokens.clamp(min=1.0)
        (grad,) = torch.autograd.grad(loss, leaf)

    with torch.no_grad():
        coef_1, adv = parts["coef_1"].detach(), parts["advantages"]
        sequence = coef_1.shape[1] == 1

        def mean(x: torch.Tensor) -> torch.Tensor:  # TRL's global_masked_mean
            if x.shape[1] == 1:
                return x.sum() / max(rows, 1)
            return (x * mask).sum() / tokens.clamp(min=1.0)

        def row_means(x: torch.Tensor) -> torch.Tensor:  # TRL's masked_seq_mean
            return x.squeeze(1) if sequence else (x * mask).sum(-1) / mask.sum(-1)

        low = ((coef_1 < 1 - settings.epsilon_low) & (adv < 0)).to(logps.dtype)
        high = ((coef_1 > 1 + settings.epsilon_upper) & (adv > 0)).to(logps.dtype)
        metrics = {"clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
                   "clip_ratio/region_mean": mean(torch.maximum(low, high)),
                   "clip_ratio/low_min": _nan_extreme(row_means(low), torch.min),
                   "clip_ratio/high_max": _nan_extreme(row_means(high), torch.max)}
        if "kl" in parts:
            metrics["kl"] = mean(parts["kl"].detach())
    return loss.detach(), grad, metrics
