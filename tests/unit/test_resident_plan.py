"""engine.gpu_resident in the plan: how many layers `auto` keeps on the GPU, what they cost there, what
`megatrain plan` prints about them, and what the speed model expects of them."""

from __future__ import annotations

import os

import pytest

from megatrain_ray.__main__ import main
from megatrain_ray.config.load import load_config
from megatrain_ray.model.layout import build_layout
from megatrain_ray.planning.gpu_memory import GPU_RESERVE_BYTES, RESIDENT_MARGIN_BYTES, resident_bytes
from megatrain_ray.planning.machine import Machine
from megatrain_ray.planning.memory import plan_run
from megatrain_ray.planning.plan_text import format_plan
from megatrain_ray.planning.speed import estimate
from tests.conftest import REPO

BENCH = os.path.join(REPO, "configs", "shapes", "llama-3.5b-bench.yaml")


def bench(**engine):
    return load_config(BENCH, overrides=[f"engine.{k}={v}" for k, v in engine.items()])


@pytest.mark.parametrize("gpu_memory", ["80GiB", "48GiB", "30GiB", "16GiB"])
def test_auto_keeps_the_most_layers_that_fit_beside_the_peak_the_reserve_and_the_margin(gpu_memory):
    machine = Machine.from_preset("h100-512gb").override(gpu_memory=gpu_memory)
    plan = plan_run(bench(gpu_resident="auto"), machine)
    count, layout = plan.run.resident_layers, build_layout(plan.cfg.model)
    stages = layout.resident_stages(count, plan.run.resident_vocab)  # every layer: the embedding and head too
    assert plan.run.resident_vocab == (count == len(layout.layers))
    assert plan.gpu["GPU-resident layers"] == resident_bytes(plan.run, stages)
    without = plan.gpu_peak - plan.gpu["GPU-resident layers"]
    budget = machine.gpu_memory - GPU_RESERVE_BYTES - RESIDENT_MARGIN_BYTES - without
    assert plan.gpu["GPU-resident layers"] <= budget and plan.fits
    if count < len(layout.layers):  # one more would not have fitted
        assert resident_bytes(plan.run, layout.resident_stages(count + 1)) > budget
    # 16 layers of 202 M parameters at 16 B each (fp32 master and moments, bf16 gradient and compute copy).
    expected = {"80GiB": 16, "48GiB": 10, "30GiB": 4, "16GiB": 0}[gpu_memory]
    assert count == expected
    if count:
        assert plan.gpu["GPU-resident layers"] // sum(s.numel for s in stages) == 16


def test_auto_is_none_without_a_gpu_or_where_the_tier_does_not_apply():
    machine = Machine.from_preset("h100-512gb")
    assert plan_run(bench(gpu_resident="auto", device="cpu"), machine).run.resident_layers == 0
    bf16 = load_config(BENCH, overrides=["engine.gpu_resident=auto", "optimizer.moment_dtype=bfloat16"])
    plan = plan_run(bf16, machine)
    assert plan.run.resident_layers == 0
    assert "GPU-resident tier (engine.gpu_resident=auto): none (optimizer.moment_dtype=float32)" in format_plan(plan)
    assert plan_run(bench(gpu_resident="none"), machine).run.resident_layers == 0
    assert plan_run(bench(), machine).run == plan_run(bench(gpu_resident="auto"), machine).run  # auto by default


def test_an_explicit_count_counts_in_the_gpu_memory_check():
    machine = Machine.from_preset("h100-512gb").override(gpu_memory="40GiB")
    plan = plan_run(bench(gpu_resident=16), machine)
    assert plan.run.resident_layers == 16 and not plan.fits
    assert any(p.startswith("GPU memory: ") for p in plan.problems)
    assert plan_run(bench(gpu_resident=6), machine).fits


def test_plan_prints_the_resident_layers_their_memory_and_the_expected_speed(capsys):
    assert main(["plan", BENCH, "--machine", "h100-512gb", "--set", "engine.gpu_resident=auto"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("GPU-resident tier"))
    assert line.startswith("GPU-resident tier (engine.gpu_resident=auto): layers 0-15 (16 of 16) with the embedding "
                           "and LM head (3.5 B params): 52.22 GiB of GPU memory (16.0 B/param)")
    assert "  chosen: every layer and the embedding and LM head fit, and the speed model predicts it faster" in out
    speeds = next(x for x in out.splitlines() if "tok/s with them" in x)
    with_tier, without = (float(x.split()[0].replace(",", "")) for x in speeds.split("expected ")[1].split(", ")[:2])
    assert with_tier > without
    assert f"{with_tier:,.0f}" in next(x for x in out.splitlines() if x.strip().startswith("tok/s"))
    assert "  GPU-resident layers                        52.22 GiB" in out
    assert main(["plan", BENCH, "--machine", "h100-512gb", "--set", "engine.gpu_resident=none"]) == 0
    assert "GPU-resident" in capsys.readouterr().out  # the table's row, at 0
    assert main(["plan", BENCH, "--machine", "h100-512gb", "--set", "engine.gpu_resident=4"]) == 0
    assert "GPU-resident tier (engine.gpu_resident=4): layers 0-3 (4 of 16" in capsys.readouterr().out


@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clip", "noclip"])
def test_resident_layers_take_no_copies_and_no_cpu_update_in_the_speed_model(clip):
    cfg = load_config(BENCH, overrides=[f"optimizer.grad_clip={clip}"])
    profile = Machine.from_preset("h100-512gb").profile
    layout = build_layout(cfg.model)
    runs = {k: estimate(cfg, profile, resident=k) for k in (0, 8, 16)}
    streamed_share = {k: 1 - sum(s.numel for s in layout.resident_stages(k)) / layout.num_params for k in runs}
    for k, est in runs.items():
        assert est.optimizer_seconds == pytest.approx(runs[0].optimizer_seconds * streamed_share[k], rel=1e-9)
        assert est.d2h_seconds == pytest.approx(runs[0].d2h_seconds * streamed_share[k], rel=1e-9)
    assert runs[16].h2d_seconds < runs[8].h2d_seconds < runs[0].h2d_seconds
    # The GPU does the resident updates: a little more busy time. With clipping on the streamed run waits for the
    # CPU optimizer, and the tier takes that wait away; with clipping off the GPU is already nearly the bound,
    # and each resident layer trades its (hidden) CPU update for a few milliseconds of GPU time.
    assert runs[0].compute_seconds < runs[16].compute_seconds < 1.05 * runs[0].compute_seconds
    if clip:
        assert runs[0].bound == "CPU optimizer" and runs[16].bound == "GPU compute"
        assert runs[16].step_seconds < runs[8].step_seconds < 0.85 * runs[0].step_seconds
    else:
        assert runs[16].step_seconds == pytest.approx(runs[0].step_seconds, rel=0.03)


def test_resident_layers_take_no_host_memory():
    """Their master, moments and streaming copy are never allocated (14 B/param with a bf16 copy); the plan's
    host store and pinned memory shrink by exactly that."""
    machine = Machine.from_preset("h100-512gb")
    streamed, resident = plan_run(bench(gpu_resident="none"), machine), plan_run(bench(gpu_resident=6), machine)
    params = sum(s.numel for s in build_layout(streamed.cfg.model).resident_stages(6))
    assert streamed.shm_total - resident.shm_total == 14 * params
    assert streamed.pinned - resident.pinned == 2 * params
    assert "no host copy" in format_plan(resident)
