"""Configuration: the root `Config`, one field per section, and the checks across its sections.

A run is described by a YAML file whose sections map one to one onto `Config`'s fields
(config/load.py reads it). Each section is a dataclass checking its own values, in the module of its
concern: config/model_section.py (`model`), config/loop_sections.py (`data`, `schedule`, `train`,
`checkpoint`, `fault`), config/engine_sections.py (`optimizer`, `precision`, `engine`),
config/runtime_sections.py (`host`, `runtime`, `parallel`), config/finetune_section.py (`finetune`) and
config/rl_section.py (`rl`).
Impossible values raise `ConfigError` naming the dotted key (`optimizer.lr`), the value received and what to
do, before anything is allocated. Settings derived from several sections and the machine live in
config/resolved.py (RunSpec).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatrain_ray.config.engine_sections import EngineConfig, OptimizerConfig, PrecisionConfig
from megatrain_ray.config.fields import refuse as _fail
from megatrain_ray.config.finetune_section import FinetuneConfig
from megatrain_ray.config.latent_attention_section import check_latent_run
from megatrain_ray.config.linear_attention_section import check_hybrid_run
from megatrain_ray.config.loop_sections import CheckpointConfig, DataConfig, FaultConfig, ScheduleConfig, TrainConfig
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.config.rl_section import RLConfig
from megatrain_ray.config.runtime_sections import HostConfig, ParallelConfig, RuntimeConfig


@dataclass(kw_only=True, slots=True)
class Config:
    """The root of a run's configuration: one field per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: HostConfig = field(default_factory=HostConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def __post_init__(self) -> None:
        if self.schedule.warmup_steps > self.train.steps:
            _fail("schedule.warmup_steps", self.schedule.warmup_steps,
                  f"exceeds train.steps={self.train.steps}")
        if self.data.seq_len > self.model.max_position_embeddings and self.model.rope_scaling is None:
            _fail("data.seq_len", self.data.seq_len,
                  f"exceeds model.max_position_embeddings={self.model.max_position_embeddings}; "
                  "raise it or configure model.rope_scaling")
        if self.data.packing and self.model.family == "gpt_oss":
            _fail("data.packing", True, "gpt_oss's attention sinks run on plain rows only (model/sinks.py); "
                  "set data.packing false")
        if self.data.path.endswith(".txt") and self.model.vocab_size < 256:
            _fail("model.vocab_size", self.model.vocab_size, "must be >= 256 for byte-level text data")
        if self.optimizer.moment_dtype == "bfloat16" and self.precision.master_dtype != "float32":
            _fail("optimizer.moment_dtype", self.optimizer.moment_dtype,
                  f"needs precision.master_dtype=float32 (it is {self.precision.master_dtype}, which exists for "
                  "exact tests); use moment_dtype=float32")
        if self.model.template == "generic":
            check_generic(self)
        if self.precision.compute_dtype in ("bfloat16", "float16") and self.engine.device == "cpu":
            pass  # allowed (slow); tests of the bf16 path use it on purpose
        check_lean(self)
        check_parallel(self)
        check_hybrid_run(self)
        check_latent_run(self)
        check_finetune(self)
        check_objective(self)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)


def check_parallel(cfg: Config, ranks: int | None = None) -> None:
    """The parallel section against the rest of the config: on load, and again in the trainer once
    `parallel.gpus: auto` is resolved to `ranks`."""
    p = cfg.parallel
    if ranks is None and p.gpus != "auto":
        ranks = p.gpus
    if cfg.runtime.mode == "local":
        if ranks is not None and ranks > 1:
            _fail("parallel.gpus", p.gpus, "more than one GPU worker needs runtime.mode=ray (each rank is a "
                  "process of its own); drop --local, or set parallel.gpus=1")
        if p.nodes > 1:
            _fail("parallel.nodes", p.nodes, "several nodes need runtime.mode=ray; drop --local")
    if ranks is not None and cfg.data.batch_size % ranks:
        _fail("parallel.gpus", p.gpus if p.gpus != "auto" else f"auto ({ranks} GPUs)",
              f"data.batch_size={cfg.data.batch_size} is not divisible by {ranks} ranks: each GPU takes an equal "
              f"slice of the global batch; set data.batch_size to a multiple of {ranks}")
    check_objective(cfg, ranks)
    check_speculative(cfg, ranks)
    if p.backend == "nccl" and cfg.engine.device == "cpu":
        _fail("parallel.backend", p.backend, "needs GPUs, but engine.device=cpu; use gloo or auto")
    if p.backend == "gloo" and cfg.engine.device == "cuda":
        _fail("parallel.backend", p.backend, "sums CPU tensors (tests); with engine.device=cuda use nccl or auto")


