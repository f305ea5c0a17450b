"""The NF4 base of mixture-of-experts layers and the start-up path that packs it (quant/nf4.py, quant/nf4_stage.py,
store/nf4_base.py): references are torch.bucketize (the nearest-code search the table lookup replaces),
quantize_nf4 / dequantize_nf4 of each whole tensor (bitsandbytes-exact, tests/unit/test_nf4.py) and
initial_values.init_master (the random initialisation the pieces must reproduce)."""

from __future__ import annotations

import pytest
import torch

from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.model.layout import build_layout
from megatrain_ray.quant import nf4 as nf4_module
from megatrain_ray.quant.nf4 import (
    _midpoints,
    _nf4_codes,
    dequantize_nf4,
    nf4_byte_table,
    quantize_nf4,
    quantize_nf4_pieces,
)
from megatrain_ray.quant.nf4_stage import (
    NF4StageFormat,
    decode_blocks,
    dequantize_stage,
    pack_stage,
    pack_stage_pieces,
    quantized_slot,
)
from megatrain_ray.store import initial_values
from megatrain_ray.store.initial_values import init_master, init_slot_pieces


def gpt_oss_layer(**kw):
    cfg = ModelConfig(family="gpt_oss", vocab_size=97, hidden_size=72, intermediate_size=40, num_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=20, attention_bias=True, num_experts=5,
                      num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention"], swiglu_limit=7.0,
                      swiglu_alpha=1.702, **kw)
    return build_layout(cfg).layers[0]


