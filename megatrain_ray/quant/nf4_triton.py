"""Triton kernels that read NF4 (quant/nf4.py) on the device without a torch-side decode.

`dequantize_blocks_into` decodes whole blocks into a preallocated buffer in one pass (codes in, values out,
no int64 index or float32 temporaries as decode_blocks makes), bit-identical to decode_blocks.
`NF4Experts.products` is a grouped matmul straight from a MoE layer's fused expert tensor left in NF4: in
the decode step a few rows go to each routed expert, so the cost is reading the routed experts' codes, and
a dequantized copy of all experts (4x the bytes, most of them for experts nobody routed to) is never made.

Exactness: each weight value is code * absmax in float32 rounded once to the matrix's dtype, and a double
quantized absmax is dyn_code * scale then + offset with two float32 roundings, as in quant/nf4.py; the
kernels are launched with enable_fp_fusion=False so that this multiply-add is not contracted into an FMA.
Under TRITON_INTERPRET=1 (the CPU tests) two interpreter gaps are worked around: its float32 -> bfloat16
cast truncates (so the rounding to nearest even is done on the bits) and its tl.dot multiplies bfloat16
operands as raw integers (so the dot runs in float32 there, on the same bf16-rounded values).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch

from megatrain_ray.quant.nf4 import ABSMAX_BLOCKSIZE, NF4_BLOCKSIZES, NF4Tensor, dynamic_code_on, nf4_code
from megatrain_ray.quant.nf4_stage import TRITON_DTYPES

try:  # optional: the module imports (and triton_available says False) where triton is missing
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

_OUT_DTYPES = TRITON_DTYPES
_DEQUANT_TILE_BYTES = 4096  # code bytes per program of the block decode: 8192 values, whole blocks
# K-loop software pipelining off: it would route the per-value NF4 table lookups through cp.async copies into
# shared memory; the codes stream is covered by many small resident programs instead.
_STAGES = 1
_CHUNK = 64  # values of the contiguous axis per weight tile row: one NF4 block (or two at blocksize 32)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available(device: torch.device) -> bool:
    """The kernels can run on `device`: triton importable and the device CUDA, or TRITON_INTERPRET=1 set (CPU
    tensors, for tests)."""
    return triton is not None and (_interpreted() or torch.device(device).type == "cuda")


@cache
def _nf4_lut(device: torch.device) -> torch.Tensor:
    """The 16 NF4 values on a device (64 bytes: stays in L1, so the per-value lookup costs no DRAM traffic)."""
    return nf4_code().to(device)


if triton is not None:
    _ABSMAX_BLOCK = tl.constexpr(ABSMAX_BLOCKSIZE)  # blocks per absmax scale (double quantization)

    @triton.jit
    def _round_to(x, dtype: tl.constexpr, SOFT: tl.constexpr):
        """float32 x rounded once (to nearest even) to dtype. SOFT: on the bits, for the interpreter."""
        if SOFT and dtype == tl.bfloat16:
            u = x.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # finite values only (NF4 values are)
            return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)

    @triton.jit
    def _weight(x, W_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, SOFT: tl.constexpr):
        """float32 x rounded once to W_DTYPE, held in DOT_DTYPE (W_DTYPE or float32: exact)."""
        if SOFT and W_DTYPE == tl.bfloat16:  # DOT_DTYPE is float32 under the interpreter
            u = x.to(tl.uint32, bitcast=True)
            return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            return x.to(W_DTYPE).to(DOT_DTYPE)

    @triton.jit
    def _to_dot(x, DOT_DTYPE: tl.constexpr, SOFT: tl.constexpr):
        """Loaded rows in the dot's dtype; the interpreter's bf16 -> fp32 cast is done on the bits."""
        if SOFT and x.dtype == tl.bfloat16:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(DOT_DTYPE)

    @triton.jit
    def _block_absmax(absmax_ptr, scales_ptr, offset_ptr, dyn_ptr, blk, mask, DOUBLE: tl.constexpr):
        """float32 absmax of blocks `blk`: one gather per block, not per value."""
        if DOUBLE:
            code = tl.load(absmax_ptr + blk, mask=mask, other=0)
            scale = tl.load(scales_ptr + blk // _ABSMAX_BLOCK, mask=mask, other=0.0)
            return tl.load(dyn_ptr + code) * scale + tl.load(offset_ptr)  # two roundings: no fp fusion
        else:
            return tl.load(absmax_ptr + blk, mask=mask, other=0.0)

    @triton.jit
    def _dequant_kernel(codes_ptr, absmax_ptr, lut_ptr, out_ptr, n, BS: tl.constexpr, NB: tl.constexpr,
                        WHOLE: tl.constexpr, SOFT: tl.constexpr):
        # A [NB blocks, BS/2 bytes] tile. WHOLE: n is whole blocks and the masks are per block, constant along a
        # tile row, so the byte loads and value stores vectorise (a per-value mask against a runtime n would
        # not); else (the tail launch of a short last block) per value.
        HB: tl.constexpr = BS // 2
        blk = tl.program_id(0).to(tl.int64) * NB + tl.arange(0, NB)
        byte = blk[:, None] * HB + tl.arange(0, HB)[None, :]
        at = blk[:, None] * BS + tl.arange(0, BS)[None, :]
        if WHOLE:
            load_mask = (blk < n // BS)[:, None]
            store_mask = load_mask
        else:
            load_mask = byte < (n + 1) // 2
            store_mask = at < n
        b = tl.load(codes_ptr + byte, mask=load_mask, other=0x77)
        a = tl.load(absmax_ptr + blk, mask=blk * BS < n, other=0.0)[:, None]
        hi = tl.load(lut_ptr + (b >> 4)) * a  # the first value of each pair
        lo = tl.load(lut_ptr + (b & 15)) * a
        values = tl.reshape(tl.join(hi, lo), (NB, BS))  # interleave: value 2j from hi[j], 2j+1 from lo[j]
        tl.store(out_ptr + at, _round_to(values, out_ptr.dtype.element_ty, SOFT), mask=store_mask)

    @triton.jit
    def _experts_kernel(rows_ptr, ends_ptr, codes_ptr, absmax_ptr, scales_ptr, offset_ptr, lut_ptr, dyn_ptr,
                        out_ptr, A: tl.constexpr, B: tl.constexpr, BS: tl.constexpr, DOUBLE: tl.constexpr,
                        TRANSPOSED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                        CW: tl.constexpr, W_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                        STAGES: tl.constexpr, SOFT: tl.constexpr):
        # weight[e] is [A, B], B contiguous. A and B are constexpr (one compile per expert tensor shape): static
        # K-loop bounds the compiler pipelines (and the interpreter's range takes no tensor bounds). Grid (tiles,
        # E), axis 0 fastest: neighbouring programs read neighbouring bytes of one expert. A weight tile row is
        # CW values of B inside one NF4 block (one absmax per tile row); its hi and lo nibbles (even and odd
        # positions along B) are never interleaved: two dots, on even/odd output columns (TRANSPOSED) or on
        # even/odd inputs (not). The row loop is a while (the interpreter's range takes no tensor bounds either):
        # an expert with no rows runs no iteration and reads no weight byte.
        tile = tl.program_id(0)
        e = tl.program_id(1)
        start = tl.where(e > 0, tl.load(ends_ptr + tl.maximum(e - 1, 0)), 0)
        end = tl.load(ends_ptr + e)
        j = tl.arange(0, CW // 2)
        first_row = e.to(tl.int64) * A  # the expert's first row of the [E * A, B] matrix
        if TRANSPOSED:  # out[r, n] = sum_k rows[r, k] * weight[e, k, n]: output columns n0 .. n0 + CW
            n0 = tile * CW
            m0 = start
            while m0 < end:
                rm = m0 + tl.arange(0, BLOCK_M)
                mm = rm < end
                acc_e = tl.zeros((BLOCK_M, CW // 2), dtype=tl.float32)
                acc_o = tl.zeros((BLOCK_M, CW // 2), dtype=tl.float32)
                for k0 in tl.range(0, A, BLOCK_K, num_stages=STAGES):
                    rk = k0 + tl.arange(0, BLOCK_K)
                    mk = rk < A
                    x = tl.load(rows_ptr + rm.to(tl.int64)[:, None] * A + rk[None, :],
                                mask=mm[:, None] & mk[None, :], other=0.0)
                    x = _to_dot(x, DOT_DTYPE, SOFT)
                    g = first_row + rk
                    b = tl.load(codes_ptr + g[:, None] * (B // 2) + n0 // 2 + j[None, :], mask=mk[:, None], other=0)
                    a = _block_absmax(absmax_ptr, scales_ptr, offset_ptr, dyn_ptr, (g * B + n0) // BS, mk,
                                      DOUBLE)[:, None]
                    w_hi = _weight(tl.load(lut_ptr + (b >> 4)) * a, W_DTYPE, DOT_DTYPE, SOFT)
                    w_lo = _weight(tl.load(lut_ptr + (b & 15)) * a, W_DTYPE, DOT_DTYPE, SOFT)
                    acc_e = tl.dot(x, w_hi, acc_e, input_precision=PRECISION)
                    acc_o = tl.dot(x, w_lo, acc_o, input_precision=PRECISION)
                at = out_ptr + rm.to(tl.int64)[:, None] * B + n0 + 2 * j[None, :]
                tl.store(at, _round_to(acc_e, out_ptr.dtype.element_ty, SOFT), mask=mm[:, None])
                tl.store(at + 1, _round_to(acc_o, out_ptr.dtype.element_ty, SOFT), mask=mm[:, None])
                m0 += BLOCK_M
        else:  # out[r, o] = sum_k rows[r, k] * weight[e, o, k]: output features o0 .. o0 + BLOCK_N
            ro = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            mo = ro < A
            g = first_row + ro
            m0 = start
            while m0 < end:
                rm = m0 + tl.arange(0, BLOCK_M)
                mm = rm < end
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in tl.range(0, B, CW, num_stages=STAGES):
                    x = tl.load(rows_ptr + rm.to(tl.int64)[:, None] * B + k0 + tl.arange(0, CW)[None, :],
                                mask=mm[:, None], other=0.0)
                    x_e, x_o = tl.split(tl.reshape(_to_dot(x, DOT_DTYPE, SOFT), (BLOCK_M, CW // 2, 2)))
                    b = tl.load(codes_ptr + g[:, None] * (B // 2) + k0 // 2 + j[None, :], mask=mo[:, None], other=0)
                    a = _block_absmax(absmax_ptr, scales_ptr, offset_ptr, dyn_ptr, (g * B + k0) // BS, mo,
                                      DOUBLE)[:, None]
                    w_hi = _weight(tl.load(lut_ptr + (b >> 4)) * a, W_DTYPE, DOT_DTYPE, SOFT)
                    w_lo = _weight(tl.load(lut_ptr + (b & 15)) * a, W_DTYPE, DOT_DTYPE, SOFT)
                    acc = tl.dot(x_e, tl.trans(w_hi), acc, input_precision=PRECISION)
                    acc = tl.dot(x_o, tl.trans(w_lo), acc, input_precision=PRECISION)
                at = out_ptr + rm.to(tl.int64)[:, None] * A + ro[None, :]
                tl.store(at, _round_to(acc, out_ptr.dtype.element_ty, SOFT), mask=mm[:, None] & mo[None, :])
                m0 += BLOCK_M


def _require_triton(device: torch.device) -> None:
    if not triton_available(device):
        raise RuntimeError(f"the NF4 Triton kernels need triton and a CUDA device (or TRITON_INTERPRET=1), "
                           f"got device {device} with triton {'present' if triton is not None else 'missing'}")


def _tl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def dequantize_blocks_into(codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, blocksize: int = 64) -> None:
    """codes uint8 [>= ceil(n/2)] (bytes past ceil(n/2) are never read), absmax float32 [>= ceil(n/blocksize)]
    (already decoded), out a 1-D contiguous tensor of n = out.numel() values (bf16, fp16 or fp32): out[i] =
    nf4_code[code_i] * absmax[i // blocksize] in float32, rounded once to out.dtype; bit-identical to
    decode_blocks(...)[:n].to(out.dtype). One pass over the codes, no temporaries; no host sync."""
    n = out.numel()
    if blocksize not in NF4_BLOCKSIZES:
        raise ValueError(f"NF4 blocksize {blocksize} is not one of {NF4_BLOCKSIZES}")
    if out.dtype not in _OUT_DTYPES or out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"out must be a 1-D contiguous bf16/fp16/fp32 tensor, got {out.dtype} {tuple(out.shape)}")
    if codes.dtype != torch.uint8 or codes.numel() < (n + 1) // 2 or absmax.dtype != torch.float32 \
            or absmax.numel() < -(-n // blocksize):
        raise ValueError(f"{n} values need >= {(n + 1) // 2} uint8 codes and >= {-(-n // blocksize)} float32 "
                         f"absmax, got {codes.numel()} {codes.dtype} and {absmax.numel()} {absmax.dtype}")
    if not codes.device == absmax.device == out.device:
        raise ValueError(f"codes, absmax and out on different devices: {codes.device}, {absmax.device}, {out.device}")
    _require_triton(out.device)
    if n == 0:
        return
    codes, absmax, lut = codes.contiguous().view(-1), absmax.contiguous().view(-1), _nf4_lut(out.device)
    whole = n // blocksize  # blocks entirely inside out; a short last block goes to a second, one-program launch
    if whole:
        nb = max(1, _DEQUANT_TILE_BYTES // (blocksize // 2))
        _dequant_kernel[(triton.cdiv(whole, nb),)](codes, absmax, lut, out, whole * blocksize, BS=blocksize, NB=nb,
                                                   WHOLE=True, SOFT=_interpreted(), num_warps=8)
    if n % blocksize:
        start = whole * blocksize
        _dequant_kernel[(1,)](codes[start // 2:], absmax[whole:], lut, out[start:], n - start, BS=blocksize, NB=1,
                              WHOLE=False, SOFT=_interpreted(), num_warps=1)


@dataclass(frozen=True)
class NF4Experts:
    """A MoE layer's fused expert tensor of `shape` (E, A, B) left in NF4 on the device."""

    codes: torch.Tensor
    """uint8, the matrix's packed codes (flat row-major, first value of each pair in the high nibble)."""
    absmax: torch.Tensor
    """uint8 absmax codes (double quantization) or float32 absmax, one per block."""
    scales: torch.Tensor | None
    """float32, one per 256 blocks (double quantization) else None."""
    offset: torch.Tensor | None
    """float32 [1] (double quantization) else None."""
    shape: tuple[int, int, int]
    blocksize: int = 64
    dtype: torch.dtype = torch.bfloat16
    """The dtype the matrix stands for: each weight value is rounded to it before its product."""

    @classmethod
    def of(cls, q: NF4Tensor) -> NF4Experts:
        """The NF4Experts of a quantized 3-D tensor (its tensors, not copies: move q to the device first)."""
        if len(q.shape) != 3:
            raise ValueError(f"NF4Experts holds a fused [E, A, B] expert tensor, got shape {q.shape}")
        offset = None if q.absmax_offset is None else q.absmax_offset.reshape(1)
        return cls(q.packed, q.absmax, q.absmax_scales, offset, (q.shape[0], q.shape[1], q.shape[2]), q.blocksize,
                   q.dtype)

    def products(self, rows: torch.Tensor, ends: torch.Tensor, transposed: bool) -> torch.Tensor:
        """out [N, out] in rows.dtype, out[r] = rows[r] @ weight[e] (transposed: weight[e] is [in, out], gpt-oss)
        or rows[r] @ weight[e].T (not: [out, in], Qwen3-MoE) for the expert e owning row r; `rows` [N, in] sorted
        by expert, `ends` int32 [E] their cumulative counts (ends[-1] == N), left on the device (no host sync).
        Accumulated in float32; each weight value is code * absmax in float32 rounded to self.dtype."""
        E, A, B = self.shape
        bs, device = self.blocksize, self.codes.device
        cw = min(_CHUNK, bs)
        if B % cw:
            raise ValueError(f"NF4Experts.products needs the contiguous axis ({B} of shape {self.shape}) to be a "
                             f"multiple of {cw} values (whole NF4 blocks of {bs} per tile row)")
        width_in, width_out = (A, B) if transposed else (B, A)
        if rows.dim() != 2 or rows.shape[1] != width_in or rows.dtype not in _OUT_DTYPES:
            raise ValueError(f"rows must be [N, {width_in}] bf16/fp16/fp32, got {rows.dtype} {tuple(rows.shape)}")
        if ends.shape != (E,) or ends.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"ends must be the int32 [{E}] cumulative row counts, got {ends.dtype} "
                             f"{tuple(ends.shape)}")
        if not rows.device == ends.device == device:
            raise ValueError(f"rows ({rows.device}), ends ({ends.device}) and the codes ({device}) are on "
                             "different devices")
        if self.codes.dtype != torch.uint8 or not self.codes.is_contiguous() or self.codes.numel() < E * A * B // 2:
            raise ValueError(f"codes must be contiguous uint8 of {E * A * B // 2} bytes, got {self.codes.dtype} "
                             f"of {self.codes.numel()}")
        double = self.scales is not None
        if double and (self.absmax.dtype != torch.uint8 or self.offset is None):
            raise ValueError("double quantization needs uint8 absmax codes, scales and an offset")
        if not double and self.absmax.dtype != torch.float32:
            raise ValueError(f"without double quantization absmax must be float32, got {self.absmax.dtype}")
        _require_triton(device)
        n = rows.shape[0]
        out = torch.empty(n, width_out, dtype=rows.dtype, device=device)
        if n == 0:
            return out
        soft = _interpreted()
        # The interpreter's dot is float32 only; on the GPU the dot takes the weights' dtype when the rows have it.
        dot = torch.float32 if soft or rows.dtype != self.dtype else rows.dtype
        # Rows per chunk: one MMA tile (16) in decoding; more when experts get many rows, so that a weight tile
        # is read once per BLOCK_M rows. From the shapes only: the counts stay on the device.
        block_m = min(64, max(16, triton.next_power_of_2(-(-n // E))))
        block_n = 64  # weight rows (output features) per program, not transposed
        tiles = B // cw if transposed else triton.cdiv(A, block_n)
        scales = self.scales if double else self.absmax  # unused pointer when not double quantized
        offset = self.offset if double else self.absmax
        _experts_kernel[(tiles, E)](
            rows.contiguous(), ends.to(torch.int32), self.codes, self.absmax, scales, offset, _nf4_lut(device),
            dynamic_code_on(device), out, A, B, BS=bs, DOUBLE=double, TRANSPOSED=transposed, BLOCK_M=block_m,
            BLOCK_K=64, BLOCK_N=block_n, CW=cw, W_DTYPE=_tl_dtype(self.dtype), DOT_DTYPE=_tl_dtype(dot),
            PRECISION="ieee" if dot == torch.float32 else None, STAGES=_STAGES, SOFT=soft, num_warps=4,
            enable_fp_fusion=False)
        return out

