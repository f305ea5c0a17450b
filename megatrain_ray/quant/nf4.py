"""NF4: QLoRA's 4-bit NormalFloat, blockwise, with double quantization of the block scales.

A tensor is cut, in flat (row-major) order, into blocks of `blocksize` values (64 by default; the last
block may be shorter). Each block keeps its absolute maximum (`absmax`) and each value becomes the index
of the nearest of the 16 NF4 codes after division by that absmax; two indices share a byte, the first
value of each pair in the high nibble (bitsandbytes' order). Double quantization (bitsandbytes'
`compress_statistics=True`) stores the absmax values themselves in 8 bits: their mean is subtracted
(the `offset`, kept in float32) and the rest is quantized blockwise, 256 per block, with the signed
8-bit dynamic code, each block of 256 keeping a float32 absmax of its own.

Bytes for n values, b = ceil(n / blocksize): ceil(n / 2) codes + b absmax codes + 4 * ceil(b / 256)
absmax scales + 4 for the offset; about 0.5 + 1/64 + 1/4096 = 0.516 bytes per value at blocksize 64
(0.5 + 4/64 = 0.5625 without double quantization).

Everything here is plain torch and equals bitsandbytes 0.50.2 on the CPU bit for bit, rounding and
ties included (tests/unit/test_nf4.py): the 4-bit step mirrors its torch kernel (reciprocal-multiply,
clamp, nearest code with ties to the lower code), the 8-bit step of the double quantization mirrors its
C kernel (a 65536-entry table from the normalised value to the nearest code). References: Dettmers et
al., "QLoRA: Efficient Finetuning of Quantized LLMs" (arXiv:2305.14314), and "8-bit Optimizers via
Block-wise Quantization" (arXiv:2110.02861) for the dynamic code.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

NF4_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""Block sizes bitsandbytes accepts for 4-bit quantization."""
ABSMAX_BLOCKSIZE = 256
"""Values per block when the absmax values are quantized (bitsandbytes' double quantization)."""
NF4_OFFSET = 0.9677083
"""QLoRA's outermost quantile: the NF4 extremes are the normal quantiles at 1 - NF4_OFFSET and NF4_OFFSET."""

# Values of one chunk of the host-side quantization: its temporaries (about 20 bytes per value, ~1.3 MB) stay
# in a core's cache, so the host shards' fill threads (one per core) do not contend for DRAM bandwidth; large
# enough that the per-chunk dispatch (about ten torch calls) costs well under a nanosecond per value; a multiple
# of every block size.
_QUANTIZE_CHUNK = 1 << 16
_CODE_CELLS = 4096  # the cells of _nf4_codes's grid over [-1, 1]
_DYNAMIC_LUT_SIZE = 65536  # bitsandbytes' CPU 8-bit quantizer: normalised value -> table index -> code


@functools.cache
def nf4_code() -> torch.Tensor:
    """The 16 NF4 values in increasing order, derived as QLoRA does: 8 positive values, the normal quantiles
    at the first 8 of 9 evenly spaced probabilities from NF4_OFFSET to 0.5; 7 negative ones, mirrored, from
    the first 7 of 8; an exact zero; all divided by the largest, so the extremes are -1 and 1. Asymmetric
    on purpose: zero is exact and the positive side gets the 16th value."""
    probs_pos = torch.linspace(NF4_OFFSET, 0.5, 9)[:-1].double()  # float32 grid, as bitsandbytes builds it
    probs_neg = torch.linspace(NF4_OFFSET, 0.5, 8)[:-1].double()
    pos = torch.special.ndtri(probs_pos).float()
    neg = (-torch.special.ndtri(probs_neg)).float()
    values = torch.cat([pos, torch.zeros(1), neg]).sort().values
    return values / values.max()


@functools.cache
def dynamic_code() -> torch.Tensor:
    """The signed 8-bit dynamic code (256 values in [-1, 1], increasing) that double quantization stores
    the absmax values in: for each exponent 10^-6 .. 10^0, 2^i linearly spaced fractions in (0.1, 1),
    both signs, plus 0 and 1."""
    data: list[float] = []
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2 ** i + 1)
        means = (edges[:-1] + edges[1:]) / 2.0
        data += ((10 ** (i - 6)) * means).tolist() + (-(10 ** (i - 6)) * means).tolist()
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)


