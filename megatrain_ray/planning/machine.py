"""The machine a run is planned for: this one (detected) or one described on the command line or by a preset."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
from dataclasses import dataclass, replace

from megatrain_ray.config.load import parse_size
from megatrain_ray.planning.profiles import SpeedProfile, preset, profile_for_gpu
from megatrain_ray.system.memory import host_memory

RAY_MEMORY_THRESHOLD = 0.95
"""Ray's default memory_usage_threshold: the share of a node's RAM above which its monitor kills a worker."""


@dataclass(frozen=True)
class Machine:
    host_memory: int
    """RAM this process may use: MemTotal, or the cgroup's memory.max when lower."""
    host_available: int
    """RAM free for the run now: MemAvailable, bounded by the cgroup's remaining allowance."""
    shm_free: int
    """Free bytes in host.shm_dir (a tmpfs: they come out of host RAM)."""
    memlock: int | None
    """RLIMIT_MEMLOCK for pinned memory; None when unlimited."""
    gpu_memory: int | None
    """Total memory of GPU 0, or None when no GPU is visible."""
    gpu_name: str = ""
    described: bool = False
    """True when the sizes come from the command line rather than this machine."""
    profile: SpeedProfile | None = None
    """Measured rates of this GPU and host for the speed estimate (megatrain_ray/planning/speed.py); None: unknown."""

    def usable_host(self, under_ray: bool) -> int:
        """RAM the run may take: what is available, less, under Ray, the part its memory monitor keeps free (it
        kills a worker once the node uses more than RAY_memory_usage_threshold of its RAM, 0.95 by default)."""
        if not under_ray or os.environ.get("RAY_memory_monitor_refresh_ms") == "0":  # the monitor is off
            return self.host_available
        try:
            threshold = min(1.0, float(os.environ.get("RAY_memory_usage_threshold", RAY_MEMORY_THRESHOLD)))
        except ValueError:
            threshold = RAY_MEMORY_THRESHOLD  # Ray itself refuses such a value at start
        return max(0, self.host_available - int((1 - threshold) * self.host_memory))

    @classmethod
    def detect(cls, shm_dir: str) -> "Machine":
        total, available = host_memory()
        if os.path.isdir(shm_dir):
            st = os.statvfs(shm_dir)
            shm_free = st.f_bavail * st.f_frsize
        else:
            shm_free = 0
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        gpu_memory, gpu_name = query_gpu()
        return cls(total, available, shm_free, None if soft == resource.RLIM_INFINITY else soft, gpu_memory,
                   gpu_name, profile=profile_for_gpu(gpu_name) if gpu_name else None)

    @classmethod
    def from_preset(cls, name: str) -> "Machine":
        """A machine of speed.PRESETS (`--machine h200-1tb`): its GPU, its RAM, /dev/shm as large as the RAM."""
        p = preset(name)
        return cls(p.host_memory, p.host_memory, p.host_memory, None, p.gpu.memory, p.gpu.name, described=True,
                   profile=p.profile)

    def override(self, host_memory: str | None = None, gpu_memory: str | None = None,
                 shm: str | None = None) -> "Machine":
        """The same machine with sizes from the command line (a box you plan for, not this one). Its /dev/shm
        is taken as large as its RAM unless --shm says otherwise (the tmpfs default is half of it)."""
        if not (host_memory or gpu_memory or shm):
            return self
        host = parse_size(host_memory, "--host-memory") if host_memory else self.host_memory
        return replace(self, host_memory=host, host_available=host,
                       shm_free=parse_size(shm, "--shm") if shm else host if host_memory else self.shm_free,
                       gpu_memory=parse_size(gpu_memory, "--gpu-memory") if gpu_memory else self.gpu_memory,
                       memlock=None, gpu_name="" if gpu_memory and not self.described else self.gpu_name,
                       described=True, profile=None if gpu_memory and not self.described else self.profile)


def query_gpu() -> tuple[int | None, str]:
    """GPU 0's memory and name through nvidia-smi, without a CUDA context in this process; (None, "")
    when there is no GPU or no nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None, ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,name", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None, ""
    if not out:
        return None, ""
    mib, _, name = out[0].partition(",")
    return int(float(mib)) * 2**20, name.strip()
