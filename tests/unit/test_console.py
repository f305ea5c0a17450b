"""What a user reads: the progress line (loss, eval_loss, lr, grad norm, an ETA without the first
step's compile time), parameter counts in human units, eval_loss in `megatrain plot`, and the plan's
advice for a box too small (each fix with its computed saving, printed once)."""

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
    assert "step 4/10" in lines[2] and "eval_loss 1.2500" in lines[2] and lines[2].endswith("eta 6s")


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
    small = ["--host-memory", "64GiB", "--gpu-memory", "80GiB"]
    assert main(["plan", config, *small]) == 2
    out = capsys.readouterr().out
    assert "7.6 B parameters" in out
    fixes = out.split("to shrink the host store (each change on its own):\n")[1].splitlines()
    fixes = [line for line in fixes if line.startswith("  - ")]
    # Clipping on: the bf16 streaming copy holds the gradients, so streaming the master saves nothing.
    assert not any("precision.stream_dtype" in fix for fix in fixes)
    saved = {fix.split(":")[0][4:]: float(m.group(1)) for fix in fixes if (m := re.search(r"saves ([0-9.]+) GiB", fix))}
    assert saved == {"optimizer.moment_dtype=bfloat16 (not full precision)": 28.4,
                     "host.moments_tier=disk with host.disk_dir on an NVMe disk (slower": 53.3}
    assert out.count("optimizer.moment_dtype=bfloat16 (not full precision)") == 1
    # The memory-tiers table agrees with the savings it offers.
    assert "moments bfloat16:                       -28.37 GiB RAM" in out
    # Clipping off: the gradients pass through a few slabs, so streaming the master does save the copy.
    assert main(["plan", config, *small, "--set", "optimizer.grad_clip=0"]) == 2
    out = capsys.readouterr().out
    assert re.search(r"  - precision.stream_dtype=float32 \(stream the master.*: saves 1[0-9].[0-9] GiB", out)
