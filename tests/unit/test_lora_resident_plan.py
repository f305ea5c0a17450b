"""engine.gpu_resident with finetune.method=lora in the plan: Qwen2.5-32B, r 16 on every linear projection, on an
H200 with 128 GB of RAM (issue 30's table), against counts made by hand from the model's dimensions: the resident
layers' base at 2 B/param on the GPU, no layer buffers once every layer is resident, every other term as the
streamed LoRA plan has it, and no H2D for the resident layers in the speed model."""

from __future__ import annotations

import dataclasses

import pytest

from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.model.layout import build_layout
from megatrain_ray.planning.gpu_memory import GPU_RESERVE_BYTES, RESIDENT_MARGIN_BYTES
from megatrain_ray.planning.machine import Machine
from megatrain_ray.planning.memory import plan_run
from megatrain_ray.planning.plan_text import format_plan
from megatrain_ray.planning.speed import estimate, stage_costs
from tests.unit.test_lora_plan import LAYER_PARAMS, H, L, V, qwen32b_lora

PAD = 2 * 64 * 12
"""Bytes of alignment padding one layer's bf16 stage may hold beyond its parameters (64 elements per tensor at
most, 12 tensors)."""
TOKENS_8K = "data.batch_size=2"  # 2 x 4096 tokens per step


def test_auto_keeps_every_layer_of_the_32b_base_on_the_h200_at_8k_tokens():
    h200 = Machine.from_preset("h200-128gb")
    plan = plan_run(qwen32b_lora("engine.gpu_resident=auto", TOKENS_8K), h200)
    streamed = plan_run(qwen32b_lora("engine.gpu_resident=none", TOKENS_8K), h200)
    assert plan.run.resident_layers == L and plan.fits
    g, s = plan.gpu, streamed.gpu
    # The base of the 64 layers in bf16: 2 B per parameter.
    assert 0 <= g["GPU-resident layers"] - 2 * L * LAYER_PARAMS <= L * PAD
    assert s["GPU-resident layers"] == 0
    # No layer buffers: the embedding and the head (LM head and final norm) only, in bf16.
    assert 0 <= g["weight buffers"] - 2 * (2 * V * H + H) <= 2 * 4 * 64
    assert 0 <= s["weight buffers"] - g["weight buffers"] - 2 * 2 * LAYER_PARAMS <= 2 * PAD
    for term in ("gradient buffers", "vocabulary accumulator", "kept layer inputs", "layer backward working set",
                 "loss head working set", "LoRA adapters (fp32, grads, AdamW)"):
        assert g[term] == s[term], term
    assert plan.gpu_peak == streamed.gpu_peak - (s["weight buffers"] - g["weight buffers"]) + g["GPU-resident layers"]
    assert plan.gpu_peak + GPU_RESERVE_BYTES + RESIDENT_MARGIN_BYTES <= h200.gpu_memory
    assert plan.host == streamed.host  # the host keeps the base: the device copies it from there
    text = format_plan(plan)
    assert "GPU-resident tier (engine.gpu_resident=auto): layers 0-63 (64 of 64, 31.2 B params): 58.13 GiB of GPU " \
           "memory (2.0 B/param); the frozen base, copied once from the host store (which keeps it), no H2D" in text


def test_auto_stops_where_one_more_layer_would_not_fit():
    """At 64k tokens per step the kept layer inputs and the backward take most of the H200: auto keeps the layers
    that fit beside them, the reserve and the margin, and not one more."""
    h200 = Machine.from_preset("h200-128gb")
    plan = plan_run(qwen32b_lora("engine.gpu_resident=auto", "data.batch_size=16"), h200)
    count, layer = plan.run.resident_layers, build_layout(plan.cfg.model).layers[0].numel * 2
    assert 0 < count < L
    budget = h200.gpu_memory - GPU_RESERVE_BYTES - RESIDENT_MARGIN_BYTES
    assert plan.gpu_peak <= budget < plan.gpu_peak + layer


def test_the_speed_model_drops_the_h2d_of_the_resident_layers():
    profile = Machine.from_preset("h200-128gb").profile
    cfg = qwen32b_lora(TOKENS_8K)
    layout = build_layout(cfg.model)
    run = RunSpec.resolve(cfg)
    half = stage_costs(cfg, dataclasses.replace(run, resident_layers=32), profile, layout)
    assert [c.h2d_bytes for c in half[1:33]] == [0] * 32 and all(c.resident for c in half[1:33])
    assert [c.h2d_bytes for c in half[33:-1]] == [s.numel * 2 for s in layout.layers[32:]]
    streamed, resident = estimate(cfg, profile, resident=0), estimate(cfg, profile, resident=L)
    # Streamed, the 8k-token step waits for the base's H2D (61 GiB at 53 GB/s each pass); resident, nothing is
    # copied (the embedding and the head stay in their slots) and the GPU computes all the time.
    assert streamed.h2d_seconds > 1.0 and streamed.gpu_waits["H2D"] > 0
    assert resident.h2d_seconds == 0 and resident.gpu_waits["H2D"] == 0
    assert resident.compute_seconds == pytest.approx(streamed.compute_seconds, rel=1e-9)
    assert resident.step_seconds == pytest.approx(resident.compute_seconds + profile.host.control_seconds, rel=1e-3)
    assert resident.tok_per_s > streamed.tok_per_s


def test_an_nf4_base_keeps_its_resident_layers_packed():
    """finetune.lora.base_quantization=nf4: the resident layers' packed bytes on the GPU (codes at 4 bits, absmax and
    their double quantization: about 0.56 B/param), dequantized into the two layer buffers at each use, which stay;
    the staging buffer of the packed copy goes once every layer is resident."""
    from megatrain_ray.planning.lora import streamed_bytes
    from megatrain_ray.store.nf4_base import stage_format

    h200 = Machine.from_preset("h200-128gb")
    plan = plan_run(qwen32b_lora("engine.gpu_resident=auto", "finetune.lora.base_quantization=nf4", TOKENS_8K), h200)
    streamed = plan_run(qwen32b_lora("engine.gpu_resident=none", "finetune.lora.base_quantization=nf4", TOKENS_8K), h200)
    layout = build_layout(plan.cfg.model)
    packed = stage_format(layout.layers[0], "bfloat16").nbytes
    assert plan.run.resident_layers == L
    assert plan.gpu["GPU-resident layers"] == L * packed
    assert 0.5 < packed / LAYER_PARAMS < 0.6
    assert streamed.gpu["weight buffers"] - plan.gpu["weight buffers"] == packed  # the staging buffer
    assert [streamed_bytes(plan.run, s, resident=True) for s in layout.layers] == [0] * L
