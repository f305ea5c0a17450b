"""The next token of each row from its logits: greedy, or sampled at a temperature with top-k and top-p (nucleus)
filtering, in transformers' order (temperature, then top-k, then top-p), with a seeded generator."""

from __future__ import annotations

import torch

from megatrain_ray.engine.rollout.interface import SamplingSettings


def filtered_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """`scaled` [rows, vocab] (logits / temperature) with the tokens outside the top k and outside the nucleus set to
    -inf. Nucleus as transformers' TopPLogitsWarper: the tokens whose ascending cumulative probability stays at or
    below 1 - top_p are dropped, the most probable token always kept."""
    out = scaled
    if top_k and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(out, dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False
        out = out.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return out


def next_tokens(logits: torch.Tensor, sampling: SamplingSettings,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """([rows] token, [rows] its log-probability under log_softmax(logits / temperature), before filtering) from
    `logits` [rows, vocab] in float32 or float64."""
    if sampling.temperature == 0:
        tokens = logits.argmax(dim=-1)
        logps = logits.log_softmax(dim=-1)
    else:
        scaled = logits / sampling.temperature
        logps = scaled.log_softmax(dim=-1)
        probs = filtered_logits(scaled, sampling.top_k, sampling.top_p).softmax(dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return tokens, logps.gather(1, tokens[:, None]).squeeze(1)
