"""The lean optimizer state in `megatrain plan` (optimizer.state=lean): its host bytes per parameter (the bfloat16
master and compensation, the moments and their scales, apart from the gradients' buffers) and the CPU update's
time per step, for the configured run and as the alternatives a full-state run could pick."""

from __future__ import annotations

import dataclasses

from megatrain_ray.config.sections import Config
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.planning.profiles import LEAN_RATE_FRACTION, adamw_gparams, optimizer_dram_bytes

STATE_KINDS = ("master", "master_comp", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
"""The kinds of the optimizer state proper in the plan's host figures (store/segments.LEAN_KINDS)."""


def state_bytes(host: dict[str, int]) -> int:
    """Host bytes of the optimizer state in a plan's shared-memory figures (no gradients, streaming copy or gates)."""
    return sum(n for kind, n in host.items() if kind in STATE_KINDS)


def lean_alternatives(cfg: Config) -> list[tuple[str, Config]]:
    """(label, config) of the other optimizer states this run could take: from a full state the two lean ones
    where bfloat16 compute allows them; from a lean state the full one and the other lean moments."""
    o = cfg.optimizer
    choices = [("full", o.lean_moments), ("lean", "int8"), ("lean", "bfloat16")]
    out = []
    for state, moments in choices:
        if (state, moments) == (o.state, o.lean_moments) or (state == "full" and o.state == "full"):
            continue
        try:
            other = dataclasses.replace(cfg, optimizer=dataclasses.replace(
                o, state=state, lean_moments=moments, moment_dtype="float32", speculative_stages=0))
        except ConfigError:  # lean refused for this config (compute dtype, LoRA, the disk tier...)
            continue
        label = "state full" if state == "full" else f"state lean, moments {moments}"
        out.append((label, other))
    return out


def lean_lines(cfg: Config, host: dict[str, int], params: int, host_profile=None) -> list[str]:
    """The configured lean state: bytes per parameter of the state, of its update's DRAM traffic, and the update's
    time per step where the host's AdamW rate is known."""
    if cfg.optimizer.state != "lean":
        return []
    o = cfg.optimizer
    moments = f"int8 blocks of {o.lean_block}" if o.lean_moments == "int8" else "bfloat16"
    line = (f"optimizer state lean (bf16 master + bf16 compensation, moments {moments}): "
            f"{state_bytes(host) / params:.3f} B/param of host RAM, the update moving "
            f"{optimizer_dram_bytes(cfg):.2f} B/param of DRAM")
    if host_profile is not None:
        rate = adamw_gparams(cfg, host_profile)
        line += (f"; CPU update {params / rate / 1e9:.3f} s per step at {rate:.3g} G params/s ("
                 f"{LEAN_RATE_FRACTION[o.lean_moments]:g} of the full state's {host_profile.adamw_gparams:g}, as "
                 "measured on the H200 box's 16 cores: planning/machines.yaml, lean_rate_fraction)")
    return [line]
