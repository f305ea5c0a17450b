"""Configuration: one dataclass per concern, each checking its own values.

A run is described by a YAML file whose sections map one to one onto `Config`'s fields
(config/load.py reads it). Impossible values raise `ConfigError` naming the dotted key
(`optimizer.lr`), the value received and what to do, before anything is allocated. Settings
derived from several sections and the machine live in config/resolved.py (RunSpec).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from megatrain_ray.config.fields import DType
from megatrain_ray.config.fields import refuse as _fail

# The sections that live in modules of their own, named here too: every section is importable from this one.
from megatrain_ray.config.finetune_section import (  # noqa: F401
    LORA_PROJECTIONS,
    PHI3_LORA_PROJECTIONS,
    DPOConfig,
    FinetuneConfig,
    LoraConfig,
)
from megatrain_ray.config.model_section import ModelConfig, RopeScalingConfig  # noqa: F401
from megatrain_ray.dtypes import DTYPE_RANK


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
class OptimizerConfig:
    """AdamW on the CPU optimizer workers (decoupled weight decay, as torch.optim.AdamW)."""

    SECTION: ClassVar[str] = "optimizer"
    lr: float = 3e-4
    """Peak learning rate (after warmup)."""
    beta1: float = 0.9
    """Decay of the first moment (AdamW's beta1)."""
    beta2: float = 0.95
    """Decay of the second moment (AdamW's beta2)."""
    eps: float = 1e-8
    """Added to the square root of the second moment."""
    weight_decay: float = 0.1
    """Applied to matrices only (embeddings, projections, LM head); never to norms or biases."""
    grad_clip: float = 1.0
    """Exact global gradient-norm clipping threshold; 0 turns clipping off. With clipping on, updates
    wait for the whole backward and then run in layer order, overlapped with the next forward."""
    workers: int | Literal["auto"] = "auto"
    """Number of OptimizerWorker actors; each owns a slice of every layer and pins itself to its own
    cores. auto: min(2, usable cores // 2) on every NUMA node (CPU AdamW is bound by DRAM bandwidth,
    so more workers on one socket add no throughput; see megatrain_ray/system/topology.py). The choice and
    the core map are logged at start."""
    kernel: Literal["auto", "native", "torch"] = "auto"
    """native: a one-pass C++ AdamW (compiled on first use, cached in ~/.cache/megatrain_ray) that reads
    the bf16 or fp32 gradient and writes the bf16 streaming copy in the same pass; torch: torch's fused
    AdamW in cache-sized chunks; auto: native where it applies (fp32 master) and builds, else torch."""
    chunk_elems: int = 1 << 18
    """Elements per chunk of the torch kernel path: the cast of the gradient and the write of the
    streaming copy happen while the chunk is still in cache."""
    moment_dtype: Literal["float32", "bfloat16"] = "float32"
    """Format of both AdamW moments (exp_avg, exp_avg_sq) in host memory. float32: full precision (the
    moments have the master weights' format, float64 with a float64 master). bfloat16: NOT full
    precision; saves 4 bytes per parameter of RAM (or disk) and of DRAM traffic per step. The update
    still computes in float32 (moments widened in a cache-sized chunk) and rounds the new moments back
    to bfloat16 stochastically, with noise that is a fixed hash of the step, stage and element (so runs
    and resumes stay bit-reproducible): plain rounding to nearest would lose every change smaller than
    half a bfloat16 step (0.2 to 0.4 %), e.g. the decay of exp_avg_sq with beta2 = 0.999. The master weights
    stay full precision. Part of the saved state: a checkpoint resumes only with the same moment_dtype."""

    def __post_init__(self) -> None:
        s = self.SECTION
        if not self.lr > 0:
            _fail(f"{s}.lr", self.lr, "must be > 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                _fail(f"{s}.{name}", getattr(self, name), "must be in [0, 1)")
        if not self.eps > 0:
            _fail(f"{s}.eps", self.eps, "must be > 0")
        if self.weight_decay < 0:
            _fail(f"{s}.weight_decay", self.weight_decay, "must be >= 0")
        if self.grad_clip < 0:
            _fail(f"{s}.grad_clip", self.grad_clip, "must be >= 0 (0 turns clipping off)")
        if self.workers != "auto" and self.workers < 1:
            _fail(f"{s}.workers", self.workers, "must be >= 1, or auto to pick from the cores and NUMA nodes")
        if self.chunk_elems < 1024:
            _fail(f"{s}.chunk_elems", self.chunk_elems, "must be >= 1024")


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


@dataclass(kw_only=True, slots=True)
class PrecisionConfig:
    """Number formats of each copy of the weights."""

    SECTION: ClassVar[str] = "precision"
    master_dtype: Literal["float32", "float64"] = "float32"
    """Master weights and both AdamW moments in host RAM. float64 exists for exact CPU tests."""
    compute_dtype: DType = "bfloat16"
    """Format of the layer math on the device."""
    stream_dtype: DType | Literal["auto"] = "auto"
    """Format of the host copy streamed to the device each step. auto = compute_dtype. When it equals
    master_dtype the master weights are streamed directly (no extra copy in RAM, twice the PCIe bytes
    for bf16 compute); otherwise the optimizer writes the copy in the same pass as the update and the
    layer's gradients land in it after backward."""
    grad_dtype: DType | Literal["auto"] = "auto"
    """Format of the gradients copied to the host when the master weights are streamed directly (with
    a separate streaming copy they land in it, in its format). auto = compute_dtype: the device
    computes them in that format, so a wider one only keeps the float32 sums of the embedding and LM
    head (and of a chunked MLP) unrounded, at twice the PCIe, DRAM and RAM bytes."""

    def __post_init__(self) -> None:
        if DTYPE_RANK[self.compute_dtype] > DTYPE_RANK[self.master_dtype]:
            _fail("precision.compute_dtype", self.compute_dtype,
                  f"is more precise than precision.master_dtype={self.master_dtype}; raise master_dtype")
        if self.resolved_stream_dtype not in DTYPE_RANK:
            _fail("precision.stream_dtype", self.stream_dtype, f"must be one of {sorted(DTYPE_RANK)} or 'auto'")
        if DTYPE_RANK[self.resolved_stream_dtype] > DTYPE_RANK[self.master_dtype]:
            _fail("precision.stream_dtype", self.stream_dtype,
                  f"is more precise than precision.master_dtype={self.master_dtype}")
        if DTYPE_RANK[self.compute_dtype] > DTYPE_RANK[self.resolved_stream_dtype]:
            _fail("precision.compute_dtype", self.compute_dtype,
                  f"is more precise than the streamed copy ({self.resolved_stream_dtype}); it would only "
                  "compute on rounded weights. Set precision.stream_dtype to match")
        if self.resolved_grad_dtype not in DTYPE_RANK:
            _fail("precision.grad_dtype", self.grad_dtype, f"must be one of {sorted(DTYPE_RANK)} or 'auto'")
        if DTYPE_RANK[self.resolved_grad_dtype] > DTYPE_RANK[self.master_dtype]:
            _fail("precision.grad_dtype", self.grad_dtype,
                  f"is more precise than precision.master_dtype={self.master_dtype}")

    @property
    def resolved_stream_dtype(self) -> str:
        return self.compute_dtype if self.stream_dtype == "auto" else self.stream_dtype

    @property
    def resolved_grad_dtype(self) -> str:
        return self.compute_dtype if self.grad_dtype == "auto" else self.grad_dtype

    @property
    def stream_is_master(self) -> bool:
        """The streaming copy is the master buffer itself (same format)."""
        return self.resolved_stream_dtype == self.master_dtype


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """The layer stream on the compute worker."""

    SECTION: ClassVar[str] = "engine"
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto: the GPU when CUDA is available, else the CPU (same code path, copies are plain memcpy)."""
    loss_chunk_tokens: int = 4096
    """Tokens per chunk of the LM-head loss: logits never exceed loss_chunk_tokens x vocab_size."""
    mlp_chunk_tokens: int = 65536
    """Tokens per chunk of each layer's MLP (forward and recomputed backward) when a step has more:
    the [tokens, intermediate_size] tensors then exist for one chunk at a time (long sequences).
    0 never chunks."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile the decoder-layer template (its forward, and the recomputed forward and backward):
    fuses the norms, RoPE and SwiGLU around the matrix products. The first step of each shape pays the
    compile time (the start-up log says when the layers compile); rows with packed documents, MoE models
    (their expert groups change size with the routing) or a chunked MLP run eagerly. auto: on when the engine runs on a GPU (on the H200, 7B-width layers at 64k
    tokens ran 1.24-1.25x faster compiled and peaked 5 GiB lower (docs/benchmarks.md); 1.08x at 32k with
    clipping on, where
    the optimizer bounds the step), off on the CPU; if torch.compile fails there (no Triton or C
    compiler), auto warns once and runs eagerly. true: always, and a compile failure is an error."""
    activation_offload: bool | Literal["auto"] = "auto"
    """Where the layer inputs kept for the backward live. false: on the GPU (one [tokens, hidden]
    tensor per layer); true: copied to pinned host memory during the forward and back during the
    backward on the copy streams, so GPU memory no longer grows with depth; auto: true when
    `megatrain plan` finds that keeping them on the GPU does not fit its memory."""
    grad_slabs: int = 4
    """Pinned host slabs for gradients in flight when the master weights are streamed directly and
    clipping is off (otherwise gradients land in the streaming copy or per-layer buffers), each the
    size of one layer's gradients."""
    vocab_grad_pieces: bool = True
    """With those slabs: the embedding's and LM head's gradients, when larger than a layer's (a large
    vocabulary), go through the layer slabs in layer-sized pieces, each copied and updated on its own
    (true), or through one slab of their own (false: on Llama-3-8B 1.05 GB more RAM, 0.13 bytes per
    parameter, and the layers never wait for their updates). Pieces need one GPU per node and the
    moments in RAM; otherwise the slab of their own is used."""
    update_trace: str | None = None
    """A directory (a relative path is from where megatrain runs): every GPU worker appends a JSON-lines
    timeline of each stage's update hand-offs there
    (gradients queued and on the host, update ordered, run and published, waits for it;
    megatrain_ray/engine/telemetry.py), and `python benchmarks/update_trace.py DIR` says which link keeps
    the optimizer from overlapping the backward. A few hundred bytes per stage and step."""
    poison_buffers: bool = False
    """Fill device and gradient buffers with NaN before first use, so that a read of memory nothing
    wrote fails loudly (tests)."""
    gpu_resident: int | Literal["none", "auto"] = "none"
    """Decoder layers whose whole training state lives on the compute device (the GPU-resident tier):
    their master weights, both AdamW moments and gradients stay there and they update there (torch's
    fused AdamW, the same math, step order and exact global-norm clipping as the streamed stages), so
    they cost no host->device or device->host copies and no CPU optimizer time. N: the first N layers
    (their updates are the ones the next forward needs first, and their backward comes last, so the CPU
    optimizer finishes the streamed layers' updates meanwhile). none: every stage streams. auto: as many
    layers as fit the GPU memory the plan leaves after its peak, the reserve and a margin (`megatrain plan`
    prints them and the expected tok/s); none on the CPU, or where the tier does not apply. About 16 bytes
    of device memory per resident parameter (fp32 master and moments, the gradient and compute copy in
    the streaming format), and no host memory: their segments are never allocated; the GPU worker fills
    them (initialisation, fine-tuning, resume, restart), writes their checkpoint files and serves them to
    export. One GPU worker, moments in RAM at the master's precision (not optimizer.moment_dtype=bfloat16).
    With finetune.method=lora the layers' frozen base alone stays on the device (in the compute dtype: 2 bytes
    per parameter in bf16), copied once from the host store, which keeps it, when the run starts (and on
    resume or restart); those layers cost no H2D copy; auto keeps every layer of a 32B base on a 141 GB H200
    at 8k tokens per step. Every GPU worker holds its own copy. An NF4 base (finetune.lora.base_quantization)
    keeps its resident layers packed (about 0.56 bytes per parameter), dequantized at each use."""

    def __post_init__(self) -> None:
        if isinstance(self.gpu_resident, int) and self.gpu_resident < 0:
            _fail("engine.gpu_resident", self.gpu_resident, "must be none, auto or a number of layers >= 0")
        if self.loss_chunk_tokens < 1:
            _fail("engine.loss_chunk_tokens", self.loss_chunk_tokens, "must be >= 1")
        if self.grad_slabs < 2:
            _fail("engine.grad_slabs", self.grad_slabs, "must be >= 2 (one written, one read)")
        if self.mlp_chunk_tokens < 0:
            _fail("engine.mlp_chunk_tokens", self.mlp_chunk_tokens, "must be >= 0 (0 never chunks)")


@dataclass(kw_only=True, slots=True)
class HostConfig:
    """The host store: shared-memory segments owned by HostShard actors."""

    SECTION: ClassVar[str] = "host"
    num_shards: int = 1
    """HostShard actors; each owns a contiguous range of stages (one per NUMA node is the intent)."""
    shm_dir: str = "/dev/shm"
    """Directory of the shared-memory segments; must be a tmpfs large enough for the whole store."""
    moments_tier: Literal["ram", "disk"] = "ram"
    """Where the AdamW moments live. ram: shared-memory segments like the rest of the store. disk: files
    in host.disk_dir: 8 bytes of RAM per parameter fewer (4 with optimizer.moment_dtype=bfloat16). Each
    optimizer worker reads its share of a stage's moments ahead of the update, in update order, and
    writes them back behind it, through two buffers of its share of one decoder layer (the embedding and
    head go in layer-sized pieces): the staging RAM `megatrain plan` shows. Every step then reads and writes all
    moments on the disk (16 bytes per parameter, 8 with optimizer.moment_dtype=bfloat16): the disk's
    bandwidth bounds the optimizer (benchmarks/moment_tiers.py measures it). Results are bit-identical
    to ram; checkpoints move freely between the tiers. Master weights and the streaming copy stay in RAM."""
    disk_dir: str = ""
    """Directory for host.moments_tier=disk, on a fast local disk (NVMe), not a tmpfs or network share.
    Checked before allocating: it must exist, be writable and have room for both moments (the files are
    allocated in full at start and removed at the end)."""

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            _fail("host.num_shards", self.num_shards, "must be >= 1")
        if self.moments_tier == "disk" and not self.disk_dir:
            _fail("host.disk_dir", self.disk_dir, "is required with host.moments_tier=disk: a directory on a fast "
                  "local disk")


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    """How the actors are launched."""

    SECTION: ClassVar[str] = "runtime"
    mode: Literal["ray", "local"] = "ray"
    """ray: actors in a Ray cluster; local: the same classes in this process (debugging, fast tests)."""
    address: str = ""
    """Ray cluster to attach to. Empty: RAY_ADDRESS if set, else a cluster started with `ray start`
    on this machine, else a private local Ray bound to 127.0.0.1."""
    dashboard: bool = True
    """Start the Ray dashboard with a private local Ray (127.0.0.1 only)."""
    allow_unauthenticated: bool = False
    """Let a private local Ray start without token auth when RAY_AUTH_MODE says so (anyone who can reach
    its ports could then run code as you). By default that is refused before Ray starts."""
    object_store_mb: int = 512
    """Object store of a private local Ray. Bulk tensors never go through it, so it stays small."""
    heartbeat_interval_s: float = 5.0
    """Seconds between health checks of the actors (Ray mode); 0 turns them off."""
    heartbeat_timeout_s: float = 30.0
    """An actor that has not answered a heartbeat for this long is logged as slow, by name."""

    def __post_init__(self) -> None:
        if self.object_store_mb < 64:
            _fail("runtime.object_store_mb", self.object_store_mb, "must be >= 64")
        if self.heartbeat_interval_s < 0:
            _fail("runtime.heartbeat_interval_s", self.heartbeat_interval_s, "must be >= 0 (0 turns checks off)")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            _fail("runtime.heartbeat_timeout_s", self.heartbeat_timeout_s,
                  f"must exceed runtime.heartbeat_interval_s={self.heartbeat_interval_s}")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Data parallelism: one GPUWorker (rank) per GPU, each streaming its slice of the batch through the
    same layers of its node's host store; gradients are summed over the ranks layer by layer before the
    node's optimizer workers see them (megatrain_ray/engine/parallel.py). The global batch, the loss,
    the schedule and the checkpoints are the same whatever the number of GPUs."""

    SECTION: ClassVar[str] = "parallel"
    gpus: int | Literal["auto"] = 1
    """GPU workers (ranks) of the run, over all nodes; each takes data.batch_size / gpus sequences of every
    step, so data.batch_size must be divisible by it. auto: every GPU the Ray cluster offers on the nodes
    used (one rank per node on a CPU-only cluster). More than 1 needs runtime.mode=ray."""
    nodes: int = 1
    """Ray nodes the ranks are spread over, gpus / nodes on each. Every node keeps its own host store and
    optimizer workers (weights are stored once per node, never per GPU); each node's first rank orders the
    updates of its copy and the copies are compared by a checksum every step. Checkpoints are written by
    the first node and read by all: on several machines checkpoint.dir must be on a shared filesystem."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend of the gradient sums: auto = nccl on GPUs, gloo on the CPU."""
    gather_weights: bool = False
    """Several GPUs on a node: each copies only its 1/gpus-per-node piece of a stage's weights from host memory
    and the GPUs of the node exchange the pieces (an all-gather over NVLink), instead of each copying the
    whole stage. Host DRAM then serves every weight byte once per pass whatever the number of GPUs (the
    CPU optimizer shares that bandwidth), and each GPU's PCIe link carries 1/gpus of the weights. Training
    steps only: evaluation runs on the first GPU and copies whole stages. On two H200s (3.5B, 32k tokens per
    GPU): it helped while the GPU workers' threads ran on AdamW's cores (clipping on, 1.89x one GPU against
    1.83x, data-parallel-x2-h200-20261123-221348); with each GPU worker on cores of its own it gains nothing
    (1.98x and 1.99x against 2.00x and 1.99x, data-parallel-x2-h200-20261123-232913 and -233902). Off by
    default; measure it on more GPUs per node."""
    timeout_s: float = 600.0
    """Seconds a rank waits for the process group to form, for a collective, or for another rank's
    gradients or its node's update of a stage, before it stops the run with an error."""

    def __post_init__(self) -> None:
        s = self.SECTION
        if self.gpus != "auto" and self.gpus < 1:
            _fail(f"{s}.gpus", self.gpus, "must be >= 1, or auto for every GPU Ray offers")
        if self.nodes < 1:
            _fail(f"{s}.nodes", self.nodes, "must be >= 1")
        if self.gpus != "auto" and self.gpus % self.nodes:
            _fail(f"{s}.gpus", self.gpus, f"must be a multiple of parallel.nodes={self.nodes} (the same number "
                  "of GPUs on every node)")
        if not self.timeout_s > 0:
            _fail(f"{s}.timeout_s", self.timeout_s, "must be > 0")


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
    """Format of the exported weights. auto: the dtype model.path's config.json declares, else float32."""
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
        check_parallel(self)
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
    if p.backend == "nccl" and cfg.engine.device == "cpu":
        _fail("parallel.backend", p.backend, "needs GPUs, but engine.device=cpu; use gloo or auto")
    if p.backend == "gloo" and cfg.engine.device == "cuda":
        _fail("parallel.backend", p.backend, "sums CPU tensors (tests); with engine.device=cuda use nccl or auto")


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
    """finetune.objective=dpo against the data and parallel sections (`ranks`: parallel.gpus once resolved)."""
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
