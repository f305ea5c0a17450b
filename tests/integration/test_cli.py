"""The `megatrain` command as a user types it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import REPO


def megatrain(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """The CLI in a child process; the result's `pid` names the driver (its run ids carry it)."""
    env = {**os.environ, "PYTHONPATH": REPO}
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
    plot = megatrain("plot", str(out), "--out", str(tmp_path / "plots"))
    assert plot.returncode == 0, plot.stderr
    for name in ("loss.png", "throughput.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.ray
def test_train_tiny_through_a_private_ray(tmp_path):
    out = tmp_path / "run"
    proc = megatrain("train", "configs/tiny.yaml", "--set", f"train.output_dir={out}", "--set", "train.steps=5",
                     "--set", "runtime.dashboard=false")
    assert proc.returncode == 0, proc.stderr
    assert "started a private Ray on 127.0.0.1" in proc.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 5
    assert not shm_segments(proc.pid)


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
    proc = megatrain("config", "configs/llama3-8b.yaml", "--set", "optimizer.workers=2")
    assert proc.returncode == 0
    assert "workers: 2" in proc.stdout and "rope_type: llama3" in proc.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return ""


@pytest.mark.ray
def test_ray_job_submit_flow_as_in_the_readme(tmp_path):
    """`ray start --head --resources="$(megatrain resources)"`, then `ray job submit --working-dir . --
    megatrain train ...` (token auth on), watched through the metrics agent's Prometheus endpoint.

    Metrics path: the Prometheus endpoint. `ray[default]` (a pinned dependency) brings the dashboard
    and its metrics agent, which serves the `ray.util.metrics` gauges of the job's driver on
    --metrics-export-port; the test scrapes it while the job runs (no Prometheus server needed) and
    asserts the endpoint was the path taken. Only when the agent is missing (a bare `ray` install)
    does it fall back to the job's metrics.jsonl, and says so in the skip reason.
    """
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PATH": bindir + os.pathsep + os.environ["PATH"],
           "RAY_metrics_report_interval_ms": "500"}  # export every 0.5 s rather than 10 s: a short job
    env.pop("RAY_ADDRESS", None)
    ray = os.path.join(bindir, "ray")
    resources = megatrain("resources").stdout.strip()
    metrics_port = free_port()
    start = subprocess.run([ray, "start", "--head", "--num-cpus=2", "--disable-usage-stats", f"--resources={resources}",
                            f"--metrics-export-port={metrics_port}"], env=env, cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    assert start.returncode == 0, start.stderr
    try:
        out = tmp_path / "run"
        prometheus, seen = f"http://127.0.0.1:{metrics_port}/metrics", ""
        for _ in range(20):
            submit = subprocess.Popen(
                [ray, "job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", ".", "--", "megatrain",
                 "train", "configs/tiny.yaml", "--set", f"train.output_dir={out}", "--set", "train.steps=40",
                 # a heartbeat round every second (default 5 s): the 40 steps may take less than 5 s, and the
                 # heartbeat-age gauge exists only once a round ran while the job is alive
                 "--set", "runtime.heartbeat_interval_s=1"],
                env={**env, "RAY_AUTH_MODE": "token"}, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True)
            while submit.poll() is None:  # the driver's gauges live as long as the job: read them while it runs
                text = scrape(prometheus)
                if "ray_megatrain_loss{" in text and "ray_megatrain_actor_heartbeat_age_seconds{" in text:
                    seen = text
                time.sleep(0.5)
            log = submit.stdout.read()
            # Right after `ray start` the dashboard may have no job agent yet ("try again later", says Ray):
            # on a loaded 2-core CI machine that took longer than the first submit.
            if "No available agent to submit job" not in log:
                break
            time.sleep(3)
        assert submit.returncode == 0, log
        for expected in ("attached to Ray cluster", "optimizer worker(s)", "topology ("):
            assert expected in log, log
        assert "declares no numa_node" not in log, "the cluster's --resources should have been used"
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(lines) == 40
        if not seen and not scrape(prometheus):
            pytest.skip("no metrics agent answers (dashboard extra missing): checked the job's metrics.jsonl only")
        loss = [ln for ln in seen.splitlines() if ln.startswith("ray_megatrain_loss{")]
        assert loss, "the Prometheus endpoint served no megatrain_loss while the job ran"
        assert 'model="llama-' in loss[0] and 'run="' in loss[0]
        for name in ("tokens_per_second", "model_tflops", "h2d_gbps", "gpu_busy_fraction", "optimizer_seconds",
                     "optimizer_hidden_fraction", "host_memory_bytes", "gpu_peak_bytes", "grad_norm", "lr"):
            assert f"ray_megatrain_{name}{{" in seen, name
        assert 'actor="gpu"' in seen and 'actor="optim0"' in seen
        # Without the token the job API refuses: the cluster is not open to anyone on the machine.
        denied = subprocess.run([ray, "job", "list", "--address", "http://127.0.0.1:8265"],
                                env={**env, "RAY_AUTH_MODE": "disabled"}, capture_output=True, text=True, timeout=60)
        assert denied.returncode != 0
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)
