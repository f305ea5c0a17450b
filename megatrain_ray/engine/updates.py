"""Update dispatch: a stage's gradients on the host become an update ordered from the optimizer workers.

A dispatcher thread waits for each D2H to complete (so the main thread never blocks on it) and hands
the order to every optimizer worker; the futures of the ordered updates are kept per stage, and a load
of the stage's weights (or a copy into a gradient slab the update reads) waits for them first.

With clipping off, an update is ordered as soon as its gradients land. With exact clipping on, the
global norm is known only after the whole backward: the stage's gradients are held back (`deferred`)
and ordered after it, in forward order, so the next step's forward of stage i waits only for stage i.
The stages of optimizer.speculative_stages are updated as their gradients land all the same (`speculated`),
into their other set of master and moments (store.segments.ALT_KINDS), their gradients saved aside. Once the
norm is known, a step that does not clip makes those sets current (the dispatcher switches each once its update
is done); one that clips, or is dropped, redoes the update on the current set, behind the held-back ones.

Several ranks per node (engine/collective.py): only the leader orders updates; it waits until every
rank's piece of the stage landed, and a publisher thread tells the other ranks when the update is done.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from megatrain_ray.engine.collective import FAILED, RankInfo, StageSync
from megatrain_ray.engine.telemetry import StepTelemetry
from megatrain_ray.messages import UpdateDone, UpdateOrder


@dataclass(frozen=True, slots=True)
class LandedGrads:
    """A stage's gradients (or a slab-sized piece of them) copied device->host, as its update reads them."""

    stage: int
    drained: Any
    """Event: the D2H is complete."""
    copied: Any
    """Timing event at the end of the D2H (engine.update_trace)."""
    grad_kind: str
    grad_index: int
    span: tuple[int, int] | None
    """The piece of the stage (a stage larger than the gradient slabs), None for the whole stage."""
    zero: tuple[Any, list[tuple[int, int]]] | None = None
    """(host buffer, spans in it) not copied because they hold zeros (MoE experts without tokens): zeroed on
    the host once the copy has landed, before the update reads them."""


