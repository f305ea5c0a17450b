"""What every config section module shares: the dtype names and the one way a bad value is refused."""

from __future__ import annotations

from typing import Any, Literal

from megatrain_ray.exceptions import ConfigError, excerpt

DType = Literal["bfloat16", "float16", "float32", "float64"]


class FieldError(ConfigError):
    """A config value refused by its section: `key` (dotted), `value` and `why`, so that a caller that filled the
    section from another file (config.json) can name that file and its own key instead."""

    def __init__(self, message: str, key: str = "", value: Any = None, why: str = ""):
        super().__init__(message)
        self.key, self.value, self.why = key, value, why

    def __reduce__(self):
        return (self.__class__, (self.args[0], self.key, None, self.why))


def refuse(key: str, value: Any, why: str) -> None:
    """One ConfigError naming the dotted key, the value received and what to do."""
    raise FieldError(f"config key '{key}' = {excerpt(value)}: {why}", key, value, why)
