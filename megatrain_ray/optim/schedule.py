"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay to a floor."""

from __future__ import annotations

import math

from megatrain_ray.config.loop_sections import ScheduleConfig


def lr_at(step: int, peak_lr: float, total_steps: int, schedule: ScheduleConfig) -> float:
    """Learning rate of 0-based step `step` of `total_steps`.

    Warmup: peak * (step + 1) / warmup_steps. Then, with p = (step - warmup) / (total - warmup) in
    [0, 1): cosine: floor + (peak - floor) * (1 + cos(pi p)) / 2; linear: peak - (peak - floor) p;
    constant: peak. floor = min_lr_ratio * peak.
    """
    warmup = schedule.warmup_steps
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    if schedule.kind == "constant":
        return peak_lr
    floor = schedule.min_lr_ratio * peak_lr
    progress = (step - warmup) / max(1, total_steps - warmup)
    if schedule.kind == "linear":
        return peak_lr - (peak_lr - floor) * progress
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
