"""NF4 with double quantization against bitsandbytes (CPU), the QLoRA paper's code values and the round-trip
error bound; the packed stage format against dequantizing tensor by tensor, and its byte formula.

Equality with bitsandbytes is exact (torch.equal, bit for bit) everywhere: both compute the same float32
operations in the same order. One exception of bitsandbytes' own, worked around in `bnb_dequantize`: its
AVX-512 CPU kernel (0.50.2) indexes a block's absmax per row, wrong when a block crosses rows (last dim a
multiple of 16 but not of the block size); there the reference is bitsandbytes' own torch implementation
of the same operation (backends/default/ops.py), which the other shapes show agrees with its C kernel.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.model.layout import build_layout
from megatrain_ray.quant.nf4 import (
    ABSMAX_BLOCKSIZE,
    dequantize_nf4,
    dynamic_code,
    nf4_absmax,
    nf4_code,
    nf4_nbytes,
    quantize_nf4,
)
from megatrain_ray.quant.nf4_stage import NF4StageFormat, decode_blocks, dequantize_stage, nf4_stage_bytes, pack_stage

try:  # bitsandbytes runs on the CPU from 0.44 on; a build that cannot skips the equality tests, saying why
    import bitsandbytes.functional as bnb_f
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    bnb_f.quantize_4bit(torch.ones(64), quant_type="nf4")
    BNB_ERROR = ""
except Exception as e:  # noqa: BLE001 - any failure to import or run means no reference
    BNB_ERROR = f"bitsandbytes cannot run on this CPU: {type(e).__name__}: {e}"
needs_bnb = pytest.mark.skipif(bool(BNB_ERROR), reason=BNB_ERROR or "")

# QLoRA (arXiv:2305.14314), Appendix E: the NF4 values as printed.
QLORA_PAPER_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                   -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                   0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                   0.7229568362236023, 1.0]

# Odd shapes: sizes not a multiple of the block, odd element counts, 1-D, 3-D, rows shorter than a block,
# last dims that are multiples of 16 but not of the block (rows crossing blocks).
SHAPES = [(7, 33), (131,), (5, 3, 29), (3, 48), (10, 96), (1, 1), (64, 64), (200, 77), (65,), (9, 640)]


def random_tensor(shape, dtype, seed: int) -> torch.Tensor:
    """Weights-like values (normal, std 0.02) with one block of zeros and one of tiny values when there is room."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 0.02
    flat = x.view(-1)
    if flat.numel() >= 256:
        flat[64:128] = 0.0
        flat[128:192] *= 1e-4
    return x.to(dtype)


