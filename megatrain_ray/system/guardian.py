"""A guardian process: what a process leaves behind is removed when it ends, however it ends.

Shared-memory segments live in a tmpfs, so nothing frees them when their creator is killed with
SIGKILL: a 70B run leaves hundreds of GiB of RAM held by nobody. Each owner (a HostShard, which
creates the segments; the driver, which starts a private Ray) starts one guardian: a small separate
process, in its own session so that signals to the owner's process group do not reach it, that
blocks on a pipe whose only write end the owner holds (the descriptor is close-on-exec, so no child
of the owner inherits it). When the owner ends, by exit, exception, SIGKILL or OOM kill, the kernel
closes the write end; the guardian reads end-of-file and then

- unlinks every file named `<prefix>*` in each directory it was told of (the run's segments), and
- kills the processes it was told to watch and all their descendants, as last seen (a private Ray:
  its GCS, raylet, dashboard and runtime-env agents and workers; they would outlive the driver by
  about a minute otherwise). The tree is re-read every second while the owner lives, because Ray's
  agents are children of the raylet and lose that parentage when it dies; a process is killed only
  when its start time still matches what was seen, so a reused pid is never touched.

The guardian imports nothing but the standard library and system/processes.py (it starts in about
30 ms) and exits after its work. Its orders arrive as lines on the same pipe, so the owner never waits for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from megatrain_ray.system.processes import GUARDIAN_MODULE, children_map, is_guardian, start_time

_SCAN_SECONDS = 1.0


class Guardian:
    """The owner's side: start one, tell it what to remove and whom to kill, keep it for the owner's life."""

    def __init__(self) -> None:
        read_end, self._write_end = os.pipe()  # both close-on-exec: only the guardian gets the read end
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", GUARDIAN_MODULE, str(read_end), str(os.getpid())],
                pass_fds=(read_end,), start_new_session=True, stdin=subprocess.DEVNULL,
                cwd=str(Path(__file__).resolve().parents[2]))
        finally:
            os.close(read_end)
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self._process.pid

    def remove_on_exit(self, paths: list[str]) -> None:
        """Unlink these files when the owner ends."""
        for path in paths:
            self._send("remove", os.path.dirname(path), os.path.basename(path), "exact")

    def remove_prefix_on_exit(self, directory: str, prefix: str) -> None:
        """Unlink `directory`/`prefix`* when the owner ends."""
        self._send("remove", directory, prefix, "prefix")

    def kill_on_exit(self, pids: list[int]) -> None:
        """Kill these processes and their descendants when the owner ends."""
        self._send("kill", *(str(p) for p in pids))

    def _send(self, *words: str) -> None:
        if any("\t" in w or "\n" in w for w in words):
            raise ValueError(f"guardian order with a tab or newline: {words!r}")
        line = ("\t".join(words) + "\n").encode()
        with self._lock:
            if self._write_end >= 0:
                os.write(self._write_end, line)

    def close(self, wait_s: float = 5.0) -> None:
        """The owner is done: the guardian does its work now (what is already gone is skipped)."""
        with self._lock:
            if self._write_end < 0:
                return
            os.close(self._write_end)
            self._write_end = -1
        try:
            self._process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass


# ----------------------------------------------------------------------------- the guardian process


def _descendants(known: dict[int, str]) -> dict[int, str]:
    """`known` ({pid: start time}) and every process below those of them still alive now."""
    tree, found = children_map(), dict(known)
    todo = [pid for pid, started in known.items() if start_time(pid) == started]
    while todo:
        for child in tree.get(todo.pop(), []):
            started = start_time(child)
            if child not in found and started is not None and child != os.getpid() and not is_guardian(child):
                found[child] = started
                todo.append(child)
    return found


class _Orders:
    def __init__(self) -> None:
        self.removals: list[tuple[str, str, bool]] = []
        """(directory, name, whether the name is a prefix)"""
        self.seen: dict[int, str] = {}
        """Every process to kill, with its start time when first seen (a pid seen once is never replaced)."""
        self.lock = threading.Lock()

    def take(self, line: str) -> None:
        verb, *words = line.split("\t")
        with self.lock:
            if verb == "remove" and len(words) == 3:
                self.removals.append((words[0], words[1], words[2] == "prefix"))
            elif verb == "kill":
                for pid in map(int, words):
                    started = start_time(pid)
                    if started is not None and pid not in self.seen:
                        self.seen[pid] = started
                self.seen = _descendants(self.seen)

    def rescan(self) -> None:
        with self.lock:
            if self.seen:  # processes that ended stay listed: their start times keep a reused pid safe
                self.seen = _descendants(self.seen)

    def carry_out(self) -> None:
        with self.lock:
            for pid, started in self.seen.items():
                if start_time(pid) == started:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            for directory, name_or_prefix, is_prefix in self.removals:
                try:
                    names = os.listdir(directory) if is_prefix else [name_or_prefix]
                except OSError:
                    continue
                for name in names:
                    if name.startswith(name_or_prefix):
                        try:
                            os.unlink(os.path.join(directory, name))
                        except OSError:
                            pass


def _serve(read_fd: int) -> None:
    # A Ctrl-C in the owner's terminal, or `ray job stop` (SIGTERM to the driver and all its descendants),
    # is the owner's to handle: the guardian ends only after its owner, by end-of-file (or SIGKILL).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    orders = _Orders()
    done = threading.Event()

    def scan() -> None:
        while not done.wait(_SCAN_SECONDS):
            orders.rescan()

    threading.Thread(target=scan, daemon=True).start()
    pending = b""
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                orders.take(line.decode())
    done.set()
    orders.carry_out()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
