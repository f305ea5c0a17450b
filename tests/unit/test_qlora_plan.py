"""finetune.lora.base_quantization=nf4 in the plan: the host bytes of the packed layers against the NF4 format's
byte count made by hand from Llama-3.1-70B's dimensions (QLoRA's 0.5 + 1/64 + 1/16384 B per matrix value), the
host total of issue 30 (about 40 GB), the H2D bytes, and the config's refusal of nf4 without LoRA."""

from __future__ import annotations

import os

import pytest

from megatrain_ray.config.load import load_config
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.model.layout import build_layout
from megatrain_ray.planning.machine import Machine
from megatrain_ray.planning.memory import plan_run
from megatrain_ray.planning.plan_text import format_plan
from megatrain_ray.planning.speed import stage_costs
from megatrain_ray.quant.nf4_stage import nf4_stage_bytes
from tests.conftest import REPO, tiny_raw

SHAPE = os.path.join(REPO, "configs", "shapes", "llama3-70b.yaml")
QLORA = ["finetune.method=lora", "finetune.lora.base_quantization=nf4", "precision.stream_dtype=bfloat16"]
# Llama-3.1-70B: hidden 8192, FFN 28672, 80 layers, 64 query heads and 8 key-value heads of 128, vocab 128256.
H, F, L, KV, V = 8192, 28672, 80, 8 * 128, 128256


def aligned(n: int) -> int:
    return -(-n // 256) * 256


def hand_layer_bytes() -> int:
    """One layer in NF4 (docs/quantization.md): per matrix of n values k = n / 64 blocks of 32 code bytes, one
    absmax code per block, a float32 scale per 256 blocks and one float32 offset; the two norms in bf16; each of
    the five sections aligned to 256 bytes."""
    matrices = [H * H, H * KV, H * KV, H * H, H * F, H * F, F * H]
    blocks = [n // 64 for n in matrices]
    sections = [32 * sum(blocks), sum(blocks), 4 * sum(-(-k // 256) for k in blocks), 4 * len(matrices), 2 * 2 * H]
    return sum(aligned(s) for s in sections)


def qlora_plan(*overrides: str):
    """The QLoRA plan with its base streamed (engine.gpu_resident=none): the packed layers cross each step."""
    return plan_run(load_config(SHAPE, overrides=[*QLORA, "engine.gpu_resident=none", *overrides]),
                    Machine.from_preset("h200-128gb"))


def test_the_plan_holds_the_layers_packed_as_the_format_counts_them():
    plan = qlora_plan()
    layout = build_layout(plan.cfg.model)
    assert plan.run.base_quantization == "nf4" and set(plan.host) == {"master", "nf4", "gate"}
    assert plan.host["nf4"] == sum(nf4_stage_bytes(s, "bfloat16") for s in layout.layers) == L * hand_layer_bytes()
    assert plan.host["master"] == 2 * (layout.embed.numel + layout.head.numel)  # embedding, LM head in bf16
    per_param = plan.host["nf4"] / sum(s.numel for s in layout.layers)
    assert 0.515 < per_param < 0.517  # the matrices' 0.5159 B, the norms' 2 B on a sliver of the values
    assert plan.pinned == plan.host["nf4"] + plan.host["master"]
    # Issue 30: Llama-3.1-70B's host RAM in about 40 GB (1.7 GiB of it the processes' estimate).
    assert 38e9 < plan.host_total < 43e9, plan.host_total
    assert "frozen base layers (NF4)" in format_plan(plan)


def test_the_h2d_bytes_and_gpu_buffers_follow_the_packed_size():
    plan, dense = qlora_plan(), qlora_plan("finetune.lora.base_quantization=none")
    layout = build_layout(plan.cfg.model)
    costs = stage_costs(plan.cfg, plan.run, Machine.from_preset("h200-128gb").profile, layout)
    assert [c.h2d_bytes for c in costs if c.kind == "layer"] == [hand_layer_bytes()] * L
    assert costs[0].h2d_bytes == 2 * layout.embed.numel
    # The GPU adds one staging buffer of a packed layer and the dequantization's temporaries (bounded by the
    # chunking: 8 B per value of a 2^24-value chunk, 40 B per block), no more than 1 GiB over the dense base.
    extra = plan.gpu["weight buffers"] - dense.gpu["weight buffers"]
    assert hand_layer_bytes() < extra < hand_layer_bytes() + 2**30


def test_nf4_without_lora_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"finetune.lora.base_quantization.*finetune.method=lora"):
        load_config(raw=tiny_raw(finetune={"method": "full", "lora": {"base_quantization": "nf4"}}))


def test_layers_of_one_shape_share_one_packed_format():
    """dequantize_stage caches its index tensors per format and device: one format for all 80 layers keeps
    them built once, not rebuilt and copied to the GPU per layer and step."""
    from megatrain_ray.store.nf4_base import stage_format

    layout = build_layout(load_config(SHAPE, overrides=QLORA).model)
    formats = {id(stage_format(s, "bfloat16")) for s in layout.layers}
    assert len(formats) == 1 and stage_format(layout.layers[0], "float32") is not stage_format(layout.layers[0],
                                                                                                "bfloat16")
