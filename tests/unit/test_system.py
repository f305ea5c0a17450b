"""The system layer's guarantees: paths read from a file stay in their directory, output directories are
checked before a run, and a guardian cleans up after an owner killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrain_ray.exceptions import DataError
from megatrain_ray.system.files import check_output_dir, contained


def test_contained_accepts_a_file_inside_and_refuses_every_way_out(tmp_path):
    inside = tmp_path / "data"
    (inside / "sub").mkdir(parents=True)
    (inside / "sub" / "a.bin").write_bytes(b"x")
    (tmp_path / "secret").write_text("s")
    (inside / "link_out").symlink_to(tmp_path / "secret")
    (inside / "dir_out").symlink_to(tmp_path)

    assert contained(inside, "sub/a.bin", "m", DataError) == (inside / "sub" / "a.bin").resolve()
    for bad, says in [("../secret", "not a relative file name"), ("/etc/passwd", "not a relative file name"),
                      ("sub/../../secret", "not a relative file name"), ("", "not a relative file name"),
                      (7, "not a relative file name"), ("link_out", "leads outside"),
                      ("dir_out/secret", "leads outside")]:
        with pytest.raises(DataError, match=says):
            contained(inside, bad, "m", DataError)


def test_contained_lets_a_hub_snapshot_link_into_its_own_blobs_only(tmp_path):
    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "f00d").write_bytes(b"w")
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs/f00d"))
    other = tmp_path / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (other / "beef").write_bytes(b"w")
    (snapshot / "foreign.safetensors").symlink_to(other / "beef")

    assert contained(snapshot, "model.safetensors", "index", DataError) == (repo / "blobs" / "f00d").resolve()
    with pytest.raises(DataError, match="leads outside"):
        contained(snapshot, "foreign.safetensors", "index", DataError)


def test_check_output_dir_refuses_a_file_a_path_under_a_file_and_too_little_space(tmp_path, monkeypatch):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    check_output_dir(tmp_path / "new" / "deeper", "train.output_dir", DataError)  # creatable: fine
    with pytest.raises(DataError, match=r"train.output_dir=.* is a file"):
        check_output_dir(a_file, "train.output_dir", DataError)
    with pytest.raises(DataError, match="lies under .* which is a file"):
        check_output_dir(a_file / "run", "train.output_dir", DataError)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(DataError, match="GB free on its disk, the run needs"):
        check_output_dir(tmp_path / "ckpt", "checkpoint.dir", DataError, need_bytes=free * 4 + (1 << 40))


_OWNER = """
import sys, time
from megatrain_ray.system.guardian import Guardian
files, marker = sys.argv[1:-1], sys.argv[-1]
guardian = Guardian()
guardian.remove_on_exit(files[:1])
guardian.remove_prefix_on_exit(files[1].rsplit("/", 1)[0], "run7-")
import subprocess
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"])
guardian.kill_on_exit([child.pid])
print(guardian.pid, child.pid, flush=True)
open(marker, "w").close()
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _descendants_of(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(entry))
                    todo.append(int(entry))
    return found


def test_guardian_removes_files_and_kills_the_watched_tree_when_its_owner_is_killed(tmp_path):
    exact, prefixed, kept = tmp_path / "exact.seg", tmp_path / "run7-stage0", tmp_path / "run8-stage0"
    for path in (exact, prefixed, kept):
        path.write_bytes(b"\0" * 4096)
    marker = tmp_path / "ready"
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(exact), str(prefixed), str(marker)],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    guardian_pid, child_pid = map(int, owner.stdout.readline().split())
    deadline = time.monotonic() + 30
    grandchildren: list[int] = []
    while time.monotonic() < deadline and not grandchildren:  # the guardian's 1 s rescan must see it too
        grandchildren = _descendants_of(child_pid)
        time.sleep(0.1)
    assert grandchildren, "the watched child never started its own child"
    time.sleep(1.5)  # one rescan after the grandchild exists
    assert _alive(guardian_pid) and exact.exists()  # nothing happens while the owner lives

    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (exact.exists() or prefixed.exists()
                                           or any(_alive(p) for p in [child_pid, *grandchildren])):
        time.sleep(0.05)
    assert not exact.exists() and not prefixed.exists()
    assert kept.exists(), "a file of another run was removed"
    assert not any(_alive(p) for p in [child_pid, *grandchildren])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(guardian_pid):
        time.sleep(0.05)
    assert not _alive(guardian_pid), "the guardian did not exit after its work"


def test_a_worker_process_ends_within_seconds_of_the_owner_it_watches():
    """system/processes.exit_when_gone (prepare's workers, a host shard's NF4 filling processes): the watcher ends
    a process busy in its main thread once the process it watches is killed, and not before."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from megatrain_ray.system.processes import exit_when_gone\n"
                               f"exit_when_gone({owner.pid})\n"
                               "end = time.time() + 60\n"
                               "while time.time() < end: sum(range(1000))"],
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        time.sleep(2.5)
        assert worker.poll() is None, "the worker ended while its owner lived"
        owner.kill()
        owner.wait()
        assert worker.wait(timeout=10) == 1
    finally:
        for proc in (owner, worker):
            if proc.poll() is None:
                proc.kill()
