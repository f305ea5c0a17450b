"""GRPO with its rollout on a GPU of its own (rl.rollout: separate; the worker is actors/rollout_worker.py).

Each step k, once the trainer's updates are applied (Trainer.step flushes them):

    on-policy (rl.async_steps: 0)        sync the weights after k updates, generate batch k, train it
    one step ahead (rl.async_steps: 1)   collect batch k (generated while step k-1 trained), sync the weights after
                                         k updates, start generating batch k+1 with them, train batch k

so with async_steps 1 batch k comes from the weights after k-1 updates (batch 0 and 1 both from the initial ones) and
the generation of k+1 runs beside the training of k. The weights are synced only there, between the trainer's
updates: the rollout worker never reads the host's copy while the optimizer writes it. The trainer's
importance-sampling correction (finetune.grpo.vllm_importance_sampling_correction) weighs each token by the ratio of
the trained policy to the one that generated it, one update older.

A checkpoint after k steps holds batch k, generated ahead (GRPOSteps.save_state): a resumed run trains on it, then
generates k+1 from the checkpoint's weights, as the uninterrupted run does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from megatrain_ray.data.prompts import PromptRows
from megatrain_ray.observe.log import get_logger

log = get_logger(__name__)


@dataclass(slots=True)
class Launched:
    """A generation under way: step `step`'s prompts (each repeated num_generations times) and the future of its
    RolloutResult."""

    step: int
    rows: PromptRows
    prompt_ids: list[list[int]]
    future: Any
    started: float
    ahead: bool = False
    """Generated while the step before trained (rl.async_steps=1)."""


def generation_seconds(stats: dict[str, float]) -> float:
    """The rollout engine's own time of one generation: the weights made ready, prefill, decode, put back."""
    return sum(stats.get(k, 0.0) for k in ("weights_sync_s", "prefill_s", "decode_s", "weights_restore_s"))


class SeparateRollouts:
    """The rollout worker's side of GRPOSteps (module docstring): when the weights are synced, what runs ahead."""

    def __init__(self, steps: Any, async_steps: int, total_steps: int, lora: bool):
        """`steps`: the run's GRPOSteps (launch, finish); `lora`: the trainer keeps the adapters, which the sync
        hands over (a full fine-tune's weights are read from the host by the worker itself)."""
        self.steps, self.async_steps, self.total_steps, self.lora = steps, async_steps, total_steps, lora
        self.ahead: Launched | None = None
        self.gpu: Any = None
        """The trainer's GPU worker (set by batch): a checkpoint collects the batch generated ahead with it."""
        self.held: tuple[int, Any] | None = None
        """(step, RolloutBatch) of a batch generated ahead and already collected (a checkpoint's, or one that a
        checkpoint collected), which step `step` trains on."""

    def batch(self, step: int, gpu: Any, worker: Any) -> Any:
        """Step `step`'s RolloutBatch; the trainer's updates of the steps before are applied."""
        self.gpu = gpu
        batch = self.collect(step, gpu)
        sync = self.sync(gpu, worker)
        if batch is None:  # on-policy; or the first step ahead, or a resume whose checkpoint holds no batch ahead
            if self.async_steps and step > 0:
                log.info("step %d: no batch generated ahead (the checkpoint holds none): generating it now, from "
                         "the weights after %d updates", step, step)
            batch = self.steps.finish(self.steps.launch(step, worker), gpu)
        if self.async_steps and step + 1 < self.total_steps:
            self.ahead = self.steps.launch(step + 1, worker, ahead=True)
        batch.metrics.update({"rollout_sync_s": sync["seconds"], "rollout_sync_gb": sync["bytes"] / 1e9})
        return batch

    def collect(self, step: int, gpu: Any) -> Any:
        """The batch of step `step` generated ahead, waited for and scored; None if there is none."""
        if self.held is not None and self.held[0] == step:
            batch, self.held = self.held[1], None
            return batch
        if self.ahead is not None and self.ahead.step == step:
            launched, self.ahead = self.ahead, None
            return self.steps.finish(launched, gpu)
        return None

    def hold_ahead(self, step: int) -> Any:
        """(A checkpoint after `step` steps) The batch generated ahead for step `step`, collected now (scored with the
        GPU worker of the last step) and kept for that step; None where there is none."""
        if self.gpu is None:  # no step ran yet in this incarnation
            return self.held[1] if self.held is not None and self.held[0] == step else None
        batch = self.collect(step, self.gpu)
        if batch is not None:
            self.held = (step, batch)
        return batch

    def up_to_date(self, gpu: Any, worker: Any) -> None:
        """Before a generation outside the steps' schedule (evaluation: the weights after every step taken): the
        batch generated ahead collected and held for its step, the trainer's updates applied, the worker synced."""
        if self.ahead is not None:
            launched, self.ahead = self.ahead, None
            self.held = (launched.step, self.steps.finish(launched, gpu))
        gpu.flush().result()
        self.sync(gpu, worker)

    def sync(self, gpu: Any, worker: Any) -> dict[str, float]:
        """The rollout worker takes the weights after the trainer's updates so far (its generation, if any, is done:
        the actor runs one call at a time)."""
        t0 = time.perf_counter()
        adapters = gpu.adapters().result() if self.lora else None
        took = worker.update_weights(adapters).result()
        return {"seconds": time.perf_counter() - t0, "bytes": took["bytes"]}

    def reset(self) -> None:
        """A restart or a resume: nothing under way or held survives (the actors are new)."""
        self.ahead, self.held, self.gpu = None, None, None
