"""`megatrain cluster stop` ends every process of the cluster it started, the Ray client server included (its
command line names no temporary tree: `ray start --head` leaves it to init; it is told by the GCS address and its
own port, both in cluster.env).

The leftovers are found by reading /proc directly, not through driver/head.py's own process search.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import REPO


def processes_naming(*markers: bytes) -> dict[int, bytes]:
    """Every live process whose command line holds one of `markers` (zombies have none)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                line = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if any(m in line for m in markers):
                found[int(entry)] = line.replace(b"\0", b" ")[:200]
    return found


def test_cluster_stop_leaves_no_process_of_the_cluster_behind(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), PATH=os.path.dirname(sys.executable) + os.pathsep + env["PATH"], PYTHONPATH=REPO)
    private = Path(tempfile.mkdtemp(prefix="mt-", dir="/tmp")) / "t"  # short: Ray's socket paths live below it
    megatrain = [sys.executable, "-m", "megatrain_ray", "cluster"]
    try:
        started = subprocess.run([*megatrain, "start", "--temp-dir", str(private)], env=env, capture_output=True,
                                 text=True, timeout=300)
        assert started.returncode == 0, started.stderr[-3000:]
        exports = dict(line.removeprefix("export ").split("=", 1) for line in started.stdout.splitlines()
                       if line.startswith("export "))
        markers = (exports["MEGATRAIN_CLUSTER_DIR"].encode(), f"--address={exports['RAY_ADDRESS']}\0".encode(),
                   f"--port={exports['MEGATRAIN_CLIENT_SERVER_PORT']}\0".encode())
        running = processes_naming(*markers)
        assert any(b"ray.util.client.server" in line for line in running.values()), running  # what is checked
        stopped = subprocess.run([*megatrain, "stop"], env=env, capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stderr[-3000:]
        assert processes_naming(*markers) == {}
    finally:
        subprocess.run([*megatrain, "stop"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(private.parent, ignore_errors=True)
