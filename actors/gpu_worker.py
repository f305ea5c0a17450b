"""GPUWorker: maps the host segments, registers them as pinned memory, runs the layer stream."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from actors.base import ActorBase
from megatrain_ray.config import Config
from megatrain_ray.engine.stream_engine import StreamEngine
from megatrain_ray.host import HostStore, SegmentSpec
from megatrain_ray.log import get_logger, init_logger
from megatrain_ray.messages import Batch, StepResult
from megatrain_ray.model.layout import ModelLayout

log = get_logger(__name__)


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("engine.device=cuda but CUDA is not available to this worker; "
                               "set engine.device=auto or cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GPUWorker(ActorBase):
    def __init__(self, cfg: Config, layout: ModelLayout, specs: list[SegmentSpec], optimizers: list[Any]):
        init_logger("gpu")
        self.device = resolve_device(cfg.engine.device)
        torch.set_num_threads(max(1, min(os.cpu_count() or 1, 4)) if self.device.type == "cuda"
                              else (os.cpu_count() or 1))
        self.store = HostStore([s for s in specs if s.kind in ("stream", "grad", "gradpool")
                                or (s.kind == "master" and cfg.precision.stream_is_master)])
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            gib = self.store.register_pinned(("master", "stream", "grad", "gradpool"))
            log.info("registered %.2f GiB of host segments as pinned memory in %.1f s", gib, time.perf_counter() - t0)
        self.engine = StreamEngine(cfg, layout, self.store, optimizers, self.device)
        log.info("layer stream on %s: compute %s, streaming %s; layer inputs %s (engine.activation_offload=%s)",
                 self.device, cfg.precision.compute_dtype, cfg.precision.resolved_stream_dtype,
                 "offloaded to pinned host memory" if self.engine.offload else "kept on the device",
                 cfg.engine.activation_offload)

    def train_step(self, batch: Batch | torch.Tensor, lr: float, adam_step: int,
                   inject_nan: bool = False) -> StepResult:
        return self.engine.train_step(batch, lr, adam_step, inject_nan)

    def eval_loss(self, batch: Batch) -> tuple[float, int]:
        return self.engine.eval_loss(batch)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.engine.logits(ids)

    def flush(self) -> float:
        return self.engine.flush()

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    def shutdown(self) -> None:
        self.engine.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.store.unregister_pinned()
