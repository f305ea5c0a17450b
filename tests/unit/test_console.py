"""What a user reads: the progress line (loss, eval_loss on the steps that computed it, lr, grad norm, an ETA
without the first step's compile time), parameter counts in human units, eval_loss in `megatrain plot`, the
plan's advice for a box too small (each fix with its computed saving, printed once), and the disk a run takes
(the plan's checkpoint and export figures, the line at the end of a run)."""

from __future__ import annotations

import io
import os
import re

import pytest

from megatrain_ray.__main__ import main
from megatrain_ray.observe import metrics as metrics_module
from megatrain_ray.observe import plot as plot_module
from megatrain_ray.observe.metrics import Progress
from megatrain_ray.units import human_count
from tests.conftest import REPO


@pytest.mark.parametrize("n, text", [(12, "12"), (12_345, "12.3 K"), (593_000, "0.6 M"), (134_515_008, "135 M"),
                                     (7.6e9, "7.6 B"), (70.55e9, "70.5 B"), (119.8e9, "120 B")])
def test_human_count(n, text):
    assert human_count(n) == text


def _record(step: int, **extra) -> dict:
    return {"step": step, "loss": 2.0 - step / 10, "lr": 1e-4, "grad_norm": 0.5, "tok_per_s": 1000.0,
            "tflops": 1.0, **extra}


def test_progress_line_shows_eval_lr_gnorm_and_an_eta_without_the_first_step(monkeypatch):
    clock = iter([100.0, 101.0, 102.0, 103.0])  # the first step (compile) ends at 100 s, then 1 s a step
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    stream = io.StringIO()
    progress = Progress(total=10, every=2, stream=stream)
    progress.update(_record(0))
    progress.update(_record(1))
    progress.update(_record(2, eval_loss=1.25))  # an eval step prints even between log lines
    progress.update(_record(3))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0] == ("[megatrain] step 2/10 loss 1.9000 lr 1.00e-04 gnorm 0.5 1,000 tok/s 1.0 TFLOPS eta 8s")
    assert "eval_loss 1.2500" in lines[1] and lines[1].endswith("eta 7s")
    # Step 4 computed no eval_loss: its line shows none (not step 3's, as if it were new)
    assert "step 4/10" in lines[2] and "eval_loss" not in lines[2] and lines[2].endswith("eta 6s")


def test_a_grpo_line_shows_the_reward_and_completion_length_and_an_eval_reward_step_prints(monkeypatch):
    clock = iter([100.0, 101.0])
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    stream = io.StringIO()
    progress = Progress(total=10, every=5, stream=stream)
    grpo = {"reward": 0.5625, "completions/mean_length": 7.5}
    progress.update(_record(0, **grpo))
    progress.update(_record(1, **grpo, eval_reward=1.40625))  # an evaluation prints between log lines
    (line,) = stream.getvalue().splitlines()
    assert line.startswith("[megatrain] step 2/10 loss 1.9000 reward 0.562 length 7.5 eval_reward 1.406 lr")
    assert "eval_loss" not in line


def test_on_a_terminal_an_eval_step_keeps_its_line_and_later_bars_show_no_eval_loss(monkeypatch):
    clock = iter([100.0, 101.0, 102.0])
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    stream = io.StringIO()
    monkeypatch.setattr(stream, "isatty", lambda: True)
    progress = Progress(total=10, every=1, stream=stream)
    for record in (_record(0), _record(1, eval_loss=1.25), _record(2)):
        progress.update(record)
    bars = stream.getvalue().split("\r")[1:]
    assert "eval_loss 1.2500" in bars[1] and bars[1].endswith("\n")  # stays on screen
    assert "eval_loss" not in bars[0] + bars[2] and not bars[2].endswith("\n")


def test_progress_eta_waits_for_a_second_step(monkeypatch):
    clock = iter([50.0])
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    stream = io.StringIO()
    Progress(total=1000, every=1, first=40, stream=stream).update(_record(40))
    assert stream.getvalue().rstrip().endswith("eta --")


