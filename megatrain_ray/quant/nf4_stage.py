"""One stage's weights in NF4, as one flat uint8 buffer the host store can hold and the weight stream can
copy to the GPU in one piece, where `dequantize_stage` turns it back into the stage's flat compute-dtype
buffer in the StageLayout's order (the buffer the layer templates bind their views to).

The matrices (2-D slots, and a mixture-of-experts layer's fused [E, ...] expert tensors, flattened) are
quantized one by one, each exactly as `quantize_nf4` (so as bitsandbytes) would quantize it alone; the vectors
(norms, biases) stay in the compute dtype, and so do the few matrices `quantized_slot` keeps (a MoE router's
weight, the experts' [E, width] biases). The buffer has six sections, each starting at a multiple of
SECTION_ALIGN bytes:

    codes     uint8    the matrices' packed codes, each matrix padded to whole blocks with the code of 0.0
    absmax    uint8    the block maxima's 8-bit codes (float32 without double quantization)
    scales    float32  one per 256 block maxima of a matrix (double quantization only)
    offsets   float32  one per matrix: its mean block maximum (double quantization only)
    kept      compute  the kept matrices, end to end in layout order (empty for a dense layer)
    vectors   compute  the layout's span [decay_numel, numel): the vectors and their padding

Bytes per matrix of n values at blocksize B, with k = ceil(n / B) blocks:
    k*B/2 + k + 4*ceil(k / 256) + 4      (double quantization)
    k*B/2 + 4*k                          (without)
that is 0.5 + 1/B + 1/(64*B) bytes per value with double quantization: 0.515869 at B = 64 (0.5625 without),
plus the vectors at the compute dtype's size and at most 5 * (SECTION_ALIGN - 1) bytes of alignment.
`nf4_stage_bytes` gives the exact figure for the planner.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from megatrain_ray.dtypes import TORCH_DTYPES
from megatrain_ray.model.layout import StageLayout, TensorSlot
from megatrain_ray.quant.nf4 import (
    ABSMAX_BLOCKSIZE,
    check_blocksize,
    dequantize_dynamic_blockwise,
    dynamic_code_on,
    nf4_byte_table,
    quantize_nf4_pieces,
)

SECTION_ALIGN = 256
"""Each section starts at a multiple of this many bytes: any dtype view of it is aligned on any device."""
# Blocks decoded at a time on the device: bounds the temporaries (an int64 index per byte and a float32
# value per element, about 24 bytes per value) to ~0.4 GB whatever the stage.
_DEQUANTIZE_CHUNK_VALUES = 1 << 24
KEPT_MATRICES = ("mlp.router.weight", "mlp.gate.weight", "linear_attn.conv1d.weight")
"""Kept in the compute dtype: the MoE routers' weights (gpt-oss, Qwen3-MoE / Mixtral), a few thousand values a
layer whose rounding would change which experts a token goes to (bitsandbytes leaves them too: in transformers 5
they are not nn.Linear); the Gated DeltaNet's depthwise convolution kernel (Qwen3.5, Qwen3-Next: an nn.Conv1d,
which bitsandbytes does not quantize either)."""

EXPERT_MATRICES = frozenset({"mlp.experts.gate_up_proj", "mlp.experts.down_proj"})
"""A MoE layer's fused expert tensors: the ones a rollout's decode step may read in NF4 where they lie
(engine/packed_stream.py, quant/nf4_triton.NF4Experts)."""

TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""The compute dtypes quant/nf4_triton's kernels write and multiply in (float64, the exact tests', decodes in torch)."""


def experts_readable_in_nf4(slots: Iterable[TensorSlot], blocksize: int = 64) -> bool:
    """A layer's fused expert tensors can be read in NF4 where they lie (quant/nf4_triton.NF4Experts.products): the
    layer has them, and each expert row is whole tiles of min(64, blocksize) values along its contiguous axis."""
    experts = [s for s in slots if s.name in EXPERT_MATRICES]
    return bool(experts) and all(s.shape[-1] % min(64, blocksize) == 0 for s in experts)


def quantized_slot(slot: TensorSlot) -> bool:
    """Whether a slot is quantized: every matrix of a layer's linear maps and every fused expert tensor; not the
    vectors, a router's weight or an expert tensor's biases ([E, width], `*_bias`)."""
    return len(slot.shape) >= 2 and slot.name not in KEPT_MATRICES and not slot.name.endswith("_bias")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SECTION_ALIGN) * SECTION_ALIGN


