"""What every config section module shares: the dtype names and the one way a bad value is refused."""

from __future__ import annotations

from typing import Any, Literal

from megatrain_ray.exceptions import ConfigError, excerpt

DType = Literal["bfloat16", "float16", "float32", "float64"]


def refuse(key: str, value: Any, why: str) -> None:
    """One ConfigError naming the dotted key, the value received and what to do."""
    raise ConfigError(f"config key '{key}' = {excerpt(value)}: {why}")
