"""Processes as /proc shows them: who is whose child, when a process started, what it runs; and a helper
process's watch on the one that started it. Standard library only: the guardian (system/guardian.py) imports it
and must start in milliseconds."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

GUARDIAN_MODULE = "megatrain_ray.system.guardian"


def exit_when_gone(pid: int) -> None:
    """End this process (os._exit, from a daemon thread, whatever its main thread is doing) within a second of the
    process `pid` ending, however it ends: a worker process that would otherwise outlive a SIGKILLed or OOM-killed
    owner, waiting for work with its memory held (prepare's tokenizing workers, a host shard's NF4 filling
    processes)."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:  # alive, another user's: cannot be ours after a pid reuse within a second
                pass

    threading.Thread(target=watch, daemon=True, name="owner-watch").start()


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces and parentheses)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def start_time(pid: int) -> str | None:
    """Start time in clock ticks since boot: with the pid, names one process (a reused pid has another)."""
    fields = _stat_fields(pid)
    return fields[19] if fields else None


def children_map() -> dict[int, list[int]]:
    """{parent pid: [child pids]} of every process now."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))):
            tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def is_guardian(pid: int) -> bool:
    """A guardian ends after its owner by itself, then does its work: it is never among the processes killed."""
    return GUARDIAN_MODULE.encode() in cmdline(pid)
