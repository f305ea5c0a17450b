"""The sections of the training loop around the steps: the data (`data`), the learning-rate schedule
(`schedule`), the loop itself (`train`), checkpoints (`checkpoint`) and fault handling (`fault`). Each checks
its own values; checks across sections are with Config (config/sections.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megatrain_ray.config.fields import refuse as _fail


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where training tokens come from and how they are cut into batches."""

    SECTION: ClassVar[str] = "data"
    path: str = ""
    """A token file (.npy of integers, or .bin of `token_dtype`), a UTF-8 text file (.txt, byte-level
    tokens 0-255), a directory written by `megatrain prepare` (documents with a per-token loss mask), or
    the word `synthetic` for seeded random tokens (benchmarks). Relative paths are resolved against the
    config file's directory first, then the working directory."""
    token_dtype: Literal["uint16", "uint32", "int32", "int64"] = "uint16"
    """Element type of a raw .bin token file."""
    seq_len: int = 2048
    """Tokens per sequence (the model sees seq_len inputs and predicts seq_len next tokens)."""
    batch_size: int = 1
    """Sequences per optimizer step; the whole batch goes through each layer at once."""
    shuffle: bool = True
    """Visit the sequences of each epoch in a seeded random order."""
    seed: int = 0
    """Seed of the shuffle order (and of synthetic tokens)."""
    packing: bool = False
    """Prepared data only. true: documents are packed whole into rows of seq_len tokens; RoPE positions
    restart and attention stops at every document boundary. false: one document per row, padded."""
    eval_path: str = ""
    """A prepared directory for train.eval_every (its train split). Empty: the eval split of data.path."""

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            _fail("data.seq_len", self.seq_len, "must be >= 1")
        if self.batch_size < 1:
            _fail("data.batch_size", self.batch_size, "must be >= 1")
        if not self.path:
            _fail("data.path", self.path, "is required: a token file, a .txt file or 'synthetic'")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size


@dataclass(kw_only=True, slots=True)
class ScheduleConfig:
    """Learning-rate schedule over `train.steps` optimizer steps (see megatrain_ray/optim/adamw.py)."""

    SECTION: ClassVar[str] = "schedule"
    kind: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape after warmup: cosine or linear decay to min_lr_ratio * lr, or constant."""
    warmup_steps: int = 0
    """Steps of linear warmup: step s (0-based) uses lr * (s + 1) / warmup_steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine and linear)."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            _fail("schedule.warmup_steps", self.warmup_steps, "must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail("schedule.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")


