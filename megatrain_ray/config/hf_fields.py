"""config.json fields that more than one family reads, checked once."""

from __future__ import annotations

from typing import Any

from megatrain_ray.exceptions import CheckpointError, excerpt


def checked_layer_types(layer_types: Any, where: str) -> list[str]:
    """config.json's layer_types: a list of full_attention / sliding_attention, one per layer."""
    if not isinstance(layer_types, list) or any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        raise CheckpointError(f"{where}: layer_types = {excerpt(layer_types)} must list full_attention or "
                              "sliding_attention per layer")
    return list(layer_types)
