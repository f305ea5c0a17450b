"""The RoPE tables of the step's sequence length, computed once per length and kind and kept on the device;
gathered per row for packed documents."""

from __future__ import annotations

import torch

from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.model.layer_spec import LayerSpec
from megatrain_ray.model.rope import rope_tables, uses_long_factors


class RopeCache:
    def __init__(self, model: ModelConfig, specs: tuple[LayerSpec, ...], device: torch.device, dtype: torch.dtype):
        """`specs`: the layers', whose LayerSpec.local_rope says which kinds of tables the model takes."""
        self.model_cfg, self.device, self.dtype = model, device, dtype
        self.kinds = {spec.local_rope for spec in specs}
        self._cache: dict[tuple[int, bool, bool], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, seq_len: int, positions: torch.Tensor | None) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """RoPE tables for positions 0..seq_len-1, or gathered per row for packed documents, by
        LayerSpec.local_rope (Gemma 3's sliding layers have their own). LongRoPE takes its long factors when
        the longest position is past the original context (as transformers given these position ids): for
        packed rows, by their longest document."""
        context = seq_len
        if positions is not None and uses_long_factors(self.model_cfg, seq_len):
            context = int(positions.max()) + 1  # host positions of the batch: no device sync
        if positions is not None:
            positions = positions.to(self.device, non_blocking=True)
        tables = {}
        for local in self.kinds:
            key = (seq_len, uses_long_factors(self.model_cfg, context) and not local, local)
            if key not in self._cache:
                self._cache[key] = rope_tables(self.model_cfg, seq_len, self.device, self.dtype, key[1], local)
            cos, sin = self._cache[key]
            tables[local] = (cos, sin) if positions is None else (cos[positions].unsqueeze(1),
                                                                  sin[positions].unsqueeze(1))
        return tables

    def clear(self) -> None:
        self._cache.clear()
