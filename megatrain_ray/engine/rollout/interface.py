"""What a rollout engine is: the four calls a trainer makes (VERL's BaseRollout shape), and the settings and
results that cross the actor boundary. The built-in engine (passes.RolloutPasses, in the GPU worker) reads the
trainer's own streamed weights; another engine (an inference server) would implement the same calls."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class SamplingSettings:
    """How the rollout samples (finetune.grpo's names, TRL's GRPOConfig)."""

    max_new_tokens: int
    temperature: float = 1.0
    """0: greedy (the most probable token, no randomness)."""
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k filtering."""
    stop_token_ids: tuple[int, ...] = ()
    """A row stops after generating one of these (it is part of its completion, as TRL's completion mask keeps it)."""
    pad_token_id: int = 0
    """Fills the rows' left padding and the tokens after a row stopped."""
    seed: int = 0
    """The sampling generator's seed: the same prompts, weights and seed give the same completions."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")


@dataclass(slots=True)
class RolloutResult:
    """The completions of N prompts, each row padded to the longest."""

    tokens: torch.Tensor
    """[N, C] int64: the generated tokens; pad_token_id after a row's end."""
    logps: torch.Tensor
    """[N, C] float32: log-probability of each generated token under the sampling distribution before top-k / top-p
    (log_softmax(logits / temperature), what the trainer recomputes; greedy: temperature 1); 0 after a row's end."""
    lengths: torch.Tensor
    """[N] int64: each completion's tokens, its stop token included."""
    stopped: torch.Tensor
    """[N] bool: the row ended with a stop token (else it reached max_new_tokens)."""
    stats: dict[str, float] = field(default_factory=dict)
    """prefill_s, decode_s, generated_tokens, tokens_per_s, kv_cache_bytes; the built-in engine's also
    weights_sync_s and weights_restore_s (the weights made ready before the generation and put back after it) and
    experts_in_nf4 (1: the decode steps read an NF4 base's MoE experts in NF4, engine.nf4_kernels)."""

    def completions(self) -> list[list[int]]:
        """Each row's completion tokens, without padding."""
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths.tolist())]


class RolloutEngine(ABC):
    """The calls a GRPO trainer makes on its rollout engine, in this order each step: update_weights (the policy
    changed), resume (memory back), generate, release (memory to the trainer)."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> RolloutResult:
        """Sample one completion per prompt (repeat a prompt for a group)."""

    @abstractmethod
    def update_weights(self) -> None:
        """Take the trainer's current weights (after its optimizer step)."""

    @abstractmethod
    def release(self) -> None:
        """Give the engine's device memory (KV cache, weight copies) back to the trainer."""

    @abstractmethod
    def resume(self) -> None:
        """Take back what release gave up, before the next generate."""
