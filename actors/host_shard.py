"""HostShard: creates and owns the shared-memory segments of a range of stages, fills them (random
init or a checkpoint) and writes its stages of each checkpoint."""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Callable

import torch

from actors.base import ActorBase
from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.exceptions import HostMemoryError
from megatrain_ray.model.hf_io import HFDirectory
from megatrain_ray.model.layout import ModelLayout
from megatrain_ray.observe.log import get_logger, init_logger
from megatrain_ray.store.checkpoint import CheckpointInfo, StageWriter, load_stage
from megatrain_ray.store.initial_values import init_stage, load_hf_stage
from megatrain_ray.store.liveness import RunLock
from megatrain_ray.store.nf4_base import (
    NF4_KIND,
    checkpoint_fill_bytes,
    fill_base_stage,
    fill_base_stage_in_process,
    fill_processes,
    fill_threads,
)
from megatrain_ray.store.segments import (
    HostStore,
    SegmentSpec,
    create_segment,
    plan_segments,
    segment_prefix,
    unlink_segment,
)
from megatrain_ray.system.guardian import Guardian
from megatrain_ray.system.memory import host_memory
from megatrain_ray.system.processes import exit_when_gone
from megatrain_ray.system.topology import bind_process, move_thread

log = get_logger(__name__)


