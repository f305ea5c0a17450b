"""optimizer.speculative_stages as `megatrain plan` weighs it: the count the speed model puts fastest."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from megatrain_ray.config.sections import Config
from megatrain_ray.exceptions import ConfigError

WORTH = 1.02
"""A count is offered only when the speed model puts it at least this much faster than the configured one."""

MAX_WEIGHED = 6
"""Counts weighed: 0 to this. Past the LM head and a few layers the speculative updates outlast the backward
and only delay the updates the next forward needs first."""


def fastest_speculation(cfg: Config, weigh: Callable[[Config], tuple[int, float]],
                        ram_left: int) -> tuple[int, Config] | None:
    """The speculative stage count the speed model predicts fastest for `cfg` (ties: the fewest stages) among
    those whose host store grows by at most `ram_left` bytes over the configured one, and the config with it,
    where it is at least WORTH times as fast as the configured count; None where speculative updates do not
    apply (clipping off, LoRA, moments on disk, the master streamed, several GPUs a node). `weigh`: a config's
    host RAM and expected tok/s, as the plan counts them (plan_text.alternative_figures)."""
    if cfg.optimizer.grad_clip <= 0 or cfg.finetune.method != "full":
        return None
    weighed, ram_now, configured = [], None, 0.0
    for count in range(min(MAX_WEIGHED, cfg.model.num_layers + 1) + 1):
        try:
            other = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, speculative_stages=count))
        except ConfigError:
            return None
        ram, tok_per_s = weigh(other)
        if count == cfg.optimizer.speculative_stages:
            ram_now, configured = ram, tok_per_s
        weighed.append((tok_per_s, -count, other, ram))
    if ram_now is None:  # configured above the counts weighed
        return None
    weighed = [w for w in weighed if w[3] - ram_now <= ram_left]
    if not weighed:
        return None
    tok_per_s, count, other, _ = max(weighed, key=lambda w: w[:2])
    return (-count, other) if tok_per_s >= WORTH * configured else None
