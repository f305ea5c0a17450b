"""The driver: builds the actors, runs the steps, writes the run directory.

    per node (parallel.nodes, 1 by default):
    shards     = HostShard x host.num_shards        (own the segments, initialise weights)
    optimizers = OptimizerWorker x optimizer.workers (map the segments, AdamW on their share)
    gpus       = GPUWorker x parallel.gpus / nodes   (map the segments, run the layer stream; the
                                                      first orders the node's updates itself)

The driver only sends each step's token ids (each GPU worker its slice) and learning rate to the
GPU workers and reads back StepResults; bulk tensors stay in shared memory.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from actors.gpu_worker import GPUWorker
from actors.host_shard import HostShard
from actors.optimizer_worker import OptimizerWorker
from megatrain_ray.config.load import config_to_yaml
from megatrain_ray.config.sections import Config, parse_drill
from megatrain_ray.data.batches import make_batches, make_eval_batches
from megatrain_ray.driver.faults import HealthMonitor, monitor_actors
from megatrain_ray.driver.parallel import ParallelPlan, merge_results, resolve_parallel, split_batch
from megatrain_ray.driver.placement import RunPlacement, gpu_actor
from megatrain_ray.driver.runtime import Handle, gather, spawn, start_ray
from megatrain_ray.exceptions import ActorFailedError, CheckpointError, ConfigError, NonFiniteError
from megatrain_ray.model.flops import model_flops_per_token
from megatrain_ray.model.hf_io import HFDirectory, export_hf, source_dtype
from megatrain_ray.model.layout import ModelLayout, build_layout
from megatrain_ray.observe.log import get_logger
from megatrain_ray.observe.metrics import (
    MetricsWriter,
    Progress,
    optimizer_hidden_fraction,
    rss_anon_bytes,
    shm_bytes,
)
from megatrain_ray.observe.ray_metrics import RayMetrics, ray_metrics_for
from megatrain_ray.optim.schedule import lr_at
from megatrain_ray.planning.memory import check_plan
from megatrain_ray.store.checkpoint import (
    CheckpointDir,
    CheckpointInfo,
    check_compatible,
    read_manifest,
    restore_rng,
    rng_state,
)
from megatrain_ray.store.segments import HostStore, SegmentSpec, StoreTensors, shard_stages, unlink_segment
from megatrain_ray.system.files import refuse_existing

log = get_logger(__name__)


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


def truncate_metrics(path: Path, next_step: int) -> None:
    """Drop the records of steps >= next_step (written after the checkpoint a run resumes from)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", -1) < next_step]
    write_atomic(path, "".join(line + "\n" for line in kept))


def state_config(cfg: Config) -> dict[str, dict[str, Any]]:
    """The config keys that decide what the saved state means: a checkpoint only loads where they agree.
    host.moments_tier is not one of them: the files are the same from either tier."""
    return {"model": cfg.to_dict()["model"], "precision": {"master_dtype": cfg.precision.master_dtype},
            "optimizer": {"moment_dtype": cfg.optimizer.moment_dtype}}


@dataclass(slots=True)
class NodeActors:
    """One node's actors and host store: its shards' segments, its optimizer workers, its GPU workers
    (local rank order), and its placement."""

    shards: list[Handle] = field(default_factory=list)
    optimizers: list[Handle] = field(default_factory=list)
    gpus: list[Handle] = field(default_factory=list)
    specs: list[SegmentSpec] = field(default_factory=list)
    placement: RunPlacement | None = None
    prefix: str = ""
    """Prefix of the short names of its actors: "" on node 0 (host0, optim0, gpu), "node<k>-" elsewhere."""

    def handles(self) -> dict[str, Handle]:
        out: dict[str, Handle] = {f"{self.prefix}host{k}": h for k, h in enumerate(self.shards)}
        out.update({f"{self.prefix}optim{w}": h for w, h in enumerate(self.optimizers)})
        out.update({f"{self.prefix}{gpu_actor(r)}": h for r, h in enumerate(self.gpus)})
        return out


class Interrupted(Exception):
    """SIGTERM/SIGINT arrived; a checkpoint was saved (or none could be) before stopping."""

    def __init__(self, signum: int, checkpoint: Path | None):
        super().__init__(signum, checkpoint)
        self.signum, self.checkpoint = signum, checkpoint


