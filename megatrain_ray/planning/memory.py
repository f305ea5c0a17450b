"""Memory plan of a run: what it needs against what the machine has, before anything is allocated.

`plan_run` fills the plan's record (planning/plan.py), `megatrain plan CONFIG` prints it (planning/plan_text.py);
`Trainer` runs the same check (`check_plan`) and refuses with the same numbers.

Host side (planning/host_memory.py), exact: the shared-memory segments are the ones `plan_segments` lays
out (the same function the HostShards use). Pinned memory is the part of them the GPU worker registers.
Process memory (interpreters, torch, the CUDA context's host side) is an estimate per process. With the
disk tier the moments' files are counted on disk and the optimizers' staging buffers in RAM; the
plan also prints what each other choice of moment format and tier would cost (`tier_lines`).

With data parallelism (parallel.gpus) the host side is one node's (its store is shared by its GPU
workers, each one more process) and the GPU side one GPU's, which holds data.batch_size / gpus rows.
`parallel.gpus: auto` is planned as one GPU per node: the count is known only once Ray is up.

GPU side (planning/gpu_memory.py): the engine's buffers (exact) plus activations (a count of the tensors
alive at the peak, per token).
"""

from __future__ import annotations

import os

from megatrain_ray.config.sections import Config
from megatrain_ray.exceptions import HostMemoryError
from megatrain_ray.planning.gpu_memory import GPU_RESERVE_BYTES, gpu_bytes, resolve_run
from megatrain_ray.planning.host_memory import GPU_PROCESS_BYTES, PROCESS_BYTES, offloaded_bytes, store_bytes
from megatrain_ray.planning.machine import Machine
from megatrain_ray.planning.plan import COMPILED_NODE_BYTES, Plan
from megatrain_ray.planning.plan_text import format_plan, host_fixes
from megatrain_ray.planning.vision import vision_counts, vision_gpu_bytes
from megatrain_ray.store.disk_tier import disk_problems
from megatrain_ray.system.topology import detect_topology, plan_placement
from megatrain_ray.units import GiB


def plan_run(cfg: Config, machine: Machine) -> Plan:
    plan = Plan(cfg, machine)
    plan.run = run = resolve_run(cfg, machine.gpu_memory, profile=plan.profile)
    workers = len(plan_placement(detect_topology(), cfg.optimizer.workers, cfg.host.num_shards,
                                 gpu_ranks=run.ranks_per_node).workers)
    plan.workers = workers = 0 if run.frozen_base else workers  # LoRA: no CPU optimizer workers
    plan.host, plan.disk, plan.staging = store_bytes(cfg, run, workers)
    pinned_kinds = {"stream", "grad", "gradpool", "nf4", "reference"} | ({"master"} if run.stream_is_master else set())
    plan.pinned = sum(n for kind, n in plan.host.items() if kind in pinned_kinds)
    plan.processes = (1 + cfg.host.num_shards + workers) * PROCESS_BYTES + run.ranks_per_node * GPU_PROCESS_BYTES
    plan.offload = run.activation_offload
    plan.offloaded = run.ranks_per_node * offloaded_bytes(cfg, run) if plan.offload else 0
    plan.pinned += plan.offloaded  # page-locked like the registered segments
    plan.gpu = gpu_bytes(cfg, run, plan.offload)
    plan.vision = vision_counts(cfg)  # a vision-language model's tower and projector, on the GPU worker
    plan.gpu.update(vision_gpu_bytes(plan.vision, run))
    _check(plan)
    return plan


def _check(plan: Plan) -> None:
    cfg, machine = plan.cfg, plan.machine
    g = GiB
    if not machine.described and not os.path.isdir(cfg.host.shm_dir):
        plan.problems.append(f"host.shm_dir={cfg.host.shm_dir!r} is not a directory; point it at a tmpfs such as "
                             "/dev/shm")
    elif plan.shm_total > machine.shm_free:
        plan.problems.append(
            f"the host store needs {plan.shm_total / g:.1f} GiB in host.shm_dir={cfg.host.shm_dir!r}, "
            f"{machine.shm_free / g:.1f} GiB is free there: enlarge it (docker --shm-size, "
            "`mount -o remount,size=...`) or shrink the store (below)")
    if cfg.host.moments_tier == "disk" and not machine.described:
        plan.problems.extend(disk_problems(cfg.host.disk_dir, sum(plan.disk.values())))
    usable = plan.usable_host
    if plan.host_total > usable:
        under_ray = machine.usable_host(cfg.runtime.mode == "ray") < machine.host_available
        kept = [what for what, applies in (("what Ray's memory monitor keeps free", under_ray),
                                           (f"the {COMPILED_NODE_BYTES / g:g} GiB that a run compiling its layers "
                                            "on a GPU took beyond the plan's count (planning/plan.py)",
                                            plan.compiles_on_gpu))
                if applies]
        margin = f" ({machine.host_available / g:.1f} GiB less {' and '.join(kept)})" if kept else ""
        shards = cfg.host.num_shards
        of_shards = f" ({shards * PROCESS_BYTES / g:.1f} GiB of it the host.num_shards={shards} HostShard processes)" \
            if shards > 1 else ""
        plan.problems.append(
            f"host RAM: {plan.host_total / g:.1f} GiB needed{of_shards}, {usable / g:.1f} GiB available{margin}: "
            f"shrink the store (below){', lower host.num_shards' if of_shards else ''} or use a machine with more RAM")
    if plan.problems and (plan.shm_total > machine.shm_free or plan.host_total > usable):
        plan.host_fixes = host_fixes(plan)
    if machine.memlock is not None and cfg.engine.device != "cpu" and machine.gpu_memory \
            and plan.pinned > machine.memlock:
        plan.problems.append(f"pinned memory: {plan.pinned / g:.1f} GiB to register, RLIMIT_MEMLOCK is "
                             f"{machine.memlock / g:.1f} GiB: raise it (ulimit -l unlimited)")
    if machine.gpu_memory and cfg.engine.device != "cpu" and plan.gpu_peak + GPU_RESERVE_BYTES > machine.gpu_memory:
        plan.problems.append(
            f"GPU memory: {(plan.gpu_peak + GPU_RESERVE_BYTES) / g:.1f} GiB needed, the GPU has "
            f"{machine.gpu_memory / g:.1f} GiB: lower data.batch_size (now {cfg.data.batch_size}) or data.seq_len "
            f"(now {cfg.data.seq_len})" + ("" if plan.offload else "; the kept layer inputs grow with both and with the "
                                        "depth: engine.activation_offload=true moves them to host RAM"))


def check_plan(cfg: Config) -> Plan:
    """The check `train` runs before allocating: raises HostMemoryError with the whole plan when it does not fit."""
    plan = plan_run(cfg, Machine.detect(cfg.host.shm_dir))
    if not plan.fits:
        raise HostMemoryError("the run does not fit this machine:\n" + format_plan(plan))
    return plan
