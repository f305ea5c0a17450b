"""GRPO's steps on the driver (finetune.objective=grpo): each step's prompts (data/prompts.py) sampled
num_generations times by the rollout engine in the GPU worker (engine/rollout/), the completions decoded and scored
by the reward functions, the advantages normalised within each group (model/policy_gradient.py), and the training
batch built: each row one prompt and one of its completions, labels on the completion's tokens, the rollout's
log-probabilities of them beside (the importance-sampling correction). The GPU worker's head computes the loss
(model/policy_head.py).

With finetune.grpo.beta > 0 the batch also carries the reference model's log-probabilities of the completion tokens
(GPUWorker.token_logps with reference: the initial weights; LoRA: the base alone), for the KL term. With
num_iterations = mu > 1 (TRL's semantics) a batch is generated at steps 0, mu, 2 mu, ... and trained on for mu
optimizer steps, with the generating policy's log-probabilities (the trainer's, computed once right after the rollout)
as the old ones of the clipped ratio and of the importance-sampling correction; the rollout's metrics are logged at
the step that generated it. A checkpoint inside such a group keeps the batch (`grpo-rollout.pt`), so a resumed run
trains on what the uninterrupted one did.

A step's completions are a pure function of the weights, the prompts and (train.seed, step), so a resumed run samples
what the uninterrupted one did."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatrain_ray.config.sections import Config
from megatrain_ray.data.prepare.tokenize import load_tokenizer, resolve_tokenizer
from megatrain_ray.data.prompts import PromptBatches, PromptRows
from megatrain_ray.driver.separate_rollout import Launched, SeparateRollouts, generation_seconds
from megatrain_ray.engine.rollout.interface import RolloutResult, SamplingSettings
from megatrain_ray.exceptions import CheckpointError, ConfigError
from megatrain_ray.messages import IGNORE_INDEX, Batch, PolicyRows
from megatrain_ray.model.policy_gradient import (
    NEGLIGIBLE_IS_WEIGHT,
    ZERO_FRACTION,
    group_advantages,
    reward_name,
    score_completions,
    weighted_rewards,
)
from megatrain_ray.observe.log import get_logger

log = get_logger(__name__)

ROLLOUT_FILE = "grpo-rollout.pt"
"""The batch a checkpoint inside a num_iterations group keeps (GRPOSteps.save_state)."""


@dataclass(slots=True)
class RolloutBatch:
    """A GRPO step's training batch and what its generation and scoring measured (TRL's metric names)."""

    batch: Batch
    metrics: dict[str, float]


def policy_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], rollout_logps: torch.Tensor,
                 advantages: torch.Tensor, grpo: Any, pad_id: int) -> Batch:
    """The training rows: prompt then completion, right-padded to the longest (causal attention never lets a real
    token see the padding after it); the labels are the completion's tokens, each at the position that predicts it,
    and the rollout's log-probabilities sit at the same positions."""
    rows = len(prompt_ids)
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)) - 1
    input_ids = torch.full((rows, width), pad_id, dtype=torch.int64)
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.int64)
    sampling = torch.zeros((rows, width), dtype=torch.float32)
    for r, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        sequence = prompt + completion
        input_ids[r, :len(sequence) - 1] = torch.tensor(sequence[:-1])
        first = len(prompt) - 1  # the position whose next token is the completion's first
        labels[r, first:first + len(completion)] = torch.tensor(completion)
        sampling[r, first:first + len(completion)] = rollout_logps[r, :len(completion)]
    return Batch(input_ids, labels, policy=PolicyRows.from_config(grpo, advantages, sampling_logps=sampling))


