"""optimizer.speculative_stages as `megatrain plan` weighs it: the count the speed model puts fastest."""

from __future__ import annotations

import dataclasses

from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.planning.host_memory import store_bytes
from megatrain_ray.planning.profiles import SpeedProfile
from megatrain_ray.planning.speed import estimate

MAX_WEIGHED = 6
"""Counts weighed: 0 to this. Past the LM head and a few layers the speculative updates outlast the backward
and only delay the updates the next forward needs first."""


def fastest_speculation(cfg: Config, profile: SpeedProfile, offload: bool, workers: int,
                        ram_left: int) -> tuple[int, Config] | None:
    """The speculative stage count the speed model predicts fastest for `cfg` (ties: the fewest stages) among
    those whose host store grows by at most `ram_left` bytes over the configured one, and the config with it;
    None where speculative updates do not apply (clipping off, LoRA, moments on disk, the master streamed,
    several GPUs a node). `workers`: the optimizer workers, as the plan counts them."""
    if cfg.optimizer.grad_clip <= 0 or cfg.finetune.method != "full":
        return None
    weighed, ram_now = [], None
    for count in range(min(MAX_WEIGHED, cfg.model.num_layers + 1) + 1):
        try:
            other = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, speculative_stages=count))
        except ConfigError:
            return None
        ram, _, staging = store_bytes(other, RunSpec.resolve(other), workers)
        if count == cfg.optimizer.speculative_stages:
            ram_now = sum(ram.values()) + staging
        weighed.append((estimate(other, profile, offload=offload).tok_per_s, -count, other,
                        sum(ram.values()) + staging))
    if ram_now is None:  # configured above the counts weighed
        return None
    weighed = [w for w in weighed if w[3] - ram_now <= ram_left]
    if not weighed:
        return None
    tok_per_s, count, other, _ = max(weighed, key=lambda w: w[:2])
    return -count, other
