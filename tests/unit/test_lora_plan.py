"""finetune.method=lora: the config's checks, and the plan's host, GPU and speed figures against counts made
by hand from the model's dimensions (Qwen2.5-32B, r 16, every linear projection)."""

from __future__ import annotations

import os
import re

import pytest

from megatrain_ray.config.load import load_config
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.model.lora import lora_params
from megatrain_ray.planning.lora import LORA_ADAPTERS
from megatrain_ray.planning.machine import Machine
from megatrain_ray.planning.memory import plan_run
from megatrain_ray.planning.plan_text import format_plan
from megatrain_ray.planning.speed import GPU_ADAMW_GBPS, estimate
from megatrain_ray.units import human_count
from tests.conftest import REPO, tiny_raw

SHAPE = os.path.join(REPO, "configs", "shapes", "qwen2.5-32b.yaml")
LORA = ["finetune.method=lora", "finetune.lora.r=16", "finetune.lora.target_modules=all-linear",
        "precision.stream_dtype=auto"]

# Qwen2.5-32B: hidden 5120, FFN 27648, 64 layers, 40 query heads and 8 key-value heads of 128, vocab 152064,
# q/k/v biases, untied LM head.
H, F, L, Q, KV, V = 5120, 27648, 64, 40 * 128, 8 * 128, 152064
# r * (in + out) per projection: q, k, v, o, gate, up, down.
ADAPTERS_PER_LAYER = 16 * ((H + Q) + (H + KV) + (H + KV) + (Q + H) + 3 * (H + F))
LAYER_PARAMS = H * Q + 2 * H * KV + Q * H + 3 * H * F + Q + 2 * KV + 2 * H
PARAMS = 2 * V * H + L * LAYER_PARAMS + H


def qwen32b_lora(*overrides: str):
    return load_config(SHAPE, overrides=[*LORA, *overrides])


def test_the_hand_count_is_the_published_size():
    assert ADAPTERS_PER_LAYER * L == 134_217_728  # 2 M adapter parameters per layer
    assert abs(PARAMS / 1e9 - 32.76) < 0.01


def test_plan_counts_the_base_in_bf16_on_the_host_and_the_adapters_on_the_gpu():
    plan = plan_run(qwen32b_lora("engine.gpu_resident=none"), Machine.from_preset("h100-512gb"))  # the base streamed
    assert plan.run.frozen_base and lora_params(plan.cfg) == ADAPTERS_PER_LAYER * L
    assert set(plan.host) == {"master", "gate"}  # no moments, no streaming copy, no gradient buffers
    # 2 bytes per parameter, plus the layout's alignment padding (64 elements per tensor at most).
    assert 0 <= plan.host["master"] - 2 * PARAMS <= 2 * 64 * (L * 12 + 3)
    assert plan.workers == 0 and plan.pinned == plan.host["master"]
    assert plan.gpu[LORA_ADAPTERS] == 16 * ADAPTERS_PER_LAYER * L  # fp32 weights, gradients, two moments: 2 GiB
    assert plan.gpu["gradient buffers"] == plan.gpu["vocabulary accumulator"] == 0
    # Two layer buffers, the embedding and the head (LM head and final norm), in bf16.
    assert abs(plan.gpu["weight buffers"] - 2 * (2 * LAYER_PARAMS + 2 * V * H + H)) <= 2 * 4 * 64 * 12
    full = plan_run(load_config(SHAPE, ["engine.gpu_resident=none"]), Machine.from_preset("h100-512gb"))
    # The full run's host store is over 6x larger (fp32 master and moments); its GPU holds gradient buffers.
    assert full.shm_total > 6 * plan.shm_total and full.gpu_peak > plan.gpu_peak
    assert plan.fits
    text = format_plan(plan)
    assert "frozen base (streamed)" in text and f"{human_count(ADAPTERS_PER_LAYER * L)} adapter parameters" in text


def test_without_a_gpu_the_plan_says_the_cpu_trains_the_adapters_and_nothing_is_pinned():
    """A machine with no GPU (or engine.device=cpu) runs the layers on the CPU: no 'train on the GPU', and no
    pinned memory (the GPU worker registers the segments only for CUDA)."""
    no_gpu = Machine(512 * 2**30, 512 * 2**30, 512 * 2**30, None, None, described=True)
    h100 = Machine.from_preset("h100-512gb")
    for cfg, machine in [(qwen32b_lora(), no_gpu), (qwen32b_lora("engine.device=cpu"), h100)]:
        text = format_plan(plan_run(cfg, machine))
        assert "adapter parameters (0.41% of the model) train on the CPU;" in text, text
        assert "train on the GPU" not in text and "pinned for the GPU" not in text
        why = "no GPU visible" if machine is no_gpu else "engine.device=cpu"
        assert re.search(rf"of which pinned +0\.00 GiB  \({why}: the layers compute on the CPU, nothing is pinned\)",
                         text), text
        assert f"compute device: the CPU, {why} (torch allocations; layer inputs" in text and "\nGPU (" not in text
    text = format_plan(plan_run(qwen32b_lora(), h100))
    assert "train on the GPU;" in text and "of which pinned for the GPU" in text and "\nGPU (torch allocations" in text


