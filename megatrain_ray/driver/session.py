"""A forward-only session: a model's weights in the host store and the layer stream on the device, in this
process, for generation (`megatrain generate`, `megatrain chat`). No run directory is written, no step is taken;
the rollout engine (engine/rollout/) decodes through the same GPU worker GRPO uses.

A model directory is held once, in the streaming dtype, as a LoRA run holds its frozen base (no AdamW moments, no
gradients, no optimizer workers: 2 bytes per parameter in bfloat16). A run's checkpoint is restored into the store
its training had (its master weights and moments: the checkpoint's files hold both); a LoRA run's is its base so
held plus the checkpoint's adapters.

What a session loads (RUN_OR_MODEL):
  a run directory (config.yaml)   its newest complete checkpoint, with the run's own config (a LoRA run: its base
                                  from model.path plus the checkpoint's adapters); else its train.export_dir
  a model directory (config.json) an export, a Hugging Face model; or a hub name or .gguf file, as model.path takes
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain_ray.config.load import load_config
from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.data.prepare.tokenize import resolve_tokenizer
from megatrain_ray.driver.checkpointing import find_checkpoint
from megatrain_ray.driver.cluster import Cluster, new_run_id
from megatrain_ray.driver.parallel import resolve_parallel
from megatrain_ray.engine.rollout.interface import RolloutResult, SamplingSettings
from megatrain_ray.dtypes import DTYPE_BYTES
from megatrain_ray.exceptions import ConfigError, HostMemoryError
from megatrain_ray.model.hf_io import HFDirectory
from megatrain_ray.model.layout import build_layout
from megatrain_ray.observe.log import get_logger
from megatrain_ray.planning.gpu_memory import resolve_run
from megatrain_ray.planning.machine import Machine
from megatrain_ray.planning.memory import check_plan
from megatrain_ray.store.checkpoint import MANIFEST, CheckpointDir, CheckpointInfo
from megatrain_ray.store.export import run_source
from megatrain_ray.store.segments import shard_stages
from megatrain_ray.system.model_sources import fetch_weights, resolve_model_dir

log = get_logger(__name__)


@dataclass(slots=True)
class SessionSource:
    """What RUN_OR_MODEL resolved to: the config the session runs, the checkpoint it restores (None: the weights
    of model.path), and the tokenizer's directory."""

    cfg: Config
    restore: CheckpointInfo | None
    tokenizer_dir: str
    what: str
    """For the log: "run R, checkpoint of step N" or "model M"."""


def _uses_cuda(device: str) -> bool:
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def _session_overrides(device: str, overrides: list[str]) -> list[str]:
    """In this process on one device; no gradient buffers (grad_clip 0: the small slab pool instead of one buffer
    per stage: the session never trains). On the CPU the rollout keeps its own copy of the weights (one memcpy)
    instead of copying every stage for each token. The user's --set come last and win."""
    fixed = ["runtime.mode=local", "runtime.dashboard=false", "parallel.gpus=1", "parallel.nodes=1",
             f"engine.device={device}", "optimizer.grad_clip=0.0", "train.report_to=[]", "rl.rollout=colocated",
             "rl.async_steps=0"]
    if not _uses_cuda(device):
        fixed.append("engine.rollout_weights=resident")
    return [*fixed, *overrides]


def resolve_source(source: str, device: str = "auto", overrides: list[str] | None = None,
                   tokenizer: str | None = None) -> SessionSource:
    """RUN_OR_MODEL (module docstring) as a session's config, checkpoint and tokenizer; every error names what is
    wrong before anything large is allocated."""
    sets, cuda = _session_overrides(device, list(overrides or [])), _uses_cuda(device)
    path = Path(source).expanduser()
    if not path.exists() and (path.is_absolute() or source.startswith((".", "~")) or path.parent.is_dir()
                              and path.parent != Path(".")):
        # a path (its folder is here), not a hub name: the hub is never asked about a typo
        raise ConfigError(f"RUN_OR_MODEL={source!r} does not exist: give a run directory (train.output_dir), a model "
                          "or export directory, a hub name (owner/name) or a .gguf file")
    if path.is_dir() and (path / MANIFEST).is_file():
        raise ConfigError(f"RUN_OR_MODEL={source!r} is a checkpoint directory; give its run directory (the one with "
                          "config.yaml), whose newest complete checkpoint is used")
    if path.is_dir() and (path / "config.yaml").is_file() and not (path / "config.json").is_file():
        return _run_source(path, sets, cuda, tokenizer)
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(f"RUN_OR_MODEL={source!r} is a directory with neither config.yaml (a run directory) nor "
                          "config.json (a model directory or export)")
    model_dir = resolve_model_dir(source, "RUN_OR_MODEL", Path.cwd(), None, ConfigError)
    return _model_source(model_dir, sets, cuda, tokenizer, f"model {model_dir}")


def _model_source(model_dir: str, sets: list[str], cuda: bool, tokenizer: str | None, what: str) -> SessionSource:
    """A model directory under a config of its own: computing in bfloat16 on a GPU, float32 on the CPU."""
    # data: a few synthetic tokens, never read (the RunSpec's training rows: none of its settings for them apply)
    raw = {"model": {"path": model_dir}, "data": {"path": "synthetic", "seq_len": 16, "batch_size": 1},
           "precision": {"compute_dtype": "bfloat16" if cuda else "float32"}}
    cfg = load_config(raw=raw, overrides=sets)
    return SessionSource(cfg, None, _tokenizer_dir(tokenizer, cfg.model.path, "RUN_OR_MODEL"), what)


