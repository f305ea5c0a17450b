"""A LoRA run's GPU-resident base (finetune.method=lora with engine.gpu_resident): the frozen weights of the first
N decoder layers, kept on the compute device for the whole run.

A frozen base has no training state beyond its weights, and they never change: each resident layer is one
device buffer in the compute dtype, copied once from the host store (the base in the streaming dtype, which the
host keeps) when the engine starts, which is after the host shards loaded or initialised it, on resume and
after a fault restart alike, and again when the driver overwrites the base (Trainer.load_weights: `reload`).
Every pass reads it in place: no H2D copy and no weight slot for those layers. The cast to the compute dtype
is the one a streamed layer's weights take on the device (its slot's copy), so a resident layer computes on
exactly the values it would have had streamed.

An NF4 base's (finetune.lora.base_quantization=nf4) resident layers stay packed on the device instead, and are
dequantized into a weight slot at each use (engine/packed_stream.py): this tier holds its dense stages only.
"""

from __future__ import annotations

import torch

from megatrain_ray.model.layout import ModelLayout, StageLayout
from megatrain_ray.model.templates import bind
from megatrain_ray.store.segments import HostStore


class ResidentBase:
    def __init__(self, layout: ModelLayout, count: int, store: HostStore, compute_dtype: torch.dtype,
                 device: torch.device):
        """`count`: resident layers (RunSpec.resident_layers), the first `count` (ModelLayout.resident_stages);
        `store`: the host store that holds the base."""
        self.store = store
        self.stages = {stage.index: (stage, torch.empty(stage.numel, dtype=compute_dtype, device=device))
                       for stage in layout.resident_stages(count) if store.has("master", stage.index)}
        self.reload()

    def reload(self) -> None:
        """Copy every resident layer from the host store (stage by stage: no host or device temporary beyond one
        stage's cast)."""
        for stage, weights in self.stages.values():
            weights.copy_(self.store.stream(stage.index)[:stage.numel])

    def holds(self, stage: StageLayout) -> bool:
        return stage.index in self.stages

    def weights(self, stage: StageLayout) -> dict[str, torch.Tensor]:
        """The stage's tensors, views of its device buffer, as WeightStream.bind gives a streamed stage's."""
        return bind(self.stages[stage.index][1], stage)

    @property
    def bytes(self) -> int:
        """Device memory the resident layers hold."""
        return sum(t.numel() * t.element_size() for _, t in self.stages.values())

    def close(self) -> None:
        self.stages = {}
