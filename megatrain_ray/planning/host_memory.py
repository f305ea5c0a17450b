"""Host side of the memory plan: the store's bytes by kind in shared memory and on disk (the segments
`plan_segments` lays out, the same function the HostShards use), the disk tier's staging RAM, the
pinned buffers of offloaded layer inputs, and the per-process estimates."""

from __future__ import annotations

import dataclasses

from megatrain_ray.config.resolved import RunSpec, resident_tier_refusal
from megatrain_ray.config.sections import Config
from megatrain_ray.dtypes import DTYPE_BYTES
from megatrain_ray.model.layout import build_layout
from megatrain_ray.store.disk_tier import staging_bytes
from megatrain_ray.store.segments import plan_segments, shard_stages
from megatrain_ray.units import GiB

PROCESS_BYTES = int(0.35 * GiB)
"""Private memory of a CPU actor or of the driver: the interpreter, torch and Ray (measured ~0.3 GiB)."""


GPU_PROCESS_BYTES = int(1.0 * GiB)
"""Private host memory of the GPU worker: the above plus the CUDA context's host side."""


def store_bytes(cfg: Config, run: RunSpec, workers: int) -> tuple[dict[str, int], dict[str, int], int]:
    """Bytes of the store by kind in RAM (shared memory) and on disk, and the disk tier's staging RAM."""
    layout = build_layout(cfg.model)
    ram: dict[str, int] = {}
    disk: dict[str, int] = {}
    for k, stages in enumerate(shard_stages(layout, cfg.host.num_shards)):
        for spec in plan_segments(layout, cfg.host, cfg.engine.grad_slabs, run, "plan", stages, k):
            where = disk if spec.on_disk else ram
            where[spec.kind] = where.get(spec.kind, 0) + spec.nbytes
    staging = staging_bytes([s.numel for s in layout.stages], layout.max_layer_numel, workers,
                            DTYPE_BYTES[run.moment_dtype]) if cfg.host.moments_tier == "disk" else 0
    return ram, disk, staging


def offloaded_bytes(cfg: Config, run: RunSpec) -> int:
    """Pinned host memory of one GPU worker for its layer inputs when they are offloaded."""
    return cfg.model.num_layers * run.rank_tokens * cfg.model.hidden_size * DTYPE_BYTES[run.compute_dtype]


def without_refused_tier(cfg: Config) -> Config:
    """An alternative config the plan weighs (bfloat16 moments, the disk tier) without engine.gpu_resident when
    the tier does not apply to it, so that it resolves instead of being refused."""
    if cfg.engine.gpu_resident == "none" or not resident_tier_refusal(cfg, 1):
        return cfg
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, gpu_resident="none"))
