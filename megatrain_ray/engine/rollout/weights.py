"""The rollout's own copy of the weights on the device (engine.rollout_weights): every stage in the compute dtype,
refreshed from the host's streaming copy (what the optimizer writes after each update) before each generation, so a
decode step copies no weights. The alternative, streaming every stage through the training slots for each generated
token, costs a host-to-device copy of the whole model per token."""

from __future__ import annotations

import torch

from megatrain_ray.model.layout import StageLayout
from megatrain_ray.model.lora import merge_adapters
from megatrain_ray.model.templates import bind
from megatrain_ray.observe.log import get_logger
from megatrain_ray.store.segments import HostStore

log = get_logger(__name__)
MARGIN = 0.10
"""The share of the free device memory left unused when auto decides whether the copy fits."""


def resident_bytes(stages: list[StageLayout], dtype: torch.dtype) -> int:
    return sum(stage.numel for stage in stages) * torch.tensor([], dtype=dtype).element_size()


def choose_resident(setting: str, device: torch.device, adapters: bool, copy_bytes: int, cache_bytes: int) -> bool:
    """engine.rollout_weights resolved for one generation: resident, streamed, or auto (module docstring). `adapters`:
    the layers bind LoRA adapters, so their base is read where training keeps it (never copied)."""
    if setting != "auto":
        return setting == "resident" and not adapters
    if adapters or device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return copy_bytes + cache_bytes <= free * (1 - MARGIN)


class RolloutWeights:
    """The weights of `stages` (those not already on the device: the GPU-resident tier's layers are read where they
    live) in the compute dtype on the device, one flat buffer per stage."""

    def __init__(self, stages: list[StageLayout], dtype: torch.dtype, device: torch.device):
        self.buffers = {stage.index: torch.empty(stage.numel, dtype=dtype, device=device) for stage in stages}
        self.stages = stages
        log.info("rollout weights resident on %s: %.2f GiB", device, resident_bytes(stages, dtype) / 2**30)

    def refresh(self, store: HostStore, wait_for_update) -> None:
        """Copy each stage's streaming copy in, once its pending update is applied (`wait_for_update(index)`)."""
        for stage in self.stages:
            wait_for_update(stage.index)
            self.buffers[stage.index].copy_(store.stream(stage.index)[:stage.numel], non_blocking=True)
        for buffer in self.buffers.values():
            if buffer.is_cuda:  # pinned sources: the copies must be done before anything reads or frees them
                torch.cuda.current_stream(buffer.device).synchronize()
            break

    def holds(self, stage: StageLayout) -> bool:
        return stage.index in self.buffers

    def bound(self, stage: StageLayout) -> dict[str, torch.Tensor]:
        return bind(self.buffers[stage.index], stage)


class ResidentBaseView:
    """A LoRA run whose base layers are all GPU-resident (engine.gpu_resident: every layer; not an NF4 base, which is
    dequantized at each use): the layers bound as training binds them (the resident base and the adapters, both on the
    device), the embedding and LM head loaded once into their slots (a frozen base's slots keep them). As with
    RolloutWeights, a decode step then reads only device tensors that stay put, so it can be one CUDA graph; the
    adapters are read where they train, so nothing is refreshed."""

    def __init__(self, engine):
        layout, weights = engine.layout, engine.weights
        self.engine = engine
        self.vocab = {}
        for stage in (layout.embed, layout.head):
            self.vocab[stage.index] = weights.bind(stage, weights.load(stage))  # the copy waited for, once

    @staticmethod
    def applies(engine) -> bool:
        return engine.weights.packed is None and all(engine.base.holds(s) for s in engine.layout.layers)

    def holds(self, stage: StageLayout) -> bool:
        return True

    def bound(self, stage: StageLayout) -> dict[str, torch.Tensor]:
        return self.vocab[stage.index] if stage.index in self.vocab else self.engine._bind(stage, None)


class MergedBaseView(ResidentBaseView):
    """ResidentBaseView with the adapters folded into the resident base for one generation (engine.rollout_lora:
    merged): each adapted matrix becomes W + scaling * B A in the compute dtype (model/lora.merge_adapters), in
    place, so the layers are bound without adapters and a decode step runs the base's products alone. `restore`
    copies the resident layers back from the host's base (engine/resident_base.ResidentBase.reload: the values the
    engine started from, bit for bit); the generation must call it however it ends."""

    def __init__(self, engine):
        super().__init__(engine)
        self.merged = False
        base, adapters = engine.base, engine.adapters
        try:
            for stage in engine.layout.layers:
                self.merged = True
                merge_adapters(base.weights(stage), adapters.layer(stage.index - 1), adapters.scaling)
        except BaseException:
            self.restore()
            raise

    @staticmethod
    def applies(engine) -> bool:
        """Every base layer resident and dense, its adapters on linear projections only (not a MoE's experts or
        router), LoRA on (not inside reference_weights)."""
        return (ResidentBaseView.applies(engine) and not engine.adapters_off
                and all(s.moe is None for s in engine.specs))

    def bound(self, stage: StageLayout) -> dict[str, torch.Tensor]:
        return self.vocab[stage.index] if stage.index in self.vocab else self.engine.base.weights(stage)

    def restore(self) -> None:
        if self.merged:
            self.engine.base.reload()
            self.merged = False
