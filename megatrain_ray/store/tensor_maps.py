"""A Mapping of tensors by name whose values are derived on lookup from another one's (export's views)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch


class DerivedTensors(Mapping[str, torch.Tensor]):
    """The names of `base`, in its order; a subclass's __getitem__ computes each tensor (merged, requantized, ...)
    when export reads it, so no second copy of the model exists."""

    def __init__(self, base: Mapping[str, torch.Tensor]):
        self.base = base

    def __contains__(self, name: object) -> bool:
        return name in self.base

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)
