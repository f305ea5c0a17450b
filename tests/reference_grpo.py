"""TRL 1.16's own GRPO code as the reference, driven without a model: GRPOTrainer._generate_and_score_completions
(which calls TRL's _calculate_rewards on the reward functions, groups and normalises the rewards into advantages,
and computes the vLLM importance-sampling ratio) and GRPOTrainer._compute_loss, both called unbound on an object
holding only the attributes they read. Generation (`_generate`) returns fixed completions, and the model forward
(`_get_per_token_logps_and_entropies`) returns fixed per-token log-probabilities: the old (generating) policy's
while scoring, the reference model's for the reference, and a leaf tensor for the policy being trained inside the
loss, so autograd gives TRL's d loss / d logp per token.

TRL builds its reward matrix with torch.zeros (the default dtype) and casts each function's output to float32, so
the reference runs with float64 as the default dtype and the tests' rewards are exact in float32 (multiples of
1/8): everything after that is float64 on both sides.
"""

from __future__ import annotations

import types
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


def first_reward(prompts, completions, r1, **kwargs):
    """A reward read from the dataset column r1 (None: does not apply)."""
    return list(r1)


def second_reward(prompts, completions, completion_ids, r2, **kwargs):
    """Column r2 plus the completion's length / 8 (None where r2 is None)."""
    return [None if r is None else r + len(ids) / 8 for r, ids in zip(r2, completion_ids)]


@dataclass
class Rollout:
    """A fixed batch: N = P * G completions (each prompt's G consecutive), their token log-probabilities [N, T]
    (right-padded; row i has lengths[i] completion tokens), the reward functions and their extra columns."""
    prompts: list[str]
    completions: list[str]
    lengths: list[int]
    old_logps: torch.Tensor
    logps: torch.Tensor
    ref_logps: torch.Tensor
    sampling_logps: torch.Tensor
    reward_funcs: list[Callable]
    columns: dict[str, list] = field(default_factory=dict)

    @property
    def mask(self) -> torch.Tensor:
        t = self.logps.shape[1]
        return (torch.arange(t)[None] < torch.tensor(self.lengths)[:, None]).to(torch.float64)


class _Model:
    training = True
    is_gradient_checkpointing = False


@dataclass
class TRLResult:
    advantages: torch.Tensor
    is_ratio: torch.Tensor | None
    loss: torch.Tensor
    grad: torch.Tensor
    metrics: dict[str, float]
    """Every metric TRL logged in _metrics['train'] (its last value)."""


def trl_grpo(rollout: Rollout, *, num_generations: int, loss_type: str = "dapo", beta: float = 0.0,
             epsilon: float = 0.2, epsilon_high: float | None = None, scale_rewards: str = "group",
             aggregation: str = "sum_then_normalize", reward_weights: Sequence[float] | None = None,
             importance_sampling_level: str = "token", use_bias_correction_kl: bool = True,
             max_completion_length: int = 16, is_mode: str | None = None, is_clip_min: float | None = None,
             is_clip_max: float | None = 3.0, num_iterations: int = 2) -> TRLResult:
    """TRL's advantages, importance-sampling ratio (is_mode: vllm_importance_sampling_mode with use_vllm and the
    correction on; None: off), loss and d loss / d logps on `rollout`. num_iterations=2 with one accumulation step
    makes TRL keep the old log-probabilities (its on-policy shortcut is the ratio 1)."""
    from accelerate import PartialState
    from trl import GRPOTrainer

    PartialState()  # TRL's logger (a warning for the unscorable completion) needs accelerate's state
    n, t = rollout.logps.shape
    policy, reference = _Model(), _Model()
    state = {"phase": "generate"}
    leaf = rollout.logps.clone().requires_grad_(True)

    def per_token_logps(model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                        compute_aux_loss=False, **kwargs):
        assert logits_to_keep == t and input_ids.shape[0] == n
        if model is reference:
            out = rollout.ref_logps
        elif state["phase"] == "generate":
            out = rollout.old_logps
        else:
            out = leaf
        return out, torch.zeros(n, t, dtype=torch.float64), None

    def generate(prompts):
        completion_ids = [[5] * length for length in rollout.lengths]
        sampling = [rollout.sampling_logps[i, :length].tolist() for i, length in enumerate(rollout.lengths)]
        return ([[1, 2, 3]] * n, completion_ids, None, list(rollout.completions), sampling, {}, None, None)

    use_vllm = is_mode is not None
    stub = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1,
                                          is_main_process=True, gather=lambda x: x,
                                          reduce=lambda x, reduction="sum": x, unwrap_model=lambda m: m),
        args=types.SimpleNamespace(gradient_accumulation_steps=1, steps_per_generation=1,
                                   per_device_train_batch_size=n, per_device_eval_batch_size=n,
                                   gradient_checkpointing_kwargs=None, use_bias_correction_kl=use_bias_correction_kl,
                                   delta=None, report_to=[]),
        model=policy, ref_model=reference if beta else None, environment_factories=None, environments=None,
        tools=[], _is_vlm=False, _generate=generate, _get_per_token_logps_and_entropies=per_token_logps,
        _tokenizer=types.SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None, mask_truncated_completions=False,
        num_iterations=num_iterations, use_vllm=use_vllm, vllm_importance_sampling_correction=use_vllm,
        vllm_importance_sampling_mode=is_mode, vllm_importance_sampling_clip_min=is_clip_min,
        vllm_importance_sampling_clip_max=is_clip_max, beta=beta,
        reward_funcs=list(rollout.reward_funcs), reward_processing_classes=[None] * len(rollout.reward_funcs),
        reward_func_names=[f.__name__ for f in rollout.reward_funcs],
        reward_weights=torch.tensor(reward_weights if reward_weights is not None
                                    else [1.0] * len(rollout.reward_funcs), dtype=torch.float64),
        state=types.SimpleNamespace(global_step=0), _log_completion_extra=lambda *a: None,
        _log_metric=lambda *a: None, multi_objective_aggregation=aggregation, scale_rewards=scale_rewards,
        num_generations=num_generations, num_generations_eval=num_generations,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list), "images": []},
        _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False,
        top_entropy_quantile=1.0, aux_loss_enabled=False, off_policy_mask_threshold=None,
        importance_sampling_level=importance_sampling_level, loss_type=loss_type, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high, current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length, _entropy_bonus_enabled=False)
    stub._calculate_rewards = types.MethodType(GRPOTrainer._calculate_rewards, stub)

    inputs = [{"prompt": p, **{k: v[i] for k, v in rollout.columns.items()}} for i, p in enumerate(rollout.prompts)]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        output = GRPOTrainer._generate_and_score_completions(stub, inputs)
        state["phase"] = "loss"
        loss = GRPOTrainer._compute_loss(stub, policy, output)
    finally:
        torch.set_default_dtype(default)
    (grad,) = torch.autograd.grad(loss, leaf)
    return TRLResult(output["advantages"], output.get("importance_sampling_ratio"), loss.detach(), grad,
                     {k: v[-1] for k, v in stub._metrics["train"].items()})


def trl_zero_fraction(is_ratio: torch.Tensor, mask: torch.Tensor, below: float) -> torch.Tensor:
    """From TRL's importance-sampling ratio ([N, T] per token, [N, 1] per completion): the share of the completion
    tokens (`mask`) it weighs below `below` (our zero_fraction; TRL logs no such metric)."""
    return ((is_ratio < below).to(mask.dtype) * mask).sum() / mask.sum()