def on_code_boundaries(numel: int, blocksize: int, dtype, seed: int) -> torch.Tensor:
    """Values at the midpoints between NF4 codes times their block's absmax, and one float32 step either
    side: where the tie rule and how the scaling rounds (multiplying by the reciprocal, or dividing in the
    short last block) decide the code. Random weights almost never land there."""
    g = torch.Generator().manual_seed(seed)
    code = nf4_code()
    midpoints = (code[:-1] + code[1:]) / 2
    blocks = -(-numel // blocksize)
    absmax = torch.rand(blocks, 1, generator=g) * 0.1 + 0.01
    x = midpoints[torch.randint(0, 15, (blocks, blocksize), generator=g)] * absmax
    step = torch.randint(-1, 2, x.shape, generator=g).float()
    x = torch.where(step != 0, torch.nextafter(x, step * torch.inf), x)
    x[:, 0] = absmax[:, 0]
    x = x.view(-1)[:numel]
    x[-1] = x[-(numel % blocksize or blocksize)]  # the short last block keeps its absmax element
    return x.to(dtype)


def bnb_dequantize(packed: torch.Tensor, state, shape, blocksize: int, dtype) -> torch.Tensor:
    if shape[-1] % 16 == 0 and shape[-1] % blocksize:  # see the module docstring
        absmax = state.absmax
        if state.nested:
            absmax = bnb_f.dequantize_blockwise(state.absmax, state.state2) + state.offset
        code = bnb_f.get_4bit_type("nf4", device="cpu")
        # __wrapped__: the eager function, not bitsandbytes' torch.compile wrapper (minutes on 2 cores)
        return _dequantize_4bit_compute.__wrapped__(packed.view(-1), absmax, code, blocksize, shape, dtype)
    return bnb_f.dequantize_4bit(packed, state).reshape(shape)  # 1-D comes back as (1, n)


def test_code_table_is_qloras_and_bitsandbytes():
    """Derived from normal quantiles, the table equals the paper's printed values (to float32) exactly."""
    assert torch.equal(nf4_code(), torch.tensor(QLORA_PAPER_NF4, dtype=torch.float32))
    assert nf4_code()[7] == 0 and nf4_code()[0] == -1 and nf4_code()[-1] == 1


@needs_bnb
def test_code_tables_equal_bitsandbytes():
    assert torch.equal(nf4_code(), bnb_f.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(dynamic_code(), bnb_f.create_dynamic_map())


@needs_bnb
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("double_quant", [True, False])
def test_quantize_and_dequantize_equal_bitsandbytes(dtype, double_quant):
    """Packed bytes, (quantized) absmax, absmax scales, offset and the dequantized tensor, bit for bit."""
    cases = [(shape, (64, 32, 128, 256, 4096)[i % 5], random_tensor(shape, dtype, seed=i))
             for i, shape in enumerate(SHAPES)]
    cases += [((3177,), blocksize, on_code_boundaries(3177, blocksize, dtype, seed=blocksize))
              for blocksize in (64, 32)]
    for shape, blocksize, x in cases:
        ref_packed, state = bnb_f.quantize_4bit(x, blocksize=blocksize, compress_statistics=double_quant,
                                                quant_type="nf4")
        q = quantize_nf4(x, blocksize=blocksize, double_quant=double_quant)
        where = f"shape {shape}, blocksize {blocksize}"
        assert torch.equal(q.packed, ref_packed.view(-1)), where
        assert torch.equal(q.absmax, state.absmax), where
        if double_quant:
            assert torch.equal(q.absmax_scales, state.state2.absmax), where
            assert torch.equal(q.absmax_offset, state.offset), where
        got = dequantize_nf4(q)
        assert got.dtype == dtype and got.shape == x.shape
        assert torch.equal(got, bnb_dequantize(ref_packed, state, shape, blocksize, dtype)), where
        assert q.nbytes == nf4_nbytes(x.numel(), blocksize, double_quant)


@needs_bnb
def test_double_quant_of_a_constant_tensor_equals_bitsandbytes():
    """All block maxima equal: the absmax minus its mean is all zero, the 8-bit block's own absmax 0."""
    x = torch.full((4, 96), 0.5)
    ref_packed, state = bnb_f.quantize_4bit(x, blocksize=64, compress_statistics=True, quant_type="nf4")
    q = quantize_nf4(x)
    assert torch.equal(q.absmax, state.absmax) and torch.equal(q.absmax_scales, state.state2.absmax)
    assert torch.equal(dequantize_nf4(q), bnb_dequantize(ref_packed, state, x.shape, 64, x.dtype))


@pytest.mark.parametrize("double_quant", [False, True])
def test_round_trip_error_bound(double_quant):
    """Every element: |x - deq(q(x))| <= absmax * (largest gap between adjacent codes) / 2, absmax being the
    block's; with double quantization the decoded absmax a' replaces a, which adds |a - a'| (code <= 1 in
    size), itself bounded by its 256-block's scale times the dynamic code's largest half gap. Slack 1e-6
    relative: float32 rounding of the scaling and of the product."""
    x = random_tensor((37, 211), torch.float32, seed=5) * torch.linspace(0.1, 10, 211)  # blocks of many scales
    q = quantize_nf4(x, blocksize=64, double_quant=double_quant)
    error = (x - dequantize_nf4(q)).view(-1)
    blocks = torch.nn.functional.pad(x.view(-1), (0, -x.numel() % 64)).view(-1, 64)
    absmax = blocks.abs().amax(dim=1)
    half_gap = nf4_code().diff().max() / 2
    assert math.isclose(half_gap.item(), (1 - 0.6961928009986877) / 2, rel_tol=1e-6)  # between -1 and the next
    bound = absmax * half_gap * (1 + 1e-6)
    if double_quant:
        decoded = nf4_absmax(q)
        dynamic_half_gap = dynamic_code().diff().max() / 2
        scales = q.absmax_scales.repeat_interleave(ABSMAX_BLOCKSIZE)[:absmax.numel()]
        assert ((absmax - decoded).abs() <= scales * dynamic_half_gap * (1 + 1e-6) + 1e-12).all()
        bound = bound + (absmax - decoded).abs() * (1 + 1e-6)
    per_element = bound.repeat_interleave(64)[:x.numel()]
    assert (error.abs() <= per_element).all()
    ratio = error.abs() / per_element.clamp(min=1e-30)  # the zero block: 0 / bound 0
    assert ratio.max() > 0.9  # and the bound is tight: some error comes close to it


_COMPILED_DECODE = torch.compile(decode_blocks, dynamic=True)


def llama_config(**kw) -> ModelConfig:
    shape = dict(vocab_size=97, hidden_size=80, intermediate_size=200, num_layers=1, num_attention_heads=4,
                 num_key_value_heads=2)
    return ModelConfig(**{**shape, **kw})


@pytest.mark.parametrize("blocksize,double_quant", [(64, True), (64, False), (32, True), (256, True)])
def test_stage_packing_equals_tensor_by_tensor(blocksize, double_quant):
    """Every stage of a tiny Llama (odd sizes, q/k/v biases) packs into one buffer and unpacks into the
    layout's flat buffer, equal to quantizing and dequantizing each matrix alone (and casting the vectors),
    padding zero; from the flat buffer and from the dict of tensors alike. Blocksizes 32 and 256 take the
    path where blocks and layout offsets differ; a tied head has no matrix at all."""
    untied = build_layout(llama_config(attention_bias=True))
    tied_head = build_layout(llama_config(tie_word_embeddings=True)).head  # vectors only: nothing to quantize
    for stage in (*untied.stages, tied_head):
        fmt = NF4StageFormat.for_stage(stage, torch.bfloat16, blocksize, double_quant)
        flat = random_tensor((stage.numel,), torch.float32, seed=stage.index)
        for s in stage.slots:  # norms near 1, as trained ones are
            if len(s.shape) < 2:
                flat[s.offset:s.offset + s.numel] += 1.0
        expected = torch.zeros(stage.numel, dtype=torch.bfloat16)
        tensors = {}
        for s in stage.slots:
            t = flat[s.offset:s.offset + s.numel].view(s.shape).clone()
            tensors[s.name] = t
            if len(s.shape) >= 2:
                t = dequantize_nf4(quantize_nf4(t, blocksize, double_quant), torch.bfloat16)
            expected[s.offset:s.offset + s.numel] = t.reshape(-1).to(torch.bfloat16)
        for source in (flat, tensors):
            packed = pack_stage(fmt, source)
            assert packed.dtype == torch.uint8 and packed.numel() == nf4_stage_bytes(
                stage, torch.bfloat16, blocksize, double_quant)
            assert torch.equal(dequantize_stage(packed, fmt), expected), stage.name
        segment = torch.full((fmt.nbytes,), 0xAB, dtype=torch.uint8)  # e.g. a reused host segment
        assert pack_stage(fmt, flat, out=segment) is segment and torch.equal(segment, packed)
        into = torch.full((stage.numel,), float("nan"), dtype=torch.bfloat16)
        assert dequantize_stage(packed, fmt, out=into) is into and torch.equal(into, expected)
        # The block decoding through torch.compile (engine.compile; one graph for every chunk's shape): the same bits
        assert torch.equal(dequantize_stage(packed, fmt, decode=_COMPILED_DECODE), expected), stage.name


@needs_bnb
def test_stage_of_a_transformers_llama_layer_equals_bitsandbytes():
    """A Hugging Face LlamaForCausalLM layer's tensors (bf16, QLoRA's input), packed as a stage: each matrix
    comes back as bitsandbytes' dequantize_4bit(quantize_4bit(W, compress_statistics=True)), the norms as
    they were."""
    transformers = pytest.importorskip("transformers")
    cfg = llama_config(hidden_size=128, intermediate_size=320)
    hf = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                  intermediate_size=cfg.intermediate_size, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf).to(torch.bfloat16)
    stage = build_layout(cfg).layers[0]
    tensors = {k.removeprefix(stage.prefix): v for k, v in model.state_dict().items() if k.startswith(stage.prefix)}
    fmt = NF4StageFormat.for_stage(stage, torch.bfloat16)
    assert fmt.blocks_in_layout_order
    flat = dequantize_stage(pack_stage(fmt, tensors), fmt)
    for s in stage.slots:
        got = flat[s.offset:s.offset + s.numel].view(s.shape)
        w = tensors[s.name]
        if len(s.shape) >= 2:
            packed, state = bnb_f.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
            w = bnb_dequantize(packed, state, w.shape, 64, w.dtype)
        assert torch.equal(got, w), s.name


def test_stage_bytes_formula():
    """The sections hold exactly k*B/2 + k + 4*ceil(k/256) + 4 bytes per matrix of k blocks (k*B/2 + 4*k
    without double quantization) and the vectors at the compute dtype's size; alignment adds < 256 per
    section. A Llama-3.1-70B decoder layer comes to 0.5159 bytes per parameter, the 80 layers plus a bf16
    embedding and LM head to about 40 GB (issue 30's estimate)."""
    for blocksize, double_quant in [(64, True), (64, False), (32, True), (256, False)]:
        stage = build_layout(llama_config(attention_bias=True)).layers[0]
        fmt = NF4StageFormat.for_stage(stage, torch.bfloat16, blocksize, double_quant)
        matrix_bytes = 0
        for s in stage.slots:
            if len(s.shape) >= 2:
                k = -(-s.numel // blocksize)
                matrix_bytes += k * blocksize // 2 + (k + 4 * -(-k // 256) + 4 if double_quant else 4 * k)
        vector_bytes = 2 * (stage.numel - stage.decay_numel)
        assert sum(size for _, _, size in fmt.sections) == matrix_bytes + vector_bytes
        assert 0 <= fmt.nbytes - matrix_bytes - vector_bytes < 5 * 256
        assert fmt.nbytes == pack_stage(fmt, torch.zeros(stage.numel)).numel()
        assert fmt.nbytes == nf4_stage_bytes(stage, "bfloat16", blocksize, double_quant)
    llama70b = ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                           num_attention_heads=64, num_key_value_heads=8)
    layout = build_layout(llama70b)
    layer = layout.layers[0]
    per_param = nf4_stage_bytes(layer, torch.bfloat16) / sum(s.numel for s in layer.slots)
    assert abs(per_param - (0.5 + 1 / 64 + 4 / (256 * 64))) < 1e-4  # 0.515869; norms add 3e-5
    total = sum(nf4_stage_bytes(s, torch.bfloat16) for s in layout.layers) + 2 * 2 * 128256 * 8192
    assert 38e9 < total < 41e9, total


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="blocksize 48"):
        quantize_nf4(torch.randn(100), blocksize=48)
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_nf4(torch.tensor([1.0, float("nan")]))
    stage = build_layout(llama_config()).layers[0]
    fmt = NF4StageFormat.for_stage(stage, torch.bfloat16)
    with pytest.raises(ValueError, match="missing"):
        pack_stage(fmt, {"self_attn.q_proj.weight": torch.zeros(80, 80)})
    with pytest.raises(ValueError, match=f"{stage.numel} elements"):
        pack_stage(fmt, torch.zeros(stage.numel + 1))
    with pytest.raises(ValueError, match=f"{fmt.nbytes} bytes"):
        dequantize_stage(torch.zeros(fmt.nbytes - 1, dtype=torch.uint8), fmt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dequantize_stage_on_cuda_equals_cpu():
    for blocksize in (64, 256):
        stage = build_layout(llama_config()).layers[0]
        fmt = NF4StageFormat.for_stage(stage, torch.bfloat16, blocksize)
        packed = pack_stage(fmt, random_tensor((stage.numel,), torch.float32, seed=1))
        assert torch.equal(dequantize_stage(packed.cuda(), fmt).cpu(), dequantize_stage(packed, fmt))
        assert torch.equal(dequantize_stage(packed.cuda(), fmt, decode=_COMPILED_DECODE).cpu(),
                           dequantize_stage(packed, fmt))
