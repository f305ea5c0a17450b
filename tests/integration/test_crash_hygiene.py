"""Nothing of a run outlives it: a kill -9 of the driver frees the run's shared memory and ends its private
Ray (agents included) within seconds, and a /dev/shm that fills up while the store is allocated gives one
clear error and leaves no segment (megatrain_ray/system/guardian.py, store/segments.create_segment)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, learnable_tokens, tiny_raw

STEPS = 12


def run_config(tmp: Path, mode: str) -> Path:
    raw = tiny_raw(train={"steps": STEPS, "log_every": 1, "output_dir": str(tmp / "run")},
                   checkpoint={"every": 2, "keep": 10}, runtime={"mode": mode, "dashboard": False})
    raw["data"]["path"] = learnable_tokens(tmp / "tokens.npy", raw["model"]["vocab_size"])
    path = tmp / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def megatrain(*args: str, **popen) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", "megatrain_ray", *args], env=env, **{"cwd": REPO, **popen})


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]


def process_tree(root: int) -> dict[int, str]:
    """{pid: start time} of `root` and every process below it now."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(entry))
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        started = start_time(pid)
        if started is not None:
            found[pid] = started
            todo.extend(children.get(pid, []))
    return found


def segments_of(pid: int, directory: str = "/dev/shm") -> list[str]:
    prefix = f"megatrain-{socket.gethostname().replace('-', '_')}-{pid}-"
    return [name for name in os.listdir(directory) if name.startswith(prefix)]


@pytest.mark.skipif(Path("/tmp/ray/ray_current_cluster").is_file(),
                    reason="a Ray cluster runs on this machine: the driver would attach to it, not start its own")
