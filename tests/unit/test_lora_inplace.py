"""The rollout's LoRA projections (LayerSpec.lora_inplace, model/lora.py project_group): the adapter's scaled output
added into the base product in place, one cast of an input shared by q, k and v (gate and up). Against the plain
arithmetic W x + b + scaling * B A x in float64, and against the training form (lora_inplace off). The merge into
the base matrices (merge_adapters, engine.rollout_lora merged) against W + scaling * B A."""

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


def test_merged_adapters_equal_the_plain_arithmetic_by_blocks_of_rows(monkeypatch):
    """model/lora.merge_adapters (the rollout's engine.rollout_lora merged) in float64, by blocks of 2 rows (matrices
    of 12 and 4 rows: several blocks each): each adapted matrix W + scaling * B A, the projection without an adapter
    and every bias untouched; the merged projections equal the in-place adapters'."""
    import megatrain_ray.model.lora as lora

    monkeypatch.setattr(lora, "MERGE_CHUNK_ELEMENTS", 25)  # 2 rows of 10 inputs a block
    w = weights(with_adapter=("self_attn.q_proj", "self_attn.v_proj"))
    adapters = {k: v for k, v in w.items() if ".lora_" in k}
    base = {k: v.clone() for k, v in w.items() if ".lora_" not in k}
    merged = {k: v.clone() for k, v in base.items()}
    lora.merge_adapters(merged, adapters, 2.5)
    for module in MODULES:
        name = f"{module}.weight"
        expected = base[name]
        if lora_a(module) in w:
            expected = expected + 2.5 * w[lora_b(module)] @ w[lora_a(module)]
            assert ((merged[name] - expected).abs().max() / expected.abs().max()).item() <= 1e-12
        else:
            assert torch.equal(merged[name], base[name])
        assert torch.equal(merged[f"{module}.bias"], base[f"{module}.bias"])
    h = torch.randn(2, 1, 10, dtype=torch.float64)
    for a, b in zip(project_group(h, merged, MODULES, spec(True)), project_group(h, w, MODULES, spec(True))):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-12
