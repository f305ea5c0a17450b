"""Whether a run's segments are alive, told by a lock, not by a process id.

Each HostShard holds a shared `flock` on a file of its own, `<run prefix>shard<k>.lock`, in every directory
where it makes segments, from before its first segment until it ends; the kernel drops the lock when the
process ends, however it ends. A later run sweeps the files of a run whose locks nobody holds. A process id
cannot tell this: a run in another PID namespace (a container sharing /dev/shm and the hostname) has pids
that mean nothing here, and its live segments would be deleted.

The lock file is made under a hidden name, locked, then renamed into place, so no sweeper ever sees it
unlocked. A run whose segments have no lock file at all was left by a process that died before this scheme
(or after its lock file was removed): it is stale.
"""

from __future__ import annotations

import fcntl
import os
import socket

from megatrain_ray.observe.log import get_logger
from megatrain_ray.system.files import lock_is_held

log = get_logger(__name__)

LOCK_SUFFIX = ".lock"


class RunLock:
    """A HostShard's lock in one directory; `release` (or the process's end) drops it."""

    def __init__(self, directory: str, prefix: str, shard: int):
        self.path = self.path_in(directory, prefix, shard)
        self.hidden_path = os.path.join(directory, "." + os.path.basename(self.path))
        fd = os.open(self.hidden_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.rename(self.hidden_path, self.path)
        except BaseException:
            os.close(fd)
            os.unlink(self.hidden_path)
            raise
        self._fd = fd

    @staticmethod
    def path_in(directory: str, prefix: str, shard: int) -> str:
        return os.path.join(directory, f"{prefix}shard{shard}{LOCK_SUFFIX}")

    def release(self) -> None:
        if self._fd >= 0:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = -1


def _run_prefix(name: str, host: str) -> str | None:
    """`megatrain-<host>-<pid>-<random>-` of a file of a run of this host, else None."""
    parts = name.split("-")
    if len(parts) < 5 or parts[0] != "megatrain" or parts[1] != host:
        return None
    return "-".join(parts[:4]) + "-"


def sweep_stale_segments(directory: str) -> int:
    """Remove the files of this host's runs in `directory` whose locks nobody holds; the count removed."""
    if not os.path.isdir(directory):
        return 0
    host = socket.gethostname().replace("-", "_")
    runs: dict[str, list[str]] = {}
    for name in os.listdir(directory):
        prefix = _run_prefix(name, host)
        if prefix is not None:
            runs.setdefault(prefix, []).append(name)
    removed = 0
    for prefix, names in runs.items():
        locks = [n for n in names if n.endswith(LOCK_SUFFIX)]
        if any(lock_is_held(os.path.join(directory, n)) for n in locks):
            continue
        for name in sorted(names, key=lambda n: n.endswith(LOCK_SUFFIX)):  # the lock files last
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except FileNotFoundError:
                pass
    if removed:
        log.info("removed %d files of dead runs from %s", removed, directory)
    return removed
