"""The example's reward functions, in TRL's signature: `prompts, completions, **columns -> list[float]` (plain-text
prompts: each completion is a string; `answer` is the dataset's column)."""

from __future__ import annotations

import re

FIRST_NUMBER = re.compile(r"^\s*(-?\d+)")


def format_reward(prompts, completions, **kwargs) -> list[float]:
    """1 when the reply starts with a number (the answer, not an explanation)."""
    return [1.0 if FIRST_NUMBER.match(c) else 0.0 for c in completions]


def correct_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1 when the reply starts with the sum."""
    found = [FIRST_NUMBER.match(c) for c in completions]
    return [1.0 if m and m.group(1) == a else 0.0 for m, a in zip(found, answer)]
