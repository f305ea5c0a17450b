"""The driver's loop: check the config, spawn the actors (cluster.py), run the steps, save checkpoints
(checkpointing.py), restart after an actor died (faults.py), write the run directory.

The driver only sends each step's token ids (each GPU worker its rows) and learning rate to the GPU
workers and reads back StepResults; bulk tensors stay in shared memory.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from megatrain_ray.config.hf_vision import vision_config_of_dir
from megatrain_ray.config.load import config_to_yaml
from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config, check_trainable
from megatrain_ray.data.preference import PreferenceBatches, make_evaluation_batches, make_training_batches
from megatrain_ray.data.prompts import PromptBatches
from megatrain_ray.driver.checkpointing import (
    Checkpointer,
    find_checkpoint,
    truncate_metrics,
)
from megatrain_ray.driver.cluster import Cluster, ClusterView, new_run_id
from megatrain_ray.driver.faults import FaultDrills, Recovery, stop_or_skip_nonfinite
from megatrain_ray.driver.grpo import GRPOSteps, warn_vanished_weights
from megatrain_ray.driver.outputs import check_outputs, place_outputs
from megatrain_ray.driver.parallel import merge_results, resolve_parallel, split_batch
from megatrain_ray.driver.reference import check_reference, load_or_compute
from megatrain_ray.driver.run_tensors import RunTensors
from megatrain_ray.driver.runtime import gather, private_ray_pids, ray_session_dir, start_ray
from megatrain_ray.driver.tracking import Tracking, check_available, last_logged_step
from megatrain_ray.engine.vision_engine import check_vision_run
from megatrain_ray.exceptions import ActorFailedError, ConfigError
from megatrain_ray.model.flops import model_flops_per_token
from megatrain_ray.model.generic_template import GenericTemplate
from megatrain_ray.model.hf_io import HFDirectory
from megatrain_ray.model.layout import ModelLayout, build_layout
from megatrain_ray.observe.grafana import install_dashboard
from megatrain_ray.observe.log import get_logger
from megatrain_ray.observe.metrics import MetricsWriter, Progress, step_record
from megatrain_ray.observe.ray_metrics import RayMetrics, ray_metrics_for
from megatrain_ray.optim.schedule import lr_at
from megatrain_ray.planning.gpu_memory import resolve_run
from megatrain_ray.planning.memory import check_plan
from megatrain_ray.store.checkpoint import CheckpointDir, CheckpointInfo, restore_rng
from megatrain_ray.store.liveness import sweep_stale_segments
from megatrain_ray.store.segments import segment_prefix, shard_stages
from megatrain_ray.system.files import refuse_existing, write_atomic
from megatrain_ray.system.guardian import Guardian
from megatrain_ray.system.model_sources import fetch_weights
from megatrain_ray.units import human_count

log = get_logger(__name__)


class Interrupted(Exception):
    """SIGTERM/SIGINT arrived; a checkpoint was saved (or none could be) before stopping."""

    def __init__(self, signum: int, checkpoint: Path | None):
        super().__init__(signum, checkpoint)
        self.signum, self.checkpoint = signum, checkpoint


class Trainer(RunTensors, ClusterView):
    """Runs a config from step 0, or from a checkpoint (`resume`: a checkpoint directory or "auto", the
    newest complete one under checkpoint.dir, starting afresh when there is none)."""

    def __init__(self, cfg: Config, run_dir: str | Path | None = None, resume: str | None = None,
                 resume_command: str | None = None):
        check_trainable(cfg)  # the GRPO settings this version does not run
        check_vision_run(cfg)  # a vision-language model's settings (engine/vision_engine.py)
        self.vision = vision_config_of_dir(cfg.model.path)
        self.cfg = cfg = place_outputs(cfg)  # absolute output paths, never in Ray's session tree
        check_available(cfg.train.report_to)  # a tracker's missing package fails before anything starts
        self.layout: ModelLayout = build_layout(cfg.model)
        self.run_dir = Path(run_dir or cfg.train.output_dir)
        # What a user types to continue this run: the CLI passes its own command line with every override;
        # otherwise the run's resolved config.yaml, which holds them all.
        self.resume_command = resume_command or f"megatrain train {self.run_dir / 'config.yaml'} --resume auto"
        self.run_id = new_run_id()
        if cfg.model.path:  # a checkpoint that does not fit the model fails before any allocation
            fetch_weights(cfg.model.path)
            HFDirectory(cfg.model.path).check_against_layout(self.layout)
        if cfg.model.template == "generic":  # the model's forward probed (refused by class) before Ray starts
            GenericTemplate(cfg.model, torch.device("cpu"), torch.float32)
        if cfg.train.export_dir:  # found now, not after hours of training
            refuse_existing(Path(cfg.train.export_dir), ConfigError, "train.export_dir")
        if (self.run_dir / "metrics.jsonl").exists() and resume is None:
            raise ConfigError(f"train.output_dir={str(self.run_dir)!r} already holds a run (metrics.jsonl); "
                              "continue it with --resume auto, or choose another train.output_dir")
        # Bad data fails before any allocation.
        self.data = make_training_batches(cfg)
        self.eval_data = make_evaluation_batches(cfg) if cfg.train.eval_every else []
        # GRPO: each step's batch is generated by the rollout engine and scored by the reward functions
        self.rollouts = GRPOSteps(cfg, self.data) if isinstance(self.data, PromptBatches) else None
        self.stage_groups = shard_stages(self.layout, cfg.host.num_shards)
        self.checkpoints = CheckpointDir(cfg.checkpoint.dir or self.run_dir / "checkpoints")
        self.resume = resume
        self.restore = find_checkpoint(resume, self.checkpoints, self.layout, cfg)
        self.next_step = self.restore.step if self.restore else 0
        self.updates_applied = int(self.restore.manifest["updates_applied"]) if self.restore else 0
        self._restore_rollout(self.restore)
        self.drills = FaultDrills(cfg)
        sweep_stale_segments(cfg.host.shm_dir)
        if cfg.host.moments_tier == "disk":
            sweep_stale_segments(cfg.host.disk_dir)
        # Settings derived from the config: the memory plan now (refuse before allocating anything), the
        # data-parallel plan at each spawn (_spawn_actors: it reads the Ray cluster's nodes).
        self.plan = check_plan(cfg)
        self.run_spec: RunSpec = self.plan.run
        """Settings derived from the config and the machine, sent to every actor (final once the ranks are known)."""
        check_outputs(cfg, self.run_dir, self.checkpoints.root, self.layout.num_params, self.run_spec)
        for pairs in (self.data, self.eval_data):  # DPO: a cached reference file read and checked before Ray starts
            if isinstance(pairs, PreferenceBatches):
                check_reference(cfg, pairs, self.run_spec.compute_dtype, resuming=self.restore is not None)
        self.flops_per_token = model_flops_per_token(cfg.model, self.layout, cfg.data.seq_len)
        self.cluster = Cluster(cfg, self.layout, self.run_id)
        self.saver = Checkpointer(cfg, self.checkpoints, self.data)
        self.recovery = Recovery(cfg.fault.max_restarts, self.resume_command)
        self.stop_signal: int | None = None
        """Set by a signal handler: the run saves a checkpoint after the current step and stops."""
        self._exporter: RayMetrics | None = None
        self._started_ray = False
        self._guardian: Guardian | None = None
        self._metrics: MetricsWriter | None = None
        self._tracking: Tracking | None = None
        self._outcome = "failed"
        """How the run ended, for the trackers: finished, killed (a signal) or failed."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "Trainer":
        cfg = self.cfg
        # What this run leaves in shared memory, and a private Ray, go when the driver does: system/guardian.py.
        self._guardian = Guardian()
        if cfg.runtime.mode == "ray":
            self._started_ray = start_ray(cfg.runtime)
            if self._started_ray:
                self._guardian.kill_on_exit(private_ray_pids())
        self._exporter = ray_metrics_for(cfg.runtime.mode, self.run_id, cfg.model.family, self.layout.num_params)
        if cfg.runtime.mode == "ray" and (session := ray_session_dir()):
            install_dashboard(session)  # a "megatrain" Grafana dashboard beside Ray's own (observe/grafana.py)
        self._spawn_actors()  # a checkpoint that fails its checks stops here, before the run directory changes
        if self.restore is not None:
            restore_rng(self.restore.manifest["rng"])
        for pairs in (self.data, self.eval_data):  # DPO: the reference log-probabilities, before the first step
            if isinstance(pairs, PreferenceBatches) and pairs.reference is None:
                pairs.attach_reference(load_or_compute(cfg, pairs, self.gpu, self.run_spec.compute_dtype,
                                                       resuming=self.restore is not None))
        for private in (self.run_dir, self.checkpoints.root):  # metrics and weights are the user's alone
            private.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(self.run_dir / "config.yaml", config_to_yaml(cfg))
        if cfg.train.report_to:  # the same tracked runs as before a resume (their ids are in the manifest)
            resumed = self.resume is not None
            self._tracking = Tracking(cfg, self.run_dir, (self.restore.manifest.get("tracking") if self.restore
                                                          else None), start_step=self.next_step if resumed else None,
                                      logged_through=last_logged_step(self.run_dir / "metrics.jsonl") if resumed else -1)
            self.saver.tracking = self._tracking.state
        self._open_metrics()
        log.info("run %s: %s, %s params, %s tokens/step, device %s, output %s%s", self.run_id, cfg.model.family,
                 human_count(self.layout.num_params), f"{cfg.data.tokens_per_step:,}", self.device_name, self.run_dir,
                 f", resuming at step {self.next_step} from {self.restore.directory}" if self.restore else "")
        return self

    def _spawn_actors(self) -> None:
        if self._guardian is not None:
            for directory in self.cluster.segment_dirs():
                self._guardian.remove_prefix_on_exit(directory, segment_prefix(self.run_id))
        on_age = self._exporter.heartbeat_age if self._exporter else None
        parallel = resolve_parallel(self.cfg)
        self.run_spec = resolve_run(self.cfg, self.plan.machine.gpu_memory, "cuda" if parallel.use_gpu else "cpu",
                                    parallel.ranks_per_node, parallel.nodes, self.plan.profile)
        self.cluster.spawn(parallel, self.run_spec, self.stage_groups, self.restore, on_age)

    def _open_metrics(self) -> None:
        """metrics.jsonl without the records of steps not yet (re)run, open for appending."""
        if self._metrics:
            self._metrics.close()
        path = self.run_dir / "metrics.jsonl"
        truncate_metrics(path, self.next_step)
        self._metrics = MetricsWriter(path, self._exporter, self._tracking)

    def close(self, failed: bool = False) -> None:
        """Finish a checkpoint in flight, stop the actors, remove the segments (also after errors). `failed`: the
        run ended on an error, so its actors are killed (none is kept for a later run: driver/warm_actors.py)."""
        try:
            if self.saver.in_flight is not None and self.shards:
                try:
                    self._finish_save()
                except Exception as exc:
                    log.warning("the checkpoint in flight could not be completed: %s", exc)
        finally:
            self.saver.in_flight = None
            self.cluster.teardown(after_failure=failed or self._outcome == "killed")
            if self._metrics:
                self._metrics.close()
                self._metrics = None
            if self._tracking:
                self._tracking.close(self._outcome)
                self._tracking = None
            if self._started_ray:
                import ray

                ray.shutdown()
                self._started_ray = False
            if self._guardian is not None:  # kills what a private Ray left behind, removes stray segments
                self._guardian.close()
                self._guardian = None

    def __enter__(self) -> "Trainer":
        try:
            return self.start()
        except BaseException:  # the actors spawned so far, and a private Ray, do not outlive a failed start
            self.close()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.close(failed=exc[0] is not None)

    # ------------------------------------------------------------------ steps

    def step(self, step: int) -> dict[str, Any]:
        health = self.cluster.health
        assert self.gpu is not None and health is not None, "Trainer.start() first"
        cfg = self.cfg
        lr = lr_at(step, cfg.optimizer.lr, cfg.train.steps, cfg.schedule)
        if self.rollouts is not None:  # GRPO: sampled after every ordered update is applied (on-policy)
            self.flush()
        rollout = self.rollouts.step_batch(step, self.gpu, self.cluster.rollout) if self.rollouts is not None else None
        parts, loss_tokens = split_batch(rollout.batch if rollout else self.data.batch(step), self.cluster.parallel.world)
        if self.drills.due("nan_grad", step) is not None:
            self.gpu.arm_nan_grad().result()  # rank 0's next step puts a NaN into a gradient
        kill = self.drills.due("kill", step)
        t0 = time.perf_counter()
        # Each rank its rows (one rank: the whole batch); every rank divides by the loss tokens of the whole batch.
        futures = [gpu.train_step(part, lr, self.updates_applied + 1, loss_tokens)
                   for gpu, part in zip(self.gpus, parts)]
        if kill:
            time.sleep(0.05)  # let the step get going: the kill lands in the middle of it
            self.drills.kill(kill, self.cluster.pid_of)
        try:
            result = merge_results(gather(futures))
        except ActorFailedError:
            raise
        except Exception as exc:
            if len(futures) > 1:  # a rank's collective failed: because a peer died? Then restart as after any death
                health.check_now("a data-parallel step", cause=exc)
            raise
        # A HostShard does no work in a step, so only asking it notices that it died.
        health.check_now(f"step {step}", names=self.cluster.shard_names())
        seconds = time.perf_counter() - t0
        record = step_record(step, lr, result, seconds, self.flops_per_token, self.layout.num_params,
                             self.cluster.parallel.world, self.host_memory_bytes(), self.data.epoch_of(step + 1))
        if rollout is not None:
            record.update(rollout.metrics)
            warn_vanished_weights(record, cfg.finetune.grpo)
        if not record["skipped"]:
            self.updates_applied += 1
        every = cfg.train.eval_every
        if every and ((step + 1) % every == 0 or step + 1 == cfg.train.steps):
            record.update(self.evaluation())
        if self._metrics:
            self._metrics.write(record)
        if record["skipped"]:
            stop_or_skip_nonfinite(cfg, step, result.loss, result.grad_norm, self.checkpoints, self.resume_command,
                                   self._save_before)
        return record

    def _save_before(self, step: int) -> Path | None:
        """Save the state before `step` (it was dropped): a resume starts again there."""
        self.next_step = step
        return self.save(wait=True)

    def train(self) -> list[dict[str, Any]]:
        """Run the remaining steps; restarts the actors from the last checkpoint when one dies (fault.max_restarts)."""
        history: list[dict[str, Any]] = []
        try:
            while True:
                try:
                    self._run_steps(history)
                    self._outcome = "finished"
                    return history
                except ActorFailedError as exc:
                    self.recovery.recover(exc, self)
                    history = [r for r in history if r["step"] < self.next_step]
        except (Interrupted, KeyboardInterrupt):
            self._outcome = "killed"
            raise

    def _run_steps(self, history: list[dict[str, Any]]) -> None:
        cfg = self.cfg
        steps, every = cfg.train.steps, cfg.checkpoint.every
        progress = Progress(steps, cfg.train.log_every, first=self.next_step)
        if self.rollouts is not None and cfg.train.eval_every and self.next_step == 0:  # GRPO: the baseline
            baseline = self.evaluation()
            log.info("held-out mean reward before training: %.4f (%s)", baseline["eval_reward"], ", ".join(
                f"{k.split('/')[1]} {v:.4f}" for k, v in baseline.items() if k.startswith("eval_rewards/")))
        for step in range(self.next_step, steps):
            record = self.step(step)
            self.next_step = step + 1
            history.append(record)
            progress.update(record)
            if self.saver.in_flight is not None:
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

    # ------------------------------------------------------------------ restarts (faults.Recovery)

    @property
    def restarts(self) -> int:
        return self.recovery.restarts

    @property
    def restart_events(self) -> list[dict[str, Any]]:
        """One entry per automatic restart: who died, when it was noticed, how long the restart took."""
        return self.recovery.events

    def finish_save_after_failure(self) -> None:
        self.saver.finish_or_lose(self.shards, self.run_id)

    def restart_from(self, last: CheckpointInfo | None) -> None:
        """New actors under a new run id, holding the state of `last` (the initial state when None)."""
        self.cluster.teardown(after_failure=True)
        self.restore = last
        self.next_step = last.step if last else 0
        self.updates_applied = int(last.manifest["updates_applied"]) if last else 0
        self._restore_rollout(last)
        if self._tracking:
            self._tracking.rewind(self.next_step)
        self._open_metrics()
        self.run_id = new_run_id()
        self.cluster = Cluster(self.cfg, self.layout, self.run_id)
        self._spawn_actors()

    def _restore_rollout(self, info: CheckpointInfo | None) -> None:
        """GRPO: the batch of the num_iterations group a checkpoint was taken inside (driver/grpo.py)."""
        if self.rollouts is not None:
            self.rollouts.restore(info.directory if info else None, info.manifest if info else None)

    # ------------------------------------------------------------------ checkpoints (checkpointing.Checkpointer)

    def save(self, wait: bool) -> Path | None:
        """Checkpoint the state after the steps run so far (`next_step` of them). The shards write in the
        background; `wait` returns only once the checkpoint is complete and returns its directory."""
        assert self.gpu is not None
        if self.saver.in_flight is not None:
            self._finish_save()
        self.flush()  # every ordered update is applied: the segments hold the state after next_step steps
        self.cluster.sync_moments()
        partial = self.checkpoints.partial(self.next_step, self.run_id)
        die = self.drills.due("kill_during_checkpoint", self.next_step) is not None
        # LoRA: the adapters' file; a vision-language model: the vision tower's
        holder = self.gpu if self.run_spec.frozen_base or self.vision else self._resident_holder
        self.saver.begin(self.shards, self.next_step, self.updates_applied, partial, die, holder,
                         self.rollouts.save_state if self.rollouts is not None else None)
        return self._finish_save() if wait else None

    def _finish_save(self) -> Path:
        return self.saver.finish(self.shards, self.run_id)

    # ------------------------------------------------------------------ evaluation and inspection (tests, export)

    def evaluation(self) -> dict[str, float]:
        """train.eval_every's measures: eval_loss, or GRPO's held-out rewards (GRPOSteps.evaluate)."""
        if self.rollouts:
            return self.rollouts.evaluate(self.eval_data, self.gpu, self.cluster.rollout)
        return {"eval_loss": self.evaluate()}

    def evaluate(self) -> float:
        """Loss over the fixed evaluation batches, each token weighted equally (forward only, after the
        pending updates)."""
        assert self.gpu is not None
        self.flush()
        results = [self.gpu.eval_loss(batch).result() for batch in self.eval_data]
        tokens = sum(n for _, n in results)
        return sum(loss * n for loss, n in results) / max(1, tokens)

    def flush(self) -> None:
        assert self.gpu is not None
        self.cluster.flush()