class HostShard(ActorBase):
    def __init__(self, cfg: Config, run: RunSpec, layout: ModelLayout, run_id: str, shard: int, stages: list[int],
                 cores: tuple[int, ...] = (), numa_node: int | None = None, fill_cores: tuple[int, ...] = (),
                 restore: CheckpointInfo | None = None):
        """`cores` and `numa_node` (Ray mode; see topology.plan_placement) bind the shard and the pages
        it first touches to its node before any segment exists; in-process nothing is bound. The stages are
        filled on `fill_cores` (its share of the node's cores, idle at start-up; default: `cores`). `restore`
        fills the segments from a checkpoint instead of the random initialisation. With several GPU workers
        on the node (run.ranks_per_node), shard 0 also owns their counters."""
        init_logger(f"host{shard}")
        binding = bind_process(cores, numa_node) if cores else "not bound (in-process)"
        self.shard = shard
        self.layout = layout
        self.stages = stages
        self.specs = plan_segments(layout, cfg.host, cfg.engine.grad_slabs, run, run_id, stages, shard)
        self._created: list[SegmentSpec] = []
        self._writer: StageWriter | None = None
        # The segments go when this process does, however it ends (a SIGKILL included): system/guardian.py.
        self._guardian = Guardian()
        self._guardian.remove_on_exit([spec.path for spec in self.specs])
        self._locks: list[RunLock] = []
        bound = move_thread(fill_cores)  # until the stages are filled
        try:
            # A lock held for this process's life tells other runs' sweeps that these segments live (store/liveness.py).
            for directory in sorted({os.path.dirname(spec.path) for spec in self.specs}):
                self._guardian.remove_on_exit([RunLock.path_in(directory, segment_prefix(run_id), shard)])
                self._locks.append(RunLock(directory, segment_prefix(run_id), shard))
            self._create_segments()
            self.store = HostStore(self.specs)
            self.gate = self.store.gates()[0]
            # The stages it holds: the GPU-resident ones (engine.gpu_resident) have no segments here.
            self.held = [i for i in stages if self.store.has("master", i) or self.store.has(NF4_KIND, i)]
            # A frozen base (LoRA) is not in its checkpoints (they hold the adapters): it is loaded as at the start.
            self.saved = [] if run.frozen_base else self.held
            # GRPO's KL reference (run.reference_copy): the initial weights, as a fresh run fills them, also on resume
            # (then the checkpoint is loaded over the trained kinds): a checkpoint never holds them.
            if restore is None or run.frozen_base or run.reference_copy:
                self._fill_initial(cfg, run)
            if run.reference_copy:
                self._each_stage("reference copy made", lambda i: self.store.get("reference", i).copy_(
                    self.store.stream(i)))
            if restore is not None and not run.frozen_base:
                self._each_stage(f"loaded from {restore.directory}", lambda i: self._restore_stage(restore, i))
            if cfg.engine.poison_buffers:
                for spec in self.specs:
                    if spec.kind in ("grad", "gradpool"):
                        self.store.get(spec.kind, spec.stage).fill_(float("nan"))
        except BaseException:
            self.shutdown()
            raise
        finally:
            move_thread(bound)
        gib = sum(s.nbytes for s in self.specs if not s.on_disk) / 2**30
        disk = sum(s.nbytes for s in self.specs if s.on_disk)
        log.info("shard %d: %d stages, %d segments, %.2f GiB in %s%s; %s", shard, len(stages), len(self.specs), gib,
                 cfg.host.shm_dir, f", {disk / 1e9:.2f} GB of moments in {cfg.host.disk_dir}" if disk else "", binding)

    def _fill_initial(self, cfg: Config, run: RunSpec) -> None:
        """The stages' initial values: a Hugging Face directory's (quantized to NF4 for a QLoRA base) or the seeded
        random initialisation."""
        layout = self.layout
        if cfg.model.path and run.base_quantization == "nf4":  # QLoRA: quantized as the stages load
            source = HFDirectory(cfg.model.path)
            self._each_stage(f"loaded from {cfg.model.path} (decoder layers quantized to NF4)",
                             lambda i: fill_base_stage(self.store, layout.stages[i], run, source, 0, 0.0),
                             thread_bytes=checkpoint_fill_bytes(layout, run),
                             in_process=lambda i: self._nf4_fill_args(i, run, str(cfg.model.path), 0, 0.0))
        elif cfg.model.path:  # fine-tuning: the weights come from a Hugging Face directory
            source = HFDirectory(cfg.model.path)
            self._each_stage(f"loaded from {cfg.model.path}",
                             lambda i: load_hf_stage(self.store, layout.stages[i], source))
        elif run.base_quantization == "nf4":
            seed, std = cfg.train.seed, cfg.model.initializer_range
            self._each_stage("initialised (decoder layers quantized to NF4)",
                             lambda i: fill_base_stage(self.store, layout.stages[i], run, None, seed, std),
                             in_process=lambda i: self._nf4_fill_args(i, run, "", seed, std))
        else:
            self._each_stage("initialised", lambda i: init_stage(self.store, layout.stages[i], cfg.train.seed,
                                                                 cfg.model.initializer_range))

    def _create_segments(self) -> None:
        """Every segment allocated whole (create_segment), in parallel threads: the kernel zero-fills the pages
        of separate files concurrently, and a large store would otherwise take minutes on one core."""
        self._created = list(self.specs)  # unlinking one never created is a no-op; a failure removes them all
        threads = max(1, min(len(self.specs), len(os.sched_getaffinity(0))))
        with ThreadPoolExecutor(threads, thread_name_prefix="allocate") as pool:
            for future in [pool.submit(create_segment, spec) for spec in self.specs]:
                future.result()

    def _each_stage(self, what: str, fill: Callable[[int], None], thread_bytes: int = 0,
                    in_process: Callable[[int], tuple] | None = None) -> None:
        """Stages in parallel threads (the torch kernels and file reads release the GIL), with progress; when each
        thread holds `thread_bytes` of temporaries, only as many as the free RAM (the segments allocated) holds.
        `in_process(i)` gives fill_base_stage_in_process's arguments for stage i: when given and the stages are
        large enough (store/nf4_base.fill_processes), they are filled in as many processes instead."""
        t0 = time.perf_counter()
        stages = self.held
        cores = len(os.sched_getaffinity(0))
        available = host_memory()[1] if thread_bytes else 0
        threads, torch_threads = fill_threads(len(stages), cores, thread_bytes, available)
        if thread_bytes and threads < min(len(stages), cores):
            log.info("shard %d: %d threads fill the stages (%.1f GB of temporaries each, %.1f GB of RAM free)",
                     self.shard, threads, thread_bytes / 1e9, available / 1e9)
        processes = fill_processes(threads, sum(self.layout.stages[i].numel for i in stages)) if in_process else 0
        done, before = 0, torch.get_num_threads()
        torch.set_num_threads(torch_threads)
        try:
            if processes:
                log.info("shard %d: %d processes fill the stages", self.shard, processes)
                # spawn, not fork: this process runs Ray's threads.
                # Each ends with the shard, however it ends (exit_when_gone), not waiting for work with the store mapped.
                pool: Executor = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                                     initializer=exit_when_gone, initargs=(os.getpid(),))
                futures = [pool.submit(fill_base_stage_in_process, *in_process(i)) for i in stages]  # type: ignore[misc]
            else:
                pool = ThreadPoolExecutor(threads, thread_name_prefix="fill")
                futures = [pool.submit(fill, i) for i in stages]
            with pool:
                try:
                    for future in as_completed(futures):
                        future.result()
                        done += 1
                        if done % max(1, len(stages) // 5) == 0 or done == len(stages):
                            log.info("shard %d: %s %d/%d stages (%.0f s)", self.shard, what, done, len(stages),
                                     time.perf_counter() - t0)
                except BrokenProcessPool as err:
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise HostMemoryError(
                        f"shard {self.shard}: a process packing the NF4 base died ({err}), most often killed for "
                        f"memory: {host_memory()[1] / 1e9:.1f} GB of RAM free now; `megatrain plan` shows the "
                        "store's size against the machine") from err
                except BaseException:
                    pool.shutdown(wait=False, cancel_futures=True)  # the error now, not after every other stage
                    raise
        finally:
            torch.set_num_threads(before)

    def _nf4_fill_args(self, stage: int, run: RunSpec, model_path: str, seed: int, std: float) -> tuple:
        """fill_base_stage_in_process's arguments: the stage's own segments, mapped again in the filling process."""
        specs = [s for s in self.specs if s.stage == stage and s.kind in (NF4_KIND, "master") and not s.on_disk]
        return specs, self.layout.stages[stage], run, model_path, seed, std

    def _flats(self, stage: int) -> dict[str, torch.Tensor]:
        return self.store.state_flats(stage)

    def _restore_stage(self, info: CheckpointInfo, stage: int) -> None:
        load_stage(info.directory, self.layout.stages[stage], self._flats(stage), info.entry_of(stage))
        if self.store.has("stream", stage):
            self.store.get("stream", stage).copy_(self.store.get("master", stage))

    # ------------------------------------------------------------------ checkpoints

    def save_begin(self, step: int, directory: str, die_after_first: bool = False) -> None:
        """Hold this shard's stages and start writing them in the background (returns at once)."""
        if self._writer is not None:
            self._writer.wait()
        self._writer = StageWriter([self.layout.stages[i] for i in self.saved], self._flats, self.gate,
                                   Path(directory), step, die_after_first)

    def save_wait(self) -> list[dict]:
        """The file entries of the checkpoint begun last, once they are on disk."""
        assert self._writer is not None, "save_begin first"
        writer, self._writer = self._writer, None
        entries = writer.wait()
        log.info("shard %d: wrote %d stage files of step %d in %.1f s", self.shard, len(entries), writer.step,
                 writer.seconds)
        return entries

    def segments(self) -> list[SegmentSpec]:
        return self.specs

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.thread.join()
        for spec in self._created:
            unlink_segment(spec)
        self._created.clear()
        for lock in self._locks:
            lock.release()
        self._locks.clear()
        self._guardian.close(wait_s=1.0)