class Trainer:
    """Runs a config from step 0, or from a checkpoint (`resume`: a checkpoint directory or "auto", the
    newest complete one under checkpoint.dir, starting afresh when there is none)."""

    def __init__(self, cfg: Config, run_dir: str | Path | None = None, resume: str | None = None,
                 config_path: str | None = None):
        self.cfg = cfg
        self.layout: ModelLayout = build_layout(cfg.model)
        self.run_dir = Path(run_dir or cfg.train.output_dir)
        self.config_path = config_path or str(self.run_dir / "config.yaml")
        self.run_id = self._new_run_id()
        if cfg.model.path:  # a checkpoint that does not fit the model fails before any allocation
            HFDirectory(cfg.model.path).check_against_layout(self.layout)
        if cfg.train.export_dir:  # found now, not after hours of training
            refuse_existing(Path(cfg.train.export_dir), ConfigError, "train.export_dir")
        # Bad data fails before any allocation.
        self.data = make_batches(cfg.data, cfg.model)
        self.eval_data = make_eval_batches(cfg.data, cfg.model, cfg.train.eval_batches) if cfg.train.eval_every else []
        self.stage_groups = shard_stages(self.layout, cfg.host.num_shards)
        self.checkpoints = CheckpointDir(cfg.checkpoint.dir or self.run_dir / "checkpoints")
        self.resume = resume
        self.restore = self._find_checkpoint(resume)
        self.next_step = self.restore.step if self.restore else 0
        self.updates_applied = int(self.restore.manifest["updates_applied"]) if self.restore else 0
        self.drills = parse_drill(cfg.fault.drill)
        if cfg.runtime.mode == "local" and any(a == "kill" and t != "driver" for a, t, _ in self.drills):
            raise ConfigError("fault.drill: killing an actor needs runtime.mode=ray (in local mode every actor is "
                              "this process); use kill:driver")
        sweep_stale_segments(cfg.host.shm_dir)
        if cfg.host.moments_tier == "disk":
            sweep_stale_segments(cfg.host.disk_dir)
        self.plan = check_plan(cfg)  # refuse before allocating anything
        self.flops_per_token = model_flops_per_token(cfg.model, self.layout, cfg.data.seq_len)
        self.nodes: list[NodeActors] = []
        """Every node's actors; node 0's shards write the checkpoints and serve the inspection methods."""
        self.parallel = ParallelPlan()
        self.actor_names: list[str] = []
        self.actor_pids: list[int] = []
        self.restarts = 0
        self.restart_events: list[dict[str, Any]] = []
        """One entry per automatic restart: who died, when it was noticed, how long the restart took."""
        self.stop_signal: int | None = None
        """Set by a signal handler: the run saves a checkpoint after the current step and stops."""
        self._pending_save: tuple[int, int, Path, float] | None = None
        self.health: HealthMonitor | None = None
        self._exporter: RayMetrics | None = None
        self._started_ray = False
        self._metrics: MetricsWriter | None = None

    @property
    def shards(self) -> list[Handle]:
        """Node 0's HostShards: they write the checkpoints."""
        return self.nodes[0].shards if self.nodes else []

    @property
    def optimizers(self) -> list[Handle]:
        return self.nodes[0].optimizers if self.nodes else []

    @property
    def specs(self) -> list[SegmentSpec]:
        """Node 0's segments: what the inspection methods (master_weights, export) read."""
        return self.nodes[0].specs if self.nodes else []

    @property
    def placement(self) -> RunPlacement | None:
        return self.nodes[0].placement if self.nodes else None

    @property
    def gpus(self) -> list[Handle]:
        """Every rank, in rank order."""
        return [g for node in self.nodes for g in node.gpus]

    @property
    def gpu(self) -> Handle | None:
        """Rank 0: evaluation and logits run there, on node 0's copy."""
        return self.nodes[0].gpus[0] if self.nodes and self.nodes[0].gpus else None

    @staticmethod
    def _new_run_id() -> str:
        return f"{socket.gethostname().replace('-', '_')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def _find_checkpoint(self, resume: str | None) -> CheckpointInfo | None:
        if resume is None:
            return None
        info = self.checkpoints.latest() if resume == "auto" else read_manifest(resume)
        if info is None:
            log.info("--resume auto: no complete checkpoint under %s, starting from step 0", self.checkpoints.root)
            return None
        check_compatible(info, self.layout, state_config(self.cfg))
        if info.step > self.cfg.train.steps:
            raise CheckpointError(f"checkpoint {info.directory} is at step {info.step}, beyond "
                                  f"train.steps={self.cfg.train.steps}; raise train.steps to continue training")
        return info

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "Trainer":
        cfg = self.cfg
        metrics_path = self.run_dir / "metrics.jsonl"
        if metrics_path.exists() and self.resume is None:
            raise ConfigError(f"train.output_dir={str(self.run_dir)!r} already holds a run (metrics.jsonl); "
                              "continue it with --resume auto, or choose another train.output_dir")
        if cfg.runtime.mode == "ray":
            self._started_ray = start_ray(cfg.runtime)
        self._exporter = ray_metrics_for(cfg.runtime.mode, self.run_id, cfg.model.family, self.layout.num_params)
        self._spawn_actors()  # a checkpoint that fails its checks stops here, before the run directory changes
        if self.restore is not None:
            restore_rng(self.restore.manifest["rng"])
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.run_dir / "config.yaml", config_to_yaml(cfg))
        self._open_metrics()
        log.info("run %s: %s, %.2f B params, %d tokens/step, device %s, output %s%s", self.run_id, cfg.model.family,
                 self.layout.num_params / 1e9, cfg.data.tokens_per_step, self.device_name, self.run_dir,
                 f", resuming at step {self.next_step} from {self.restore.directory}" if self.restore else "")
        return self

    def _open_metrics(self) -> None:
        """metrics.jsonl without the records of steps not yet (re)run, open for appending."""
        if self._metrics:
            self._metrics.close()
        path = self.run_dir / "metrics.jsonl"
        truncate_metrics(path, self.next_step)
        self._metrics = MetricsWriter(path, self._exporter)

    def _spawn_actors(self) -> None:
        cfg, mode = self.cfg, self.cfg.runtime.mode
        self.parallel = plan = resolve_parallel(cfg)
        t0 = time.perf_counter()
        tag = f"megatrain-{self.run_id}"
        for k in range(plan.nodes):  # what was spawned before an error is in self.nodes, for close()
            self.nodes.append(NodeActors(prefix="" if k == 0 else f"node{k}-"))
            self._spawn_node(k, tag)
        if plan.world > 1:
            self._join_process_group()
        log.info("host store ready: %.2f GiB in %d segments per node, %s (%.1f s)",
                 sum(s.nbytes for s in self.specs) / 2**30, len(self.specs), plan.describe(),
                 time.perf_counter() - t0)
        self.device_name = self.gpu.device_name().result()
        handles = self.actor_handles()
        self.actor_names = list(handles)
        self.actor_pids = [h.pid().result() for h in handles.values()]
        self.health = monitor_actors(cfg.runtime.heartbeat_interval_s if mode == "ray" else 0,
                                     cfg.runtime.heartbeat_timeout_s, handles,
                                     self._exporter.heartbeat_age if self._exporter else None)

    def _spawn_node(self, k: int, tag: str) -> None:
        """Node k's host store, optimizer workers and GPU workers (each node its own copy of the state)."""
        cfg, mode, plan, node = self.cfg, self.cfg.runtime.mode, self.parallel, self.nodes[k]
        run_id = self.run_id if k == 0 else f"{self.run_id}-node{k}"  # segment names differ per node
        ranks = plan.ranks_per_node
        node.placement = placement = RunPlacement(cfg, use_gpu=plan.use_gpu, ranks=ranks, node_id=plan.node_ids[k],
                                                  node_resources=plan.node_resources[k])
        name = f"{tag}-{node.prefix}"
        node.shards = [spawn(mode, HostShard, cfg, self.layout, run_id, s, stages, *placement.shard_binding(s),
                             restore=self.restore, ranks_per_node=ranks, name=f"{name}host{s}",
                             ray_options=placement.options(f"host{s}"))
                       for s, stages in enumerate(self.stage_groups)]
        for shard in node.shards:
            node.specs.extend(shard.segments().result())
        workers = placement.num_workers
        node.optimizers = [spawn(mode, OptimizerWorker, cfg, self.layout, node.specs, w, workers,
                                 placement.worker_cores(w), name=f"{name}optim{w}",
                                 ray_options=placement.options(f"optim{w}")) for w in range(workers)]
        node.gpus = [spawn(mode, GPUWorker, cfg, self.layout, node.specs, node.optimizers if r == 0 else [],
                           plan.rank(k, r), placement.gpu_cores(r), name=f"{name}{gpu_actor(r)}",
                           num_gpus=1 if plan.use_gpu else 0, ray_options=placement.options(gpu_actor(r)))
                     for r in range(ranks)]

    def _join_process_group(self) -> None:
        """Every rank joins one torch.distributed group: through a file in shared memory when all ranks are
        on this host (no socket), else through rank 0's address on its node."""
        plan = self.parallel
        if plan.same_host:
            init_method = f"file://{self._store_file()}"
        else:
            init_method = self.gpu.rendezvous().result()
        gather([g.join(init_method, plan.backend, self.cfg.parallel.timeout_s, plan.same_host)
                for g in self.gpus])

    def _store_file(self) -> str:
        return os.path.join(self.cfg.host.shm_dir, f"megatrain-{self.run_id}-pgstore")

    def actor_handles(self) -> dict[str, Handle]:
        """Every actor by its short name: host<k>, optim<w>, gpu, gpu<r> (node 0), node<k>-... (others)."""
        return {name: h for node in self.nodes for name, h in node.handles().items()}

    def _teardown_actors(self, after_failure: bool = False) -> None:
        """Stop the actors and remove the segments, tolerating actors that already died. `after_failure`:
        an actor died, so a rank may be blocked in a collective with it and never answer; it is killed
        after a short wait instead of the collective's timeout."""
        if self.health is not None:
            self.health.stop()
            self.health = None
        # All ranks at once: the leaders' last updates release the others' waits.
        patience = self.cfg.parallel.timeout_s
        if after_failure and self.parallel.world > 1:
            patience = min(patience, 30.0)
        deadline = time.monotonic() + patience
        for name, future in [(n, g.shutdown()) for n, g in self._rank_names()]:
            try:
                future.result(timeout=max(0.1, deadline - time.monotonic()))
            except Exception as exc:  # a dead optimizer makes the last flush fail; keep closing
                log.warning("%s shutdown: %s", name, exc)
        for node in self.nodes:
            for handle in node.optimizers:  # their disk-tier writes finish, their threads stop
                try:
                    handle.shutdown().result(timeout=max(0.1, deadline - time.monotonic()))
                except Exception as exc:
                    log.warning("optimizer shutdown: %s", exc)
            for handle in node.shards:
                try:
                    handle.shutdown().result()
                except Exception as exc:
                    log.warning("shard shutdown: %s", exc)
            for handle in [*node.gpus, *node.optimizers, *node.shards]:
                handle.kill()
            for spec in node.specs:  # segments of a shard that died
                unlink_segment(spec)
            if node.placement is not None:
                node.placement.close()
        if os.path.exists(self._store_file()):
            os.unlink(self._store_file())
        self.nodes = []

    def _rank_names(self) -> list[tuple[str, Handle]]:
        return [(f"{node.prefix}{gpu_actor(r)}", g) for node in self.nodes for r, g in enumerate(node.gpus)]

    def close(self) -> None:
        """Finish a checkpoint in flight, stop the actors, remove the segments (also after errors)."""
        try:
            if self._pending_save is not None and self.shards:
                try:
                    self._finish_save()
                except Exception as exc:
                    log.warning("the checkpoint in flight could not be completed: %s", exc)
        finally:
            self._pending_save = None
            self._teardown_actors()
            if self._metrics:
                self._metrics.close()
                self._metrics = None
            if self._started_ray:
                import ray

                ray.shutdown()
                self._started_ray = False

    def __enter__(self) -> "Trainer":
        try:
            return self.start()
        except BaseException:  # the actors spawned so far, and a private Ray, do not outlive a failed start
            self.close()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ steps

    def _drill(self, action: str, step: int) -> str | None:
        """The target of a fault drill due now ("" when it has none), or None; each fires once per process."""
        for drill in self.drills:
            if drill[0] == action and drill[2] == step:
                self.drills.remove(drill)
                return drill[1]
        return None

    def _kill(self, target: str) -> None:
        pid = os.getpid() if target == "driver" else self.actor_pids[self.actor_names.index(target)]
        log.warning("fault drill: SIGKILL to %s (pid %d)", target, pid)
        os.kill(pid, signal.SIGKILL)

    def step(self, step: int) -> dict[str, Any]:
        assert self.gpu is not None, "Trainer.start() first"
        cfg = self.cfg
        lr = lr_at(step, cfg.optimizer.lr, cfg.train.steps, cfg.schedule)
        parts, loss_tokens = split_batch(self.data.batch(step), self.parallel.world)
        if self._drill("nan_grad", step) is not None:
            self.gpu.arm_nan_grad().result()  # rank 0's next step puts a NaN into a gradient
        kill = self._drill("kill", step)
        t0 = time.perf_counter()
        # Each rank its rows (one rank: the whole batch); every rank divides by the loss tokens of the whole batch.
        futures = [gpu.train_step(part, lr, self.updates_applied + 1, loss_tokens)
                   for gpu, part in zip(self.gpus, parts)]
        if kill:
            time.sleep(0.05)  # let the step get going: the kill lands in the middle of it
            self._kill(kill)
        pings = [shard.pid() for node in self.nodes for shard in node.shards]  # a dead HostShard fails here
        try:
            result = merge_results(gather(futures))
        except ActorFailedError:
            raise
        except Exception as exc:
            if len(futures) > 1:  # a rank's collective failed: because a peer died?
                self._raise_if_an_actor_died(exc)
            raise
        for ping in pings:
            ping.result()
        seconds = time.perf_counter() - t0
        finite = math.isfinite(result.loss) and math.isfinite(result.grad_norm)
        if finite:
            self.updates_applied += 1
        tok_per_s = result.tokens / seconds
        params = self.layout.num_params
        record = {
            "step": step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm, "tokens": result.tokens,
            "loss_tokens": result.valid_tokens,
            "tok_per_s": tok_per_s, "tflops": tok_per_s * self.flops_per_token / 1e12, "step_seconds": seconds,
            "compute_seconds": result.compute_seconds, "gpu_busy": min(1.0, result.compute_seconds / seconds),
            "gpus": self.parallel.world, "comm_seconds": result.comm_seconds,
            "optimizer_seconds": result.optimizer_seconds, "update_wait_seconds": result.update_wait_seconds,
            "slab_wait_seconds": result.slab_wait_seconds,
            **({"rank_update_wait_seconds": list(result.rank_update_wait_seconds)}
               if result.rank_update_wait_seconds else {}),
            "optimizer_hidden": optimizer_hidden_fraction(result.optimizer_seconds, seconds, result.compute_seconds),
            "h2d_bytes": result.h2d_bytes, "d2h_bytes": result.d2h_bytes,
            "h2d_gbps": result.h2d_bytes / seconds / 1e9, "d2h_gbps": result.d2h_bytes / seconds / 1e9,
            "h2d_link_gbps": result.h2d_bytes / result.h2d_seconds / 1e9 if result.h2d_seconds else 0.0,
            "d2h_link_gbps": result.d2h_bytes / result.d2h_seconds / 1e9 if result.d2h_seconds else 0.0,
            "dram_bytes_per_param": (result.h2d_bytes + result.d2h_bytes + result.optimizer_bytes) / params,
            "host_mem_gib": self.host_memory_bytes() / 2**30,
            "gpu_peak_gib": result.gpu_peak_bytes / 2**30, "skipped": not finite,
            "epoch": self.data.epoch_of(step + 1),
        }
        every = cfg.train.eval_every
        if every and ((step + 1) % every == 0 or step + 1 == cfg.train.steps):
            record["eval_loss"] = self.evaluate()
        if self._metrics:
            self._metrics.write(record)
        if not finite:
            self._nonfinite(step, result.loss, result.grad_norm)
        return record

    def _raise_if_an_actor_died(self, cause: Exception) -> None:
        """ActorFailedError naming the actors that no longer answer a heartbeat (it runs beside a busy
        actor's work), so that the run restarts as after any death rather than stopping on the error a
        surviving rank's collective raised."""
        dead: dict[str, BaseException] = {}
        for handle in self.actor_handles().values():
            try:
                handle.heartbeat().result(timeout=30)
            except ActorFailedError as exc:
                dead[handle.name] = exc
            except Exception:  # noqa: BLE001 (slow, not dead)
                continue
        if dead:
            raise ActorFailedError(f"{', '.join(dead)} died during a data-parallel step ({cause})", dead) from cause

    def _nonfinite(self, step: int, loss: float, grad_norm: float) -> None:
        what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
        if self.cfg.optimizer.grad_clip <= 0:
            last = self.checkpoints.latest()
            raise NonFiniteError(f"non-finite {what}. With optimizer.grad_clip=0 the updates stream layer by layer, "
                                 "so part of this step was applied; the last good state is "
                                 f"{last.directory if last else 'the initial one (no checkpoint yet)'}. Resume with "
                                 f"`megatrain train {self.config_path} --resume auto` after lowering the lr")
        if self.cfg.fault.nonfinite == "skip":
            log.warning("non-finite %s: step dropped, weights and moments unchanged", what)
            return
        self.next_step = step  # the dropped step is where a resume starts again
        saved = self.save(wait=True)
        raise NonFiniteError(f"non-finite {what}; fault.nonfinite=stop. The state before this step is saved in "
                             f"{saved}; resume with `megatrain train {self.config_path} --resume auto` after "
                             "lowering the lr or fixing the data")

    def train(self) -> list[dict[str, Any]]:
        """Run the remaining steps; restarts the actors from the last checkpoint when one dies (fault.max_restarts)."""
        history: list[dict[str, Any]] = []
        while True:
            try:
                self._run_steps(history)
                return history
            except ActorFailedError as exc:
                self._recover(exc)
                history = [r for r in history if r["step"] < self.next_step]

    def _run_steps(self, history: list[dict[str, Any]]) -> None:
        cfg = self.cfg
        steps, every = cfg.train.steps, cfg.checkpoint.every
        progress = Progress(steps, cfg.train.log_every, first=self.next_step)
        for step in range(self.next_step, steps):
            record = self.step(step)
            self.next_step = step + 1
            history.append(record)
            progress.update(step, record["loss"], record["tok_per_s"], record["tflops"])
            if self._pending_save is not None:
                self._finish_save()
            if self.stop_signal is not None:
                saved = self.save(wait=True) if cfg.checkpoint.on_signal else None
                raise Interrupted(self.stop_signal, saved)
            if every and self.next_step % every == 0 and self.next_step < steps:
                self.save(wait=False)
        self.flush()
        latest = self.checkpoints.latest()
        if cfg.checkpoint.at_end and (latest is None or latest.step != steps):
            self.save(wait=True)
        if cfg.train.export_dir:
            self.export(cfg.train.export_dir, cfg.train.export_dtype)

    def _recover(self, exc: ActorFailedError) -> None:
        dead = ", ".join(n.removeprefix(f"megatrain-{self.run_id}-") for n in exc.failures) or "an actor"
        if self._pending_save is not None:  # its snapshot predates the failure: complete it if its writers live
            try:
                self._finish_save()
            except Exception as failed:  # noqa: BLE001 (a dead shard): the previous checkpoint stands
                log.warning("the checkpoint in flight is lost: %s", str(failed).splitlines()[0])
                self._pending_save = None
        last = self.checkpoints.latest()
        where = f"{last.directory} (step {last.step})" if last else "none yet (a restart begins at step 0)"
        noticed = self.next_step
        if self.restarts >= self.cfg.fault.max_restarts:
            raise ActorFailedError(f"{dead} died, noticed at step {noticed} ({str(exc).splitlines()[0]}). "
                                   f"Last good checkpoint: {where}. "
                                   f"Resume with: megatrain train {self.config_path} --resume auto", exc.failures) \
                from exc
        self.restarts += 1
        log.error("%s died, noticed at step %d; restart %d of %d from checkpoint %s", dead, noticed, self.restarts,
                  self.cfg.fault.max_restarts, where)
        t0 = time.perf_counter()
        self._teardown_actors(after_failure=True)
        self.restore = last
        self.next_step = last.step if last else 0
        self.updates_applied = int(last.manifest["updates_applied"]) if last else 0
        self._open_metrics()
        self.run_id = self._new_run_id()
        self._spawn_actors()
        seconds = time.perf_counter() - t0
        self.restart_events.append({"dead": dead, "noticed_at_step": noticed, "resumed_at_step": self.next_step,
                                    "restart_seconds": seconds})
        log.info("restarted in %.1f s; continuing at step %d", seconds, self.next_step)

    # ------------------------------------------------------------------ checkpoints

    def save(self, wait: bool) -> Path | None:
        """Checkpoint the state after the steps run so far (`next_step` of them). The shards write in the
        background; `wait` returns only once the checkpoint is complete and returns its directory."""
        assert self.gpu is not None
        if self._pending_save is not None:
            self._finish_save()
        self.flush()  # every ordered update is applied: the segments hold the state after next_step steps
        self.sync_moments()
        partial = self.checkpoints.partial(self.next_step, self.run_id)
        die = self._drill("kill_during_checkpoint", self.next_step) is not None
        for begun in [shard.save_begin(self.next_step, str(partial), die) for shard in self.shards]:
            begun.result()
        self._pending_save = (self.next_step, self.updates_applied, partial, time.perf_counter())
        return self._finish_save() if wait else None

    def _finish_save(self) -> Path:
        assert self._pending_save is not None
        step, updates, partial, t0 = self._pending_save
        self._pending_save = None
        files = [entry for shard in self.shards for entry in shard.save_wait().result()]
        manifest = {"updates_applied": updates, "state_config": state_config(self.cfg), "config": self.cfg.to_dict(),
                    "rng": rng_state(), "data": {"seed": self.cfg.data.seed, "epoch": self.data.epoch_of(step)},
                    "run_id": self.run_id, "files": files}
        final = self.checkpoints.commit(partial, step, manifest, self.cfg.checkpoint.keep)
        log.info("checkpoint of step %d: %s (%.2f GiB, %.1f s)", step, final,
                 sum(e["bytes"] for e in files) / 2**30, time.perf_counter() - t0)
        return final

    def evaluate(self) -> float:
        """Loss over the fixed evaluation batches, each token weighted equally (forward only, after the
        pending updates)."""
        assert self.gpu is not None
        self.flush()
        results = [self.gpu.eval_loss(batch).result() for batch in self.eval_data]
        tokens = sum(n for _, n in results)
        return sum(loss * n for loss, n in results) / max(1, tokens)

    def host_memory_bytes(self) -> int:
        """Shared segments actually allocated, plus the private memory of the driver and of every actor on
        this node (a process on another node reads as 0); the segments of every node whose files are on
        this host (all of them when the nodes share a machine, as in tests)."""
        private = {os.getpid(), *self.actor_pids}
        return shm_bytes([s.path for node in self.nodes for s in node.specs if not s.on_disk]) + \
            sum(rss_anon_bytes(pid) for pid in private)

    def flush(self) -> None:
        assert self.gpu is not None
        gather([g.flush() for g in self.gpus])

    def sync_moments(self) -> None:
        """With the disk tier: wait until the moments the optimizers wrote back behind are in their files."""
        if self.cfg.host.moments_tier == "disk":
            for done in [worker.sync() for worker in self.optimizers]:
                done.result()

    def read_moments(self, kind: str) -> dict[str, torch.Tensor]:
        """A copy of one AdamW moment (`exp_avg` or `exp_avg_sq`) by Hugging Face name, from RAM or disk."""
        self.flush()
        self.sync_moments()
        return HostStore([s for s in self.specs if s.kind == kind]).read_tensors(self.layout, kind)  # type: ignore

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

    def load_weights(self, tensors: dict[str, torch.Tensor], nodes: list[int] | None = None) -> None:
        """Overwrite master weights (and the streaming copy) by Hugging Face name, before training, on every
        node (or on `nodes`: tests that make the copies disagree)."""
        self.flush()
        for k in nodes if nodes is not None else range(len(self.nodes)):
            store = HostStore([s for s in self.nodes[k].specs if s.kind in ("master", "stream")])
            store.write_tensors(self.layout, tensors)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.gpu is not None
        self.flush()
        return self.gpu.logits(ids).result()
