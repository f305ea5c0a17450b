"""MXFP4 (OCP Microscaling FP4), as gpt-oss's released checkpoints store their experts: dequantized once on
the host to the master dtype when the checkpoint loads.

A checkpoint tensor `W` is stored as two: `W_blocks`, uint8 of shape (*rows, G, 16), two FP4 (E2M1) values
per byte, the first of each pair in the LOW nibble; and `W_scales`, uint8 of shape (*rows, G), one E8M0
exponent (bias 127) per 32 values. Value = E2M1(code) * 2^(scale - 127), E2M1 codes 0..7 being
0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 their negatives. gpt-oss's expert tensors have rows = (experts, R) and
load into transformers' GptOssExperts transposed: `mlp.experts.gate_up_proj_blocks` (E, 2I, H/32, 16)
becomes `mlp.experts.gate_up_proj` (E, H, 2I), `down_proj_blocks` (E, H, I/32, 16) becomes `down_proj`
(E, I, H). This equals transformers' `convert_moe_packed_tensors` (transformers/integrations/mxfp4.py)
bit for bit (tests/unit/test_mxfp4.py): E2M1 value times 2^(scale - 127) in float32 (2^128, scale 255, is
inf there as here), rounded once to the dtype. Reference: OCP Microscaling Formats (MX) v1.0.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain_ray.exceptions import CheckpointError

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""FP4 E2M1 by 4-bit code: bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa."""
VALUES_PER_SCALE = 32
E8M0_BIAS = 127
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
# Scale rows dequantized at a time: bounds the float32 temporaries to ~0.5 GB whatever the tensor.
_ROWS_PER_CHUNK = 1 << 22


@dataclass(frozen=True, slots=True)
class MXFP4Tensor:
    """One MXFP4 pair of a checkpoint and the tensor it loads as."""

    name: str
    """The dequantized tensor's name (transformers' parameter name)."""
    blocks_key: str
    scales_key: str
    shape: tuple[int, ...]
    """The dequantized tensor's shape (gpt-oss experts: transposed, see dequantize_gpt_oss_experts)."""


@functools.cache
def _byte_table(device: torch.device) -> torch.Tensor:
    """byte -> (value of its low nibble, value of its high nibble): the order the values come in."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack([values[byte & 15], values[byte >> 4]], dim=1).to(device)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 blocks (uint8, (*rows, G, 16)) and scales (uint8, (*rows, G)) -> values of shape (*rows, G * 32),
    in row order, not transposed."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] * 2 != VALUES_PER_SCALE or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks must be (*rows, G, {VALUES_PER_SCALE // 2}) and scales (*rows, G); got "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    *rows, groups, _ = blocks.shape
    flat_blocks = blocks.reshape(-1, VALUES_PER_SCALE // 2)
    flat_scales = scales.reshape(-1)
    out = torch.empty(flat_blocks.shape[0], VALUES_PER_SCALE, dtype=dtype, device=blocks.device)
    table = _byte_table(blocks.device)
    for r0 in range(0, flat_blocks.shape[0], _ROWS_PER_CHUNK):
        r1 = min(r0 + _ROWS_PER_CHUNK, flat_blocks.shape[0])
        values = table[flat_blocks[r0:r1].long()].view(r1 - r0, VALUES_PER_SCALE)
        exponents = flat_scales[r0:r1].to(torch.int32).sub_(E8M0_BIAS).view(-1, 1)
        out[r0:r1] = torch.ldexp(values, exponents)  # float32, then one rounding to dtype
    return out.view(*rows, groups * VALUES_PER_SCALE)


def dequantize_gpt_oss_experts(blocks: torch.Tensor, scales: torch.Tensor,
                               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A gpt-oss expert tensor as transformers' GptOssExperts holds it: blocks (E, R, G, 16), scales (E, R, G)
    -> (E, G * 32, R), contiguous. One expert at a time: the temporary beyond the result is one expert's."""
    if blocks.dim() != 4:
        raise ValueError(f"gpt-oss expert blocks are 4-D (experts, rows, groups, 16), got {tuple(blocks.shape)}")
    experts, rows, groups, _ = blocks.shape
    out = torch.empty(experts, groups * VALUES_PER_SCALE, rows, dtype=dtype, device=blocks.device)
    for e in range(experts):
        out[e].copy_(dequantize_mxfp4(blocks[e], scales[e], dtype).T)
    return out


def find_mxfp4_tensors(source: str | Path | Mapping[str, Sequence[int]]) -> list[MXFP4Tensor]:
    """The MXFP4 pairs of a checkpoint: a safetensors file, a directory (all its *.safetensors shards together:
    a pair may straddle two) or a name -> shape mapping; only headers are read. For each `X_blocks` with its
    `X_scales`, the tensor `X` it dequantizes to and its shape. A blocks tensor without its scales (or the
    other way round), or shapes that do not fit, raise CheckpointError naming the file or directory."""
    if isinstance(source, str | Path):
        where = str(source)
        files = sorted(Path(source).glob("*.safetensors")) if Path(source).is_dir() else [Path(source)]
        if not files:
            raise CheckpointError(f"{where}: no *.safetensors files in this directory")
        shapes = {k: v for f in files for k, v in safetensors_shapes(f).items()}
    else:
        where, shapes = "the given tensors", {k: tuple(v) for k, v in source.items()}
    found = []
    for key in sorted(shapes):
        if key.endswith(SCALES_SUFFIX) and key.removesuffix(SCALES_SUFFIX) + BLOCKS_SUFFIX not in shapes:
            raise CheckpointError(f"{where}: {key} has no {key.removesuffix(SCALES_SUFFIX) + BLOCKS_SUFFIX}; "
                                  "an MXFP4 tensor needs both (is the checkpoint complete?)")
        if not key.endswith(BLOCKS_SUFFIX):
            continue
        name = key.removesuffix(BLOCKS_SUFFIX)
        scales_key = name + SCALES_SUFFIX
        if scales_key not in shapes:
            raise CheckpointError(f"{where}: {key} has no {scales_key}; an MXFP4 tensor needs both "
                                  "(is the checkpoint complete?)")
        blocks, scales = shapes[key], shapes[scales_key]
        if len(blocks) != 4 or blocks[-1] * 2 != VALUES_PER_SCALE or blocks[:-1] != scales:
            raise CheckpointError(f"{where}: {key} {blocks} and {scales_key} {scales} are not an MXFP4 expert pair "
                                  f"(experts, rows, groups, {VALUES_PER_SCALE // 2}) and (experts, rows, groups)")
        experts, rows, groups, _ = blocks
        found.append(MXFP4Tensor(name, key, scales_key, (experts, groups * VALUES_PER_SCALE, rows)))
    return found


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from a safetensors file's header (no tensor data is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{path}: cannot read its safetensors header ({e}); is the file complete?") from e

