"""The `megatrain` command as a user types it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


def megatrain(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "megatrain_ray", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def shm_segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("megatrain-")}


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


@pytest.mark.ray
def test_train_tiny_through_a_private_ray(tmp_path):
    before = shm_segments()
    out = tmp_path / "run"
    proc = megatrain("train", "configs/tiny.yaml", "--set", f"train.output_dir={out}", "--set", "train.steps=5",
                     "--set", "runtime.dashboard=false")
    assert proc.returncode == 0, proc.stderr
    assert "started a private Ray on 127.0.0.1" in proc.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 5
    assert shm_segments() == before


def test_bad_override_is_one_clear_error_and_allocates_nothing(tmp_path):
    before = shm_segments()
    proc = megatrain("train", "configs/tiny.yaml", "--local", "--set", "optimizer.lr=fast",
                     "--set", f"train.output_dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert "config key 'optimizer.lr' = 'fast'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert shm_segments() == before and not (tmp_path / "run").exists()


def test_an_existing_run_directory_is_never_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    proc = megatrain("train", "configs/tiny.yaml", "--local", "--set", f"train.output_dir={out}")
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_config_command_prints_the_resolved_config():
    proc = megatrain("config", "configs/llama3-8b.yaml", "--set", "optimizer.workers=2")
    assert proc.returncode == 0
    assert "workers: 2" in proc.stdout and "rope_type: llama3" in proc.stdout


@pytest.mark.ray
def test_ray_job_submit_flow_as_in_the_readme(tmp_path):
    """`ray start --head`, then `ray job submit --working-dir . -- megatrain train ...` (token auth on)."""
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PATH": bindir + os.pathsep + os.environ["PATH"]}
    env.pop("RAY_ADDRESS", None)
    ray = os.path.join(bindir, "ray")
    start = subprocess.run([ray, "start", "--head", "--num-cpus=2", "--disable-usage-stats"], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert start.returncode == 0, start.stderr
    try:
        out = tmp_path / "run"
        submit = subprocess.run(
            [ray, "job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", ".", "--",
             "megatrain", "train", "configs/tiny.yaml", "--set", f"train.output_dir={out}", "--set", "train.steps=6"],
            env={**env, "RAY_AUTH_MODE": "token"}, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert submit.returncode == 0, submit.stdout + submit.stderr
        assert "attached to Ray cluster" in submit.stdout + submit.stderr
        assert len((out / "metrics.jsonl").read_text().splitlines()) == 6
        # Without the token the job API refuses: the cluster is not open to anyone on the machine.
        denied = subprocess.run([ray, "job", "list", "--address", "http://127.0.0.1:8265"],
                                env={**env, "RAY_AUTH_MODE": "disabled"}, capture_output=True, text=True, timeout=60)
        assert denied.returncode != 0
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)
