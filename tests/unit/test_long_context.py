"""Long sequences on the CPU: the chunked layer backward against plain autograd, and what the memory
plan decides about offloading the layer inputs. (The 32K-token step on the GPU is in test_gpu.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain_ray.config.load import load_config
from megatrain_ray.model import norms
from megatrain_ray.model.attention import document_buckets
from megatrain_ray.model.layer_spec import LayerSpec
from megatrain_ray.model.templates import decoder_layer, decoder_layer_backward
from megatrain_ray.planning.machine import Machine
from megatrain_ray.planning.memory import plan_run
from megatrain_ray.units import GiB
from tests.conftest import saved_storage_bytes, tiny_raw


def _layer(gen: torch.Generator, hidden: int = 32, ffn: int = 48, heads: int = 4, kv: int = 2):
    head_dim = hidden // heads
    shapes = {"input_layernorm.weight": (hidden,), "self_attn.q_proj.weight": (hidden, hidden),
              "self_attn.k_proj.weight": (kv * head_dim, hidden), "self_attn.v_proj.weight": (kv * head_dim, hidden),
              "self_attn.o_proj.weight": (hidden, hidden), "post_attention_layernorm.weight": (hidden,),
              "mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden),
              "mlp.down_proj.weight": (hidden, ffn)}
    weights = {n: torch.randn(s, generator=gen, dtype=torch.float64) * (0.2 if len(s) == 2 else 1.0) + (
        1.0 if len(s) == 1 else 0.0) for n, s in shapes.items()}
    spec = LayerSpec(heads, kv, head_dim, 1e-6, qk_norm=False, attention_bias=False, sliding_window=0)
    return weights, spec


def _fused(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same layer in Phi-3's tensors: q, k, v as one qkv_proj, gate and up as one gate_up_proj."""
    out = {n: t for n, t in weights.items() if n.split(".")[1] not in ("q_proj", "k_proj", "v_proj", "gate_proj",
                                                                      "up_proj")}
    out["self_attn.qkv_proj.weight"] = torch.cat([weights[f"self_attn.{p}_proj.weight"] for p in "qkv"])
    out["mlp.gate_up_proj.weight"] = torch.cat((weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"]))
    return out


def _gemma(weights: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The same layer with Gemma's extra norms (post_attention_layernorm then norms the attention's output,
    the first half; pre/post_feedforward_layernorm the second) and Gemma 3's q/k norms, all (1 + w)."""
    out = {n: t - 1.0 if t.ndim == 1 else t for n, t in weights.items()}  # (1 + w): weights near 0
    for name, width in (("pre_feedforward_layernorm", 32), ("post_feedforward_layernorm", 32),
                        ("self_attn.q_norm", 8), ("self_attn.k_norm", 8)):
        out[f"{name}.weight"] = torch.randn(width, generator=gen, dtype=torch.float64) * 0.3
    return out


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma"],
                         ids=["llama", "phi3-fused-partial-rotary", "gemma-norms-softcap-window"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed-documents"])
@pytest.mark.parametrize("chunk", [7, 16, 40], ids=["ragged", "even", "one-chunk-bigger"])
def test_chunked_layer_backward_equals_plain_autograd(packed, chunk, family):
    """phi3: fused qkv_proj and gate_up_proj (the chunked MLP backward takes gate_up_proj's gradient in
    pieces too), RoPE over half of each head's 8 dimensions. gemma: Gemma's four (1 + w) norms and q/k
    norms, its attention scale, a sliding window of 6 and soft-capped scores (the explicit attention)."""
    gen = torch.Generator().manual_seed(0)
    weights, spec = _layer(gen)
    if family == "phi3":
        weights = _fused(weights)
    if family == "gemma":
        weights = _gemma(weights, gen)
        spec = dataclasses.replace(spec, qk_norm=True, gemma=True, scale=0.3, softcap=0.5, sliding_window=6)
    batch, seq = 2, 20
    x = torch.randn(batch, seq, 32, generator=gen, dtype=torch.float64)
    grad_y = torch.randn(batch, seq, 32, generator=gen, dtype=torch.float64)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), torch.rand(4, generator=gen, dtype=torch.float64))
    if family == "phi3":
        angles = angles[:, :2]
    rope = (torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin())
    docs = document_buckets(((5, 15), (20,)), torch.device("cpu")) if packed else None
    if packed:  # packed rows: RoPE positions restart per document
        positions = torch.tensor([list(range(5)) + list(range(15)), list(range(20))])
        rope = (rope[0][positions].unsqueeze(1), rope[1][positions].unsqueeze(1))

    # Reference: the whole layer as one autograd graph, nothing chunked.
    xr = x.clone().requires_grad_(True)
    wr = {n: t.clone().requires_grad_(True) for n, t in weights.items()}
    out = decoder_layer(xr, wr, rope, spec, docs)
    expected = torch.autograd.grad(out, [xr, *wr.values()], grad_y)

    grad_x, grads = decoder_layer_backward(x, weights, rope, spec, docs, grad_y, mlp_chunk_tokens=chunk)
    assert (grad_x - expected[0]).abs().max().item() < 1e-12
    for name, ref in zip(wr, expected[1:]):
        assert grads[name].shape == ref.shape
        assert (grads[name] - ref).abs().max().item() < 1e-12, name
    # The chunked forward (no autograd) is the same function.
    with torch.no_grad():
        assert (decoder_layer(x, weights, rope, spec, docs, mlp_chunk_tokens=chunk) - out).abs().max().item() < 1e-12


@pytest.mark.parametrize("plus_one", [False, True], ids=["weight", "gemma-one-plus-weight"])
@pytest.mark.parametrize("shape", [(2, 37, 24), (2, 9, 3, 16)], ids=["hidden", "per-head-qk-norm"])
def test_lean_rms_norm_gradients_equal_plain_autograd(monkeypatch, shape, plus_one):
    """The norm's own backward (rows in ragged slices: 40 elements a slice) against autograd through the
    plain operations, in float64; and in bfloat16 the same forward bit for bit, gradients to rounding.
    plus_one: Gemma's (1 + w) scaling, multiplied in float32 before the cast."""
    monkeypatch.setattr(norms, "NORM_BACKWARD_ELEMENTS", 40)
    gen = torch.Generator().manual_seed(1)
    for dtype, tol in ((torch.float64, 1e-12), (torch.bfloat16, 2e-2)):
        x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype).requires_grad_(True)
        w = (torch.randn(shape[-1], generator=gen, dtype=torch.float64) + 1).to(dtype).requires_grad_(True)
        grad = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        lean = norms.rms_norm(x, w, 1e-6, plus_one)
        assert lean.grad_fn is not None and "LeanRMSNorm" in type(lean.grad_fn).__name__
        plain = norms._plain_rms_norm(x, w, 1e-6, plus_one)
        assert torch.equal(lean, plain)
        got = torch.autograd.grad(lean, (x, w), grad)
        want = torch.autograd.grad(plain, (x, w), grad)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape
            scale = b.double().abs().max().item()
            assert (a.double() - b.double()).abs().max().item() <= tol * scale