def check_speculative(cfg: Config, ranks: int | None) -> None:
    """optimizer.speculative_stages against the rest of the config (`ranks`: GPU workers, None while unknown)."""
    count = cfg.optimizer.speculative_stages
    if not count:
        return
    why = ""
    if cfg.optimizer.grad_clip <= 0:
        why = "optimizer.grad_clip > 0 (without clipping every update already starts when its gradients land)"
    elif cfg.finetune.method != "full":
        why = "finetune.method=full (LoRA adapters update on the device)"
    elif cfg.host.moments_tier != "ram":
        why = "host.moments_tier=ram (the second set of state is kept for moments in RAM)"
    elif cfg.precision.stream_is_master:
        why = ("a streaming copy apart from the master weights (precision.stream_dtype below master_dtype): the "
               "device reads the master itself, and it would change place with the current set")
    elif ranks is not None and ranks > cfg.parallel.nodes:
        why = "one GPU worker per node (parallel.gpus = parallel.nodes)"
    if why:
        _fail("optimizer.speculative_stages", count, f"needs {why}; or set it to 0")


def check_lean(cfg: Config) -> None:
    """optimizer.state=lean against the rest of the config, on load (before Ray starts): one error naming the
    keys that conflict."""
    o, p = cfg.optimizer, cfg.precision
    if o.state != "lean":
        return
    conflicts = [(key, value, want) for key, value, want, ok in (
        ("precision.compute_dtype", p.compute_dtype, "bfloat16", p.compute_dtype == "bfloat16"),
        ("precision.stream_dtype", p.stream_dtype, "auto or bfloat16 (the bfloat16 master is streamed)",
         p.stream_dtype in ("auto", "bfloat16")),
        ("precision.grad_dtype", p.grad_dtype, "auto, bfloat16 or float32", p.grad_dtype in ("auto", "bfloat16",
                                                                                              "float32")),
        ("precision.master_dtype", p.master_dtype, "float32 (the default; lean keeps a bfloat16 master of its own)",
         p.master_dtype == "float32"),
        ("optimizer.moment_dtype", o.moment_dtype, "float32 (lean moments are set by optimizer.lean_moments)",
         o.moment_dtype == "float32"),
        ("optimizer.speculative_stages", o.speculative_stages, "0 (the master is the streaming copy)",
         o.speculative_stages == 0),
        ("host.moments_tier", cfg.host.moments_tier, "ram", cfg.host.moments_tier == "ram"),
        ("finetune.method", cfg.finetune.method, "full (LoRA adapters keep their own state on the device)",
         cfg.finetune.method == "full"),
        ("engine.gpu_resident", cfg.engine.gpu_resident, "none or auto (resident layers keep float32 state; auto "
         "keeps none with lean)", cfg.engine.gpu_resident in ("none", "auto")),
    ) if not ok]
    if conflicts:
        _fail("optimizer.state", "lean", "needs " + "; ".join(f"{key}={want} (it is {value!r})"
                                                            for key, value, want in conflicts)
              + "; or set optimizer.state=full")


def check_finetune(cfg: Config) -> None:
    """finetune.method=lora against the rest of the config."""
    if cfg.finetune.method != "lora":
        if cfg.finetune.lora.base_quantization != "none":
            _fail("finetune.lora.base_quantization", cfg.finetune.lora.base_quantization,
                  f"quantizes the frozen base of a LoRA run, and finetune.method is {cfg.finetune.method!r}: set "
                  "finetune.method=lora or finetune.lora.base_quantization=none")
        return
    cfg.finetune.lora.targets(cfg.model.family)
    why = ""
    if cfg.model.template == "generic":
        why = ("a native layer template (the adapters are bound into the native templates' projections; the generic "
               "path runs the model's own layer modules): model.template=generic cannot take them")
    elif cfg.parallel.nodes != 1:
        why = "one node (parallel.nodes=1; several GPUs of one node are fine)"
    elif cfg.host.moments_tier != "ram":
        why = "host.moments_tier=ram (the adapters' moments live on the device, the host holds none)"
    elif cfg.finetune.lora.modules_to_save and cfg.model.tie_word_embeddings:
        why = ("an untied LM head (model.tie_word_embeddings=false) for finetune.lora.modules_to_save: the tied "
               "matrix would be two trained copies")
    elif cfg.fault.kills("optim"):
        why = "no fault.drill kill:optimK (a LoRA run has no optimizer workers)"
    if why:
        _fail("finetune.method", "lora", f"needs {why}")


