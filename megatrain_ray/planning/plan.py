"""The memory plan's record (`Plan`): the host, disk and GPU bytes by kind, the settings resolved for the
machine, and the problems found; planning/memory.py fills it, planning/plan_text.py prints it."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.planning.gpu_memory import peak_allocated
from megatrain_ray.planning.machine import Machine
from megatrain_ray.planning.profiles import SpeedProfile
from megatrain_ray.planning.speed import estimate
from megatrain_ray.planning.speed_estimate import SpeedEstimate
from megatrain_ray.planning.vision import VisionCounts
from megatrain_ray.units import GiB

COMPILED_NODE_BYTES = 8 * GiB
"""RAM that a run whose layers compile on a GPU takes beyond the plan's count, as the node's memory accounting
(Ray's memory monitor) sees it; it grows with the model. Measured on the 125 GiB H200 box with the Qwen3-30B-A3B
width, compiling in process (engine/compiled.py compile_in_process): 4 layers planned at 42.9 GiB used 44.9 (+2.0);
12 layers with a speculative stage planned at 112.1 GiB used 119.5 (+7.4) and ran, at Ray's threshold. With
inductor's pool of compile workers, as before, the 4-layer run used 49.9 (+7.0) and the 12-layer one was killed
(docs/memory-and-long-context.md). Counted once per GPU worker of a node (each compiles), which is an
assumption: only one-GPU runs were measured."""


@dataclass
class Plan:
    cfg: Config
    machine: Machine
    host: dict[str, int] = field(default_factory=dict)
    """Shared-memory segments by kind."""
    disk: dict[str, int] = field(default_factory=dict)
    """Disk-tier files by kind (host.moments_tier=disk)."""
    staging: int = 0
    """RAM of the optimizers' disk-tier staging buffers."""
    workers: int = 1
    processes: int = 0
    pinned: int = 0
    gpu: dict[str, int] = field(default_factory=dict)
    offload: bool = False
    """Layer inputs offloaded to pinned host memory (engine.activation_offload, resolved)."""
    offloaded: int = 0
    """Bytes of the pinned host buffers holding the offloaded layer inputs."""
    run: RunSpec | None = None
    """The settings derived from the config on this machine (plan_run resolves them)."""
    problems: list[str] = field(default_factory=list)
    host_fixes: list[str] = field(default_factory=list)
    """When the host store does not fit: each change that shrinks it, with what it saves on its own."""
    vision: VisionCounts | None = None
    """A vision-language model's tower and projector (planning/vision.py); None: a text model."""

    @property
    def shm_total(self) -> int:
        return sum(self.host.values())

    @property
    def host_total(self) -> int:
        return self.shm_total + self.staging + self.processes + self.offloaded

    @property
    def gpu_peak(self) -> int:
        """Peak of torch's allocations on the GPU (what torch.cuda.max_memory_allocated reports)."""
        return peak_allocated(self.gpu)

    @property
    def on_gpu(self) -> bool:
        """The layers compute on a GPU: the machine has one (detected or described) and engine.device is not cpu.
        Otherwise they compute on the CPU, and nothing is pinned (actors/gpu_worker.py registers only for CUDA)."""
        return bool(self.machine.gpu_memory) and self.cfg.engine.device != "cpu"

    @property
    def compiles_on_gpu(self) -> bool:
        """The decoder layers go through torch.compile on a GPU (what COMPILED_NODE_BYTES was measured with)."""
        return self.on_gpu and self.run is not None and self.run.layers_compiled

    @property
    def usable_host(self) -> int:
        """RAM the run may take: the machine's (Machine.usable_host), less COMPILED_NODE_BYTES where the
        decoder layers compile on a GPU."""
        usable = self.machine.usable_host(self.cfg.runtime.mode == "ray")
        return max(0, usable - (COMPILED_NODE_BYTES * self.run.ranks_per_node if self.compiles_on_gpu else 0))

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def profile(self) -> SpeedProfile | None:
        """The measured rates the speed model uses: none on the CPU device or for a GPU without them."""
        return self.machine.profile if self.cfg.engine.device != "cpu" else None

    @functools.cached_property
    def expected(self) -> SpeedEstimate | None:
        """The speed model's estimate of this run (offload and GPU-resident layers as resolved), computed once
        for every part of the printout that quotes it."""
        if self.profile is None:
            return None
        return estimate(self.cfg, self.profile, offload=self.offload, run=self.run)
