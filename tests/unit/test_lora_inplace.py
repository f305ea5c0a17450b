"""The rollout's LoRA projections (LayerSpec.lora_inplace, model/lora.py project_group): the adapter's scaled output
added into the base product in place, one cast of an input shared by q, k and v (gate and up). Against the plain
arithmetic W x + b + scaling * B A x in float64, and against the training form (lora_inplace off)."""

from __future__ import annotations

import torch

from megatrain_ray.model.layer_spec import LayerSpec
from megatrain_ray.model.lora import lora_a, lora_b, project, project_group

MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def weights(with_adapter=MODULES):
    g = torch.Generator().manual_seed(0)
    w = {}
    for module, out in zip(MODULES, (12, 4, 4)):
        w[f"{module}.weight"] = torch.randn(out, 10, generator=g, dtype=torch.float64)
        w[f"{module}.bias"] = torch.randn(out, generator=g, dtype=torch.float64)
        if module in with_adapter:
            w[lora_a(module)] = torch.randn(3, 10, generator=g, dtype=torch.float64)
            w[lora_b(module)] = torch.randn(out, 3, generator=g, dtype=torch.float64)
    return w


def spec(inplace: bool) -> LayerSpec:
    return LayerSpec(4, 2, 3, 1e-6, qk_norm=False, attention_bias=True, sliding_window=0, lora_scaling=2.5,
                     lora_inplace=inplace)


def test_in_place_adapters_equal_the_plain_arithmetic_and_the_training_form():
    h = torch.randn(2, 1, 10, dtype=torch.float64)
    # k_proj without an adapter (a target_modules subset): the base product alone
    w = weights(with_adapter=("self_attn.q_proj", "self_attn.v_proj"))
    fast = project_group(h, w, MODULES, spec(True))
    slow = project_group(h, w, MODULES, spec(False))
    for module, a, b in zip(MODULES, fast, slow):
        expected = h @ w[f"{module}.weight"].T + w[f"{module}.bias"]
        if lora_a(module) in w:
            expected = expected + 2.5 * (h @ w[lora_a(module)].T) @ w[lora_b(module)].T
        assert ((a - expected).abs().max() / expected.abs().max()).item() <= 1e-12
        assert ((b - expected).abs().max() / expected.abs().max()).item() <= 1e-12
    single = project(h, w, "self_attn.q_proj", spec(True))
    assert ((single - fast[0]).abs().max() / fast[0].abs().max()).item() <= 1e-12
