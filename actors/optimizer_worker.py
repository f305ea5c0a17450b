"""OptimizerWorker: AdamW on its share of every stage, in place on the shared segments (with the disk
tier, on moments staged from disk: megatrain_ray/store/disk_tier.py). The actor pins its cores and maps
the segments; the updates themselves are megatrain_ray/optim/updater.py's StageUpdater."""

from __future__ import annotations

import torch

from actors.base import ActorBase
from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.dtypes import TORCH_DTYPES
from megatrain_ray.messages import UpdateDone, UpdateOrder
from megatrain_ray.model.layout import ModelLayout
from megatrain_ray.observe.log import get_logger, init_logger
from megatrain_ray.optim.adamw import FlatAdamW, split_span
from megatrain_ray.optim.lean_adamw import FlatLeanAdamW, span_align
from megatrain_ray.optim.updater import StageUpdater
from megatrain_ray.store.disk_tier import MOMENT_KINDS, MomentStager, piece_elems, update_order
from megatrain_ray.store.segments import HostStore, SegmentSpec
from megatrain_ray.system.topology import bind_process

log = get_logger(__name__)


def pin_to_cores(cores: list[int]) -> int:
    """Pin this worker process to its cores; returns how many optimizer threads to run.

    Affinity first (Ray's num_cpus is bookkeeping, not pinning), then one optimizer thread per
    core, each running single-threaded torch kernels on its own piece of the span. In-process
    (runtime.mode=local, no cores given) nothing is pinned and one thread runs the updates.
    """
    if not cores:
        return 1
    bind_process(cores)
    torch.set_num_threads(1)
    return len(cores)


class OptimizerWorker(ActorBase):
    def __init__(self, cfg: Config, run: RunSpec, layout: ModelLayout, specs: list[SegmentSpec], index: int,
                 num_workers: int,
                 cores: list[int]):
        init_logger(f"optim{index}")
        threads = pin_to_cores(cores)
        store = HostStore(specs)
        if run.optimizer_state == "lean":  # blocks of 8-bit moments are never split between workers
            adamw: FlatAdamW | FlatLeanAdamW = FlatLeanAdamW(cfg.optimizer, threads)
            align = span_align(run.lean_block)
        else:
            adamw, align = FlatAdamW(cfg.optimizer, TORCH_DTYPES[run.master_dtype], threads), 64
        spans = {s.index: split_span(s.numel, index, num_workers, align) for s in layout.stages}
        disk: MomentStager | None = None
        if cfg.host.moments_tier == "disk":
            paths = {(kind, s.index): store.get(kind, s.index).path for kind in MOMENT_KINDS for s in layout.stages}
            disk = MomentStager(paths, spans, update_order(len(layout.stages), cfg.optimizer.grad_clip > 0),
                                TORCH_DTYPES[run.moment_dtype], piece_elems(layout.max_layer_numel, num_workers),
                                poison=cfg.engine.poison_buffers)
        self.updater = StageUpdater(index, layout, store, adamw, spans, disk, store.gates())
        log.info("optimizer worker %d/%d on cores %s, %d optimizer threads%s", index, num_workers,
                 cores or "(shared)", threads,
                 f", moments staged from disk through {disk.staging_bytes / 2**20:.0f} MiB" if disk else "")

    @property
    def disk(self) -> MomentStager | None:
        """The moments' stager (host.moments_tier disk), None in RAM: its counters tell how staging went."""
        return self.updater.disk

    def apply(self, order: UpdateOrder) -> UpdateDone:
        return self.updater.apply(order)

    def sync(self) -> None:
        """Return once every moment written back is on disk (before a checkpoint reads the files)."""
        self.updater.sync()

    def shutdown(self) -> None:
        self.updater.close()