def check_objective(cfg: Config, ranks: int | None = None) -> None:
    """finetune.objective=dpo or grpo against the data and parallel sections (`ranks`: parallel.gpus once
    resolved)."""
    if cfg.finetune.objective == "grpo":
        check_grpo(cfg)
    check_rl(cfg)
    if cfg.finetune.objective != "dpo":
        return
    if cfg.model.template == "generic":
        _fail("finetune.objective", "dpo", "needs a native layer template (the DPO head works on the native final norm); "
              "model.template=generic cannot take it")
    if cfg.model.is_moe:
        _fail("finetune.objective", "dpo", f"is not tested with the router's load-balancing loss of {cfg.model.family} "
              "yet; use a dense family, or finetune.objective=sft")
    if cfg.data.packing:
        _fail("data.packing", True, "finetune.objective=dpo keeps one sequence per row (a pair's rows are scored "
              "whole); set data.packing=false")
    if cfg.data.batch_size % 2:
        _fail("data.batch_size", cfg.data.batch_size, "finetune.objective=dpo counts rows, two per preference pair "
              "(chosen and rejected): set an even data.batch_size")
    if ranks is None and cfg.parallel.gpus != "auto":
        ranks = cfg.parallel.gpus
    if ranks is not None and (cfg.data.batch_size // 2) % ranks:
        _fail("data.batch_size", cfg.data.batch_size, f"finetune.objective=dpo gives each of the {ranks} ranks "
              f"whole pairs, the same number each: set data.batch_size to a multiple of {2 * ranks}")


def check_grpo(cfg: Config) -> None:
    """finetune.objective=grpo: reward functions given and importable, whole groups per batch, and rows that hold a
    prompt and its completion where finetune.grpo.max_prompt_length bounds the prompt (else the prompts' lengths are
    known from the data only: data/prompts.py checks them)."""
    grpo = cfg.finetune.grpo
    if not grpo.reward_funcs:
        _fail("finetune.grpo.reward_funcs", grpo.reward_funcs, "finetune.objective=grpo needs at least one reward "
              "function, `module:function` (docs/fine-tuning.md, GRPO)")
    grpo.reward_functions()  # imports the user's modules: a ConfigError names the one that fails
    if cfg.data.batch_size % grpo.num_generations:
        _fail("data.batch_size", cfg.data.batch_size, f"finetune.objective=grpo counts completions, "
              f"finetune.grpo.num_generations={grpo.num_generations} per prompt: set data.batch_size to a multiple "
              f"of {grpo.num_generations}")
    if grpo.max_prompt_length is not None and grpo.max_prompt_length + grpo.max_completion_length > cfg.data.seq_len:
        _fail("data.seq_len", cfg.data.seq_len, f"finetune.objective=grpo puts a prompt and its completion in one row: "
              f"finetune.grpo.max_prompt_length={grpo.max_prompt_length} + max_completion_length="
              f"{grpo.max_completion_length} = {grpo.max_prompt_length + grpo.max_completion_length} tokens; raise "
              "data.seq_len or lower those")


def check_trainable(cfg: Config) -> None:
    """What `megatrain train` refuses although the config is valid: the GRPO settings this version's trainer does not
    run yet. Called by the trainer before anything else, so such a config never trains as something else."""
    if cfg.finetune.objective != "grpo":
        return
    if cfg.model.template == "generic":
        _fail("model.template", "generic", "the rollout engine generates with the native templates only (its KV cache "
              "path); GRPO needs a model family with a native template")
    if cfg.data.packing:
        _fail("data.packing", True, "a GRPO row is one prompt and one completion; set data.packing: false")


def check_rl(cfg: Config) -> None:
    """The rl section against the objective and the GRPO settings it changes the meaning of."""
    rl, grpo = cfg.rl, cfg.finetune.grpo
    if not rl.separate:
        return
    if cfg.finetune.objective != "grpo":
        _fail("rl.rollout", rl.rollout, f"places GRPO's rollout; finetune.objective is {cfg.finetune.objective!r}: "
              "set rl.rollout: colocated")
    if cfg.optimizer.speculative_stages:
        _fail("optimizer.speculative_stages", cfg.optimizer.speculative_stages, "keeps a second set of weights per "
              "stage, which the separate rollout worker (rl.rollout: separate) does not follow: set it to 0")
    if cfg.engine.rollout_weights == "streamed" and cfg.finetune.method == "full":
        _fail("engine.rollout_weights", "streamed", "with rl.rollout: separate the rollout worker holds its own copy "
              "of the weights on its GPU (taken between steps, never while the optimizer writes them): set it to auto")
    if rl.async_steps and not grpo.vllm_importance_sampling_correction:
        _fail("finetune.grpo.vllm_importance_sampling_correction", False, "rl.async_steps=1 trains on completions of "
              "the weights before the last update; the importance-sampling correction is what accounts for that "
              "gap: set it true (or rl.async_steps: 0)")
    if rl.async_steps and grpo.num_iterations != 1:
        _fail("finetune.grpo.num_iterations", grpo.num_iterations, "rl.async_steps=1 generates every step's batch "
              "one step ahead; several updates on one batch (num_iterations > 1) are not combined with it: set "
              "num_iterations: 1 or rl.async_steps: 0")


def check_generic(cfg: Config) -> None:
    """What the generic layer path (model.template=generic) cannot do, refused on load."""
    if cfg.data.packing:
        _fail("data.packing", True, "needs per-document attention masks, which the generic path (model.template="
              "generic) does not build; set data.packing=false (one document per row)")
    if cfg.engine.compile is True:
        _fail("engine.compile", True, "compiles the native layer template; the generic path (model.template="
              "generic) runs the model's own layer class eagerly: set engine.compile to auto or false")


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return obj
