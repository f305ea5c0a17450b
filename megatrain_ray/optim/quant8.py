"""8-bit blockwise quantization of the lean AdamW moments (optimizer.lean_moments=int8), as bitsandbytes' 8-bit
optimizers store theirs: each block of `block` elements keeps one float32 scale (its absolute maximum) and one byte
per element, the index of the nearest value of a 256-entry map of [-1, 1] (exp_avg, signed) or [0, 1] (exp_avg_sq,
unsigned). The maps are bitsandbytes' dynamic maps (create_dynamic_map: a dynamic exponent and a shrinking
fraction, dense near 0), rebuilt here so that the product does not import bitsandbytes.

One change of representation: the byte stored is the map index minus the index of 0.0, modulo 256, so that a
zero-filled segment (every fresh one, store/segments.create_segment) holds zero moments, and a stage's padding,
whose gradients are zero, stays zero. The torch functions here are the definition the native kernel
(kernels/lean_adamw.cpp) repeats bit for bit: the scaled value is x * (1 / absmax) in float32 (0 for an all-zero
block), its code the number of midpoints between neighbouring map values that lie below it (a tie goes to the
lower value, as torch.bucketize and bitsandbytes' CPU path), the value read back code_value * absmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch


def dynamic_map(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes.functional.create_dynamic_map (8-bit approximations of Dettmers 2015), sorted, float32."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else \
            2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        boundaries = torch.linspace(0.1, 1, int(items), dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (2**total_bits - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


@dataclass(frozen=True)
class ByteCode:
    """A map as the store holds it: `values[b]` is the value of stored byte b, `bounds` the 255 midpoints of the
    sorted map (float32), `zero` the sorted index of 0.0 (stored byte = sorted index - zero, mod 256). `below`:
    for the native kernel, per 16-bit prefix of a float32 (its bfloat16 truncation), how many bounds lie below
    every float of that prefix (int32, 65536): no prefix spans more than one bound, so a value's count is that
    plus one comparison with the next bound, instead of a binary search."""

    values: torch.Tensor
    bounds: torch.Tensor
    zero: int
    below: torch.Tensor


def prefix_counts(bounds: np.ndarray) -> np.ndarray:
    """ByteCode.below, checked: the count of bounds under the lowest float of each 16-bit prefix; a prefix (of a
    finite float) that spans two bounds would make the kernel's one comparison wrong, and is refused here."""
    prefix = np.arange(1 << 16, dtype=np.uint32)
    negative = prefix >= 0x8000
    low = np.where(negative, (prefix << 16) | 0xFFFF, prefix << 16).view(np.float32)  # the most negative of each
    high = np.where(negative, prefix << 16, (prefix << 16) | 0xFFFF).view(np.float32)
    below = np.searchsorted(bounds, low, side="left")
    finite = (prefix & 0x7F80) != 0x7F80
    spans = np.searchsorted(bounds, high, side="right") - below
    if (spans[finite] > 1).any():
        raise AssertionError("a 16-bit float prefix spans two bounds of the 8-bit map")
    return np.where(finite, below, bounds.size).astype(np.int32)  # int32: the kernel's loop gathers them


@lru_cache(maxsize=2)
def byte_code(signed: bool) -> ByteCode:
    ordered = dynamic_map(signed)
    zero = int((ordered == 0).nonzero()[0])
    values = torch.roll(ordered, -zero)  # values[b] = ordered[(b + zero) % 256]
    bounds = (ordered[:-1] + ordered[1:]) / 2
    return ByteCode(values, bounds, zero, torch.from_numpy(prefix_counts(bounds.numpy())))


def quantize_(out: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, block: int, code: ByteCode) -> None:
    """Quantize float32 `x` (whole blocks but the last) into bytes `out` (uint8, x's length) and `scales`
    (float32, one per block): the module's definition."""
    n = x.numel()
    blocks = -(-n // block)
    pad = blocks * block - n
    padded = torch.nn.functional.pad(x, (0, pad)) if pad else x
    grid = padded.view(blocks, block)
    absmax = grid.abs().amax(dim=1)
    inverse = torch.where(absmax > 0, torch.reciprocal(absmax), torch.zeros_like(absmax))
    index = torch.searchsorted(code.bounds, (grid * inverse[:, None]).reshape(-1)[:n])
    out.copy_(index.sub_(code.zero).bitwise_and_(0xFF))
    scales.copy_(absmax)


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int, code: ByteCode) -> torch.Tensor:
    """The float32 values of bytes `q` with their blocks' `scales`."""
    n = q.numel()
    return code.values[q.long()] * scales.repeat_interleave(block)[:n]
