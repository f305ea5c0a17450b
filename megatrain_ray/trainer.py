"""The driver: builds the actors, runs the steps, writes the run directory.

    shards     = HostShard x host.num_shards        (own the segments, initialise weights)
    optimizers = OptimizerWorker x optimizer.workers (map the segments, AdamW on their share)
    gpu        = GPUWorker                           (maps the segments, runs the layer stream,
                                                      orders updates from the optimizers itself)

The driver only sends each step's token ids and learning rate to the GPU worker and reads back
a StepResult; bulk tensors stay in shared memory.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from actors.gpu_worker import GPUWorker
from actors.host_shard import HostShard
from actors.optimizer_worker import OptimizerWorker
from megatrain_ray.config import Config, config_to_yaml
from megatrain_ray.data import make_batches, make_eval_batches
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.files import refuse_existing
from megatrain_ray.host import HostStore, SegmentSpec, StoreTensors, check_capacity, plan_segments, shard_stages
from megatrain_ray.log import get_logger
from megatrain_ray.metrics import (
    MetricsWriter,
    Progress,
    model_flops_per_token,
    optimizer_hidden_fraction,
    rss_anon_bytes,
    shm_bytes,
)
from megatrain_ray.model.hf_io import HFDirectory, export_hf, source_dtype
from megatrain_ray.model.layout import ModelLayout, build_layout
from megatrain_ray.optim import lr_at
from megatrain_ray.runtime import Handle, spawn, start_ray

log = get_logger(__name__)


def optimizer_cores(num_workers: int, cores: list[int]) -> list[list[int]]:
    """Disjoint core sets, one per worker; two cores stay free for the GPU worker on larger boxes."""
    if len(cores) >= 8:
        cores = cores[2:]
    if num_workers >= len(cores):
        return [[cores[w % len(cores)]] for w in range(num_workers)]
    per = len(cores) // num_workers
    return [cores[w * per:(w + 1) * per] for w in range(num_workers)]


def resolve_workers(requested: int) -> int:
    return requested or max(1, len(os.sched_getaffinity(0)) // 4)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def sweep_stale_segments(shm_dir: str) -> None:
    """Remove segments left by runs of this host whose driver process no longer exists."""
    host = socket.gethostname()
    for name in os.listdir(shm_dir) if os.path.isdir(shm_dir) else []:
        parts = name.split("-")
        if len(parts) < 4 or parts[0] != "megatrain" or parts[1] != host.replace("-", "_"):
            continue
        try:
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(shm_dir, name))
            except FileNotFoundError:
                pass
        except (ValueError, PermissionError):
            continue


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path | None = None):
        self.cfg = cfg
        self.layout: ModelLayout = build_layout(cfg.model)
        self.run_dir = Path(run_dir or cfg.train.output_dir)
        self.run_id = f"{socket.gethostname().replace('-', '_')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if cfg.model.path:  # a checkpoint that does not fit the model fails before any allocation
            HFDirectory(cfg.model.path).check_against_layout(self.layout)
        if cfg.train.export_dir:  # found now, not after hours of training
            refuse_existing(Path(cfg.train.export_dir), ConfigError, "train.export_dir")
        # Bad data fails before any allocation.
        self.data = make_batches(cfg.data, cfg.model)
        self.eval_data = make_eval_batches(cfg.data, cfg.model, cfg.train.eval_batches) if cfg.train.eval_every else []
        self.stage_groups = shard_stages(self.layout, cfg.host.num_shards)
        planned = [spec for k, stages in enumerate(self.stage_groups)
                   for spec in plan_segments(self.layout, cfg, self.run_id, stages, with_pool=k == 0)]
        sweep_stale_segments(cfg.host.shm_dir)
        check_capacity(planned, cfg.host.shm_dir)
        self.flops_per_token = model_flops_per_token(cfg.model, self.layout, cfg.data.seq_len)
        self.shards: list[Handle] = []
        self.optimizers: list[Handle] = []
        self.gpu: Handle | None = None
        self.specs: list[SegmentSpec] = []
        self._started_ray = False
        self._metrics: MetricsWriter | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "Trainer":
        cfg, mode = self.cfg, self.cfg.runtime.mode
        metrics_path = self.run_dir / "metrics.jsonl"
        if metrics_path.exists():
            raise ConfigError(f"train.output_dir={str(self.run_dir)!r} already holds a run (metrics.jsonl); "
                              "choose another train.output_dir or remove that directory")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.run_dir / "config.yaml", config_to_yaml(cfg))
        num_gpus = 0
        if mode == "ray":
            self._started_ray = start_ray(cfg.runtime)
            import ray

            has_gpu = ray.cluster_resources().get("GPU", 0) >= 1
            if cfg.engine.device == "cuda" and not has_gpu:
                raise ConfigError("engine.device=cuda but the Ray cluster offers no GPU; set engine.device=auto")
            num_gpus = 1 if has_gpu and cfg.engine.device != "cpu" else 0
        t0 = time.perf_counter()
        tag = f"megatrain-{self.run_id}"
        self.shards = [spawn(mode, HostShard, cfg, self.layout, self.run_id, k, stages, name=f"{tag}-host{k}")
                       for k, stages in enumerate(self.stage_groups)]
        for shard in self.shards:
            self.specs.extend(shard.call("segments").result())
        log.info("host store ready: %.2f GiB in %d segments (%.1f s)",
                 sum(s.nbytes for s in self.specs) / 2**30, len(self.specs), time.perf_counter() - t0)
        workers = resolve_workers(cfg.optimizer.workers)
        core_sets = optimizer_cores(workers, sorted(os.sched_getaffinity(0))) if mode == "ray" else [[]] * workers
        self.optimizers = [spawn(mode, OptimizerWorker, cfg, self.layout, self.specs, w, workers, core_sets[w],
                                 name=f"{tag}-optim{w}") for w in range(workers)]
        log.info("%d optimizer worker(s), cores %s", workers, core_sets)
        self.gpu = spawn(mode, GPUWorker, cfg, self.layout, self.specs, self.optimizers, name=f"{tag}-gpu",
                         num_gpus=num_gpus)
        self.device_name = self.gpu.call("device_name").result()
        self.actor_pids = [h.call("pid").result() for h in (*self.shards, *self.optimizers, self.gpu)]
        self._metrics = MetricsWriter(metrics_path)
        log.info("run %s: %s, %.2f B params, %d tokens/step, device %s, output %s", self.run_id, cfg.model.family,
                 self.layout.num_params / 1e9, cfg.data.tokens_per_step, self.device_name, self.run_dir)
        return self

    def close(self) -> None:
        """Wait for the last updates, stop the actors, remove the segments (also after errors)."""
        try:
            if self.gpu is not None:
                self.gpu.call("shutdown").result()
        finally:
            for handle in self.shards:
                try:
                    handle.call("shutdown").result()
                except Exception as exc:  # keep closing the rest
                    log.warning("shard shutdown failed: %s", exc)
            for handle in [*([self.gpu] if self.gpu else []), *self.optimizers, *self.shards]:
                handle.kill()
            self.gpu, self.optimizers, self.shards = None, [], []
            if self._metrics:
                self._metrics.close()
                self._metrics = None
            if self._started_ray:
                import ray

                ray.shutdown()
                self._started_ray = False

    def __enter__(self) -> "Trainer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ steps

    def step(self, step: int) -> dict[str, Any]:
        assert self.gpu is not None, "Trainer.start() first"
        cfg = self.cfg
        lr = lr_at(step, cfg.optimizer.lr, cfg.train.steps, cfg.schedule)
        batch = self.data.batch(step)
        t0 = time.perf_counter()
        result = self.gpu.call("train_step", batch, lr, step + 1).result()
        seconds = time.perf_counter() - t0
        tok_per_s = result.tokens / seconds
        params = self.layout.num_params
        record = {
            "step": step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm, "tokens": result.tokens,
            "loss_tokens": result.valid_tokens,
            "tok_per_s": tok_per_s, "tflops": tok_per_s * self.flops_per_token / 1e12, "step_seconds": seconds,
            "compute_seconds": result.compute_seconds, "gpu_busy": min(1.0, result.compute_seconds / seconds),
            "optimizer_seconds": result.optimizer_seconds, "update_wait_seconds": result.update_wait_seconds,
            "optimizer_hidden": optimizer_hidden_fraction(result.optimizer_seconds, seconds, result.compute_seconds),
            "h2d_bytes": result.h2d_bytes, "d2h_bytes": result.d2h_bytes,
            "h2d_gbps": result.h2d_bytes / seconds / 1e9, "d2h_gbps": result.d2h_bytes / seconds / 1e9,
            "h2d_link_gbps": result.h2d_bytes / result.h2d_seconds / 1e9 if result.h2d_seconds else 0.0,
            "d2h_link_gbps": result.d2h_bytes / result.d2h_seconds / 1e9 if result.d2h_seconds else 0.0,
            "dram_bytes_per_param": (result.h2d_bytes + result.d2h_bytes + result.optimizer_bytes) / params,
            "host_mem_gib": self.host_memory_bytes() / 2**30,
            "gpu_peak_gib": result.gpu_peak_bytes / 2**30, "skipped": result.skipped,
            "epoch": self.data.epoch_of(step + 1),
        }
        every = cfg.train.eval_every
        if every and ((step + 1) % every == 0 or step + 1 == cfg.train.steps):
            record["eval_loss"] = self.evaluate()
        if self._metrics:
            self._metrics.write(record)
        return record

    def evaluate(self) -> float:
        """Loss over the fixed evaluation batches, each token weighted equally (forward only, after the
        pending updates)."""
        assert self.gpu is not None
        self.flush()
        results = [self.gpu.call("eval_loss", batch).result() for batch in self.eval_data]
        tokens = sum(n for _, n in results)
        return sum(loss * n for loss, n in results) / max(1, tokens)

    def host_memory_bytes(self) -> int:
        """Shared segments actually allocated, plus the private memory of the driver and of every actor on
        this node (a process on another node reads as 0)."""
        private = {os.getpid(), *self.actor_pids}
        return shm_bytes([s.path for s in self.specs]) + sum(rss_anon_bytes(pid) for pid in private)

    def train(self) -> list[dict[str, Any]]:
        steps = self.cfg.train.steps
        progress = Progress(steps, self.cfg.train.log_every)
        history = []
        for step in range(steps):
            record = self.step(step)
            history.append(record)
            progress.update(step, record["loss"], record["tok_per_s"], record["tflops"])
        self.flush()
        if self.cfg.train.export_dir:
            self.export(self.cfg.train.export_dir, self.cfg.train.export_dtype)
        return history

    def flush(self) -> None:
        assert self.gpu is not None
        self.gpu.call("flush").result()

    # ------------------------------------------------------------------ inspection (tests, export)

    def master_weights(self) -> dict[str, torch.Tensor]:
        """A copy of the master weights by Hugging Face name (after the pending updates)."""
        self.flush()
        store = HostStore([s for s in self.specs if s.kind == "master"])
        return store.read_tensors(self.layout)

    def export(self, out_dir: str | Path, dtype: str = "auto", shard_bytes: int = 5 * 10**9) -> Path:
        """Write the master weights as a Hugging Face directory (see megatrain_ray/model/hf_io.py), one
        tensor at a time straight from the shared segments."""
        self.flush()
        source = self.cfg.model.path or None
        if dtype == "auto":
            dtype = (source_dtype(source) if source else None) or "float32"
        store = HostStore([s for s in self.specs if s.kind == "master"])
        return export_hf(StoreTensors(store, self.layout), self.cfg.model, out_dir, source_dir=source, dtype=dtype,
                         shard_bytes=shard_bytes)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite master weights (and the streaming copy) by Hugging Face name, before training."""
        self.flush()
        store = HostStore([s for s in self.specs if s.kind in ("master", "stream")])
        store.write_tensors(self.layout, tensors)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.gpu is not None
        self.flush()
        return self.gpu.call("logits", ids).result()
