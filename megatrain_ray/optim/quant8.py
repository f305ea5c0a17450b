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
    sorted map (float32), `zero` the sorted index of 0.0 (stored byte = sorted index - zero, mod 256). `prefix`:
    for the native kernel, one uint32 entry per 16-bit prefix of a float32 (prefix_table), from which a value's
    count of midpoints below it is one load and one integer comparison, instead of a binary search."""

    values: torch.Tensor
    bounds: torch.Tensor
    zero: int
    prefix: torch.Tensor


def prefix_table(bounds: np.ndarray) -> np.ndarray:
    """ByteCode.prefix, checked. Entry P (the floats whose top 16 bits are P): in the high 16 bits the number of
    bounds below every float of P; in the low 16 bits the threshold t for which a float x of P has one bound more
    below it exactly where its low 16 bits, flipped for a negative x, exceed t (for floats of one sign and one
    prefix, integer order of the low bits is magnitude order). t is the bound's own low bits (flipped likewise) when
    a bound lies in P, 0xFFFF (never exceeded) when none does. A prefix that holds two bounds would need a second
    comparison, and is refused; every NaN prefix counts all bounds (the count a NaN gets from the kernel)."""
    prefix = np.arange(1 << 16, dtype=np.uint32)
    negative = prefix >= 0x8000
    flip = np.where(negative, np.uint32(0xFFFF), np.uint32(0))
    low = np.where(negative, (prefix << 16) | 0xFFFF, prefix << 16).view(np.float32)  # the most negative of each
    high = np.where(negative, prefix << 16, (prefix << 16) | 0xFFFF).view(np.float32)
    below = np.searchsorted(bounds, low, side="left")
    inside = np.searchsorted(bounds, high, side="right") - below
    finite = (prefix & 0x7F80) != 0x7F80
    if (inside[finite] > 1).any():
        raise AssertionError("a 16-bit float prefix holds two bounds of the 8-bit map")
    bound_bits = bounds.astype(np.float32).view(np.uint32)
    held = finite & (inside == 1)
    threshold = np.full(prefix.size, 0xFFFF, np.uint32)
    threshold[held] = (bound_bits[below[held]] & 0xFFFF) ^ flip[held]
    count = np.where(finite, below, bounds.size).astype(np.uint32)
    return ((count << 16) | threshold).astype(np.int32)  # below 2**24: torch holds it as int32


@lru_cache(maxsize=2)
def byte_code(signed: bool) -> ByteCode:
    ordered = dynamic_map(signed)
    zero = int((ordered == 0).nonzero()[0])
    values = torch.roll(ordered, -zero)  # values[b] = ordered[(b + zero) % 256]
    bounds = (ordered[:-1] + ordered[1:]) / 2
    return ByteCode(values, bounds, zero, torch.from_numpy(prefix_table(bounds.numpy())))


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
