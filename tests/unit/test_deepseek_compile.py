"""DeepSeek-V3's decoder layers through torch.compile (engine.compile), on the CPU, as tests/unit/test_moe_compile.py
holds the other MoE families: the latent attention, and the sigmoid router's group-limited top-k beside the fused
experts (torch._grouped_mm's CPU kernel in bfloat16, the GPU's path) and the shared experts.

The compiled layer (engine/compiled.CompiledDecoderLayer: the forward, then the recompute + backward with the routing
record) must trace without a graph break, route as the eager layer does, return every gradient, and be as close to a
float64 run as the eager layer is (bfloat16 rounding). Dynamo and AOTAutograd run here with torch.compile's
aot_eager backend (the traced joint graph and its forward/backward partition, where a graph break or a missing
gradient shows) instead of Inductor's C++ kernels, which take minutes on a 2-core machine: the same layer through
Inductor passed these checks by hand (211 s wall under load, 2 graphs, no graph break).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.hf import model_config_from_hf  # noqa: E402
from megatrain_ray.config.resolved import RunSpec  # noqa: E402
from megatrain_ray.engine.compiled import CompiledDecoderLayer  # noqa: E402
from megatrain_ray.model import moe  # noqa: E402
from megatrain_ray.model.layer_spec import LayerSpec  # noqa: E402
from megatrain_ray.model.layout import build_layout  # noqa: E402
from megatrain_ray.model.moe import RouterRecord  # noqa: E402
from megatrain_ray.model.rope import rope_tables  # noqa: E402
from megatrain_ray.model.templates import bind, decoder_layer, decoder_layer_backward  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402
from tests.reference_deepseek import hf_deepseek_model  # noqa: E402

WIDTHS = dict(moe_intermediate_size=24)
"""Expert width a multiple of 8, as torch._grouped_mm needs (hidden 72 is)."""


def _run(layer_fn, cfg, state, layer: int, dtype: torch.dtype):
    """The layer's output and its recompute's input and weight gradients and routing counts (None: a dense layer)."""
    stage = build_layout(cfg).layers[layer]
    buffer = torch.zeros(stage.numel, dtype=torch.float64)
    for slot in stage.slots:
        value = state[stage.hf_name(slot)].double()
        if slot.name == "mlp.gate.weight":  # well-separated router scores: bfloat16 rounding flips no choice
            value = value * 32
        buffer[slot.offset:slot.offset + slot.numel] = value.reshape(-1)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 33, cfg.hidden_size, generator=gen, dtype=torch.float64)
    grad_y = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    spec = LayerSpec.from_config(cfg, layer)
    w = bind(buffer.to(dtype), stage)
    rope = rope_tables(cfg, 33, x.device, dtype)
    x, grad_y = x.to(dtype), grad_y.to(dtype)
    with torch.no_grad():
        y = layer_fn(x, w, rope, spec, None, 0, None)
    routing = RouterRecord() if spec.moe is not None else None
    grad_x, grads = decoder_layer_backward(x, w, rope, spec, None, grad_y, layer=layer_fn, router=routing)
    return y, grad_x, grads, None if routing is None else routing.counts


def test_compiled_deepseek_moe_layer_matches_the_eager_template(monkeypatch):
    """Layer 1: the latent attention and the sigmoid-routed experts with shared experts (the dense first layer's
    MLP is Llama's, compiled for every dense family)."""
    from torch._dynamo.utils import counters

    layer = 1
    model = hf_deepseek_model("deepseek_v3", **WIDTHS)
    cfg, state = model_config_from_hf(model.config.to_dict()), model.state_dict()
    reference = _run(decoder_layer, cfg, state, layer, torch.float64)
    monkeypatch.setattr(moe, "grouped_mm_usable", lambda *tensors: True)  # the GPU's path, on torch's CPU kernel
    eager = _run(decoder_layer, cfg, state, layer, torch.bfloat16)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    counters.clear()
    compiled = _run(CompiledDecoderLayer(fall_back=False), cfg, state, layer, torch.bfloat16)
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"]
    torch._dynamo.reset()
    assert compiled[3] is not None  # the same routing in all three
    assert torch.equal(compiled[3], eager[3]) and torch.equal(eager[3], reference[3])
    y64, gx64, grads64, _ = reference
    assert set(compiled[2]) == set(grads64)
    for label, want, got_eager, got_compiled in [("output", y64, eager[0], compiled[0]),
                                                 ("input gradient", gx64, eager[1], compiled[1]),
                                                 *((n, grads64[n], eager[2][n], compiled[2][n]) for n in grads64)]:
        scale = want.abs().max().item() or 1.0  # the routing bias's gradient: zeros on every side
        eager_err = (got_eager.double() - want).abs().max().item() / scale
        compiled_err = (got_compiled.double() - want).abs().max().item() / scale
        assert compiled_err <= max(2 * eager_err, 2 ** -7), f"{label}: compiled {compiled_err:.2e}, eager {eager_err:.2e}"


def test_which_deepseek_models_compile(tmp_path):
    """engine.compile takes DeepSeek-V3 and GLM-4.5 MoE layers in bfloat16 on a GPU (torch._grouped_mm), as the other
    MoE families; float32 stays eager; engine.compile true is no longer refused."""
    def compiles(name: str, compute_dtype: str, **overrides) -> bool:
        model = dataclasses.asdict(model_config_from_hf(hf_deepseek_model(name, **overrides).config.to_dict()))
        cfg = tiny_config(tmp_path, model=model, data={"seq_len": 24}, engine={"compile": True},
                          precision={"compute_dtype": compute_dtype, "master_dtype": "float32"})
        return RunSpec.resolve(cfg, device_type="cuda").compiles

    assert compiles("deepseek_v3", "bfloat16", **WIDTHS) and compiles("glm4_moe", "bfloat16", **WIDTHS)
    assert not compiles("deepseek_v3", "float32", **WIDTHS)
    assert not compiles("deepseek_v3", "bfloat16")  # expert width 20: no torch._grouped_mm


def test_compiled_deepseek_moe_layer_with_lora_adapters_matches_the_eager_template(monkeypatch):
    """The same MoE layer with LoRA's all-linear adapters bound (every latent projection, the router, the stacked
    expert adapters: model/lora_moe.py), the base frozen: the compiled recompute's adapter gradients as close to
    float64 as the eager layer's, no graph break (what a DeepSeek-V3 LoRA run compiles on an H200 under
    engine.compile auto)."""
    from torch._dynamo.utils import counters

    from megatrain_ray.config.finetune_section import LoraConfig
    from megatrain_ray.model.lora import initial_adapters, is_adapter

    model = hf_deepseek_model("deepseek_v3", **WIDTHS)
    cfg, state = model_config_from_hf(model.config.to_dict()), model.state_dict()
    lora = LoraConfig(r=4, lora_alpha=8)
    g = torch.Generator().manual_seed(1)
    adapters = {k: v.double() + (0.3 * torch.randn(v.shape, generator=g, dtype=torch.float64) if "lora_B" in k
                                 else 0.0) for k, v in initial_adapters(cfg, lora, 0, 1).items()}
    assert any(k.startswith("mlp.experts") for k in adapters) and "self_attn.kv_b_proj.lora_A.weight" in adapters

    def run(layer_fn, dtype):
        stage = build_layout(cfg).layers[1]
        buffer = torch.zeros(stage.numel, dtype=torch.float64)
        for slot in stage.slots:
            value = state[stage.hf_name(slot)].double() * (32 if slot.name == "mlp.gate.weight" else 1)
            buffer[slot.offset:slot.offset + slot.numel] = value.reshape(-1)
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(2, 33, cfg.hidden_size, generator=gen, dtype=torch.float64).to(dtype)
        grad_y = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(dtype)
        spec = dataclasses.replace(LayerSpec.from_config(cfg, 1), lora_scaling=lora.scaling)
        w = {**bind(buffer.to(dtype), stage), **{k: v.to(torch.promote_types(dtype, torch.float32))
                                                 for k, v in adapters.items()}}
        rope = rope_tables(cfg, 33, x.device, dtype)
        return decoder_layer_backward(x, w, rope, spec, None, grad_y, layer=layer_fn, trainable=is_adapter,
                                      router=RouterRecord())

    reference = run(decoder_layer, torch.float64)
    monkeypatch.setattr(moe, "grouped_mm_usable", lambda *tensors: True)
    eager = run(decoder_layer, torch.bfloat16)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    counters.clear()
    compiled = run(CompiledDecoderLayer(fall_back=False), torch.bfloat16)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    torch._dynamo.reset()
    assert set(compiled[1]) == set(reference[1]) == set(adapters)
    for label, want, got_eager, got_compiled in [("input gradient", reference[0], eager[0], compiled[0]),
                                                 *((n, reference[1][n], eager[1][n], compiled[1][n])
                                                   for n in reference[1])]:
        scale = want.abs().max().item()
        eager_err = (got_eager.double() - want).abs().max().item() / scale
        compiled_err = (got_compiled.double() - want).abs().max().item() / scale
        assert compiled_err <= max(2 * eager_err, 2 ** -7), f"{label}: compiled {compiled_err:.2e}, eager {eager_err:.2e}"