@functools.cache
def _dynamic_lut() -> torch.Tensor:
    """For each of 65536 evenly spaced points of [-1, 1] (float32, as bitsandbytes computes them), the index
    of the nearest dynamic code; a midpoint goes to the lower code."""
    code = dynamic_code().numpy()
    midpoints = np.float32(0.5) * (code[:-1] + code[1:])
    steps = np.arange(_DYNAMIC_LUT_SIZE, dtype=np.float32)
    points = np.float32(-1.0) + (np.float32(2.0) * steps) / np.float32(_DYNAMIC_LUT_SIZE - 1)
    return torch.from_numpy(np.searchsorted(midpoints, points, side="left").astype(np.uint8))


@functools.cache
def nf4_byte_table(device: torch.device) -> torch.Tensor:
    """(256, 2) float32 on a device: for each byte, the NF4 values of its high and low nibble, in the order
    the values come. Decoding is one lookup per byte. Copied to each device once."""
    code = nf4_code()
    byte = torch.arange(256)
    return torch.stack([code[byte >> 4], code[byte & 15]], dim=1).to(device)


@functools.cache
def dynamic_code_on(device: torch.device) -> torch.Tensor:
    """dynamic_code() on a device, copied there once."""
    return dynamic_code().to(device)


@dataclass(frozen=True)
class NF4Tensor:
    """A tensor in NF4. Without double quantization `absmax` holds the float32 block maxima; with it,
    `absmax` holds their uint8 codes and `absmax_scales` / `absmax_offset` what decodes them."""

    packed: torch.Tensor
    """uint8, ceil(numel / 2): two code indices per byte, the first value in the high nibble."""
    absmax: torch.Tensor
    absmax_scales: torch.Tensor | None
    """float32, one per ABSMAX_BLOCKSIZE absmax values (double quantization only)."""
    absmax_offset: torch.Tensor | None
    """float32 scalar: the mean absmax, subtracted before the 8-bit quantization (double quantization only)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    """The dtype of the quantized tensor, and of its dequantization unless another is asked for."""
    blocksize: int

    @property
    def double_quant(self) -> bool:
        return self.absmax_scales is not None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def num_blocks(self) -> int:
        return -(-self.numel // self.blocksize)

    @property
    def nbytes(self) -> int:
        parts = [self.packed, self.absmax, self.absmax_scales, self.absmax_offset]
        return sum(p.numel() * p.element_size() for p in parts if p is not None)


def nf4_nbytes(numel: int, blocksize: int = 64, double_quant: bool = True) -> int:
    """Bytes of a tensor of `numel` values in NF4, as NF4Tensor.nbytes counts them."""
    blocks = -(-numel // blocksize)
    if not double_quant:
        return (numel + 1) // 2 + 4 * blocks
    return (numel + 1) // 2 + blocks + 4 * -(-blocks // ABSMAX_BLOCKSIZE) + 4


def check_blocksize(blocksize: int) -> None:
    if blocksize not in NF4_BLOCKSIZES:
        raise ValueError(f"NF4 blocksize {blocksize} is not supported: use one of {NF4_BLOCKSIZES} "
                         "(the sizes bitsandbytes accepts)")


def quantize_nf4(tensor: torch.Tensor, blocksize: int = 64, double_quant: bool = True) -> NF4Tensor:
    """Quantize a float tensor (bf16, fp16, fp32 or fp64 on its float32 values) to NF4; what bitsandbytes'
    quantize_4bit(tensor, blocksize, compress_statistics=double_quant, quant_type="nf4") computes."""
    check_blocksize(blocksize)
    if not tensor.is_floating_point() or tensor.numel() == 0:
        raise ValueError(f"NF4 quantizes a non-empty float tensor, got {tensor.dtype} of shape {tuple(tensor.shape)}")
    return quantize_nf4_pieces([tensor.detach().reshape(-1)], tuple(tensor.shape), tensor.dtype, blocksize,
                               double_quant)


def quantize_nf4_pieces(pieces: Iterable[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype,
                        blocksize: int = 64, double_quant: bool = True,
                        packed: torch.Tensor | None = None) -> NF4Tensor:
    """quantize_nf4 of the tensor of `shape` whose flat values are the float `pieces`, end to end, made as they
    are consumed (a tensor too large to hold whole in a temporary, e.g. one of a 120B MoE's fused expert tensors
    being randomly initialised); every piece but the last holds whole blocks. The codes are written into `packed`
    (uint8, ceil(numel / 2): e.g. a view of the packed stage) when given. Only the block maxima (4 bytes per
    block) are held for the whole tensor: the double quantization needs their mean."""
    check_blocksize(blocksize)
    n = math.prod(shape)
    absmax = torch.empty(-(-n // blocksize), dtype=torch.float32)
    done = 0
    for piece in pieces:
        if packed is None:
            packed = torch.empty((n + 1) // 2, dtype=torch.uint8, device=piece.device)
        end = done + piece.numel()
        if end > n or (end < n and end % blocksize):
            raise ValueError(f"NF4 pieces: the piece ending at value {end} breaks a block of {blocksize} or passes "
                             f"the tensor's {n} values")
        absmax = absmax.to(piece.device)
        _quantize_blocks(piece.reshape(-1), done, n, blocksize, packed, absmax)
        done += piece.numel()
    if done != n or packed is None:
        raise ValueError(f"NF4 pieces gave {done} values for a tensor of shape {shape}")
    # amax propagates NaN and infinity: a non-finite value makes its block's maximum non-finite (one pass over
    # the maxima, not over the values).
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError(f"NF4 cannot quantize a tensor with NaN or infinite values (shape {shape}): "
                         "check the checkpoint it came from")
    if not double_quant:
        return NF4Tensor(packed, absmax, None, None, shape, dtype, blocksize)
    offset = absmax.mean()
    absmax_codes, absmax_scales = _quantize_dynamic_blockwise(absmax - offset, ABSMAX_BLOCKSIZE)
    return NF4Tensor(packed, absmax_codes, absmax_scales, offset, shape, dtype, blocksize)


def _quantize_blocks(flat: torch.Tensor, first: int, n: int, blocksize: int, packed: torch.Tensor,
                     absmax: torch.Tensor) -> None:
    """Values [first, first + len(flat)) of a tensor of n values (first a whole number of blocks in) into their
    codes in `packed` and their blocks' maxima in `absmax`."""
    full = flat.numel() - (flat.numel() % blocksize if first + flat.numel() == n else 0)
    for start in range(0, full, _QUANTIZE_CHUNK):
        stop = min(start + _QUANTIZE_CHUNK, full)
        blocks = flat[start:stop].float().view(-1, blocksize)
        block_max = blocks.abs().amax(dim=1)
        # bitsandbytes multiplies by the reciprocal (kept: it rounds differently from a division) and
        # guards an all-zero block against 1/0; absmax itself stays 0 there.
        scaled = (blocks * (1.0 / block_max.clamp(min=1e-38)).view(-1, 1)).clamp(-1, 1)
        codes = _nf4_codes(scaled.view(-1))
        at = (first + start) // 2  # blocks are even-sized: a chunk starts on a byte
        packed[at:at + (stop - start) // 2] = (codes[0::2] << 4) | codes[1::2]
        absmax[(first + start) // blocksize:(first + stop) // blocksize] = block_max
    if full < flat.numel():  # the short last block: bitsandbytes divides here, and keeps the 1e-38 guard in absmax
        tail = flat[full:].float()
        tail_max = tail.abs().max().clamp(min=1e-38)
        codes = _nf4_codes((tail / tail_max).clamp(-1, 1))
        if n % 2:  # the code of 0.0: bitsandbytes pads an odd count with a zero value
            codes = torch.cat([codes, torch.full((1,), 7, dtype=torch.uint8, device=flat.device)])
        packed[(first + full) // 2:] = (codes[0::2] << 4) | codes[1::2]
        absmax[-1] = tail_max


def dequantize_nf4(q: NF4Tensor, dtype: torch.dtype | None = None, device: torch.device | str | None = None
                   ) -> torch.Tensor:
    """The tensor q stands for, in `dtype` (default: the dtype it was quantized from) on `device` (default:
    where q is): code * absmax in float32, rounded once to the dtype, as bitsandbytes' dequantize_4bit."""
    device = torch.device(device) if device is not None else q.packed.device
    absmax = nf4_absmax(q, device)
    values = nf4_byte_table(device)[q.packed.to(device).long()].view(-1)
    # 2 * ceil(n / 2) <= blocks * blocksize: pad to whole blocks, scale, drop the padding.
    values = torch.nn.functional.pad(values, (0, q.num_blocks * q.blocksize - values.numel()))
    values = (values.view(-1, q.blocksize) * absmax.view(-1, 1)).view(-1)[:q.numel]
    return values.to(dtype or q.dtype).view(q.shape)


def nf4_absmax(q: NF4Tensor, device: torch.device | None = None) -> torch.Tensor:
    """The float32 block maxima of q (decoded from 8 bits under double quantization)."""
    device = device or q.absmax.device
    if not q.double_quant:
        return q.absmax.to(device)
    assert q.absmax_scales is not None and q.absmax_offset is not None
    decoded = dequantize_dynamic_blockwise(q.absmax.to(device), q.absmax_scales.to(device), ABSMAX_BLOCKSIZE)
    return decoded + q.absmax_offset.to(device)


def dequantize_dynamic_blockwise(codes: torch.Tensor, scales: torch.Tensor, blocksize: int) -> torch.Tensor:
    """uint8 codes of the dynamic code, one float32 scale per `blocksize` of them -> float32 values."""
    n = codes.numel()
    values = dynamic_code_on(codes.device)[codes.long()]
    padded = torch.nn.functional.pad(values, (0, -n % blocksize))
    return (padded.view(-1, blocksize) * scales.view(-1, 1)).view(-1)[:n]


def _quantize_dynamic_blockwise(values: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values -> (uint8 codes of the dynamic code, float32 absmax per block); bitsandbytes' CPU
    quantize_blockwise: values times the block's float32 reciprocal, clamped to [-1, 1], mapped to one of
    65536 grid points ((v + 1) * 0.5 * 65535 + 0.5, truncated) whose nearest code a table holds. An all-zero
    block gets absmax 0 and codes 0."""
    n = values.numel()
    padded = torch.nn.functional.pad(values.float(), (0, -n % blocksize)).view(-1, blocksize)
    block_max = padded.abs().amax(dim=1)
    zero = block_max == 0
    inverse = torch.where(zero, torch.zeros_like(block_max), 1.0 / torch.where(zero, 1.0, block_max))
    normalised = ((padded * inverse.view(-1, 1)).clamp(-1, 1) + 1.0) * 0.5
    grid = (normalised * (_DYNAMIC_LUT_SIZE - 1) + 0.5).long()  # the C expression, in float32, truncated
    codes = _dynamic_lut().to(values.device)[grid]
    codes[zero] = 0
    return codes.view(-1)[:n].contiguous(), block_max


def _nf4_codes(scaled: torch.Tensor) -> torch.Tensor:
    """The nearest NF4 code of each float32 value in [-1, 1] (ties to the lower code): what
    torch.bucketize(scaled, midpoints) gives, in two table lookups and a comparison (bucketize's binary search
    costs ~10x more): the value's cell of a uniform grid gives the codes below the cell and the one midpoint
    inside it (_code_grid)."""
    below, midpoint = _code_grid(scaled.device)
    cell = scaled.mul(_CODE_CELLS // 2).add_(_CODE_CELLS // 2).long()  # (v + 1) * 2048 rounded once: exact scaling
    cell.clamp_(0, _CODE_CELLS)  # a NaN (refused by the caller once its block's maximum shows it) indexes in bounds
    return below.index_select(0, cell).add_(scaled > midpoint.index_select(0, cell))


@functools.cache
def _code_grid(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each cell g of _CODE_CELLS over [-1, 1] (cell g: [g / 2048 - 1, (g + 1) / 2048 - 1); one more for 1.0):
    how many midpoints lie below it (uint8) and the midpoint inside it (+inf if none). The computed cell of a
    value may be off by one where (v + 1) rounds across a cell edge (within 1.2e-7); no midpoint lies within
    1e-6 of an edge and no cell holds two, so the count is exact anyway (checked here)."""
    mid = _midpoints(torch.device("cpu")).double()
    half = _CODE_CELLS // 2
    edges = torch.arange(_CODE_CELLS + 1, dtype=torch.float64) / half - 1
    cell_of_mid = ((mid + 1) * half).floor().long()
    assert (mid[:, None] - edges[None, :]).abs().min() > 1e-6 and cell_of_mid.unique().numel() == mid.numel()
    below = (mid[None, :] < edges[:, None]).sum(1).to(torch.uint8)
    midpoint = torch.full((_CODE_CELLS + 1,), float("inf"), dtype=torch.float32)
    midpoint[cell_of_mid] = mid.float()
    return below.to(device), midpoint.to(device)


@functools.cache
def _midpoints(device: torch.device) -> torch.Tensor:
    """Decision boundaries between adjacent NF4 codes (bucketize gives a value on one the lower code)."""
    code = nf4_code()
    return ((code[:-1] + code[1:]) / 2).to(device)