def test_plot_draws_eval_loss_beside_the_training_loss(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    records = [dict(_record(s), **({"eval_loss": 3.0 - s / 10} if s % 2 else {})) for s in range(6)]
    (run / "metrics.jsonl").write_text("\n".join(map(__import__("json").dumps, records)) + "\n")
    drawn = {}
    monkeypatch.setattr(plot_module, "line_chart", lambda path, lines, *a, **k: drawn.setdefault(path.name, lines))
    plot_module.plot_run(run)
    labels = {line.label: line.points for line in drawn["loss.png"]}
    assert labels["eval_loss"] == [(1, 2.9), (3, 2.7), (5, 2.5)] and len(labels["loss (train)"]) == 6


def test_plan_advice_counts_the_gpu_resident_layers_as_the_plan_resolved_them(capsys):
    """engine.gpu_resident=auto keeps 15 of 28 layers on an 80 GiB GPU, with two speculative stages (the LM head and
    the last layer, both on the host). Dropping speculation saves their second sets and saved gradients, 14 bytes a
    parameter. Read as 0 resident layers, the store it was weighed against held all 28 layers, and the fix looked
    like it saved nothing."""
    from megatrain_ray.config.load import load_config
    from megatrain_ray.model.layout import build_layout

    config = os.path.join(REPO, "configs", "shapes", "qwen2.5-7b.yaml")
    assert main(["plan", config, "--host-memory", "40GiB", "--gpu-memory", "80GiB", "--set", "engine.gpu_resident=auto",
                 "--set", "optimizer.speculative_stages=2"]) == 2
    out = capsys.readouterr().out
    assert re.search(r"layers 0-14 \(15 of 28", out)
    layout = build_layout(load_config(config).model)
    second_sets = 14 * (layout.head.numel + layout.layers[-1].numel)
    fix = re.search(r"  - optimizer.speculative_stages=0 \(no second sets.*: saves ([0-9.]+) GiB", out)
    assert fix, out
    assert float(fix.group(1)) == pytest.approx(second_sets / 2**30, abs=0.05)


def test_plan_advice_is_computed_for_the_config_and_printed_once(capsys):
    config = os.path.join(REPO, "configs", "shapes", "qwen2.5-7b.yaml")
    small = ["--host-memory", "64GiB", "--gpu-memory", "80GiB", "--set", "engine.gpu_resident=none"]  # all on the host
    assert main(["plan", config, *small]) == 2
    out = capsys.readouterr().out
    assert "7.6 B parameters" in out
    fixes = out.split("to shrink the host store (each change on its own):\n")[1].splitlines()
    fixes = [line for line in fixes if line.startswith("  - ")]
    # Clipping on: the bf16 streaming copy holds the gradients, so streaming the master saves nothing.
    assert not any("precision.stream_dtype" in fix for fix in fixes)
    saved = {fix.split(":")[0][4:]: float(m.group(1)) for fix in fixes if (m := re.search(r"saves ([0-9.]+) GiB", fix))}
    assert saved == {"optimizer.moment_dtype=bfloat16 (not full precision)": 28.4,
                     "host.moments_tier=disk with host.disk_dir on an NVMe disk (slower": 53.3,
                     # 7.6 B x (14 - 8.03) B/param: the lean state with int8 moments, clipping's 2 B/param kept
                     "optimizer.state=lean with optimizer.lean_moments=int8 (a bf16 master with its compensation, "
                     "8-bit moments; not full precision)": 42.3}
    assert out.count("optimizer.moment_dtype=bfloat16 (not full precision)") == 1
    # The memory-tiers table agrees with the savings it offers.
    assert "moments bfloat16:                       -28.37 GiB RAM" in out
    # Clipping off: the gradients pass through a few slabs, so streaming the master does save the copy.
    assert main(["plan", config, *small, "--set", "optimizer.grad_clip=0"]) == 2
    out = capsys.readouterr().out
    assert re.search(r"  - precision.stream_dtype=float32 \(stream the master.*: saves 1[0-9].[0-9] GiB", out)


def test_plan_prints_one_checkpoint_what_keep_keeps_and_the_export_in_config_jsons_dtype(tmp_path):
    """A full fine-tune keeps checkpoint.keep checkpoints of 12 B/param (fp32 master, two fp32 moments); the export
    is in the dtype model.path's config.json names (Qwen2.5-7B-Instruct's: bfloat16), float32 only when asked."""
    from megatrain_ray.config.load import load_config
    from megatrain_ray.model.layout import build_layout
    from megatrain_ray.planning.machine import Machine
    from megatrain_ray.planning.memory import plan_run
    from megatrain_ray.planning.plan_text import format_plan

    model = os.path.join(REPO, "tests", "fixtures", "hub_configs", "Qwen--Qwen2.5-7B-Instruct")
    def config(*overrides: str):
        raw = {"model": {"path": model}, "data": {"path": "synthetic", "seq_len": 256, "batch_size": 1},
               "train": {"steps": 10, "export_dir": str(tmp_path / "exp")}, "checkpoint": {"every": 3, "keep": 2}}
        return load_config(raw=raw, overrides=list(overrides))

    machine = Machine(2**40, 2**40, 2**40, None, 80 * 2**30, described=True)
    cfg = config()
    params = build_layout(cfg.model).num_params
    one, export = params * 12 / 2**30, params * 2 / 2**30
    text = format_plan(plan_run(cfg, machine))
    assert re.search(rf"one checkpoint +{one:.2f} GiB  \(master weights, both AdamW moments\)", text), text
    # saves after steps 3, 6 and 9, and at the end: two kept, three for a moment while the next is written
    assert re.search(rf"kept: 2 \(checkpoint.keep=2\) +{2 * one:.2f} GiB  \(of 4 save\(s\) in 10 steps; 3 for a "
                     r"moment", text), text
    assert re.search(rf"export \(bfloat16\) +{export:.2f} GiB  \(train.export_dtype=auto: the dtype .*config.json "
                     r"names\)", text), text
    assert re.search(rf"on disk at the end +{2 * one + export:.2f} GiB", text), text
    asked = format_plan(plan_run(config("train.export_dtype=float32"), machine))
    assert re.search(rf"export \(float32\) +{2 * export:.2f} GiB  \(train.export_dtype=float32; "
                     r"train.export_dtype=bfloat16 halves it\)", asked), asked


def test_the_end_of_a_run_says_what_its_directory_checkpoints_and_export_take(tmp_path):
    from megatrain_ray.store.checkpoint import CheckpointDir
    from megatrain_ray.store.disk_use import run_disk_summary

    run = tmp_path / "run"
    checkpoints = CheckpointDir(run / "checkpoints")
    for step in (3, 6, 9):  # keep 2: the first goes
        partial = checkpoints.partial(step, "r")
        (partial / "s.bin").write_bytes(os.urandom(2**20))  # incompressible: du counts it whole
        checkpoints.commit(partial, step, {"files": [{"path": "s.bin", "bytes": 2**20, "crc32": 0, "stage": 0}]},
                           keep=2)
    (run / "metrics.jsonl").write_text("{}\n")
    export = tmp_path / "exp"
    export.mkdir()
    (export / "model.safetensors").write_bytes(os.urandom(2**19))
    text = run_disk_summary(run, run / "checkpoints", 2, str(export), ("float32", "train.export_dtype=auto: ..."))
    m = re.match(rf"disk: {re.escape(str(run))} takes ([0-9.]+) MiB, ([0-9.]+) MiB of it 2 checkpoint\(s\) of "
                 rf"([0-9.]+) MiB \(checkpoint.keep=2\); the export {re.escape(str(export))} ([0-9]+) KiB \(float32: "
                 r"train.export_dtype=auto: \.\.\.; train.export_dtype=bfloat16 halves it\)$", text)
    assert m, text
    total, kept, one, exported = map(float, m.groups())
    assert 2.0 <= kept <= total < 2.2 and 1.0 <= one < 1.1 and 512 <= exported < 600  # blocks as du counts them
