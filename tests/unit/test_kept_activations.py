"""engine.kept_activations in the plan: what a kept layer's forward graph holds (counted against autograd's saved
tensors of the engine's layer), how many resident layers auto keeps, and what the speed model expects of them."""

from __future__ import annotations

import os

import pytest
import torch

from megatrain_ray.config.load import load_config
from megatrain_ray.engine.rope_cache import RopeCache
from megatrain_ray.model.layer_spec import layer_specs
from megatrain_ray.model.layout import build_layout
from megatrain_ray.model.templates import bind, decoder_layer
from megatrain_ray.planning.gpu_memory import GPU_RESERVE_BYTES, RESIDENT_MARGIN_BYTES, kept_layer_bytes
from megatrain_ray.planning.machine import Machine
from megatrain_ray.planning.memory import plan_run
from megatrain_ray.planning.plan_text import format_plan
from megatrain_ray.planning.speed import estimate
from tests.conftest import REPO, saved_storage_bytes, tiny_raw

BENCH = os.path.join(REPO, "configs", "shapes", "llama-3.5b-bench.yaml")


@pytest.mark.parametrize("heads, kv_heads, intermediate", [(4, 4, 688), (4, 2, 1024)], ids=["mha", "gqa"])
def test_the_plan_counts_what_a_kept_layer_saves_for_its_backward(heads, kv_heads, intermediate):
    """The engine's eager layer in bfloat16, its forward with autograd on: every storage autograd saves, less the
    weights and RoPE's tables (held anyway), is the plan's count less the layer input (which the plan counts with
    the kept layer inputs as well)."""
    rows, seq = 2, 256
    cfg = load_config(raw=tiny_raw(model={"hidden_size": 256, "intermediate_size": intermediate,
                                          "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                                          "max_position_embeddings": seq},
                                   data={"seq_len": seq, "batch_size": rows},
                                   precision={"compute_dtype": "bfloat16", "master_dtype": "float32"}))
    stage, spec = build_layout(cfg.model).layers[0], layer_specs(cfg.model)[0]
    flat = (torch.randn(stage.numel) * 0.02).to(torch.bfloat16)
    w = {n: t.requires_grad_() for n, t in bind(flat, stage).items()}
    rope = RopeCache(cfg.model, [spec], torch.device("cpu"), torch.bfloat16).tables(seq, None)[spec.local_rope]
    x = torch.randn(rows, seq, 256, dtype=torch.bfloat16, requires_grad=True)
    with saved_storage_bytes() as seen:
        decoder_layer(x, w, rope, spec)
    held = {flat.untyped_storage().data_ptr(), x.untyped_storage().data_ptr(),
            *(t.untyped_storage().data_ptr() for t in rope)}
    saved = sum(n for ptr, n in seen.items() if ptr not in held)
    assert saved + x.numel() * 2 == kept_layer_bytes(cfg, rows * seq, 2)


@pytest.mark.parametrize("batch, kept", [(4, 16), (16, 16), (32, 8)], ids=["8k", "32k", "64k"])
def test_auto_keeps_the_graphs_that_fit_beside_the_tier(batch, kept):
    """The 3.5B bench on an H200 (140.4 GiB): every stage resident (52.2 GiB); compiled layers' graphs (0.8 of the
    eager count: COMPILED_KEPT_GRAPH) of every layer fit at 8k and 32k tokens (1.0 and 3.8 GiB each), 8 at 64k
    (7.5 GiB each)."""
    machine = Machine.from_preset("h200-1tb")
    plan = plan_run(load_config(BENCH, [f"data.batch_size={batch}"]), machine)
    run = plan.run
    assert (run.resident_layers, run.resident_vocab, run.kept_layers) == (16, True, kept) and plan.fits
    assert run.layers_compiled
    per_layer = kept_layer_bytes(plan.cfg, run.rank_tokens, 2, compiled=True)
    assert per_layer == int(0.8 * kept_layer_bytes(plan.cfg, run.rank_tokens, 2))
    assert plan.gpu["kept layer graphs"] == kept * per_layer
    budget = machine.gpu_memory - GPU_RESERVE_BYTES - RESIDENT_MARGIN_BYTES
    assert plan.gpu_peak <= budget and (kept == 16 or budget < plan.gpu_peak + per_layer)  # one more would not fit
    text = format_plan(plan)
    assert "kept forward graphs (engine.kept_activations=auto): " + (
        f"layers {16 - kept}-15 ({kept})" if kept else "none") in text
    # The speed model: a kept layer's backward without the recompute, a third of its compute less.
    without = estimate(plan.cfg, plan.profile, run=plan.run.__class__(**{**_fields(run), "kept_layers": 0}))
    assert (plan.expected.compute_seconds < without.compute_seconds) == bool(kept)


def _fields(run) -> dict:
    return {f: getattr(run, f) for f in run.__dataclass_fields__}


def test_none_on_the_cpu_and_an_explicit_count_is_clamped_to_the_resident_layers(tmp_path):
    machine = Machine.from_preset("h200-1tb")
    assert plan_run(load_config(BENCH, ["engine.device=cpu"]), machine).run.kept_layers == 0
    assert plan_run(load_config(BENCH, ["engine.gpu_resident=4", "engine.kept_activations=9"]),
                    machine).run.kept_layers == 4
    assert plan_run(load_config(BENCH, ["engine.gpu_resident=none"]), machine).run.kept_layers == 0