def test_lean_rms_norm_keeps_only_its_input_and_a_scale_per_row():
    """What the backward holds, counted through autograd's saved-tensor hooks: the bfloat16 input (the
    residual, alive anyway), the weight and one float32 per row; plain autograd instead keeps the float32
    upcast and the normalised bfloat16 copy, three times the input's bytes."""
    x = torch.randn(4, 64, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(32, dtype=torch.bfloat16, requires_grad=True)

    def saved_bytes(norm) -> int:
        with saved_storage_bytes() as seen:
            norm(x, w, 1e-6)
        return sum(seen.values())

    rows = 4 * 64
    assert saved_bytes(norms.rms_norm) == x.numel() * 2 + 32 * 2 + rows * 4
    assert saved_bytes(norms._plain_rms_norm) >= x.numel() * (4 + 2)


def _long_config(layers: int, seq: int, offload="auto"):
    raw = tiny_raw(model={"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                          "num_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8,
                          "max_position_embeddings": seq},
                   data={"seq_len": seq, "batch_size": 1},
                   precision={"compute_dtype": "bfloat16", "master_dtype": "float32", "stream_dtype": "float32"},
                   optimizer={"grad_clip": 0.0},
                   engine={"device": "cuda", "activation_offload": offload, "poison_buffers": False,
                           "gpu_resident": "none"})
    return load_config(raw=raw)


def _plan(layers: int, seq: int, gpu_gib: float, offload="auto"):
    machine = Machine.detect("/dev/shm").override(host_memory="2TiB", gpu_memory=f"{gpu_gib}GiB", shm="2TiB")
    return plan_run(_long_config(layers, seq, offload), machine)


def test_auto_offloads_exactly_when_the_kept_inputs_do_not_fit():
    kept_on_gpu = _plan(32, 131072, 1000, offload=False)
    need = kept_on_gpu.gpu_peak / GiB + 1.5
    assert not _plan(32, 131072, need + 1).offload
    small = _plan(32, 131072, need - 1)
    assert small.offload and small.fits
    # The inputs moved to pinned host memory: one [tokens, hidden] bf16 tensor per layer.
    assert small.offloaded == 32 * 131072 * 4096 * 2
    assert small.host_total - kept_on_gpu.host_total == small.offloaded
    assert kept_on_gpu.gpu_peak - small.gpu_peak == 30 * 131072 * 4096 * 2


def test_offloaded_plan_is_flat_in_depth_and_at_most_linear_in_sequence_length():
    seqs = (131072, 262144, 393216, 524288, 655360)
    peaks = {(layers, seq): _plan(layers, seq, 141, offload=True).gpu_peak for layers in (8, 32) for seq in seqs}
    for seq in seqs:
        assert peaks[(8, seq)] == peaks[(32, seq)]
    # At most proportional to the tokens: the fixed buffers and one MLP chunk count once.
    for a, b in zip(seqs, seqs[1:]):
        assert peaks[(8, b)] <= peaks[(8, a)] * b / a
    # Past about 256K tokens of an 8B layer the attention half's backward sets the peak (as measured on
    # the GPU: +15.1 GiB from 128K to 256K, +41.6 GiB from 256K to 512K): affine in tokens from there.
    steps = [peaks[(8, b)] - peaks[(8, a)] for a, b in zip(seqs[2:], seqs[3:])]
    assert steps[0] == steps[1] > peaks[(8, 262144)] - peaks[(8, 131072)]


def test_plan_reports_memory_per_token():
    from megatrain_ray.planning.plan_text import format_plan

    text = format_plan(_plan(32, 131072, 141, offload=True))
    line = next(ln for ln in text.splitlines() if "activations per token" in ln)
    # The host side: one bf16 [hidden] row per layer per token, 32 x 4096 x 2 bytes = 256 KiB.
    assert "(+ 256.0 KiB pinned host RAM)" in line
    assert 0 < float(line.split("KiB")[0].split()[-1]) < 1024


def test_a_closed_run_lets_go_of_its_device_and_pinned_buffers_without_the_garbage_collector(tmp_path):
    """The next run in the same process (a sweep, a notebook, the GPU tests) must not find the last one's
    weight slots, gradient slots and offload buffers still allocated: the GPU peak of the GPU run at 12
    layers once counted the 4-layer run's 0.37 GiB that only gc.collect() would have freed."""
    import gc
    import weakref

    from megatrain_ray.driver.trainer import Trainer
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path, engine={"device": "cpu", "activation_offload": True})
    gc.collect()
    gc.disable()
    try:
        with Trainer(cfg) as trainer:
            trainer.step(0)
            engine = trainer.gpu.instance.engine
            buffers = [weakref.ref(t) for t in (engine.weights.layer_slots[0].raw, engine.grads.layer_slots[0].buf,
                                                 engine.vocab_acc, *engine.activations.host.values())]
            del engine
        assert len(buffers) > 4  # the offloaded inputs' host buffers are among them
        alive = [ref for ref in buffers if ref() is not None]
        assert not alive, f"{len(alive)} of {len(buffers)} buffers outlive the closed run"
    finally:
        gc.enable()