def test_kill_9_of_the_driver_frees_its_segments_and_its_ray_and_the_run_resumes_bit_identical(tmp_path):
    reference = tmp_path / "reference"
    reference.mkdir()
    # The uninterrupted run trains beside the victim's start (needed only at the end): a private Ray's start mostly
    # waits on its processes, so the two overlap on a small machine.
    uninterrupted = megatrain("train", str(run_config(reference, "local")), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)

    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    config = run_config(victim_dir, "ray")
    kill_after = random.Random().randint(3, 9)  # steps done when the driver dies
    with open(victim_dir / "driver.log", "wb") as log:
        driver = megatrain("train", str(config), stdout=log, stderr=subprocess.STDOUT)
        metrics = victim_dir / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= kill_after):
            assert driver.poll() is None, (victim_dir / "driver.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach the step to kill at"
            time.sleep(0.05)
        tree = process_tree(driver.pid)
        held = segments_of(driver.pid)
        assert len(tree) >= 6 and held, (tree, held)  # Ray's processes, its agents and the actors; the store
        driver.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        driver.wait()
        while True:
            alive = {pid for pid, started in tree.items() if start_time(pid) == started}
            left = segments_of(driver.pid)
            if not alive and not left:
                break
            assert time.monotonic() - killed < 15, f"15 s after the kill: processes {alive}, segments {left}"
            time.sleep(0.1)
    freed_in = time.monotonic() - killed

    # The run goes on from its newest checkpoint, from another working directory, and ends where an
    # uninterrupted run ends, bit for bit.
    resumed = megatrain("train", str(config), "--resume", "auto", "--local", cwd=str(tmp_path))
    assert resumed.wait(timeout=300) == 0
    assert uninterrupted.wait(timeout=300) == 0
    expected = losses(reference / "run")
    assert len(expected) == STEPS
    assert losses(victim_dir / "run") == expected
    print(f"killed after {kill_after} steps; segments and {len(tree)} processes gone in {freed_in:.1f} s")


SCRIPT = r"""
import json, os, sys, threading
from pathlib import Path
import yaml
from megatrain_ray.__main__ import main
from megatrain_ray.store import segments
from tests.conftest import tiny_raw

shm, out = Path(sys.argv[1]), Path(sys.argv[2])
raw = tiny_raw(train={"steps": 4, "output_dir": str(out / "run")}, host={"shm_dir": str(shm)})
raw["model"].update(hidden_size=128, intermediate_size=512, num_layers=6)
(out / "c.yaml").write_text(yaml.safe_dump(raw))
create = segments.create_segment
made = []
lock = threading.Lock()

def fill():
    # What is left of the shared memory but 64 KiB, whatever the allocations running beside it take meanwhile.
    with open(shm / "someone-else", "wb") as f:
        size = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize - 64 * 1024
        while size > 0:
            try:
                os.posix_fallocate(f.fileno(), 0, size)
                return
            except OSError:
                size = size * 9 // 10

def create_then_fill(spec):
    # Another process takes the shared memory after the plan's check, in the middle of the allocation.
    create(spec)
    with lock:
        made.append(spec.path)
        if len(made) == 3:
            fill()

segments.create_segment = create_then_fill
import actors.host_shard
actors.host_shard.create_segment = create_then_fill
code = main(["train", str(out / "c.yaml"), "--local"])
print(json.dumps({"code": code, "left": sorted(os.listdir(shm)), "run": (out / "run").exists()}))
"""


def test_shared_memory_filled_mid_allocation_is_one_error_and_leaves_no_segment(tmp_path):
    if not shutil.which("unshare") or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("needs `unshare -rm` (user and mount namespaces) to mount a small tmpfs")
    shm = tmp_path / "shm"
    shm.mkdir()
    (tmp_path / "script.py").write_text(SCRIPT)
    shell = f"mount -t tmpfs -o size=64m tmpfs {shm} && exec {sys.executable} {tmp_path / 'script.py'} {shm} {tmp_path}"
    result = subprocess.run(["unshare", "-rm", "sh", "-c", shell], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert outcome["code"] == 2 and len(errors) == 1, result.stderr[-3000:]
    assert "has no room for segment" in errors[0] and "MiB free of 64.0 MiB" in errors[0], errors[0]
    assert "Traceback" not in result.stderr and "SIGBUS" not in result.stderr
    assert outcome["left"] == ["someone-else"], outcome
    assert not outcome["run"]


def _in_new_pid_namespace(args: list[str], tmp: Path, pid_at_least: int) -> list[str]:
    """`args` as the first program of a new PID namespace (with its own /proc), after `pid_at_least` short-lived
    processes, so its pid there is one that no process of the other namespace has (a pid-based sweep in the
    other namespace would take it for dead). /dev/shm and the hostname stay shared, as between containers."""
    spin = f"i=0; while [ $i -lt {pid_at_least} ]; do /bin/true; i=$((i+1)); done; \"$@\""
    return ["unshare", "-rpf", "--mount-proc", "sh", "-c", spin, "sh", *args]


def _runs_inside(launcher: subprocess.Popen) -> set[str]:
    """The segment-name prefixes (megatrain-<host>-<pid>-<random>-) of the runs whose processes are in the PID
    namespace that `launcher` (unshare) made, read from the run lock files (store/liveness.py) those processes hold
    open. A pid alone cannot tell them: a process of this namespace may have the same number (small pids in a
    container), and its own run's segments carry it too; the random part of the run id differs."""
    namespace = None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"PPid:\t{launcher.pid}\n" in Path(f"/proc/{pid}/status").read_text():
                namespace = os.readlink(f"/proc/{pid}/ns/pid")
                break
        except OSError:
            continue
    prefixes: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")) if namespace else ():
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != namespace:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                name = os.path.basename(os.readlink(f"/proc/{pid}/fd/{fd}"))
                if name.startswith("megatrain-") and re.fullmatch(r".*-shard\d+\.lock", name):
                    prefixes.add(name[:name.rindex("shard")])
        except OSError:
            continue
    return prefixes


def test_two_runs_in_two_pid_namespaces_sharing_shm_never_sweep_each_other(tmp_path):
    if not shutil.which("unshare") or subprocess.run(["unshare", "-rpf", "--mount-proc", "true"],
                                                     capture_output=True).returncode:
        pytest.skip("needs `unshare -rpf --mount-proc` (user, PID and mount namespaces)")
    config = run_config(tmp_path, "local")
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONPATH": REPO}
    first_run, second_run = tmp_path / "first", tmp_path / "second"
    host = socket.gethostname().replace("-", "_")
    before = {f for f in os.listdir("/dev/shm") if f.startswith(f"megatrain-{host}-")}
    train = [sys.executable, "-m", "megatrain_ray", "train", str(config), "--local", "--set", "train.log_every=1"]
    first = subprocess.Popen(_in_new_pid_namespace([*train, "--set", f"train.output_dir={first_run}", "--set",
                                                    "train.steps=1000000", "--set", "checkpoint.every=0"], tmp_path, 300),
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and first.poll() is None and not (
                (first_run / "metrics.jsonl").exists() and (first_run / "metrics.jsonl").read_text().count("\n") >= 3):
            time.sleep(0.1)
        # Other test processes' runs may create segments meanwhile, one of them with the same pid as the first
        # run's driver (as in CI's container, a decoy here): the first run's are told by its run id.
        runs = _runs_inside(first)
        decoys = [f"/dev/shm/megatrain-{host}-{p.split('-')[2]}-00000000-decoy" for p in runs]
        for decoy in decoys:
            Path(decoy).touch()
        try:
            first_segments = {f for f in os.listdir("/dev/shm") if f.startswith(tuple(runs))} - before
        finally:
            for decoy in decoys:
                Path(decoy).unlink(missing_ok=True)
        assert first.poll() is None and first_segments, "the first run should be training, with its segments"
        assert not {f"/dev/shm/{f}" for f in first_segments} & set(decoys), first_segments
        assert all(int(f.split("-")[2]) >= 300 for f in first_segments), first_segments
        # The second run sweeps at its start, in a namespace where the first run's pid does not exist.
        second = subprocess.run(_in_new_pid_namespace([*train, "--set", f"train.output_dir={second_run}", "--set",
                                                       "train.steps=4"], tmp_path, 0),
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stderr[-3000:]
        # Alive first (it trains until interrupted below): a run that ended removed its own segments, which the
        # check after it would blame on the second run.
        assert first.poll() is None, "the first run should still be training"
        still = {f for f in os.listdir("/dev/shm") if f in first_segments}
        assert still == first_segments, f"the second run removed {sorted(first_segments - still)[:5]}"
    finally:
        for pid in filter(str.isdigit, os.listdir("/proc")):  # the driver itself, inside the namespace
            try:
                if f"train.output_dir={first_run}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes() \
                        and b"megatrain_ray" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(int(pid), signal.SIGINT)
            except OSError:
                pass
        _, first_err = first.communicate(timeout=120)
    # The driver removes them as it exits, or its guardian just after (the same 15 s as after a kill -9).
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and {f for f in os.listdir("/dev/shm") if f in first_segments}:
        time.sleep(0.1)
    assert not {f for f in os.listdir("/dev/shm") if f in first_segments}, \
        f"the first run's segments outlived it by 15 s; its log ends: {first_err[-2000:]}"