def test_modules_to_save_count_on_the_gpu_with_their_float32_gradient_sums():
    plan = plan_run(qwen32b_lora("finetune.lora.modules_to_save=[embed_tokens,lm_head]"),
                    Machine.from_preset("h100-512gb"))
    assert plan.gpu[LORA_ADAPTERS] == 16 * (ADAPTERS_PER_LAYER * L + 2 * V * H)  # 12.1 GiB more than the adapters
    assert plan.gpu["vocabulary accumulator"] == 4 * V * H
    assert plan.run.checkpoint_bytes(PARAMS, lora_params(plan.cfg)) == 12 * (ADAPTERS_PER_LAYER * L + 2 * V * H)


def test_speed_model_has_no_d2h_no_cpu_adamw_a_quarter_less_matrix_time_at_the_lora_rate():
    machine = Machine.from_preset("h100-512gb")
    lora, full = estimate(qwen32b_lora(), machine.profile), estimate(load_config(SHAPE), machine.profile)
    assert lora.d2h_seconds == 0 and lora.optimizer_seconds == 0
    # Per token: full fine-tuning computes 8 N (forward, recompute, input and weight gradients) for 6 N model
    # FLOPs; LoRA drops the weight gradients (2 N of the layers' matrices, and of the LM head's 6: 2), and adds
    # its adapters. Compare the GPU time with that count, made here from the dimensions.
    tokens = 8 * 4096
    assert lora.compiled == full.compiled
    rate = machine.profile.gpu.tflops(lora.compiled) * 1e12
    saved = (L * 6 * (LAYER_PARAMS - Q - 2 * KV - 2 * H) / 4 + 2 * V * H) * tokens / rate
    added = L * 6 * ADAPTERS_PER_LAYER * tokens / rate
    # At the LoRA rate: the measured fraction of the full rate (machines.yaml's lora_rate_fraction: what the FLOP
    # count does not see, the adapters' float32 side path).
    flop_seconds = (full.compute_seconds - saved + added) / machine.profile.gpu.lora_rate_fraction
    # The adapters' AdamW step on the device: 28 B of HBM traffic per fp32 parameter (weight, two moments read
    # and written, gradient read) at the speed model's assumed HBM rate.
    adamw = L * ADAPTERS_PER_LAYER * 28 / (GPU_ADAMW_GBPS["h100"] * 1e9)
    assert lora.compute_seconds == pytest.approx(flop_seconds + adamw, rel=1e-6)


def test_lora_config_errors_name_the_key():
    def build(**finetune):
        return load_config(raw=tiny_raw(finetune={"method": "lora", **finetune}))

    for lora, key in [({"lora_dropout": 1.0}, "finetune.lora.lora_dropout"), ({"bias": "all"}, "finetune.lora.bias"),
                      ({"target_modules": ["qkv_proj"]}, "finetune.lora.target_modules"),
                      ({"target_modules": []}, "finetune.lora.target_modules"),
                      ({"modules_to_save": ["norm"]}, "finetune.lora.modules_to_save"),
                      ({"modules_to_save": ["lm_head", "lm_head"]}, "finetune.lora.modules_to_save"),
                      ({"r": 0}, "finetune.lora.r")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            build(lora=lora)
    with pytest.raises(ConfigError, match="finetune.method.*parallel.nodes=1"):
        load_config(raw=tiny_raw(finetune={"method": "lora"}, parallel={"gpus": 2, "nodes": 2},
                                 runtime={"mode": "ray"}))
    with pytest.raises(ConfigError, match="finetune.method.*tie_word_embeddings=false"):
        load_config(raw=tiny_raw(finetune={"method": "lora", "lora": {"modules_to_save": ["lm_head"]}},
                                 model={"tie_word_embeddings": True}))
    with pytest.raises(ConfigError, match="finetune.method.*no optimizer workers"):
        load_config(raw=tiny_raw(finetune={"method": "lora"}, fault={"drill": "kill:optim0@2"}))
    cfg = build(lora={"target_modules": ["v_proj", "q_proj"], "r": 4, "lora_alpha": 8, "use_rslora": True})
    assert cfg.finetune.lora.targets("llama") == ("q_proj", "v_proj") and cfg.finetune.lora.scaling == 4.0
