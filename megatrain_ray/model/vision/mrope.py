"""Multimodal RoPE (Qwen2.5-VL's and Qwen3-VL's M-RoPE): rotary positions with three axes in the text layers.

Each token has a (time, height, width) position: a text token the same number on all three (its place in the row,
counted on after each image), an image's tokens their place on the image's grid of merged patches, offset by the
text before it: transformers' own `get_rope_index` of the model's base class gives them (model/vision/modules.py
holds that class, without its language model). Each rotary frequency takes its angle from one axis, by
`mrope_section` (e.g. 16, 24, 24 of 64 frequencies):

- contiguous (Qwen2.5-VL): three runs, the first s0 frequencies time, the next s1 height, the last s2 width;
- interleaved (Qwen3-VL): frequency f is height where f % 3 == 1 and f < 3 s1, width where f % 3 == 2 and
  f < 3 s2, else time (transformers' Qwen3VLTextRotaryEmbedding.recomposition_frequencies).

The table is that angle twice over (the rotate-half layout), so the layers apply it as any RoPE table, one per row:
[B, 1, T, head_dim], the packed-rows shape the templates take. Computed in the compute dtype (float64 in a float64
run; transformers' own tables are float32).
"""

from __future__ import annotations

from typing import Any

import torch


def mrope_positions(base: Any, ids: torch.Tensor, image_token_id: int,
                    image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """[3, B, T] positions of the rows `ids` (their images' grids `image_grid_thw` [images, 3] in order)."""
    if image_grid_thw is None:
        return torch.arange(ids.shape[1], device=ids.device).expand(3, *ids.shape)
    types = (ids == image_token_id).to(torch.int32)
    positions, _ = base.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=image_grid_thw.to(ids.device))
    return positions


def frequency_axes(section: tuple[int, ...], frequencies: int, interleaved: bool) -> list[int]:
    """The position axis (0 time, 1 height, 2 width) each rotary frequency takes its angle from."""
    if sum(section) != frequencies:
        raise ValueError(f"mrope_section {list(section)} sums to {sum(section)}, not the {frequencies} rotary "
                         "frequencies of the head")
    if not interleaved:
        return [axis for axis, n in enumerate(section) for _ in range(n)]
    return [f % 3 if f % 3 and f < 3 * section[f % 3] else 0 for f in range(frequencies)]


def mrope_tables(positions: torch.Tensor, section: tuple[int, ...], theta: float, head_dim: int,
                 dtype: torch.dtype, device: torch.device,
                 interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, 1, T, head_dim] of [3, B, T] positions."""
    work = torch.promote_types(dtype, torch.float32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(work) / head_dim))
    axes = torch.tensor(frequency_axes(section, inv_freq.numel(), interleaved), device=device)
    freqs = positions.to(device=device, dtype=work)[..., None] * inv_freq  # [3, B, T, head_dim / 2]
    chosen = torch.where(axes == 1, freqs[1], torch.where(axes == 2, freqs[2], freqs[0]))
    angles = torch.cat((chosen, chosen), dim=-1).unsqueeze(1)
    return angles.cos().to(dtype), angles.sin().to(dtype)
