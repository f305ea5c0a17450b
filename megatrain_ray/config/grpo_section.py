"""The `finetune.grpo` section: GRPO's settings with TRL 1.16's GRPOConfig names and defaults, and the reward
functions named `module:function` (resolved by importing the user's module; config/sections.py: check_objective).
The loss is megatrain_ray/model/policy_gradient.py (in the head: model/policy_head.py), the completions come from the
rollout engine (engine/rollout/), the driver's side of a step is driver/grpo.py."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megatrain_ray.config.fields import refuse as _fail

REWARD_SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
REWARD_SIGNATURE = "def reward(prompts, completions, **kwargs) -> list[float | None]"


@dataclass(kw_only=True, slots=True)
class GRPOConfig:
    """Group relative policy optimization (finetune.objective=grpo), with TRL 1.16's GRPOConfig names and defaults
    (docs/fine-tuning.md, megatrain_ray/model/policy_gradient.py)."""

    SECTION: ClassVar[str] = "finetune.grpo"
    reward_funcs: list[str] = field(default_factory=list)
    """The reward functions, each `module:function` (a dotted module importable from the Python path or the working
    directory, then the function's name in it), called as TRL calls them: f(prompts=..., completions=...,
    completion_ids=..., **the dataset's other columns) -> one float per completion, or None where the function does
    not apply. Imported when the config is loaded; at least one with finetune.objective=grpo."""
    reward_weights: list[float] | None = None
    """One weight per reward function (TRL's reward_weights); null: 1 each."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """sum_then_normalize: the weighted sum of the rewards, then normalised as scale_rewards says. normalize_then_sum
    (GDPO): each function's rewards normalised within the group, their weighted sum then normalised over the batch."""
    scale_rewards: Literal["group", "batch", "none"] | bool = "group"
    """What the advantage (reward minus its group's mean) is divided by (plus 1e-4): group: the group's standard
    deviation; batch: the whole batch's; none: nothing (Dr. GRPO). true means group and false none, as TRL's."""
    num_generations: int = 8
    """Completions sampled per prompt (the group); data.batch_size counts completions and must be a multiple: a step
    takes data.batch_size / num_generations prompts (from `megatrain prepare --format prompts`)."""
    max_prompt_length: int | None = None
    """The longest prompt in tokens; a longer prompt keeps its last tokens (older TRL releases' left truncation).
    TRL 1.16 has no such setting: null (the default) keeps prompts whole."""
    max_completion_length: int = 512
    """The longest completion the rollout generates, in tokens; also dr_grpo's divisor per completion. A prompt and
    its completion share a row: data.seq_len must hold the longest prompt (max_prompt_length when set, else the
    data's longest) plus this."""
    temperature: float = 1.0
    """Sampling temperature of the rollout; the loss's log-probabilities are log_softmax(logits / temperature), as
    TRL's."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probabilities add up to top_p; 1 keeps all."""
    top_k: int = 0
    """Sample from the top_k most probable tokens only; 0 keeps all."""
    beta: float = 0.0
    """The KL coefficient: 0 loads no reference model; > 0 adds beta times the k3 estimate of KL(policy || reference)
    per token, the reference being the initial model: with LoRA the base with the adapters left out (no extra
    memory); with full fine-tuning a frozen copy of the initial weights in host RAM in precision.stream_dtype (2
    bytes per parameter in bf16, in `megatrain plan`), streamed once per step for the reference pass (engine.gpu_resident
    must be none)."""
    num_iterations: int = 1
    """Optimizer steps on each generated batch (TRL's mu): a batch is generated every num_iterations steps and each of
    them trains on it; above 1, the generating policy's log-probabilities (a forward pass right after the rollout) are
    the old ones of the clipped ratio and of the importance-sampling correction, and a checkpoint inside a group keeps
    its batch for a resume."""
    epsilon: float = 0.2
    """Lower clipping bound of the probability ratio: 1 - epsilon."""
    epsilon_high: float | None = None
    """Upper clipping bound 1 + epsilon_high (DAPO recommends 0.28); null: epsilon."""
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = "dapo"
    """How the masked per-token losses are divided. grpo: each completion's by its length, then averaged over the
    completions; dapo: by the completion tokens of the batch; dr_grpo: by completions * max_completion_length; bnpo:
    by the completion tokens of the batch (TRL: of each process's micro-batch)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: one probability ratio per token; sequence (GSPO): exp of the mean log-ratio of the completion."""
    use_bias_correction_kl: bool = True
    """Multiply the KL term by the probability ratio (unbiased reverse-KL gradient, DeepSeek-V3.2), as TRL's default."""
    vllm_importance_sampling_correction: bool = True
    """Weight each token's loss by the importance ratio between the trainer's and the rollout engine's log-probabilities
    of the sampled tokens (TRL's name; here the rollout engine plays vLLM's part)."""
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                                           "sequence_mask"] = "sequence_mask"
    """token_*: a ratio per token; sequence_*: one per completion (the exp of the summed log-ratio). *_truncate clamps it
    to [clip_min, clip_max]; *_mask sets it to 0 outside."""
    vllm_importance_sampling_clip_min: float | None = None
    """Lower bound C_min of the importance ratio; null: none."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """Upper bound C_max of the importance ratio; null: none."""

    def __post_init__(self) -> None:
        s = self.SECTION
        for i, spec in enumerate(self.reward_funcs):
            if not REWARD_SPEC.match(spec):
                _fail(f"{s}.reward_funcs[{i}]", spec, "expected `module:function` (e.g. my_rewards:format_reward)")
        if len(set(self.reward_funcs)) != len(self.reward_funcs):
            _fail(f"{s}.reward_funcs", self.reward_funcs, "names a function twice; give it once with a larger weight")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            _fail(f"{s}.reward_weights", self.reward_weights, f"has {len(self.reward_weights)} weights for "
                  f"{len(self.reward_funcs)} reward functions; give one per function, or null for 1 each")
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        if self.num_generations < 2:
            _fail(f"{s}.num_generations", self.num_generations, "must be >= 2 (the advantage compares a group's "
                  "completions)")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            _fail(f"{s}.max_prompt_length", self.max_prompt_length, "must be >= 1, or null")
        if self.max_completion_length < 1:
            _fail(f"{s}.max_completion_length", self.max_completion_length, "must be >= 1")
        if not self.temperature > 0:
            _fail(f"{s}.temperature", self.temperature, "must be > 0")
        if not 0 < self.top_p <= 1:
            _fail(f"{s}.top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < 0:
            _fail(f"{s}.top_k", self.top_k, "must be >= 0 (0: no top-k filtering)")
        if self.beta < 0:
            _fail(f"{s}.beta", self.beta, "must be >= 0")
        if self.num_iterations < 1:
            _fail(f"{s}.num_iterations", self.num_iterations, "must be >= 1")
        if not 0 < self.epsilon < 1:
            _fail(f"{s}.epsilon", self.epsilon, "must be in (0, 1)")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            _fail(f"{s}.epsilon_high", self.epsilon_high, "must be > 0, or null (epsilon)")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and low < 0:
            _fail(f"{s}.vllm_importance_sampling_clip_min", low, "must be >= 0, or null")
        if high is not None and not high > 0:
            _fail(f"{s}.vllm_importance_sampling_clip_max", high, "must be > 0, or null")
        if low is not None and high is not None and low >= high:
            _fail(f"{s}.vllm_importance_sampling_clip_min", low,
                  f"must be below vllm_importance_sampling_clip_max={high}")
        if (self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode.endswith("truncate")
                and low is None and high is None):
            _fail(f"{s}.vllm_importance_sampling_mode", self.vllm_importance_sampling_mode,
                  "truncates to [clip_min, clip_max]: set vllm_importance_sampling_clip_min or _clip_max")

    @property
    def epsilon_upper(self) -> float:
        """The upper clipping epsilon: epsilon_high, else epsilon."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def weights(self) -> list[float]:
        return list(self.reward_weights) if self.reward_weights is not None else [1.0] * len(self.reward_funcs)

    def reward_functions(self) -> list[Callable]:
        """The reward functions, imported (the user's modules run); a ConfigError names the one that fails."""
        return [resolve_reward_function(spec, f"{self.SECTION}.reward_funcs[{i}]")
                for i, spec in enumerate(self.reward_funcs)]


def resolve_reward_function(spec: str, key: str) -> Callable:
    """`module:function` -> the function: the module imported (searched on the Python path, then in the working
    directory), the attribute looked up, checked to be a plain callable taking TRL's keyword arguments."""
    module_name, _, attr = spec.partition(":")
    added = os.getcwd() not in sys.path and "" not in sys.path
    if added:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        _fail(key, spec, f"module {module_name!r} cannot be imported ({exc}); put it on PYTHONPATH or in the "
              "directory megatrain runs in")
    except Exception as exc:  # noqa: BLE001 (the user's module may raise anything while importing)
        _fail(key, spec, f"importing module {module_name!r} raised {type(exc).__name__}: {exc}")
    finally:
        if added:
            sys.path.remove(os.getcwd())
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            _fail(key, spec, f"module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        kind = type(fn).__name__
        _fail(key, spec, f"{attr!r} is not callable ({'an' if kind[0] in 'aeiou' else 'a'} {kind}); expected "
              f"{REWARD_SIGNATURE}")
    if inspect.iscoroutinefunction(fn) or (not inspect.isroutine(fn)
                                           and inspect.iscoroutinefunction(type(fn).__call__)):
        _fail(key, spec, "is an async function; only plain functions are supported")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # a builtin or C callable: no signature to check
    params = signature.parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):  # other required parameters are dataset columns
        by_keyword = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        missing = [name for name in ("prompts", "completions", "completion_ids") if name not in by_keyword]
        if missing:
            _fail(key, spec, f"cannot take TRL's keyword argument(s) {', '.join(missing)}; expected "
                  f"{REWARD_SIGNATURE}")
    if any(p.kind is p.POSITIONAL_ONLY and p.default is p.empty for p in params):
        _fail(key, spec, f"has positional-only parameters; TRL passes every argument by keyword ({REWARD_SIGNATURE})")
    return fn