def vanished_weights_warning(record: dict[str, Any], grpo: Any) -> str | None:
    """The warning for a step whose importance-sampling weights (vllm_importance_sampling_correction) left every
    completion token below NEGLIGIBLE_IS_WEIGHT, so that it trained on nothing (loss and gradient 0, or nearly) but
    the KL penalty where beta > 0 (TRL adds beta x KL after the weighting); None for any other step. `record`: the
    step's metrics (ZERO_FRACTION; summed over data-parallel ranks, each a share of the whole batch)."""
    if not grpo.vllm_importance_sampling_correction or record.get(ZERO_FRACTION, 0.0) < 1 - 1e-6:
        return None
    key, mode = "finetune.grpo.vllm_importance_sampling_mode", grpo.vllm_importance_sampling_mode
    bounds = (f"clip_min={grpo.vllm_importance_sampling_clip_min}, "
              f"clip_max={grpo.vllm_importance_sampling_clip_max}")
    gap = record.get("sampling/sampling_logp_difference/mean")
    gap = "" if gap is None else f" (mean |gap| {gap:.3g} nats a token)"
    trains = f"on the KL penalty alone (beta={grpo.beta:g})" if grpo.beta else "on nothing"
    head = (f"step {record.get('step')}: the importance-sampling correction weighs every completion token below "
            f"{NEGLIGIBLE_IS_WEIGHT:g} ({key}={mode}, {bounds}): this step trains {trains} (loss "
            f"{record.get('loss', float('nan')):.3g}, grad_norm {record.get('grad_norm', float('nan')):.3g}). ")
    if mode.startswith("sequence"):
        return head + (f"A sequence mode weighs a completion by exp of the trainer-minus-rollout log-probability gap "
                       f"summed over all its tokens{gap}; over long completions that sum falls far below 0 (or above "
                       f"log(clip_max)) and the weight vanishes. For long completions set {key}=token_truncate (one "
                       f"ratio per token, clamped to [clip_min, clip_max]); docs/fine-tuning.md, GRPO.")
    return head + (f"Every per-token ratio{gap} fell outside [clip_min, clip_max] ({mode}): widen the bounds, or set "
                   f"{key}=token_truncate, which clamps instead of zeroing; docs/fine-tuning.md, GRPO.")


def warn_vanished_weights(record: dict[str, Any], grpo: Any) -> str | None:
    """Log vanished_weights_warning as a warning (the console and the run's log) and return it."""
    message = vanished_weights_warning(record, grpo)
    if message is not None:
        log.warning("%s", message)
    return message