def test_table_lookup_codes_equal_bucketize_at_every_boundary():
    """Every midpoint and every grid-cell edge, one float32 ulp either side, the ends, zero and random values: the
    same code as torch.bucketize over the midpoints (ties to the lower code)."""
    mid = _midpoints(torch.device("cpu"))
    edges = torch.arange(nf4_module._CODE_CELLS + 1, dtype=torch.float32) / (nf4_module._CODE_CELLS // 2) - 1
    around = torch.cat([mid, edges])
    values = torch.cat([around, torch.nextafter(around, torch.tensor(2.0)), torch.nextafter(around, torch.tensor(-2.0)),
                        torch.tensor([-1.0, 1.0, 0.0, -0.0]), torch.rand(1 << 20, generator=torch.Generator().manual_seed(0))
                        * 2 - 1, torch.linspace(-1, 1, 1_000_003)]).clamp(-1, 1)
    assert torch.equal(_nf4_codes(values), torch.bucketize(values, mid, out_int32=True).to(torch.uint8))


def test_quantizing_in_pieces_equals_the_whole_tensor():
    """Pieces of 192, 64 and the rest (an odd count with a short last block): the same codes and block maxima."""
    x = torch.randn(1000 * 3 + 17, generator=torch.Generator().manual_seed(1)) * 0.02
    whole = quantize_nf4(x.view(1, -1))
    parts = quantize_nf4_pieces([x[:192], x[192:256], x[256:]], (1, x.numel()), x.dtype)
    for name in ("packed", "absmax", "absmax_scales", "absmax_offset"):
        assert torch.equal(getattr(parts, name), getattr(whole, name)), name
    with pytest.raises(ValueError, match="breaks a block"):
        quantize_nf4_pieces([x[:100], x[100:]], (x.numel(),), x.dtype)


def test_a_moe_layer_quantizes_experts_and_attention_and_keeps_router_biases_and_vectors():
    """gpt-oss (router with bias, expert biases, sinks): the attention matrices and both fused expert tensors come
    back as dequantize(quantize(W)) of the whole tensor; the router's weight, the experts' [E, width] biases and the
    vectors exactly in the compute dtype; also for a Qwen3-MoE-style router (mlp.gate.weight)."""
    stage = gpt_oss_layer()
    assert {s.name for s in stage.slots if quantized_slot(s)} == {
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    fmt = NF4StageFormat.for_stage(stage, torch.float32)
    assert not fmt.blocks_in_layout_order and {s.name for s in fmt.kept} == {
        "mlp.router.weight", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"}
    flat = torch.randn(stage.numel, generator=torch.Generator().manual_seed(2)) * 0.02
    for s in stage.slots:  # the layout's padding is zero, as in a real buffer
        end = s.offset + s.numel
        following = [t.offset for t in stage.slots if t.offset >= end]
        flat[end:min(following, default=stage.numel)] = 0
    out = dequantize_stage(pack_stage(fmt, flat), fmt, out=torch.full((stage.numel,), float("nan")))
    for s in stage.slots:
        w = flat[s.offset:s.offset + s.numel].view(s.shape)
        expected = dequantize_nf4(quantize_nf4(w), torch.float32) if quantized_slot(s) else w
        assert torch.equal(out[s.offset:s.offset + s.numel].view(s.shape), expected), s.name
    assert not out.isnan().any()  # the padding between slots is written (zero), not left as it was
    assert torch.equal(out[stage.decay_numel:], flat[stage.decay_numel:])


@pytest.mark.parametrize("double_quant", [True, False])
def test_a_decode_step_skips_the_experts_and_an_in_place_decoder_writes_the_same_values(double_quant):
    """dequantize_stage with skip={the fused experts} (a rollout's decode step, engine/packed_stream.py): every other
    matrix, the kept ones and the vectors as the full dequantization gives them, the experts' spans untouched. With
    `decode_into` (the Triton kernel's place; here the torch block decoding written in place) the same bytes as the
    chunked decoding, for every matrix's run (gpt-oss's are not in layout order)."""
    stage = gpt_oss_layer()
    fmt = NF4StageFormat.for_stage(stage, torch.bfloat16, double_quant=double_quant)
    flat = torch.randn(stage.numel, generator=torch.Generator().manual_seed(3)) * 0.02
    packed = pack_stage(fmt, flat)
    full = dequantize_stage(packed, fmt)
    calls = []

    def decode_into(codes, absmax, out, blocksize):
        calls.append(out.numel())
        out.copy_(decode_blocks(codes, absmax, nf4_byte_table(codes.device), torch.float32)[:out.numel()])

    assert torch.equal(dequantize_stage(packed, fmt, decode_into=decode_into), full)
    assert sorted(calls) == sorted(m.slot.numel for m in fmt.matrices)
    experts = frozenset({"mlp.experts.gate_up_proj", "mlp.experts.down_proj"})
    sentinel = torch.full((stage.numel,), 3.0, dtype=torch.bfloat16)
    partial = dequantize_stage(packed, fmt, out=sentinel.clone(), skip=experts)
    for s in stage.slots:
        got, want = partial[s.offset:s.offset + s.numel], full[s.offset:s.offset + s.numel]
        assert torch.equal(got, torch.full_like(want, 3.0) if s.name in experts else want), s.name


def test_random_init_in_pieces_is_init_master_and_packs_to_the_same_bytes(monkeypatch):
    """init_slot_pieces with pieces of 4096 values (so the expert tensors come in several, the last longer): the
    values init_master writes, and pack_stage_pieces of them the bytes pack_stage gives for the whole stage."""
    monkeypatch.setattr(initial_values, "INIT_PIECE", 4096)
    stage = gpt_oss_layer()
    dense = torch.empty(stage.numel, dtype=torch.bfloat16)
    init_master(dense, stage, seed=7, std=0.02)
    pieces = {s.name: list(init_slot_pieces(stage, s, 7, 0.02, torch.bfloat16)) for s in stage.slots}
    assert len(pieces["mlp.experts.gate_up_proj"]) > 3
    for s in stage.slots:
        assert torch.equal(torch.cat(pieces[s.name]), dense[s.offset:s.offset + s.numel]), s.name
    fmt = NF4StageFormat.for_stage(stage, torch.bfloat16)
    assert torch.equal(pack_stage_pieces(fmt, lambda s: init_slot_pieces(stage, s, 7, 0.02, torch.bfloat16)),
                       pack_stage(fmt, dense))


def test_checkpoint_filling_threads_are_capped_by_free_ram():
    """gpt-oss-120b from a checkpoint: 14.9 GB of temporaries a thread (its gate_up_proj, 2.1 G values at up to 4 + 2
    + 1 bytes); with 60 GB free (a 128 GB box after the 58 GB store) 3 threads (0.75 of it), not 16; random init (no
    per-thread bytes) takes every core; each runs torch single-threaded."""
    import os

    from megatrain_ray.config.load import load_config
    from megatrain_ray.config.resolved import RunSpec
    from megatrain_ray.store.nf4_base import checkpoint_fill_bytes, fill_threads
    from tests.conftest import REPO

    cfg = load_config(os.path.join(REPO, "configs", "shapes", "gpt-oss-120b-qlora.yaml"))
    per_thread = checkpoint_fill_bytes(build_layout(cfg.model), RunSpec.resolve(cfg, device_type="cpu"))
    assert per_thread == 128 * 2880 * 5760 * (4 + 2 + 1)
    assert fill_threads(36, 16, per_thread, 60 * 10**9) == (3, 1)
    assert fill_threads(36, 16) == (16, 1) and fill_threads(3, 16) == (3, 1)
    assert fill_threads(36, 16, per_thread, 10**9) == (1, 1)  # never fewer than one


def test_a_stage_packed_in_a_process_of_its_own_has_the_bytes_of_one_packed_here(tmp_path):
    """fill_base_stage_in_process (the start-up of a large NF4 base: a process per stage, each with its own GIL)
    maps the stage's segment from its spec in a spawned process and writes the bytes pack_stage_pieces gives here."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from types import SimpleNamespace

    from megatrain_ray.store.nf4_base import NF4_KIND, fill_base_stage_in_process, stage_format
    from megatrain_ray.store.segments import HostStore, SegmentSpec, create_segment

    stage = gpt_oss_layer()
    fmt = stage_format(stage, torch.bfloat16)
    spec = SegmentSpec(str(tmp_path / "stage0.nf4"), "uint8", fmt.nbytes, NF4_KIND, stage.index)
    create_segment(spec)
    run = SimpleNamespace(master_dtype="bfloat16", compute_dtype="bfloat16")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(fill_base_stage_in_process, [spec], stage, run, "", 7, 0.02).result()
    expected = pack_stage_pieces(fmt, lambda s: init_slot_pieces(stage, s, 7, 0.02, torch.bfloat16))
    assert torch.equal(HostStore([spec]).get(NF4_KIND, stage.index), expected)


def test_large_bases_are_packed_in_processes_and_small_ones_or_two_cores_in_threads():
    """Packing threads contend for the GIL (store/nf4_base.fill_processes): a 70B base packs in processes on 16 cores,
    in threads on a box of two cores or for a model of a few layers, whose processes' start would cost more."""
    from megatrain_ray.store.nf4_base import PROCESS_FILL_VALUES, fill_processes

    assert fill_processes(16, 70 * 10**9) == 16
    assert fill_processes(3, 70 * 10**9) == 3
    assert fill_processes(2, 70 * 10**9) == 0
    assert fill_processes(16, PROCESS_FILL_VALUES - 1) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_random_pieces_are_one_float32_draw_of_the_whole_tensor_rounded(dtype, monkeypatch):
    """A slot's random values (init_slot_pieces, which init_master writes) in any dtype: torch's float32 normal_ of
    the whole tensor from its seed, rounded to the dtype, on every torch version; the pieces (here of 4096 values,
    the last longer) continue one generator."""
    monkeypatch.setattr(initial_values, "INIT_PIECE", 4096)
    stage = gpt_oss_layer()
    for slot in (s for s in stage.slots if s.init == "normal"):
        gen = torch.Generator().manual_seed(initial_values.tensor_seed(7, stage.hf_name(slot)))
        whole = torch.empty(slot.numel, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(dtype)
        assert torch.equal(torch.cat(list(init_slot_pieces(stage, slot, 7, 0.02, dtype))), whole), slot.name
    master = torch.empty(stage.numel, dtype=dtype)
    init_master(master, stage, seed=7, std=0.02)
    for slot in stage.slots:
        pieces = torch.cat(list(init_slot_pieces(stage, slot, 7, 0.02, dtype)))
        assert torch.equal(master[slot.offset:slot.offset + slot.numel], pieces), slot.name


def test_nf4_kernels_triton_where_it_cannot_run_is_one_clear_error(monkeypatch):
    """engine.nf4_kernels=triton on a CPU worker (no interpreter): a ConfigError naming the key and what to set;
    auto falls back to torch there, and float64 (the exact test runs) always decodes in torch."""
    from megatrain_ray.engine.packed_stream import uses_triton
    from megatrain_ray.exceptions import ConfigError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="engine.nf4_kernels=triton needs triton and a CUDA device"):
        uses_triton("triton", cpu, torch.bfloat16)
    assert not uses_triton("auto", cpu, torch.bfloat16)
    assert not uses_triton("triton", cpu, torch.float64) and not uses_triton("torch", cpu, torch.bfloat16)