TRACKERS = ("tensorboard", "mlflow", "wandb")
"""The experiment trackers train.report_to may name (driver/tracking.py)."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The loop around the steps."""

    SECTION: ClassVar[str] = "train"
    steps: int = 100
    """Optimizer steps to run."""
    seed: int = 0
    """Seed of the random initialisation."""
    output_dir: str = "runs/default"
    """Run directory: resolved config, metrics.jsonl, checkpoints. A relative path is taken under
    train.storage_root."""
    storage_root: str = "auto"
    """Where relative train.output_dir, checkpoint.dir and train.export_dir paths are taken from. auto: the
    working directory, except inside Ray's session tree (the copy of `--working-dir` that `ray job submit`
    runs in, deleted when Ray stops), where it is ~/megatrain. A path lying in Ray's session tree is refused."""
    log_every: int = 1
    """Steps between console log lines (metrics.jsonl gets every step)."""
    eval_every: int = 0
    """Steps between evaluations (forward-only loss over train.eval_batches batches of the eval data,
    written as eval_loss in metrics.jsonl, also after the last step); 0 turns evaluation off."""
    eval_batches: int = 4
    """Batches of data.batch_size rows per evaluation, always the same ones (the first of the eval data)."""
    export_dir: str = ""
    """Write the trained model there as a Hugging Face directory (safetensors + config.json + the
    tokenizer files of model.path) at the end of training. Empty: no export."""
    export_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Format of the exported weights. auto: the dtype model.path's config.json declares; bfloat16 for a .gguf file
    whose matrices are all quantized or BF16; else float32."""
    report_to: list[str] = field(default_factory=list)
    """Experiment trackers that get every metrics.jsonl record (loss, lr, grad_norm, tok_per_s, eval_loss, ...)
    at its step, and the config once: any of `tensorboard` (event files in <train.output_dir>/tensorboard),
    `mlflow` (the store MLFLOW_TRACKING_URI names; experiment MLFLOW_EXPERIMENT_NAME, default megatrain) and
    `wandb` (WANDB_PROJECT, default megatrain; WANDB_MODE=offline keeps it local; files under WANDB_DIR, default
    the run directory). Needs `pip install 'megatrain-ray[track]'`. A resume continues the same tracked runs
    (their ids are in the checkpoint manifest). Empty: no tracking."""
    run_name: str = ""
    """Name of the tracked run (MLflow run name, W&B display name). Empty: the run directory's name."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            _fail("train.steps", self.steps, "must be >= 1")
        if self.eval_every < 0:
            _fail("train.eval_every", self.eval_every, "must be >= 0 (0 turns evaluation off)")
        if self.eval_batches < 1:
            _fail("train.eval_batches", self.eval_batches, "must be >= 1")
        if self.log_every < 1:
            _fail("train.log_every", self.log_every, "must be >= 1")
        for name in self.report_to:
            if name not in TRACKERS:
                _fail("train.report_to", name, f"unknown tracker; expected a list of {', '.join(TRACKERS)}")
        if len(set(self.report_to)) != len(self.report_to):
            _fail("train.report_to", self.report_to, "names a tracker twice")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpoints of the whole training state (master weights, both moments, step, data position)."""

    SECTION: ClassVar[str] = "checkpoint"
    every: int = 0
    """Steps between checkpoints; 0 saves only at the end and on SIGTERM/SIGINT. Each one is written
    by the HostShard actors in the background while training goes on."""
    keep: int = 2
    """How many of the newest complete checkpoints to keep; older ones are deleted once a newer one is complete."""
    dir: str = ""
    """Where checkpoints go; empty means `<train.output_dir>/checkpoints`."""
    at_end: bool = True
    """Save a checkpoint after the last step."""
    on_signal: bool = True
    """On SIGTERM or SIGINT, finish the current step, save a checkpoint and exit (code 130 or 143)."""

    def __post_init__(self) -> None:
        if self.every < 0:
            _fail("checkpoint.every", self.every, "must be >= 0 (0: only at the end and on signals)")
        if self.keep < 1:
            _fail("checkpoint.keep", self.keep, "must be >= 1")


DRILL_ACTIONS = ("kill", "nan_grad", "kill_during_checkpoint")


@dataclass(kw_only=True, slots=True)
class FaultConfig:
    """What happens when something goes wrong: dead actors, non-finite numbers."""

    SECTION: ClassVar[str] = "fault"
    max_restarts: int = 0
    """Times the run may restart its actors and resume from the last good checkpoint by itself after an actor
    dies; 0 stops with a message naming the actor and the command that resumes."""
    nonfinite: Literal["skip", "stop"] = "skip"
    """Policy for a non-finite loss or gradient norm: `skip` drops the step (weights and moments untouched);
    `stop` saves the last good state as a checkpoint and exits non-zero. With optimizer.grad_clip = 0 a
    non-finite gradient under a finite loss is found only after some layers were updated, so the run stops."""
    drill: str = ""
    """Fault drills, for testing recovery only: comma-separated `ACTION@STEP` with ACTION one of
    `kill:ACTOR` (SIGKILL to `driver`, `gpu`, `gpuR` (rank R), `hostK` or `optimK` while step STEP runs), `nan_grad`
    (a NaN in one gradient of step STEP) or `kill_during_checkpoint` (the process writing the checkpoint
    taken after STEP steps dies after its first file). Steps count from 0. Empty in real runs."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            _fail("fault.max_restarts", self.max_restarts, "must be >= 0")
        parse_drill(self.drill)

    def kills(self, actor: str) -> bool:
        """Whether a drill kills an actor whose name starts with `actor` (optim, host, gpu, driver)."""
        return any(action == "kill" and target.startswith(actor) for action, target, _ in parse_drill(self.drill))


def parse_drill(text: str) -> list[tuple[str, str, int]]:
    """`kill:optim0@5,nan_grad@3` -> [("kill", "optim0", 5), ("nan_grad", "", 3)]."""
    drills = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        action, _, step = item.partition("@")
        action, _, target = action.partition(":")
        if action not in DRILL_ACTIONS or not step.isdigit() or (action == "kill") != bool(target) \
                or (target and not re.fullmatch(r"driver|gpu\d*|host\d+|optim\d+", target)):
            _fail("fault.drill", item, "expected ACTION@STEP with ACTION one of kill:driver, kill:gpu, kill:gpuR, "
                  "kill:hostK, kill:optimK, nan_grad, kill_during_checkpoint")
        drills.append((action, target, int(step)))
    return drills
