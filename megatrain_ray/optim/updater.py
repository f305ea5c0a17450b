"""One optimizer worker's share of a stage's update: AdamW in place on the shared segments.

Kept apart from the actor (actors/optimizer_worker.py) so that it runs, and is read, without Ray: the
actor pins its cores and builds it; this class turns each UpdateOrder into the kernel calls on the
worker's span of the stage (with the disk tier, piece by piece on moments staged from disk).
"""

from __future__ import annotations

import time

import torch

from megatrain_ray.messages import UpdateDone, UpdateOrder
from megatrain_ray.model.layout import ModelLayout
from megatrain_ray.observe.log import get_logger
from megatrain_ray.optim.adamw import FlatAdamW
from megatrain_ray.optim.lean_adamw import FlatLeanAdamW, LeanStage
from megatrain_ray.store.checkpoint import wait_for_gate
from megatrain_ray.store.disk_tier import MomentStager
from megatrain_ray.store.segments import HostStore

log = get_logger(__name__)


class StageUpdater:
    def __init__(self, worker: int, layout: ModelLayout, store: HostStore, adamw: FlatAdamW | FlatLeanAdamW,
                 spans: dict[int, tuple[int, int]], disk: MomentStager | None, gates: list[torch.Tensor]):
        """`worker`: this worker's index; `spans`: stage -> [start, end) of the stage this worker updates;
        `disk`: the moments' stager (host.moments_tier disk, else None); `gates`: the checkpoint gates. `adamw`:
        FlatLeanAdamW with optimizer.state=lean (whose spans start on its span_align)."""
        self.worker = worker
        self.layout = layout
        self.store = store
        self.adamw = adamw
        self.spans = spans
        self.disk = disk
        self.gates = gates

    def apply(self, order: UpdateOrder) -> UpdateDone:
        """Update (or, for a dropped step, only refresh the streaming copy of) this worker's span of the stage."""
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
        into = save_grad = None
        if order.speculative == "update":  # into the other set; the current one stays for a redo
            into, save_grad = store.other_set(order.stage), store.get("saved_grad", order.stage)
        elif order.speculative == "redo":  # the streaming copy holds the speculative weights now
            grad = store.get("saved_grad", order.stage)
        if isinstance(self.adamw, FlatLeanAdamW):  # the master is the streaming copy: a dropped step changes nothing
            if order.apply and end > start:
                self.adamw.update(state=lean_stage(store, order.stage), grad=grad, start=start, end=end,
                                  decay_end=stage.decay_numel, adam_step=order.adam_step, lr=order.lr,
                                  grad_coef=order.grad_coef, stage=order.stage, grad_base=grad_base)
        elif not order.apply:
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
                    moments_base=base, grad_base=grad_base, into=into, save_grad=save_grad)
                if self.disk is not None:
                    self.disk.release((order.stage, k))
        ended = time.perf_counter()
        per_element = self.adamw.bytes_per_element(grad, order.apply) if isinstance(self.adamw, FlatLeanAdamW) else \
            self.adamw.bytes_per_element(grad, stream_out, order.apply, speculative=save_grad is not None)
        return UpdateDone(order.stage, self.worker, ended - t0, end - start, (end - start) * per_element, t0, ended)

    def sync(self) -> None:
        """Return once every moment written back is on disk (before a checkpoint reads the files)."""
        if self.disk is not None:
            self.disk.drain()

    def close(self) -> None:
        """Stop the disk tier's staging and the optimizer's threads."""
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        if self.adamw.pool is not None:
            self.adamw.pool.shutdown(wait=True)


def lean_stage(store: HostStore, stage: int) -> LeanStage:
    """A stage's lean state in the store (optimizer.state=lean)."""
    scales = (store.get("exp_avg_scale", stage), store.get("exp_avg_sq_scale", stage)) \
        if store.has("exp_avg_scale", stage) else None
    return LeanStage(store.get("master", stage), store.get("master_comp", stage), store.get("exp_avg", stage),
                     store.get("exp_avg_sq", stage), scales)