class GRPOSteps:
    """The rollout, scoring and batch of each GRPO step."""

    def __init__(self, cfg: Config, prompts: PromptBatches):
        self.cfg, self.grpo, self.prompts = cfg, cfg.finetune.grpo, prompts
        self.functions = self.grpo.reward_functions()
        self.names = [reward_name(fn) for fn in self.functions]
        self.weights = torch.tensor(self.grpo.weights, dtype=torch.float64)
        source = prompts.docs.manifest.get("tokenizer")
        if not source:
            raise ConfigError(f"data.path={cfg.data.path!r}: its manifest names no tokenizer to decode the completions "
                              "with; prepare it again with `megatrain prepare --format prompts`")
        self.tokenizer = load_tokenizer(resolve_tokenizer(source, None))
        self.stop_ids = stop_token_ids(self.tokenizer, cfg.model.path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.stop_ids[0] if self.stop_ids else 0))
        self.pending: tuple[int, Batch] | None = None
        """(the step that generated it, the batch) of the num_iterations group under way."""
        self.separate = SeparateRollouts(self, cfg.rl.async_steps, cfg.train.steps, cfg.finetune.method == "lora") \
            if cfg.rl.separate else None
        """rl.rollout: separate: the rollout worker's steps (driver/separate_rollout.py)."""

    def step_batch(self, step: int, gpu: Any, worker: Any = None) -> RolloutBatch:
        """Step `step`'s batch: generated at the first step of its num_iterations group (with the rollout's metrics),
        the group's batch again at the others. `worker`: the separate rollout worker (rl.rollout: separate)."""
        start = step - step % self.grpo.num_iterations
        if self.pending is not None and self.pending[0] == start:
            return RolloutBatch(self.pending[1], {})
        if step != start:
            raise RuntimeError(f"step {step} trains on the batch generated at step {start}, which this run does not "
                               "hold")
        if self.separate is not None:
            assert worker is not None, "rl.rollout=separate: the cluster spawns a rollout worker"
            generated = self.separate.batch(step, gpu, worker)
        else:
            generated = self.batch(step, gpu)
        self.pending = (start, generated.batch) if self.grpo.num_iterations > 1 else None
        return generated

    def save_state(self, next_step: int, directory: Path) -> dict[str, Any]:
        """What a checkpoint after `next_step` steps keeps of the GRPO loop, written into `directory`, and the
        manifest's entry naming it: inside a num_iterations group its batch; with rl.async_steps=1 the batch of step
        `next_step`, generated ahead (waited for now); else nothing."""
        if self.separate is not None and self.separate.async_steps:
            ahead = self.separate.hold_ahead(next_step)
            if ahead is None:
                return {}
            self._write_batch(ahead.batch, ahead.metrics, directory)
            return {"grpo_rollout": {"file": ROLLOUT_FILE, "generated_at": next_step, "ahead": True}}
        if self.pending is None or next_step % self.grpo.num_iterations == 0:
            return {}
        start, batch = self.pending
        self._write_batch(batch, {}, directory)
        return {"grpo_rollout": {"file": ROLLOUT_FILE, "generated_at": start}}

    @staticmethod
    def _write_batch(batch: Batch, metrics: dict[str, float], directory: Path) -> None:
        rows = batch.policy
        directory.mkdir(parents=True, exist_ok=True)
        torch.save({"input_ids": batch.input_ids, "labels": batch.labels, "advantages": rows.advantages,
                    **{name: getattr(rows, name) for name in ("sampling_logps", "old_logps", "ref_logps")
                       if getattr(rows, name) is not None},
                    "metrics": {k: float(v) for k, v in metrics.items()}}, directory / ROLLOUT_FILE)

    def restore(self, directory: Path | None, manifest: dict[str, Any] | None) -> None:
        """The batch a checkpoint keeps (save_state): a num_iterations group's, none at a group's first step; with
        rl.async_steps=1 the one generated ahead, where it holds one."""
        self.pending = None
        if self.separate is not None:
            self.separate.reset()
        entry, mu = (manifest or {}).get("grpo_rollout"), self.grpo.num_iterations
        if self.separate is not None and self.separate.async_steps:
            if entry is not None and entry.get("ahead"):
                batch, metrics = self._read_batch(Path(directory), entry, "")
                self.separate.held = (int(entry["generated_at"]), RolloutBatch(batch, metrics))
            return
        if manifest is None or int(manifest["step"]) % mu == 0:
            return
        if entry is None:
            raise CheckpointError(f"checkpoint {directory} is at step {manifest['step']}, inside a group of "
                                  f"finetune.grpo.num_iterations={mu} steps on one generated batch, and holds no batch "
                                  f"({ROLLOUT_FILE}); resume from a checkpoint at a multiple of {mu} steps")
        batch, _ = self._read_batch(Path(directory), entry, f"; resume from a checkpoint at a multiple of "
                                    f"finetune.grpo.num_iterations={mu} steps")
        self.pending = (int(entry["generated_at"]), batch)

    def _read_batch(self, directory: Path, entry: dict[str, Any], advice: str) -> tuple[Batch, dict[str, float]]:
        path = directory / Path(entry["file"]).name  # a name inside the checkpoint directory, never a path out of it
        try:
            saved = torch.load(path, weights_only=True)
        except Exception as exc:  # a missing or damaged file
            raise CheckpointError(f"checkpoint {directory}: the GRPO batch {path} cannot be read ({exc}){advice}") \
                from None
        rows = PolicyRows.from_config(self.grpo, saved["advantages"], sampling_logps=saved.get("sampling_logps"),
                                      old_logps=saved.get("old_logps"), ref_logps=saved.get("ref_logps"))
        return Batch(saved["input_ids"], saved["labels"], policy=rows), dict(saved.get("metrics", {}))

    def sampling(self, step: int) -> SamplingSettings:
        """The rollout's settings at `step`: its generator seeded by (train.seed, step)."""
        g = self.grpo
        return SamplingSettings(max_new_tokens=g.max_completion_length, temperature=g.temperature, top_p=g.top_p,
                                top_k=g.top_k, stop_token_ids=tuple(self.stop_ids), pad_token_id=self.pad_id,
                                seed=(self.cfg.train.seed * 1_000_003 + step) % (1 << 63))

    def batch(self, step: int, gpu: Any) -> RolloutBatch:
        """Generate, score and batch the completions of step `step` on `gpu` (the GPU worker of rank 0)."""
        return self.finish(self.launch(step, gpu), gpu)

    def launch(self, step: int, generator: Any, ahead: bool = False) -> Launched:
        """Start the generation of step `step`'s completions on `generator` (a GPU worker or the rollout worker);
        `ahead`: while the trainer trains the step before (rl.async_steps=1)."""
        rows = self.prompts.step_prompts(step)
        prompt_ids = [ids for ids in rows.ids for _ in range(self.grpo.num_generations)]
        return Launched(step, rows, prompt_ids, generator.generate(prompt_ids, self.sampling(step)),
                        time.perf_counter(), ahead)

    def finish(self, launched: Launched, gpu: Any) -> RolloutBatch:
        """Wait for a launched generation, then score and batch its completions; `gpu`: the trainer's GPU worker
        (the old and reference log-probabilities)."""
        rows, prompt_ids, group = launched.rows, launched.prompt_ids, self.grpo.num_generations
        t0 = time.perf_counter()
        rollout: RolloutResult = launched.future.result()
        t1 = time.perf_counter()
        completion_ids = rollout.completions()
        rewards, prompts, completions = self.score(rows, completion_ids)
        scored = group_advantages(rewards, self.weights, group, self.grpo.scale_rewards,
                                  self.grpo.multi_objective_aggregation, self.names)
        t2 = time.perf_counter()
        batch = policy_batch(prompt_ids, completion_ids, rollout.logps, scored.advantages, self.grpo, self.pad_id)
        t3 = time.perf_counter()
        batch = self.with_logps(batch, gpu)
        t4 = time.perf_counter()
        lengths = rollout.lengths.double()
        metrics = {name: float(value) for name, value in scored.metrics.items()}
        truncated = ~rollout.stopped
        metrics.update({
            "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(truncated.double().mean()),
            # generated ahead: the generation's own seconds (it overlapped the step before), and how long the
            # driver still waited for it
            "rollout_s": generation_seconds(rollout.stats) if launched.ahead else t1 - launched.started,
            **({"rollout_wait_s": t1 - t0} if launched.ahead else {}),
            "reward_s": t2 - t1, "rollout_tokens_per_s": rollout.stats["tokens_per_s"],
            "rollout_tokens": rollout.stats["generated_tokens"],
            # inside rollout_s: the weights made ready before the generation and put back after it (the resident
            # copy's refresh; LoRA merged: the adapters folded in, the base copied back)
            "rollout_sync_s": rollout.stats.get("weights_sync_s", 0.0) + rollout.stats.get("weights_restore_s", 0.0),
        })
        if self.grpo.beta > 0 or self.grpo.num_iterations > 1:
            metrics["logps_s"] = t4 - t3  # the forward passes of the old and reference log-probabilities
        return RolloutBatch(batch, metrics)

    def with_logps(self, batch: Batch, gpu: Any) -> Batch:
        """The forward-only log-probabilities the loss needs beyond the step's own: the generating policy's
        (num_iterations > 1: the weights now, before the group's first update) and the reference model's
        (beta > 0), both at the sampling temperature, as TRL computes them right after generating."""
        g, rows = self.grpo, batch.policy
        old = gpu.token_logps(batch, g.temperature).result() if g.num_iterations > 1 else None
        ref = gpu.token_logps(batch, g.temperature, reference=True).result() if g.beta > 0 else None
        if old is None and ref is None:
            return batch
        return dataclasses.replace(batch, policy=dataclasses.replace(rows, old_logps=old, ref_logps=ref))

    def evaluate(self, prompts: PromptBatches, gpu: Any, worker: Any = None) -> dict[str, float]:
        """The mean reward of the first train.eval_batches x (data.batch_size / num_generations) held-out prompts,
        num_generations completions each, sampled as in training but with one fixed seed: evaluations differ only by
        the weights (those after every step taken). `worker`: the separate rollout worker, which generates them."""
        rows = prompts.eval_prompts(self.cfg.train.eval_batches * self.prompts.prompts_per_step)
        prompt_ids = [ids for ids in rows.ids for _ in range(self.grpo.num_generations)]
        sampling = dataclasses.replace(self.sampling(0), seed=self.cfg.train.seed)
        generator = gpu
        if self.separate is not None and worker is not None:
            self.separate.up_to_date(gpu, worker)
            generator = worker
        rollout: RolloutResult = generator.generate(prompt_ids, sampling).result()
        rewards = self.score(rows, rollout.completions())[0]
        metrics = {"eval_reward": float(weighted_rewards(rewards, self.weights).nanmean())}
        for name, column in zip(self.names, rewards.T):
            metrics[f"eval_rewards/{name}/mean"] = float(column.nanmean())
        return metrics

    def score(self, rows: PromptRows, completion_ids: list[list[int]]) -> tuple[torch.Tensor, list, list]:
        """[N, F] rewards of the completions (TRL's call: prompts, completions as text, or as an assistant message
        for chat prompts, completion_ids, and the dataset's other columns, one value per completion)."""
        group = self.grpo.num_generations
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        prompts = [p for p in rows.prompts for _ in range(group)]
        completions = [[{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
                       for prompt, text in zip(prompts, texts)]
        columns = {name: [v for v in values for _ in range(group)] for name, values in rows.columns.items()}
        rewards = score_completions(self.functions, prompts, completions, completion_ids, columns)
        return rewards, prompts, completions


def stop_token_ids(tokenizer: Any, model_path: str) -> list[int]:
    """The tokens that end a completion: the model's generation_config.json eos_token_id (one or a list) where
    model.path has one, else the tokenizer's eos token."""
    ids: list[int] = []
    config = Path(model_path) / "generation_config.json" if model_path else None
    if config is not None and config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids = [eos] if isinstance(eos, int) else [i for i in (eos or []) if isinstance(i, int)]
    if not ids and tokenizer.eos_token_id is not None:
        ids = [int(tokenizer.eos_token_id)]
    return ids
