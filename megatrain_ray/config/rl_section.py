"""The `rl` section: where a reinforcement-learning run (finetune.objective=grpo) generates its completions, and how
far the generation may run ahead of the training. The loop is driver/grpo.py (driver/separate_rollout.py for the
separate rollout worker); the worker is actors/rollout_worker.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from megatrain_ray.config.fields import refuse as _fail


@dataclass(kw_only=True, slots=True)
class RLConfig:
    """Placement of GRPO's rollout (docs/fine-tuning.md, GRPO: the rollout on a GPU of its own)."""

    SECTION: ClassVar[str] = "rl"
    rollout: Literal["colocated", "separate"] = "colocated"
    """colocated: the trainer's GPU worker generates, its device memory time-shared between the KV cache and the
    training buffers. separate: a rollout worker of its own (a Ray actor on a GPU of its own, beside the trainer's on
    the same node) holds the whole model in the compute dtype on its GPU and generates there; after each optimizer
    step it copies the new weights from the host's streaming copy, which the CPU optimizer writes anyway (LoRA: the
    frozen base stays, the adapters are copied from the trainer), so no weight crosses between the GPUs. Needs a node
    with one GPU more than the trainer uses (parallel.gpus + 1), or a CPU run (tests), and runtime.mode=ray on
    GPUs. Full fine-tuning then keeps no layer GPU-resident in the trainer (engine.gpu_resident: none; auto resolves
    to it): the rollout reads every stage from the host."""
    async_steps: int = 0
    """0: each step generates with the weights it trains (on-policy). 1 (needs rollout: separate): the completions of
    step k+1 are generated while step k trains, with the weights from before step k's update, so the training
    batch is one update old. The gap between the generating and the training policy is what
    finetune.grpo.vllm_importance_sampling_correction corrects (required on). A checkpoint keeps the batch generated
    ahead, so a resumed run trains on what the uninterrupted one did."""

    def __post_init__(self) -> None:
        if self.async_steps not in (0, 1):
            _fail("rl.async_steps", self.async_steps, "must be 0 (on-policy) or 1 (generation one step ahead)")
        if self.async_steps and self.rollout != "separate":
            _fail("rl.async_steps", self.async_steps, "generates beside the training step, on a GPU of its own: set "
                  "rl.rollout: separate (and give the node a GPU for it)")

    @property
    def separate(self) -> bool:
        return self.rollout == "separate"
