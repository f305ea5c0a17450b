"""OptimizerWorker: AdamW on its share of every stage, in place on the shared segments (with the disk
tier, on moments staged from disk: megatrain_ray/store/disk_tier.py)."""

from __future__ import annotations

import time

import torch

from actors.base import ActorBase
from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.dtypes import TORCH_DTYPES
from megatrain_ray.messages import UpdateDone, UpdateOrder
from megatrain_ray.model.layout import ModelLayout
from megatrain_ray.observe.log import get_logger, init_logger
from megatrain_ray.optim.adamw import FlatAdamW, split_span
from megatrain_ray.store.checkpoint import wait_for_gate
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
        self.index = index
        self.layout = layout
        self.store = HostStore(specs)
        self.gates = self.store.gates()
        self.adamw = FlatAdamW(cfg.optimizer, TORCH_DTYPES[run.master_dtype], threads)
        self.spans = {s.index: split_span(s.numel, index, num_workers) for s in layout.stages}
        self.disk: MomentStager | None = None
        if cfg.host.moments_tier == "disk":
            paths = {(kind, s.index): self.store.get(kind, s.index).path for kind in MOMENT_KINDS
                     for s in layout.stages}
            self.disk = MomentStager(paths, self.spans, update_order(len(layout.stages), cfg.optimizer.grad_clip > 0),
                                     TORCH_DTYPES[run.moment_dtype], piece_elems(layout.max_layer_numel, num_workers),
                                     poison=cfg.engine.poison_buffers)
        log.info("optimizer worker %d/%d on cores %s, %d optimizer threads%s", index, num_workers,
                 cores or "(shared)", threads,
                 f", moments staged from disk through {self.disk.staging_bytes / 2**20:.0f} MiB" if self.disk else "")

    def apply(self, order: UpdateOrder) -> UpdateDone:
        if order.apply:
            held = wait_for_gate(self.gates, order.stage)  # a checkpoint is still writing this stage
            if held > 0.1:
                log.info("stage %d waited %.2f s for its checkpoint write", order.stage, held)
        t0 = time.perf_counter()
        stage = self.layout.stages[order.stage]
        start, end = self.spans[order.stage]
        grad_base = 0
        if order.span is not None:  # a piece of the stage, its gradients at the start of a slab
            grad_base = order.span[0]
            start, end = max(start, order.span[0]), min(end, order.span[1])
            end = max(start, end)
        store = self.store
        stream_out = store.get("stream", order.stage) if store.has("stream", order.stage) else None
        grad = store.get(order.grad_kind, order.grad_index)
        if not order.apply:
            if stream_out is not None:
                self.adamw.refresh(store.get("master", order.stage), stream_out, start, end)
        elif end > start:
            # RAM tier: the whole span at once. Disk tier: piece by piece, each read ahead during the update
            # before it, written back behind, in the worker's staging buffers (element 0 = the piece's first).
            pieces = self.disk.pieces(order.stage) if self.disk is not None else [(start, end)]
            for k, (lo, hi) in enumerate(pieces):
                if self.disk is not None:
                    (exp_avg, exp_avg_sq), base = self.disk.acquire((order.stage, k)), lo
                else:
                    exp_avg, exp_avg_sq = store.get("exp_avg", order.stage), store.get("exp_avg_sq", order.stage)
                    base = 0
                self.adamw.update(
                    master=store.get("master", order.stage), exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, grad=grad,
                    stream_out=stream_out, start=lo, end=hi, decay_end=stage.decay_numel,
                    adam_step=order.adam_step, lr=order.lr, grad_coef=order.grad_coef, stage=order.stage,
                    moments_base=base, grad_base=grad_base)
                if self.disk is not None:
                    self.disk.release((order.stage, k))
        ended = time.perf_counter()
        return UpdateDone(order.stage, self.index, ended - t0, end - start,
                          (end - start) * self.adamw.bytes_per_element(grad, stream_out, order.apply), t0, ended)

    def sync(self) -> None:
        """Return once every moment written back is on disk (before a checkpoint reads the files)."""
        if self.disk is not None:
            self.disk.drain()

    def shutdown(self) -> None:
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        if self.adamw.pool is not None:
            self.adamw.pool.shutdown(wait=True)

