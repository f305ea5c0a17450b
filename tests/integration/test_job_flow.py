"""The README's job flow on a real Ray head, as a user runs it: `megatrain cluster start`, `ray job submit`,
`ray job stop` at a random step, a second submit with `--resume auto` from another working directory, and
the metrics seen through a real Prometheus with the megatrain Grafana dashboard's queries.

The cluster lives in a temporary HOME (its token, cluster.env and the ~/megatrain storage root) and a
temporary tree of its own, so a cluster or token of the user's is never touched.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from megatrain_ray.observe.grafana import dashboard, panel_queries
from tests.conftest import REPO, prepared_data, tiny_raw
from tests.integration.test_runtime import LOOPBACK, listening_sockets

pytestmark = pytest.mark.ray
STEPS = 200  # the job runs on while Prometheus warms up (about 40 to 60 steps here); the resume does the rest


def job_config(directory: Path, data: Path) -> None:
    raw = tiny_raw(train={"steps": STEPS, "output_dir": "runs/flow", "eval_every": 5, "log_every": 10},
                   checkpoint={"every": 0}, runtime={"mode": "ray", "heartbeat_interval_s": 1})
    raw["data"] = {**raw["data"], "path": str(data), "seq_len": 32}
    directory.mkdir()
    (directory / "job.yaml").write_text(yaml.safe_dump(raw))


def run(*args: str, env: dict, timeout: int = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=timeout, **kwargs)


def losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def prometheus_query(base: str, expr: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr.replace("$run", ".*")})
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())["data"]["result"]


def start_prometheus(session: Path, workdir: Path, env: dict) -> tuple[subprocess.Popen, str]:
    """Debian's prometheus, scraping what Ray's generated config scrapes (every node's metrics agent),
    every second."""
    from megatrain_ray.driver.ray_setup import free_port

    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "ray", "file_sd_configs": [
            {"files": [str(session / "prom_metrics_service_discovery.json")], "refresh_interval": "1s"}]}]}))
    process = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                                f"--web.listen-address=127.0.0.1:{port}"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    return process, f"http://127.0.0.1:{port}"


def test_job_stop_saves_and_a_resubmit_from_elsewhere_resumes_bit_identically(tmp_path):
    if not shutil.which("prometheus"):
        pytest.skip("needs Debian's prometheus (apt-get install prometheus; .ci/run installs it)")
    bindir = os.path.dirname(sys.executable)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), PATH=bindir + os.pathsep + env["PATH"], PYTHONPATH=REPO,
               RAY_metrics_report_interval_ms="500")  # export every 0.5 s rather than 10 s: a short job
    private = Path(tempfile.mkdtemp(prefix="mt-", dir="/tmp")) / "t"  # short: Ray's socket paths live below it
    data = prepared_data(tmp_path / "data", tiny_raw()["model"]["vocab_size"])
    first_dir, second_dir = tmp_path / "checkout", tmp_path / "elsewhere"
    job_config(first_dir, data)
    job_config(second_dir, data)
    # The uninterrupted reference run trains beside the cluster's start and the job (it is needed only at the
    # end): the cluster mostly waits on its processes' start, so the two overlap on a small machine.
    reference = subprocess.Popen([sys.executable, "-m", "megatrain_ray", "train", "job.yaml", "--local", "--set",
                                  f"train.output_dir={tmp_path / 'reference'}"], env=env, cwd=first_dir,
                                 stdout=subprocess.DEVNULL, stderr=(tmp_path / "reference.log").open("w"))

    started = run("megatrain", "cluster", "start", "--temp-dir", str(private), env=env, cwd=first_dir)
    assert started.returncode == 0, started.stderr
    exports = dict(line.removeprefix("export ").split("=", 1) for line in started.stdout.splitlines()
                   if line.startswith("export "))
    env.update(exports)
    prometheus = None
    try:
        session = Path(exports["MEGATRAIN_CLUSTER_DIR"]) / "session_latest"
        assert stat_mode(private) == 0o700
        assert (session / "metrics" / "grafana" / "dashboards" / "megatrain_grafana_dashboard.json").is_file()
        prometheus, prometheus_url = start_prometheus(session, tmp_path, env)
        stop_wait = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "120"}})
        submit = ["ray", "job", "submit", "--runtime-env-json", stop_wait, "--metadata-json",
                  json.dumps({"job_name": "flow"}), "--working-dir", "."]
        train = ["--", "megatrain", "train", "job.yaml"]
        for _ in range(20):  # right after the head starts the dashboard may have no job agent yet
            first = run(*submit, "--submission-id", f"flow-first-{_}", "--no-wait", *train, env=env, cwd=first_dir)
            if "No available agent" not in first.stdout + first.stderr:
                break
            time.sleep(3)
        assert first.returncode == 0, first.stdout + first.stderr
        submission = f"flow-first-{_}"
        metrics = home / "megatrain" / "runs" / "flow" / "metrics.jsonl"  # relative output: the storage root

        # Every panel of the dashboard has data in Prometheus while the job runs.
        missing, deadline = list(panel_queries()), time.monotonic() + 120
        while missing and time.monotonic() < deadline:
            missing = [q for q in missing if not prometheus_query(prometheus_url, q)]
            time.sleep(1)
        assert not missing, (f"panels without data: {missing}; job log: "
                             f"{run('ray', 'job', 'logs', submission, env=env).stdout[-3000:]}")
        loss = prometheus_query(prometheus_url, 'ray_megatrain_loss{run=~".*"}')[0]["metric"]
        assert loss["submission"] == submission and loss["run"] and loss["model"].startswith("llama-")
        assert "submission" in json.dumps(dashboard()["templating"])

        # Every socket of the cluster and of the job listens on loopback.
        from megatrain_ray.driver.head import _cluster_processes

        tree = set(_cluster_processes(Path(exports["MEGATRAIN_CLUSTER_DIR"])))
        sockets = [s for s in listening_sockets() if s[2] in tree]
        assert len(sockets) >= 5 and not [s for s in sockets if s[0] not in LOOPBACK], sockets

        # ray job stop at a random step: the step finishes, a checkpoint is written, the driver exits 143.
        stop_at = len(metrics.read_text().splitlines()) + random.randrange(3, 15)
        assert stop_at < STEPS - 10, "the job ran too far while Prometheus warmed up"
        while len(metrics.read_text().splitlines()) < stop_at:
            time.sleep(0.05)
        stopped = run("ray", "job", "stop", submission, env=env, timeout=200)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        log = run("ray", "job", "logs", submission, env=env).stdout
        done = len(metrics.read_text().splitlines())
        assert "stopped by signal 15" in log and f"checkpoint of step {done}" in log, log[-3000:]
        assert done < STEPS

        # A second submit of the same config from another directory continues the run bit for bit.
        second = run(*submit, "--submission-id", "flow-second", *train, "--resume", "auto", env=env, cwd=second_dir)
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        assert f"resuming at step {done}" in second.stdout
        assert reference.wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()[-3000:]
        assert losses(metrics) == losses(tmp_path / "reference" / "metrics.jsonl")
        assert stat_mode(metrics.parent) == 0o700  # the run's metrics and checkpoints are the user's alone

        # Without the token the job API refuses.
        denied = run("ray", "job", "list", env={**env, "RAY_AUTH_MODE": "disabled"}, timeout=60)
        assert denied.returncode != 0
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()
        if prometheus is not None:
            prometheus.kill()
            prometheus.wait()
        run("megatrain", "cluster", "stop", env=env, timeout=120)
        shutil.rmtree(private.parent, ignore_errors=True)


def stat_mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o777