def _run_source(run_dir: Path, sets: list[str], cuda: bool, tokenizer: str | None) -> SessionSource:
    """A run directory: its newest complete checkpoint under its own config; else the weights it exported."""
    newest = run_source(run_dir)
    if not (newest / MANIFEST).is_file():  # no checkpoint, but train.export_dir
        return _model_source(str(newest), sets, cuda, tokenizer, f"run {run_dir}, its export {newest}")
    cfg = load_config(run_dir / "config.yaml", sets)
    restore = find_checkpoint(str(newest), CheckpointDir(newest.parent), build_layout(cfg.model), cfg)
    assert restore is not None
    source = cfg.model.path or _prepared_tokenizer(cfg)
    if not tokenizer and not source:
        raise ConfigError(f"run {str(run_dir)!r} trained from random weights on data without a tokenizer "
                          f"(data.path={cfg.data.path!r}); give the tokenizer with --tokenizer")
    return SessionSource(cfg, restore, _tokenizer_dir(tokenizer, source, f"run {run_dir}"),
                         f"run {run_dir}, checkpoint of step {restore.step}")


def _prepared_tokenizer(cfg: Config) -> str:
    """The tokenizer `megatrain prepare` recorded in data.path's manifest ("" where there is none)."""
    manifest = Path(cfg.data.path) / "manifest.json"
    if not manifest.is_file():
        return ""
    try:
        return str(json.loads(manifest.read_text()).get("tokenizer") or "")
    except (OSError, ValueError):
        return ""


def _tokenizer_dir(flag: str | None, source: str, where: str) -> str:
    """--tokenizer when given, else the model's (or prepared data's) own, as `megatrain prepare` resolves it."""
    if flag:
        return resolve_tokenizer(flag, None)
    directory = resolve_tokenizer(source, None)
    if not any((Path(directory) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"{where}: {directory} holds no tokenizer (tokenizer.json); give one with --tokenizer")
    return directory


def forward_only(run: RunSpec) -> RunSpec:
    """`run` holding its weights once, in the streaming dtype, as a frozen LoRA base is held (RunSpec.frozen_base),
    with no layer kept GPU-resident with training state (the rollout keeps its own copy on the device)."""
    dtype = run.stream_dtype
    return dataclasses.replace(run, master_dtype=dtype, stream_is_master=True, grad_home="stream", grad_dtype=dtype,
                               moment_dtype=dtype, vocab_in_pieces=False, resident_layers=0, resident_vocab=False,
                               kept_layers=0, speculative_stages=0, frozen_base=True, base_quantization="none")


def check_store_fits(store_bytes: int, machine: Machine, shm_dir: str) -> None:
    """HostMemoryError, before anything is allocated, when the weights do not fit the free shared memory or RAM."""
    free = min(machine.shm_free, machine.host_available)
    if store_bytes > free:
        gib = 2**30
        raise HostMemoryError(f"the model's weights take {store_bytes / gib:.2f} GiB of host memory, more than is free "
                              f"({machine.shm_free / gib:.2f} GiB in {shm_dir}, {machine.host_available / gib:.2f} GiB "
                              "of RAM available); --set precision.compute_dtype=bfloat16 halves float32 weights")


class GenerationSession:
    """The source's weights in a host store and one GPU worker (the trainer's actors, in this process), ready to
    generate. A context manager: the segments go when it closes (and when the process ends, however it ends)."""

    def __init__(self, source: SessionSource):
        cfg = self.cfg = source.cfg
        if cfg.model.template == "generic":
            raise ConfigError("generation runs on the native layer templates; this model uses model.template generic "
                              "(transformers' own modules), which has no KV-cache path here")
        layout = build_layout(cfg.model)
        if cfg.model.path:  # a checkpoint that does not fit the model fails before any allocation
            fetch_weights(cfg.model.path)
            HFDirectory(cfg.model.path).check_against_layout(layout)
        parallel = resolve_parallel(cfg)
        device = "cuda" if parallel.use_gpu else "cpu"
        if source.restore is None and cfg.finetune.method == "full":  # a model: its weights alone
            machine = Machine.detect(cfg.host.shm_dir)
            run = forward_only(resolve_run(cfg, machine.gpu_memory, device, 1, 1))
            check_store_fits(layout.num_params * DTYPE_BYTES[run.master_dtype], machine, cfg.host.shm_dir)
        else:  # refuses a store that does not fit this machine, before allocating it
            # The rollout streams the embedding and LM head (engine/rollout/): the tier keeps its layers only.
            run = dataclasses.replace(resolve_run(cfg, check_plan(cfg).machine.gpu_memory, device, 1, 1),
                                      resident_vocab=False)
        # In this process: each HostShard's guardian removes its segments however the process ends.
        self.cluster = Cluster(cfg, layout, new_run_id())
        try:
            self.cluster.spawn(parallel, run, shard_stages(layout, cfg.host.num_shards), source.restore, None)
        except BaseException:
            self.close()
            raise
        log.info("generating with %s on %s (%s)", source.what, self.cluster.device_name, run.compute_dtype)

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> RolloutResult:
        """One completion per prompt (token ids), by the rollout engine."""
        assert self.cluster.gpu is not None
        return self.cluster.gpu.generate(prompts, sampling).result()

    def close(self) -> None:
        self.cluster.teardown()

    def __enter__(self) -> "GenerationSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
