"""Host RAM as this process sees it: /proc/meminfo, bounded by the cgroup's limit (containers)."""

from __future__ import annotations

from pathlib import Path


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def host_memory() -> tuple[int, int]:
    """(total, available) bytes: MemTotal and MemAvailable, or the cgroup's memory.max and what remains of it when
    lower. Shared-memory segments already allocated are not available."""
    meminfo = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        meminfo[key] = int(rest.split()[0]) * 1024
    total, available = meminfo["MemTotal"], meminfo.get("MemAvailable", meminfo["MemFree"])
    limit = _read_int("/sys/fs/cgroup/memory.max") or _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    if limit and limit < total:
        used = _read_int("/sys/fs/cgroup/memory.current") or _read_int(
            "/sys/fs/cgroup/memory/memory.usage_in_bytes") or 0
        total, available = limit, min(available, limit - used)
    return total, available