class UpdateDispatch:
    def __init__(self, rank: RankInfo, sync: StageSync | None, optimizers: list[Any], telemetry: StepTelemetry,
                 defer: bool, speculative: tuple[int, ...] = (), store: Any = None):
        """`sync`: the node's stage counters (several ranks per node, else None); `optimizers`: the node's
        OptimizerWorker handles (the leader's); `defer`: hold the updates back until order_deferred (clipping);
        `speculative`: the stages updated all the same (model.layout.speculative_stages), whose current set of
        state `store` (the HostStore) switches."""
        if speculative and (sync is not None or store is None):
            raise ValueError("speculative updates need one GPU worker per node and the host store")
        self.store = store
        self.rank = rank
        self.sync = sync
        self.optimizers = optimizers
        self.telemetry = telemetry
        self.defer = defer
        self.step = 0
        """train_step calls so far: the step number the ranks of a node exchange in `sync`."""
        self.lr = 0.0
        self.adam_step = 0
        self.deferred: list[LandedGrads] = []
        self.speculative = frozenset(speculative)
        self.speculated: list[LandedGrads] = []
        """This step's updates ordered before the norm was known, into the stages' other sets."""
        self.pending: dict[int, list[tuple[int, Future]]] = {}
        """Stage -> (step, ordered update) for its updates (one, or one per piece) not yet awaited."""
        self.awaited: dict[int, int] = {}
        """(Not the leader) Stage -> the step whose update of it this rank waits for."""
        self.dispatcher = ThreadPoolExecutor(1, thread_name_prefix="update-dispatch")
        # The leader's thread that publishes each update's completion to the node's other ranks.
        self.publisher = ThreadPoolExecutor(1, thread_name_prefix="update-publish") if sync else None

    def begin_step(self, lr: float, adam_step: int) -> int:
        """A training step starts: its updates use `lr` and `adam_step`; returns its step number."""
        self.step += 1
        self.lr, self.adam_step = lr, adam_step
        return self.step

    def wait(self, stage: int, for_slab: bool = False) -> None:
        """Block the issuing thread until the last ordered update of `stage` is applied. `for_slab`: the wait
        is for a gradient slab that update reads (counted apart from waits for weights to load)."""
        # The leader orders the updates and holds their futures; the other ranks learn through `sync`.
        ordered_updates = self.pending.pop(stage, [])
        step = None if self.rank.leader else self.awaited.pop(stage, None)
        if not ordered_updates and step is None:
            return
        telemetry = self.telemetry
        stats = telemetry.stats
        t0 = time.perf_counter()
        if step is not None:
            self.sync.wait_applied(stage, step)
        for step, ordered in ordered_updates:
            results: list[UpdateDone] = [done.result() for done in ordered.result()]
            if not results:  # a switch of a stage's current set (_switch_set): no update of its own
                continue
            stats["optimizer_seconds"] += max(r.seconds for r in results)
            stats["optimizer_bytes"] += sum(r.dram_bytes for r in results)
            telemetry.mark("run_start", stage, step, min(r.started for r in results))
            telemetry.mark("run_end", stage, step, max(r.ended for r in results))
        t1 = time.perf_counter()
        waited = t1 - t0
        if telemetry.trace is not None and waited > 1e-4:
            telemetry.mark("wait_start", stage, step, t0)
            telemetry.mark("wait_end", stage, step, t1)
        stats["update_wait_seconds"] += waited
        if for_slab:
            stats["slab_wait_seconds"] += waited

    def landed(self, grads: LandedGrads) -> None:
        """The D2H of `grads` is queued: announce it (not the leader) and order its update, now or deferred."""
        self.telemetry.mark("emit", grads.stage, self.step)
        self.telemetry.on_device(grads.stage, self.step, grads.copied)
        if self.sync is not None and not self.rank.leader:
            self._publish_landed(grads.stage, grads.drained)
        speculate = grads.stage in self.speculative and grads.span is None
        if self.defer and speculate:
            self.speculated.append(grads)
            self._order(grads, UpdateOrder(grads.stage, grads.grad_kind, grads.grad_index, self.adam_step, self.lr,
                                           speculative="update"))
        elif self.defer:
            self.deferred.append(grads)
        else:
            self._order(grads, UpdateOrder(grads.stage, grads.grad_kind, grads.grad_index, self.adam_step, self.lr,
                                           span=grads.span))

    def order_deferred(self, coef: float, apply: bool) -> int:
        """Order the step's held-back updates in forward order, their gradients scaled by `coef`; `apply` False
        drops them (non-finite gradients): the workers only rewrite the streaming copies from the masters.
        Returns how many speculative updates are redone."""
        deferred, self.deferred = self.deferred, []
        speculated, self.speculated = self.speculated, []
        for grads in sorted(deferred, key=lambda landed: landed.stage):
            self._order(grads, UpdateOrder(grads.stage, grads.grad_kind, grads.grad_index, self.adam_step, self.lr,
                                           coef, apply=apply, span=grads.span))
        # A redo is sent without waiting for its speculative update: each worker runs its orders one at a time in
        # the order sent (an actor's default concurrency group, a local handle's single thread).
        kept = apply and coef == 1.0  # the speculative updates were the right ones
        for grads in sorted(speculated, key=lambda landed: landed.stage):
            if kept:
                self._switch_set(grads.stage)
                continue
            # The saved gradients were zeroed where no token reached an expert, before the update read them.
            self._order(replace(grads, zero=None), UpdateOrder(
                grads.stage, grads.grad_kind, grads.grad_index, self.adam_step, self.lr, coef, apply=apply,
                speculative="redo"))
        return 0 if kept else len(speculated)

    def _switch_set(self, stage: int) -> None:
        """Make the set the stage's speculative update wrote current, once that update is done: on the dispatcher
        thread, so before any later order reads the stage; a wait for the stage waits for it."""
        updates = [ordered for _, ordered in self.pending.get(stage, [])]

        def switch() -> list[Any]:
            for ordered in updates:
                for done in ordered.result():
                    done.result()
            self.store.switch_set(stage)
            return []
        self.pending.setdefault(stage, []).append((self.step, self.dispatcher.submit(switch)))

    def _order(self, grads: LandedGrads, order: UpdateOrder) -> None:
        stage, drained = grads.stage, grads.drained
        step, sync, telemetry = self.step, self.sync, self.telemetry
        if not self.rank.leader:
            self.awaited[stage] = step
            return

        def send() -> list[Any]:
            drained.synchronize()  # gradients are on the host before any worker reads them
            if grads.zero is not None:
                host, spans = grads.zero
                for a, b in spans:
                    host[a:b].zero_()
            telemetry.mark("drained", stage, step)
            if sync is not None:
                sync.wait_landed(stage, step)  # and so are the other ranks' pieces
                telemetry.mark("landed", stage, step)
            telemetry.mark("sent", stage, step)
            return [worker.apply(order) for worker in self.optimizers]
        future = self.dispatcher.submit(send)
        self.pending.setdefault(stage, []).append((step, future))
        if self.publisher is not None:
            self.publisher.submit(self._publish_applied, stage, step, future)

    def _publish_applied(self, stage: int, step: int, ordered: Future) -> None:
        try:
            for done in ordered.result():
                done.result()
        except BaseException:
            self.sync.applied(stage, FAILED)  # the other ranks stop waiting; `wait` raises it here
            raise
        self.sync.applied(stage, step)
        self.telemetry.mark("applied", stage, step)

    def _publish_landed(self, stage: int, drained: Any) -> None:
        """(Not the leader) Tell the leader when this rank's piece of `stage` is on the host."""
        step, sync, telemetry = self.step, self.sync, self.telemetry

        def landed() -> None:
            drained.synchronize()
            telemetry.mark("drained", stage, step)
            sync.landed(stage, step)
            telemetry.mark("landed", stage, step)
        self.dispatcher.submit(landed)

    def flush(self) -> float:
        """Wait for every ordered update; returns the optimizer seconds they took."""
        self.telemetry.reset_stats()
        for stage in [*self.pending, *self.awaited]:
            self.wait(stage)
        return self.telemetry.stats["optimizer_seconds"]

    def close(self) -> None:
        self.flush()
        self.dispatcher.shutdown(wait=True)
        if self.publisher is not None:
            self.publisher.shutdown(wait=True)
