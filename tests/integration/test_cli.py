"""The `megatrain` command as a user types it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest

from tests.conftest import REPO

T = TypeVar("T")


def megatrain(*args: str, timeout: int = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The CLI in a child process (`env`: variables set for it alone); the result's `pid` names the driver (its run
    ids carry it)."""
    env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    with subprocess.Popen([sys.executable, "-m", "megatrain_ray", *args], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            raise
    result = subprocess.CompletedProcess(child.args, child.returncode, out, err)
    result.pid = child.pid
    return result


def side_by_side(*calls: Callable[[], T]) -> list[T]:
    """The results of `calls` (each runs the CLI in a child process) run at once: a child spends its first seconds
    importing on one core, so two independent ones take little more than one on a 2-core machine."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def shm_segments(pid: int) -> set[str]:
    """The shared-memory segments of the run driven by process `pid` (other runs on the machine aside)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith("megatrain-") and f"-{pid}-" in f}


def test_train_tiny_locally_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = megatrain("train", "configs/tiny.yaml", "--local", "--set", f"train.output_dir={out}",
                     "--set", "train.steps=30")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(30))
    for key in ("loss", "lr", "grad_norm", "tokens", "tok_per_s", "tflops", "host_mem_gib", "gpu_peak_gib"):
        assert key in lines[0]
    assert lines[-1]["loss"] < lines[0]["loss"] - 1.0  # bytes: from ln(256) = 5.5 towards ~2.5
    assert "vocab_size: 256" in (out / "config.yaml").read_text()
    # `export RUN_DIR` of a run without train.export_dir: its newest complete checkpoint.
    newest = sorted((out / "checkpoints").glob("step-*"))[-1]
    by_run, by_checkpoint = tmp_path / "by-run", tmp_path / "by-checkpoint"
    plot, *exports = side_by_side(lambda: megatrain("plot", str(out), "--out", str(tmp_path / "plots")),
                                  lambda: megatrain("export", str(out), str(by_run)),
                                  lambda: megatrain("export", str(newest), str(by_checkpoint)))
    assert plot.returncode == 0, plot.stderr
    for name in ("loss.png", "throughput.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r"llama, 0\.[0-9] M params, 1,024 tokens/step", proc.stderr), proc.stderr
    assert re.search(r"step 30/30 loss [0-9.]+ lr [0-9.e+-]+ gnorm [0-9.]+ ", proc.stderr), proc.stderr
    assert [e.returncode for e in exports] == [0, 0], [e.stderr for e in exports]
    assert (by_run / "model.safetensors").read_bytes() == (by_checkpoint / "model.safetensors").read_bytes()


@pytest.mark.ray
def test_train_tiny_through_a_private_ray(private_ray_cli_run):
    """`megatrain train configs/tiny.yaml` (5 steps) without --local: tests/conftest.private_ray_cli_run, whose
    token test_ray_privacy checks."""
    proc, out = private_ray_cli_run["result"], private_ray_cli_run["out"]
    assert proc.returncode == 0, proc.stderr
    assert "started a private Ray on 127.0.0.1" in proc.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 5
    assert not shm_segments(private_ray_cli_run["pid"])


def test_bad_override_is_one_clear_error_and_allocates_nothing(tmp_path):
    proc = megatrain("train", "configs/tiny.yaml", "--local", "--set", "optimizer.lr=fast",
                     "--set", f"train.output_dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert "config key 'optimizer.lr' = 'fast'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not shm_segments(proc.pid) and not (tmp_path / "run").exists()


def test_an_existing_run_directory_is_never_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    proc = megatrain("train", "configs/tiny.yaml", "--local", "--set", f"train.output_dir={out}")
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_config_command_prints_the_resolved_config():
    proc = megatrain("config", "configs/shapes/llama3-8b.yaml", "--set", "optimizer.workers=2")
    assert proc.returncode == 0
    assert "workers: 2" in proc.stdout and "rope_type: llama3" in proc.stdout