@dataclass(frozen=True, slots=True)
class NF4Matrix:
    """Where one quantized matrix lives in the packed stage."""

    slot: TensorSlot
    first_block: int
    """Index of its first block among the stage's blocks (codes at first_block * blocksize / 2 bytes)."""
    num_blocks: int
    first_scale: int
    """Index of its first absmax scale (double quantization)."""
    num_scales: int


@dataclass(frozen=True)
class NF4StageFormat:
    """The packed layout of one stage: a function of the StageLayout's shapes, the compute dtype, the block
    size and double quantization only, so every decoder layer of a model shares one format."""

    stage: StageLayout
    compute_dtype: torch.dtype
    blocksize: int
    double_quant: bool
    matrices: tuple[NF4Matrix, ...]
    sections: tuple[tuple[str, int, int], ...]
    """(name, byte offset, bytes) of codes, absmax, scales, offsets, vectors."""
    nbytes: int

    @classmethod
    def for_stage(cls, stage: StageLayout, compute_dtype: torch.dtype, blocksize: int = 64,
                  double_quant: bool = True) -> NF4StageFormat:
        check_blocksize(blocksize)
        if not compute_dtype.is_floating_point:
            raise ValueError(f"the compute dtype of an NF4 stage must be a float dtype, got {compute_dtype}")
        matrices, blocks, scales = [], 0, 0
        for slot in stage.slots:
            if quantized_slot(slot):
                k = -(-slot.numel // blocksize)
                s = -(-k // ABSMAX_BLOCKSIZE) if double_quant else 0
                matrices.append(NF4Matrix(slot, blocks, k, scales, s))
                blocks, scales = blocks + k, scales + s
        vector_elems = stage.numel - stage.decay_numel
        kept_elems = sum(s.numel for s in stage.slots if s.decay and not quantized_slot(s))
        sizes = [("codes", blocks * blocksize // 2), ("absmax", blocks * (1 if double_quant else 4)),
                 ("scales", 4 * scales), ("offsets", 4 * len(matrices) if double_quant else 0),
                 ("kept", kept_elems * compute_dtype.itemsize), ("vectors", vector_elems * compute_dtype.itemsize)]
        sections, offset = [], 0
        for name, size in sizes:
            sections.append((name, offset, size))
            offset += _aligned(size)
        return cls(stage, compute_dtype, blocksize, double_quant, tuple(matrices), tuple(sections), offset)

    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.matrices)

    @property
    def kept(self) -> tuple[TensorSlot, ...]:
        """The matrices kept in the compute dtype (quantized_slot false), in layout order."""
        return tuple(s for s in self.stage.slots if s.decay and not quantized_slot(s))

    @functools.cached_property
    def padding(self) -> tuple[tuple[int, int], ...]:
        """[start, end) element spans of the matrix span [0, decay_numel) that no slot covers (the alignment
        between slots): the dequantization zeroes them, not the whole span (gigabytes in a MoE layer)."""
        spans, end = [], 0
        for slot in (s for s in self.stage.slots if s.decay):
            if slot.offset > end:
                spans.append((end, slot.offset))
            end = slot.offset + slot.numel
        if self.stage.decay_numel > end:
            spans.append((end, self.stage.decay_numel))
        return tuple(spans)

    @property
    def blocks_in_layout_order(self) -> bool:
        """The stage's blocks, end to end, are the layout's matrix span [0, decay_numel) itself: each matrix
        starts at first_block * blocksize and pads to the next one (true at blocksize 64, as the layout
        aligns slots to 64 elements), so the decoded values go to the output in one piece."""
        return (not self.kept and self.num_blocks * self.blocksize == self.stage.decay_numel
                and all(m.first_block * self.blocksize == m.slot.offset for m in self.matrices))

    def section(self, packed: torch.Tensor, name: str, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A section of a packed buffer, viewed as dtype (no copy)."""
        for section, offset, size in self.sections:
            if section == name:
                return packed[offset:offset + size].view(dtype)
        raise KeyError(name)

    def matrix_parts(self, packed: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                                  torch.Tensor | None]:
        """Matrix i's views in a packed buffer (no copy): its codes (whole blocks), its stored block maxima (uint8
        codes with double quantization, else float32), and with double quantization its absmax scales and its
        offset as a 1-element tensor (else None, None)."""
        m, bs = self.matrices[i], self.blocksize
        blocks = slice(m.first_block, m.first_block + m.num_blocks)
        codes = self.section(packed, "codes")[m.first_block * bs // 2:(m.first_block + m.num_blocks) * bs // 2]
        if not self.double_quant:
            return codes, self.section(packed, "absmax", torch.float32)[blocks], None, None
        return (codes, self.section(packed, "absmax")[blocks],
                self.section(packed, "scales", torch.float32)[m.first_scale:m.first_scale + m.num_scales],
                self.section(packed, "offsets", torch.float32)[i:i + 1])


def nf4_stage_bytes(stage: StageLayout, compute_dtype: torch.dtype | str, blocksize: int = 64,
                    double_quant: bool = True) -> int:
    """Bytes of one stage packed in NF4 (its host segment and its H2D copy), for the planner; the compute
    dtype as a torch dtype or as configs spell it (`bfloat16`)."""
    if isinstance(compute_dtype, str):
        if compute_dtype not in TORCH_DTYPES:
            raise ValueError(f"unknown compute dtype {compute_dtype!r}: use one of {sorted(TORCH_DTYPES)}")
        compute_dtype = TORCH_DTYPES[compute_dtype]
    return NF4StageFormat.for_stage(stage, compute_dtype, blocksize, double_quant).nbytes


def dequantize_workspace_bytes(fmt: NF4StageFormat) -> int:
    """Device bytes of dequantize_stage's temporaries at their peak, for the planner: per chunk of values the
    int64 index of each code byte and the float32 values (8 B per value), and for the whole stage the block
    maxima's decoding (their codes as int64, the gathered scales and offsets, the float32 products, the cached
    block-to-scale index: at most 40 B per block)."""
    return 8 * min(_DEQUANTIZE_CHUNK_VALUES, fmt.num_blocks * fmt.blocksize) + 40 * fmt.num_blocks


def pack_stage(fmt: NF4StageFormat, weights: Mapping[str, torch.Tensor] | torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize a stage's weights into its packed buffer (`out`, a uint8 tensor of fmt.nbytes, e.g. a view of
    a host segment, or a new one). `weights` is either the stage's tensors by slot name (Hugging Face names
    less the stage prefix) or its flat buffer in the StageLayout's order; matrices are quantized from the
    values as given (quantize from bf16 to reproduce QLoRA on a bf16 checkpoint)."""
    tensors = _stage_tensors(fmt.stage, weights)
    return pack_stage_pieces(fmt, lambda slot: [tensors[slot.name].reshape(-1)], out)


def pack_stage_pieces(fmt: NF4StageFormat, pieces: Callable[[TensorSlot], Iterable[torch.Tensor]],
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """pack_stage from each slot's flat values given as consecutive pieces (`pieces(slot)`, each but the last of
    whole 64-value blocks: quant/nf4.quantize_nf4_pieces), so that no slot need exist whole in a temporary; the
    same bytes as pack_stage of the whole tensors."""
    stage = fmt.stage
    if out is None:
        out = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != fmt.nbytes:
        raise ValueError(f"the packed buffer of stage {stage.name} must be 1-D uint8 of {fmt.nbytes} bytes, "
                         f"got {out.dtype} of shape {tuple(out.shape)}")
    else:
        out.zero_()  # the gaps between sections too: the bytes are a function of the weights alone
    codes, half_block = fmt.section(out, "codes"), fmt.blocksize // 2
    for i, m in enumerate(fmt.matrices):
        span = codes[m.first_block * half_block:(m.first_block + m.num_blocks) * half_block]
        length = (m.slot.numel + 1) // 2
        q = quantize_nf4_pieces(pieces(m.slot), m.slot.shape, fmt.compute_dtype, fmt.blocksize, fmt.double_quant,
                                packed=span[:length])
        span[length:] = 0x77  # two codes of 0.0 per byte: the padding decodes to exact zeros
        if fmt.double_quant:
            assert q.absmax_scales is not None and q.absmax_offset is not None
            fmt.section(out, "absmax")[m.first_block:m.first_block + m.num_blocks] = q.absmax
            fmt.section(out, "scales", torch.float32)[m.first_scale:m.first_scale + m.num_scales] = q.absmax_scales
            fmt.section(out, "offsets", torch.float32)[i] = q.absmax_offset
        else:
            fmt.section(out, "absmax", torch.float32)[m.first_block:m.first_block + m.num_blocks] = q.absmax
    kept, start = fmt.section(out, "kept", fmt.compute_dtype), 0
    for slot in fmt.kept:
        kept[start:start + slot.numel] = _whole(pieces(slot), slot).to(fmt.compute_dtype)
        start += slot.numel
    vectors = fmt.section(out, "vectors", fmt.compute_dtype)
    for slot in stage.slots:
        if not slot.decay:
            start = slot.offset - stage.decay_numel
            vectors[start:start + slot.numel] = _whole(pieces(slot), slot).to(fmt.compute_dtype)
    return out


def _whole(pieces: Iterable[torch.Tensor], slot: TensorSlot) -> torch.Tensor:
    """An unquantized slot's values from its pieces (small tensors: vectors, routers, biases)."""
    values = torch.cat([p.reshape(-1) for p in pieces])
    if values.numel() != slot.numel:
        raise ValueError(f"{slot.name}: {values.numel()} values for a tensor of shape {slot.shape}")
    return values


def decode_blocks(codes: torch.Tensor, absmax: torch.Tensor, pairs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks' values: `codes` [blocks * B / 2] uint8, `absmax` [blocks] float32, `pairs` the byte table
    (quant/nf4.nf4_byte_table) -> [blocks * B] values in `dtype`, each code * absmax in float32 rounded once.
    Eagerly a table lookup by indexing and a broadcast multiply (float32 out, rounded by the caller's copy);
    through torch.compile one pass that reads the codes and writes the values (engine/packed_stream.py)."""
    values = pairs[codes.long()].view(absmax.numel(), -1)
    return values.mul_(absmax.view(-1, 1)).view(-1).to(dtype)


def dequantize_stage(packed: torch.Tensor, fmt: NF4StageFormat, out: torch.Tensor | None = None,
                     decode: Callable[..., torch.Tensor] | None = None,
                     decode_into: Callable[..., None] | None = None,
                     skip: frozenset[str] = frozenset()) -> torch.Tensor:
    """The stage's flat compute-dtype buffer (StageLayout order, padding zero) from its packed buffer, on
    the packed buffer's device, written into `out` if given (e.g. the GPU weight buffer the stage streams
    into). Per chunk of blocks `decode` (decode_blocks, or a compiled version of it, which then returns the
    compute dtype); or, given `decode_into(codes, absmax, out, blocksize)` (quant/nf4_triton.dequantize_blocks_into:
    one kernel writing the output in place, no temporaries), each run of blocks at once. Each value is code * absmax
    in float32 rounded once to the compute dtype, as bitsandbytes' dequantize_4bit. The matrices named in `skip` are
    not decoded (their span of `out` is left as it was: a rollout's decode step reads its experts in NF4)."""
    stage, bs, device = fmt.stage, fmt.blocksize, packed.device
    if packed.dtype != torch.uint8 or packed.numel() != fmt.nbytes:
        raise ValueError(f"the packed buffer of stage {stage.name} must be uint8 of {fmt.nbytes} bytes, "
                         f"got {packed.dtype} of {packed.numel()} elements")
    if out is None:
        out = torch.empty(stage.numel, dtype=fmt.compute_dtype, device=device)
    elif out.dtype != fmt.compute_dtype or out.numel() != stage.numel or out.device != device:
        raise ValueError(f"the output of stage {stage.name} must hold {stage.numel} {fmt.compute_dtype} on "
                         f"{device}, got {out.numel()} {out.dtype} on {out.device}")
    flat = out.view(-1)
    codes = fmt.section(packed, "codes")
    # Runs of blocks: (their codes, their float32 block maxima, the output offset, the values). With `skip` each kept
    # matrix decodes its own block maxima (a MoE layer's skipped experts hold nearly all of the stage's blocks).
    if fmt.blocks_in_layout_order and not skip:  # one run: all blocks straight into [0, decay_numel)
        runs = [(codes[:fmt.num_blocks * bs // 2], _stage_absmax(packed, fmt), 0, stage.decay_numel)]
    else:
        for start, end in fmt.padding:  # the alignment between slots
            flat[start:end].zero_()
        stage_absmax = _stage_absmax(packed, fmt) if not skip else None
        runs = [(fmt.matrix_parts(packed, i)[0],
                 _matrix_absmax(packed, fmt, i) if skip else stage_absmax[m.first_block:m.first_block + m.num_blocks],
                 m.slot.offset, m.slot.numel)
                for i, m in enumerate(fmt.matrices) if m.slot.name not in skip]
    if decode_into is not None:
        for run_codes, run_absmax, out_offset, numel in runs:
            decode_into(run_codes, run_absmax, flat[out_offset:out_offset + numel], bs)
        runs = []
    pairs = nf4_byte_table(device)
    chunk_blocks = max(1, _DEQUANTIZE_CHUNK_VALUES // bs)
    decode, dtype = (decode_blocks, torch.float32) if decode is None else (decode, fmt.compute_dtype)
    for run_codes, run_absmax, out_offset, numel in runs:
        for b0 in range(0, run_absmax.numel(), chunk_blocks):
            b1 = min(b0 + chunk_blocks, run_absmax.numel())
            values = decode(run_codes[b0 * bs // 2:b1 * bs // 2], run_absmax[b0:b1], pairs, dtype)
            take = min(numel, b1 * bs) - b0 * bs
            flat[out_offset + b0 * bs:out_offset + b0 * bs + take].copy_(values[:take])
    kept, start = fmt.section(packed, "kept", fmt.compute_dtype), 0
    for slot in fmt.kept:
        flat[slot.offset:slot.offset + slot.numel].copy_(kept[start:start + slot.numel])
        start += slot.numel
    flat[stage.decay_numel:].copy_(fmt.section(packed, "vectors", fmt.compute_dtype))
    return out


def _stage_absmax(packed: torch.Tensor, fmt: NF4StageFormat) -> torch.Tensor:
    """float32 block maxima of all the stage's blocks, decoded for all matrices at once: code * scale, then
    plus the matrix's offset (two roundings, as bitsandbytes adds the offset after decoding)."""
    if not fmt.double_quant:
        return fmt.section(packed, "absmax", torch.float32)
    codes = fmt.section(packed, "absmax")
    scales = fmt.section(packed, "scales", torch.float32)
    offset_of_scale = fmt.section(packed, "offsets", torch.float32)[_matrix_of_scale(fmt, packed.device)]
    if all(m.num_blocks % ABSMAX_BLOCKSIZE == 0 for m in fmt.matrices):  # every scale covers 256 blocks
        decoded = dequantize_dynamic_blockwise(codes, scales, ABSMAX_BLOCKSIZE).view(-1, ABSMAX_BLOCKSIZE)
        return (decoded + offset_of_scale.view(-1, 1)).view(-1)
    scale_of_block = _scale_of_block(fmt, packed.device)
    decoded = dynamic_code_on(packed.device)[codes.long()] * scales[scale_of_block]
    return decoded + offset_of_scale[scale_of_block]


def _matrix_absmax(packed: torch.Tensor, fmt: NF4StageFormat, i: int) -> torch.Tensor:
    """_stage_absmax's values for matrix i's blocks alone, decoded from its own codes, scales and offset in the same
    two roundings (a view of the section without double quantization)."""
    _, stored, scales, offset = fmt.matrix_parts(packed, i)
    if scales is None or offset is None:  # no double quantization: stored as float32
        return stored
    return dequantize_dynamic_blockwise(stored, scales, ABSMAX_BLOCKSIZE) + offset


@functools.lru_cache(maxsize=16)
def _matrix_of_scale(fmt: NF4StageFormat, device: torch.device) -> torch.Tensor:
    """For each absmax scale of the stage, the index of its matrix (static per format, built once per device)."""
    counts = torch.tensor([m.num_scales for m in fmt.matrices], dtype=torch.long)
    return torch.repeat_interleave(torch.arange(len(fmt.matrices)), counts).to(device)


@functools.lru_cache(maxsize=16)
def _scale_of_block(fmt: NF4StageFormat, device: torch.device) -> torch.Tensor:
    """For each block of the stage, the index of its absmax scale (a matrix's last scale may cover fewer
    than 256 blocks)."""
    per_scale = [min(ABSMAX_BLOCKSIZE, m.num_blocks - j * ABSMAX_BLOCKSIZE)
                 for m in fmt.matrices for j in range(m.num_scales)]
    counts = torch.tensor(per_scale, dtype=torch.long)
    return torch.repeat_interleave(torch.arange(len(per_scale)), counts).to(device)


def _stage_tensors(stage: StageLayout, weights: Mapping[str, torch.Tensor] | torch.Tensor) -> dict[str, torch.Tensor]:
    """The stage's tensors by slot name, checked against the layout."""
    if isinstance(weights, torch.Tensor):
        if weights.dim() != 1 or weights.numel() != stage.numel:
            raise ValueError(f"the flat buffer of stage {stage.name} must be 1-D with {stage.numel} elements, "
                             f"got shape {tuple(weights.shape)}")
        return {s.name: weights[s.offset:s.offset + s.numel].view(s.shape) for s in stage.slots}
    names = {s.name for s in stage.slots}
    if set(weights) != names:
        raise ValueError(f"stage {stage.name}: tensors {sorted(set(weights) - names)} are not in its layout and "
                         f"{sorted(names - set(weights))} are missing")
    for s in stage.slots:
        if tuple(weights[s.name].shape) != s.shape:
            raise ValueError(f"stage {stage.name}: {s.name} has shape {tuple(weights[s.name].shape)}, "
                             f"the layout says {s.shape}")
    return dict(weights)

