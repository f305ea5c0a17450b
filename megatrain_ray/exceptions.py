"""Errors users see. Each one names what was wrong and what to do; all pickle across actors."""

from __future__ import annotations

import reprlib
from typing import Any

_EXCERPT = reprlib.Repr()
_EXCERPT.maxlevel, _EXCERPT.maxstring, _EXCERPT.maxother, _EXCERPT.maxlong = 2, 60, 60, 40
_EXCERPT.maxdict = _EXCERPT.maxlist = _EXCERPT.maxtuple = _EXCERPT.maxset = 4


def excerpt(value: Any, limit: int = 80) -> str:
    """A short repr of a value for an error message: bounded in time and length whatever the value (a YAML
    alias bomb, a megabyte string)."""
    text = _EXCERPT.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class MegatrainError(Exception):
    """Base of every error megatrain raises on purpose."""

    def __reduce__(self):
        return (self.__class__, self.args)


class ConfigError(MegatrainError, ValueError):
    """A config key, file or override is wrong; the message names the dotted key."""


class DataError(MegatrainError):
    """A data file is missing, unreadable or too small for the configured batch."""


class RewardFunctionError(MegatrainError, ValueError):
    """A GRPO reward function raised, or returned the wrong number of rewards or a value that is not a finite number
    or None; the message names the function."""


class HostMemoryError(MegatrainError):
    """The host store does not fit: RAM, /dev/shm or pinned memory; the message gives the numbers."""


class ActorFailedError(MegatrainError):
    """An actor died or raised; `failures` maps actor names to what they raised."""

    def __init__(self, message: str, failures: dict[str, BaseException] | None = None):
        super().__init__(message, failures or {})
        self.failures = failures or {}

    def __str__(self) -> str:
        return str(self.args[0])


class CheckpointError(MegatrainError):
    """A checkpoint or a model directory is missing, incomplete, corrupt or belongs to another model;
    the message names the file."""


class NonFiniteError(MegatrainError):
    """The loss or gradient norm was not finite and fault.nonfinite is `stop`."""


class ParallelError(MegatrainError):
    """The ranks of a data-parallel run stopped answering each other, or their nodes' copies of the
    weights disagree; the message names the rank, node or stage."""
