"""HostShard: creates and owns the shared-memory segments of a range of stages."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch

from megatrain_ray.config import Config
from megatrain_ray.host import HostStore, SegmentSpec, create_segment, init_stage, plan_segments, unlink_segment
from megatrain_ray.log import get_logger, init_logger
from megatrain_ray.model.hf_io import HFDirectory, load_stage
from megatrain_ray.model.layout import ModelLayout

log = get_logger(__name__)


class HostShard:
    def __init__(self, cfg: Config, layout: ModelLayout, run_id: str, shard: int, stages: list[int]):
        init_logger(f"host{shard}")
        self.shard = shard
        self.specs = plan_segments(layout, cfg, run_id, stages, with_pool=shard == 0)
        self._created: list[SegmentSpec] = []
        try:
            for spec in self.specs:
                create_segment(spec)
                self._created.append(spec)
            self.store = HostStore(self.specs)
            self._initialise(layout, stages, cfg)
            if cfg.engine.poison_buffers:
                for spec in self.specs:
                    if spec.kind in ("grad", "gradpool"):
                        self.store.get(spec.kind, spec.stage).fill_(float("nan"))
        except BaseException:
            self.shutdown()
            raise
        gib = sum(s.nbytes for s in self.specs) / 2**30
        log.info("shard %d: %d stages, %d segments, %.2f GiB in %s", shard, len(stages), len(self.specs), gib,
                 cfg.host.shm_dir)

    def _initialise(self, layout: ModelLayout, stages: list[int], cfg: Config) -> None:
        """Random init or loading, stages in parallel threads (the torch kernels release the GIL), with progress in the log."""
        t0 = time.perf_counter()
        threads = max(1, min(len(stages), len(os.sched_getaffinity(0))))
        done = 0
        with ThreadPoolExecutor(threads, thread_name_prefix="init") as pool:
            if cfg.model.path:  # fine-tuning: the weights come from a Hugging Face directory
                source = HFDirectory(cfg.model.path)
                futures = [pool.submit(load_stage, self.store, layout.stages[i], source) for i in stages]
            else:
                futures = [pool.submit(init_stage, self.store, layout.stages[i], cfg.train.seed,
                                       cfg.model.initializer_range) for i in stages]
            for future in as_completed(futures):
                future.result()
                done += 1
                if done % max(1, len(stages) // 5) == 0 or done == len(stages):
                    log.info("shard %d: %s %d/%d stages (%.0f s)", self.shard,
                             "loaded" if cfg.model.path else "initialised", done, len(stages),
                             time.perf_counter() - t0)

    def segments(self) -> list[SegmentSpec]:
        return self.specs

    def pid(self) -> int:
        return os.getpid()

    def read_tensors(self, layout: ModelLayout, kind: str = "master") -> dict[str, torch.Tensor]:
        return self.store.read_tensors(layout, kind)  # type: ignore[arg-type]

    def write_tensors(self, layout: ModelLayout, tensors: dict[str, torch.Tensor]) -> None:
        self.store.write_tensors(layout, tensors)

    def shutdown(self) -> None:
        for spec in self._created:
            unlink_segment(spec)
        self._created.clear()
