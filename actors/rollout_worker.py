"""RolloutWorker: GRPO's rollout on a GPU of its own (rl.rollout: separate), beside the trainer's GPU worker.

It maps the same host segments as the trainer and runs the same layer templates and rollout engine
(engine/rollout/), but trains nothing: no optimizer workers, no GPU-resident training state. Its weights:

- full fine-tuning: its own copy of every stage in the compute dtype on its device, copied from the host's
  streaming copy (what the CPU optimizer writes after each update) when the driver says the trainer's updates are
  applied (update_weights), never while it generates: so with rl.async_steps=1 the optimizer may rewrite the host's
  copy during a generation without the generation seeing a half-updated model;
- LoRA: the frozen base read where it lies (its own resident copy of the base, or the NF4 bytes in the host store:
  neither ever changes) and the adapters, which the trainer keeps on its device, handed over by the driver.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from actors.gpu_worker import GPUWorker
from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.engine.rollout.weights import resident_bytes
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.model.layout import ModelLayout
from megatrain_ray.observe.log import get_logger
from megatrain_ray.store.checkpoint import CheckpointInfo
from megatrain_ray.store.segments import SegmentSpec

log = get_logger(__name__)


def rollout_run(run: RunSpec) -> RunSpec:
    """The trainer's RunSpec as the rollout worker runs it: the same store and dtypes; a full fine-tune's layers all
    read from the host (the trainer keeps none resident under rl.rollout: separate), no reference copy (the
    trainer computes the KL reference's log-probabilities)."""
    if run.frozen_base:  # LoRA: its resident base is copied from the host store, as the trainer's
        return dataclasses.replace(run, kept_layers=0, reference_copy=False)
    # frozen_base: the engine then allocates no gradient sink and no vocabulary accumulator (it never trains); the
    # store it maps stays the trainer's (stream_is_master, the kinds and dtypes unchanged)
    return dataclasses.replace(run, resident_layers=0, resident_vocab=False, kept_layers=0, speculative_stages=0,
                               reference_copy=False, frozen_base=True)


class RolloutWorker(GPUWorker):
    STORE_KINDS = ("stream", "nf4")
    PINNED_KINDS = ("master", "stream", "nf4")

    def __init__(self, cfg: Config, run: RunSpec, layout: ModelLayout, specs: list[SegmentSpec],
                 cores: list[int] | None = None, restore: CheckpointInfo | None = None):
        super().__init__(cfg, rollout_run(run), layout, specs, [], None, cores, restore)
        self.engine.refresh_on_generate = False
        self.lora = run.frozen_base

    def update_weights(self, adapters: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """Take the trainer's weights after its last update (RolloutEngine.update_weights): a full fine-tune's from
        the host's streaming copy, a LoRA run's `adapters` (by PEFT name, the trainer's GPUWorker.adapters()).
        Seconds and bytes copied."""
        t0 = time.perf_counter()
        if self.lora:
            if adapters is None:
                raise ValueError("a LoRA rollout worker takes the trainer's adapters: pass them")
            self.engine.adapters.put_named(adapters)
            copied = sum(t.numel() * t.element_size() for t in adapters.values())
        else:
            if getattr(self.engine, "_rollout_weights", None) is None:
                self._check_fits()
            copied = self.engine.refresh_rollout_weights()
        return {"seconds": time.perf_counter() - t0, "bytes": float(copied)}

    def _check_fits(self) -> None:
        """One clear error, before the allocation, when the model in the compute dtype does not fit this GPU."""
        if self.device.type != "cuda":
            return
        need = resident_bytes(list(self.layout.stages), self.engine.compute_dtype)
        free, total = torch.cuda.mem_get_info(self.device)
        if need > free:
            gib = 2**30
            raise ConfigError(f"rl.rollout=separate holds the whole model on the rollout GPU in "
                              f"{self.engine.compute_dtype}: {need / gib:.1f} GiB, more than its {free / gib:.1f} GiB "
                              f"free (of {total / gib:.1f}); use rl.rollout: colocated")

