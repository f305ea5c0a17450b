"""Speculative updates (optimizer.speculative_stages): stages updated during the backward, before the step's
gradient norm is known, into their second set of state, train bit for bit as with every update waiting for the
norm, through steps that clip, steps that do not, and a dropped step; checkpoints save the current set; and the
plan counts the second sets."""

from __future__ import annotations

import os

import pytest
import torch

from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.model.layout import build_layout
from megatrain_ray.planning.machine import Machine
from megatrain_ray.planning.memory import plan_run
from megatrain_ray.planning.plan import COMPILED_NODE_BYTES
from megatrain_ray.planning.plan_text import format_plan
from tests.conftest import REPO, tiny_config


def train(cfg) -> tuple[list[dict], dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    with Trainer(cfg) as trainer:
        records = [trainer.step(s) for s in range(cfg.train.steps)]
        return records, trainer.master_weights(), trainer.read_moments("exp_avg"), trainer.read_moments("exp_avg_sq")


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


BF16_STREAM = {"master_dtype": "float32", "compute_dtype": "bfloat16", "stream_dtype": "bfloat16"}
"""Gradients land in the bf16 streaming copy, which the update overwrites with the new weights."""


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_speculative_updates_train_bit_for_bit_as_waiting_for_the_norm(tmp_path, moments):
    steps = {"steps": 8}
    probe, *_ = train(tiny_config(tmp_path / "probe", train=steps, precision=BF16_STREAM))
    clip = sorted(r["grad_norm"] for r in probe)[len(probe) // 2]  # about half the steps clip
    runs = {}
    for count in (0, 3):  # 3: the LM head and the last two of the three layers
        cfg = tiny_config(tmp_path / f"spec{count}", train=steps, precision=BF16_STREAM,
                          optimizer={"grad_clip": clip, "workers": 2, "speculative_stages": count,
                                     "moment_dtype": moments},
                          fault={"drill": "nan_grad@5"})
        runs[count] = train(cfg)
    (records, weights, m, v), (spec_records, spec_weights, spec_m, spec_v) = runs[0], runs[3]
    norms = [r["grad_norm"] for r in records if not r["skipped"]]
    assert any(n > clip for n in norms) and any(n < clip for n in norms)  # both ways were taken
    assert [r["skipped"] for r in records] == [s == 5 for s in range(8)]
    # The three speculative updates are redone on the steps that clip and on the dropped one, kept on the others.
    assert [r["speculative_redone"] for r in spec_records] == \
        [3 if r["skipped"] or r["grad_norm"] + 1e-6 > clip else 0 for r in records]
    assert "speculative_redone" not in records[0]
    assert [r["loss"] for r in spec_records] == [r["loss"] for r in records]
    assert equal(spec_weights, weights) and equal(spec_m, m) and equal(spec_v, v)


def test_speculative_stages_are_the_first_gradients_of_the_backward(tmp_path):
    layout = build_layout(tiny_config(tmp_path).model)  # embed 0, layers 1..3, head 4
    assert layout.speculative_stages(2, 0) == (4, 3)
    assert layout.speculative_stages(9, 1) == (4, 3, 2)  # never a resident layer, never the embedding
    assert layout.speculative_stages(0, 0) == ()


@pytest.mark.parametrize("sections, needs", [
    ({"optimizer": {"grad_clip": 0.0}}, "optimizer.grad_clip > 0"),
    ({"host": {"moments_tier": "disk", "disk_dir": "/tmp"}}, "host.moments_tier=ram"),
    ({"finetune": {"method": "lora"}}, "finetune.method=full"),
    ({"precision": {"master_dtype": "float32", "compute_dtype": "float32"}}, "a streaming copy apart")])
def test_speculation_refuses_what_it_cannot_take_back(tmp_path, sections, needs):
    optimizer = {"speculative_stages": 2, **sections.pop("optimizer", {})}
    sections.setdefault("precision", BF16_STREAM)
    with pytest.raises(ConfigError, match=r"optimizer\.speculative_stages.*" + needs.replace(".", r"\.")):
        tiny_config(tmp_path, optimizer=optimizer, **sections)


def test_the_plan_counts_the_second_sets(tmp_path):
    machine = Machine.detect("/dev/shm").override(host_memory="64GiB")
    plans = [plan_run(tiny_config(tmp_path / str(count), optimizer={"speculative_stages": count},
                                  precision=BF16_STREAM), machine) for count in (0, 2)]
    layout = build_layout(tiny_config(tmp_path / "layout").model)
    numel = layout.head.numel + layout.layers[-1].numel
    added = {kind: plans[1].host.get(kind, 0) - plans[0].host.get(kind, 0)
             for kind in ("alt_master", "alt_exp_avg", "alt_exp_avg_sq", "saved_grad", "parity")}
    assert added == {"alt_master": 4 * numel, "alt_exp_avg": 4 * numel, "alt_exp_avg_sq": 4 * numel,
                     "saved_grad": 2 * numel, "parity": 2 * 4}  # bf16 gradients; one int32 parity per stage
    assert plans[1].shm_total - plans[0].shm_total == 14 * numel + 8


def test_speculative_updates_through_ray_match_the_process(tmp_path, ray_session):
    """Shard actors own the second sets in shared memory; two optimizer worker actors take and redo updates."""
    common = {"train": {"steps": 6}, "precision": BF16_STREAM}
    probe, *_ = train(tiny_config(tmp_path / "probe", **common))
    clip = sorted(r["grad_norm"] for r in probe)[len(probe) // 2]
    optimizer = {"grad_clip": clip, "workers": 2, "speculative_stages": 2}
    local = train(tiny_config(tmp_path / "local", optimizer={**optimizer, "speculative_stages": 0}, **common))
    ray = train(tiny_config(tmp_path / "ray", optimizer=optimizer, runtime={"mode": "ray", "dashboard": False},
                            **common))
    assert any(r["grad_norm"] > clip for r in local[0]) and any(r["grad_norm"] < clip for r in local[0])
    assert [r["loss"] for r in ray[0]] == [r["loss"] for r in local[0]]
    assert all(equal(a, b) for a, b in zip(ray[1:], local[1:]))


def test_a_checkpoint_saves_the_current_set_and_resumes_without_speculation(tmp_path):
    """Stages whose current state is their second set when the checkpoint is taken: it holds that set, and a run
    resumed from it without speculation ends where a run that never speculated ends."""
    clip = {"grad_clip": 1e6}  # no step clips: every speculative update is kept, the sets switch each step
    reference = train(tiny_config(tmp_path / "ref", train={"steps": 7}, precision=BF16_STREAM, optimizer=clip))
    cfg = tiny_config(tmp_path / "cut", train={"steps": 7}, precision=BF16_STREAM,
                      optimizer={**clip, "speculative_stages": 2})
    with Trainer(cfg) as trainer:
        for step in range(3):  # an odd number of switches: the head and the last layer are in their second sets
            trainer.step(step)
        trainer.next_step = 3
        trainer.save(wait=True)
    resumed_cfg = tiny_config(tmp_path / "cut", train={"steps": 7}, precision=BF16_STREAM, optimizer=clip)
    with Trainer(resumed_cfg, resume="auto") as trainer:
        assert trainer.next_step == 3
        trainer.train()
        weights, exp_avg_sq = trainer.master_weights(), trainer.read_moments("exp_avg_sq")
    assert equal(weights, reference[1]) and equal(exp_avg_sq, reference[3])


def test_the_plan_keeps_rays_memory_margin_and_offers_to_drop_the_second_sets(tmp_path):
    """Ray's memory monitor kills a worker above 95 % of the node's RAM: a store that fits the RAM but not that is
    refused before anything is allocated (under Ray, not in-process), and the fixes and tiers that cannot keep
    speculative updates (master streamed, moments on disk) are offered without them."""
    model = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_layers": 8,
             "num_attention_heads": 8, "num_key_value_heads": 8}  # each fix saves above the plan's 0.01 GiB floor
    cfg = tiny_config(tmp_path / "ray", model=model, optimizer={"speculative_stages": 2}, precision=BF16_STREAM,
                      runtime={"mode": "ray", "dashboard": False})
    needed = plan_run(cfg, Machine.detect("/dev/shm").override(host_memory="64GiB")).host_total
    box = Machine.detect("/dev/shm").override(host_memory=str(int(needed * 1.02)))
    plan = plan_run(cfg, box)
    assert not plan.fits and "less what Ray's memory monitor keeps free" in plan.problems[0]
    assert plan.host_fixes[0].startswith("optimizer.speculative_stages=0")
    assert "host.moments_tier=disk with host.disk_dir on an NVMe disk and optimizer.speculative_stages=0" in \
        "\n".join(plan.host_fixes)
    text = format_plan(plan)
    assert "moments on disk:" in text and "(no speculative updates)" in text
    in_process = tiny_config(tmp_path / "local", model=model, optimizer={"speculative_stages": 2},
                             precision=BF16_STREAM, runtime={"mode": "local", "dashboard": False})
    assert plan_run(in_process, box).fits


def test_the_plan_offers_the_fastest_speculative_count_that_fits(tmp_path):
    """Clipping on, bound by the CPU optimizer: `megatrain plan` lists the count the speed model puts fastest among
    those that fit the box, with its RAM; none that does not fit, none without clipping."""
    from megatrain_ray.config.load import load_config
    from megatrain_ray.planning.speed import estimate

    def shape(*overrides: str):
        return load_config(os.path.join(REPO, "configs", "shapes", "qwen3-30b-a3b.yaml"),
                           overrides=["model.num_layers=4", "data.batch_size=8", "data.seq_len=8192",
                                      "engine.gpu_resident=none", *overrides])  # every stage's state on the host
    box = Machine.from_preset("h200-128gb")
    predicted = {n: estimate(shape(f"optimizer.speculative_stages={n}"), box.profile).tok_per_s for n in range(6)}
    fastest = max(predicted, key=lambda n: (predicted[n], -n))
    assert fastest > 0 and predicted[fastest] > 1.05 * predicted[0]
    plan = plan_run(shape(), box)
    layout = build_layout(plan.cfg.model)
    second_sets = 14 * sum(layout.stages[i].numel for i in layout.speculative_stages(fastest, 0))
    line = next(line for line in format_plan(plan).splitlines() if "speculative_stages" in line)
    assert line.split()[:4] == ["speculative_stages", f"{fastest}:", f"+{second_sets / 2**30:.2f}", "GiB"]
    assert f"{predicted[fastest]:,.0f} tok/s" in line
    # Fits with no room to spare: Ray's 5 % and the compiled layers' 8 GiB kept, 1 MiB more.
    tight = box.override(host_memory=f"{int((plan.host_total + COMPILED_NODE_BYTES) / 0.95) + 2**20}")
    tight_plan = plan_run(shape(), tight)
    assert tight_plan.fits and tight_plan.compiles_on_gpu
    tight_text = format_plan(tight_plan)
    assert "tok/s" in tight_text.split("memory tiers")[1].splitlines()[0]  # the speed model still weighs the tiers
    assert "speculative_stages" not in tight_text
    assert "speculative_stages" not in format_plan(plan_run(shape("optimizer.grad_clip=0"), box))


@pytest.mark.parametrize("result, ran, fits", [
    ("moe-qwen3-30b-a3b-12l-64k-compiled-head-h200-20261126-041005.json", True, True),
    ("moe-qwen3-30b-a3b-12l-64k-spec1-h200-20261126-072138.json", False, False),
    ("moe-qwen3-30b-a3b-12l-64k-spec2-h200-20261126-063851.json", False, False),
    ("moe-qwen3-30b-a3b-12l-64k-spec1-inprocess-h200-20261126-091405.json", True, False)])
def test_the_plan_refuses_what_rays_memory_monitor_killed(result, ran, fits):
    """The 12-layer Qwen3-30B-A3B width on the 125 GiB H200 box (the h200-128gb preset): the run without
    speculative stages ran; with one or two, Ray's memory monitor killed a worker, and the plan refuses them.
    With one stage compiled in process (no pool of compile workers) it ran, 0.1 GiB under the monitor's threshold:
    the plan, which keeps 8 GiB for a compiled run, still refuses it."""
    import json

    from megatrain_ray.config.load import load_config

    measured = json.load(open(os.path.join(REPO, "benchmarks", "results", result)))
    row = next(r for r in measured["rows"] if r["system"] == "megatrain")
    assert (row["status"] == "ok") == ran, row.get("status")
    cfg = load_config(os.path.join(REPO, measured["config"]), overrides=[
        f"model.num_layers={row['layers']}", f"data.batch_size={row['batch']}", f"data.seq_len={row['seq_len']}",
        "optimizer.workers=2", "engine.gpu_resident=none",  # the box's two workers, whatever cores this machine has;
        *measured["overrides"]])  # streamed, as the runs' default was then
    plan = plan_run(cfg, Machine.from_preset("h200-128gb"))
    assert plan.fits == fits, plan.problems


def test_a_machine_without_a_gpu_keeps_no_room_for_compiled_gpu_layers(tmp_path):
    """The compiled layers' margin (planning/plan.py COMPILED_NODE_BYTES) is for a GPU: with engine.device auto on
    a machine without one, the plan keeps none."""
    cfg = tiny_config(tmp_path, engine={"device": "auto"})
    needed = plan_run(cfg, Machine.detect("/dev/shm").override(host_memory="64GiB")).host_total
    no_gpu = Machine(needed + 2**30, needed + 2**30, needed + 2**30, None, None)
    plan = plan_run(cfg, no_gpu)
    assert plan.fits and not plan.compiles_on_gpu and plan.usable_host == needed + 2**30
