"""The sections of how a step runs on the machine: the CPU optimizer (`optimizer`), the number formats of
each copy of the weights (`precision`) and the layer stream (`engine`). Where the run lives (the host store,
the actors' launch, data parallelism) is runtime_sections.py. Each checks its own values; checks across sections
are with Config (config/sections.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from megatrain_ray.config.fields import DType
from megatrain_ray.config.fields import refuse as _fail
from megatrain_ray.dtypes import DTYPE_RANK


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
    speculative_stages: int = 0
    """With clipping on, how many stages are updated while the backward still runs, before the step's
    gradient norm is known: the first to finish their backward, the LM head's then the last decoder layers'
    (never a GPU-resident layer's nor the embedding's). Each such stage keeps a second set of master weights
    and moments in host RAM (shared memory; with its saved gradients 14 bytes per parameter of those stages
    with fp32 master and moments and bf16 gradients): the update reads the current set and writes the other,
    which becomes current when the step does not clip (clipping coefficient 1: norm + 1e-6 <= grad_clip, as
    torch's clip_grad_norm_); when it clips (or the norm is not finite) the update is redone on the current
    set with the clipping coefficient, so the result is bit for bit that of 0. What it buys: the CPU
    optimizer starts during the backward instead of after it, at the cost of 2 more bytes per parameter of
    DRAM traffic for those stages with the native kernel (the saved gradients; 30 instead of 28, the second
    set streamed out), 14 more with optimizer.kernel torch (docs/speed-model.md). `megatrain plan` counts the
    second sets in host RAM. Needs grad_clip > 0, a streaming copy apart from the master
    (precision.stream_dtype below master_dtype), the moments in RAM (host.moments_tier=ram), full
    fine-tuning and one GPU per node. 0: every update waits for the norm."""

    state: Literal["full", "lean"] = "full"
    """What the optimizer keeps per parameter in host RAM. full: the float32 master weights, both AdamW moments
    (optimizer.moment_dtype) and a separate bfloat16 streaming copy that also receives the gradients (14 bytes
    per parameter with float32 moments). lean: NOT full precision; a bfloat16 master that is itself the
    streaming copy, its rounding error carried in a bfloat16 compensation buffer (Kahan-compensated update, as
    in "Revisiting BFloat16 Training" and the optimi library: master + compensation hold about 16 bits of
    mantissa), and the moments in optimizer.lean_moments: with int8 moments 2 + 2 + 1 + 1 bytes plus a float32
    scale per optimizer.lean_block elements of each moment (6.03 bytes per parameter at block 256, 6.004 at
    2048), with bfloat16 moments 8. The gradients cannot land in the master (it is read by the next forward),
    so they take 2 more bytes per parameter with clipping on (per-stage buffers) or a few layer-sized slabs with
    clipping off, as with precision.stream_dtype=float32. The update (optim/lean_adamw.py, native kernel
    kernels/lean_adamw.cpp) computes in float32 and reads and writes 14 bytes per parameter with int8 moments
    and bf16 gradients (18 with bfloat16 moments), against 28 for full, but is not faster: on the H200 box's 16
    cores the int8 update is compute-bound at 0.83 of the full state's rate, bfloat16 moments at about the same
    rate (`megatrain plan` counts it: planning/machines.yaml). Needs precision.compute_dtype=bfloat16
    (and stream_dtype auto or bfloat16), full fine-tuning, host.moments_tier=ram, moment_dtype float32 (the
    lean moments have their own key), no speculative stages; the GPU-resident tier keeps its own float32 state
    and is not combined with it. The first bfloat16 master is the loaded or initialised weights rounded to
    nearest, the compensation what that rounding dropped. Part of the saved state: a checkpoint resumes only with the same state,
    lean_moments and lean_block."""
    lean_moments: Literal["int8", "bfloat16"] = "int8"
    """With optimizer.state=lean, the format of both moments. int8: 8-bit blockwise quantization as
    bitsandbytes' 8-bit optimizers (its dynamic map, signed for exp_avg, unsigned for exp_avg_sq; one float32
    absmax scale per block, recomputed from the block's float32 moments at every update, each moment rounded
    to the nearest code): 1 byte each. bfloat16: 2 bytes each, rounded stochastically with the hashed noise of
    moment_dtype=bfloat16."""
    lean_block: int = 256
    """With lean_moments=int8, elements per quantization block (256 or 2048, bitsandbytes' blockwise sizes):
    each block's scale costs 4 bytes per moment (0.031 bytes per parameter at 256, 0.004 at 2048); smaller
    blocks follow the moments' local range more closely. Optimizer workers split stages on block boundaries."""

    def __post_init__(self) -> None:
        s = self.SECTION
        if self.lean_block not in (256, 2048):
            _fail(f"{s}.lean_block", self.lean_block, "must be 256 or 2048 (bitsandbytes' blockwise sizes)")
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
        if self.speculative_stages < 0:
            _fail(f"{s}.speculative_stages", self.speculative_stages, "must be >= 0 (0 turns speculation off)")

    def runs_native_kernel(self, master_dtype: str, grad_dtype: str, stream_dtype: str | None) -> bool:
        """Whether an update of these formats runs the native kernel (optim/kernels/adamw.cpp, where it builds),
        else torch's: float32 master, float32 or bfloat16 gradients, a bfloat16 streaming copy or none."""
        return self.kernel != "torch" and master_dtype == "float32" and grad_dtype in ("float32", "bfloat16") and \
            stream_dtype in (None, "bfloat16")


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
    fuses the norms, RoPE and SwiGLU around the matrix products. The loss head's chunks (upcast, softmax and
    logits gradient) and an NF4 base's block decoding compile too wherever this is on, whatever the layers do. The first step of each shape pays the
    compile time (the start-up log says when the layers compile); rows with packed documents or a chunked MLP
    run eagerly. MoE layers compile where their expert products take torch._grouped_mm (bfloat16 on an sm90
    GPU, widths multiples of 8: the shapes then stay fixed whatever the routing), else run eagerly, as gpt-oss's
    do (compiled, its router got no gradient). auto: on when the engine runs on a GPU (on the H200, 7B-width layers at 64k tokens ran 1.24-1.25x
    faster compiled and peaked 5 GiB lower (docs/benchmarks.md); 1.08x at 32k with clipping on, where the
    optimizer bounds the step), off on the CPU; if torch.compile fails there (no Triton or C compiler), auto
    warns once and runs eagerly. true: always, and a compile failure is an error."""
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
    gpu_resident: int | Literal["none", "auto", "all"] = "auto"
    """Decoder layers whose whole training state lives on the compute device (the GPU-resident tier):
    their master weights, both AdamW moments and gradients stay there and they update there (torch's
    fused AdamW, the same math, step order and exact global-norm clipping as the streamed stages), so
    they cost no host->device or device->host copies and no CPU optimizer time. N: the first N layers
    (their updates are the ones the next forward needs first, and their backward comes last, so the CPU
    optimizer finishes the streamed layers' updates meanwhile). none: every stage streams. all: every layer,
    the embedding and the LM head (their update on the device too; not with finetune.objective=grpo, whose
    rollout streams them). auto (the default): as many layers as fit the GPU memory the plan leaves after its
    peak, the reserve and a margin, and the embedding and LM head too once every layer fits and they do, where
    the speed model predicts the tier is faster than streaming (`megatrain plan` prints what it chose and why,
    with the expected tok/s either way); none on the CPU, or where the tier does not apply. About 16 bytes
    of device memory per resident parameter (fp32 master and moments, the gradient and compute copy in
    the streaming format), and no host memory: their segments are never allocated; the GPU worker fills
    them (initialisation, fine-tuning, resume, restart), writes their checkpoint files and serves them to
    export. One GPU worker, moments in RAM at the master's precision (not optimizer.moment_dtype=bfloat16).
    With finetune.method=lora the layers' frozen base alone stays on the device (in the compute dtype: 2 bytes
    per parameter in bf16), copied once from the host store, which keeps it, when the run starts (and on
    resume or restart); those layers cost no H2D copy; auto keeps every layer of a 32B base on a 141 GB H200
    at 8k tokens per step. Every GPU worker holds its own copy. An NF4 base (finetune.lora.base_quantization)
    keeps its resident layers packed (about 0.56 bytes per parameter), dequantized at each use."""

    kept_activations: int | Literal["auto"] = "auto"
    """GPU-resident layers (engine.gpu_resident) whose forward keeps its autograd graph, every activation the
    backward reads, so that their backward recomputes nothing (as a GPU-resident PyTorch run without activation
    checkpointing). The last N of the resident layers (clamped to their number): their graphs are freed first
    in the backward. auto: as many as fit the GPU memory the plan leaves after the resident tier, the reserve
    and a margin (`megatrain plan` prints them); none on the CPU. 0: every layer recomputes its forward in the
    backward. Not with finetune.method=lora or model.template=generic (both recompute)."""

    rollout_weights: Literal["auto", "resident", "streamed"] = "auto"
    """Where the rollout engine (GRPO's generation) reads the weights. resident: a copy of every stage in the
    compute dtype on the device, refreshed from the host's streaming copy before each generation (after the
    optimizer's updates; full fine-tuning), so a decode step copies nothing; it costs the model's size in device
    memory beside the training buffers. streamed: each decode step streams every stage through the layer slots as
    training does (no extra memory; a host-to-device copy of the whole model per generated token). auto: resident on
    a GPU where the copy and the KV cache fit the free memory (with a 10 % margin), else streamed; streamed on the
    CPU. With finetune.method=lora the base is read where training keeps it (engine.gpu_resident) and the adapters
    where they live."""

    rollout_lora: Literal["merged", "adapters"] = "merged"
    """How the rollout applies LoRA adapters when every base layer is GPU-resident and dense (engine.gpu_resident
    all, no NF4 base, no mixture of experts). merged: before each generation every adapter is folded into its
    resident base matrix in place, W + scaling * B A computed in float32 and rounded once to the compute dtype
    (PEFT's merge), so a decode step runs the base's products alone; after the generation the resident layers are
    copied back from the host's base (bit-exact: the copy the engine started from), about the resident base's size
    over PCIe. The merged matrix's rounding makes the rollout's log-probabilities differ from the trainer's by more
    than the adapters computed apart would (finetune.grpo.vllm_importance_sampling_correction weighs the gap);
    training always computes the adapters apart. adapters: each projection adds scaling * B A x beside the base's
    product in every decode step (two small float32 products per projection). Elsewhere (a streamed or NF4 base,
    MoE) the adapters are always computed apart."""

    nf4_kernels: Literal["auto", "triton", "torch"] = "auto"
    """How an NF4 base (finetune.lora.base_quantization=nf4) is read on the device. torch: each use dequantizes the
    whole layer into its weight slot with torch operations (through torch.compile with engine.compile). triton: the
    Triton kernels of quant/nf4_triton.py: a one-pass dequantization into the slot (bit for bit the torch values),
    and in a GRPO rollout's decode step over GPU-resident packed MoE layers the routed experts read in NF4 where they
    lie (a grouped product from the 4-bit codes; only the experts some row is routed to are read) instead of every
    expert dequantized for each generated token. Needs triton and a CUDA device. auto: triton where it runs, else
    torch. At start-up the kernels are tried once on a small tensor against the torch decoding
    (quant/nf4_triton_probe.py): where they do not compile or disagree, auto decodes in torch with a warning and
    triton stops with an error naming the failure. A float64 compute dtype (exact test runs) always decodes in
    torch. Measured on an H200 (one gpt-oss-120b layer, benchmarks/nf4_decode.py): the dequantization at 1,071 G
    values/s against compiled torch's 133, bit for bit equal; a decode step's MoE half at 32 rows 2.5 ms with the routed experts read in NF4, 4.6 ms dequantizing them
    with the kernel, 27.0 ms in torch. The rollout/trainer log-probability gap of a bf16 GRPO step on gpt-oss-120b's
    shape (8 layers, H100) is the kernels' and torch's alike: 0.60 and 0.61 nats a token on average (0.12 with 2
    layers; 5e-6 in float32: bf16 rounding through the random-init layers, not the kernels). Checked in Triton's
    interpreter on the CPU and on CUDA (H200 and H100: tests/unit/test_nf4_triton.py,
    tests/integration/test_rollout_nf4_experts.py)."""

    def __post_init__(self) -> None:
        if isinstance(self.gpu_resident, int) and self.gpu_resident < 0:
            _fail("engine.gpu_resident", self.gpu_resident, "must be none, auto, all or a number of layers >= 0")
        if isinstance(self.kept_activations, int) and self.kept_activations < 0:
            _fail("engine.kept_activations", self.kept_activations, "must be auto or a number of layers >= 0")
        if self.loss_chunk_tokens < 1:
            _fail("engine.loss_chunk_tokens", self.loss_chunk_tokens, "must be >= 1")
        if self.grad_slabs < 2:
            _fail("engine.grad_slabs", self.grad_slabs, "must be >= 2 (one written, one read)")
        if self.mlp_chunk_tokens < 0:
            _fail("engine.mlp_chunk_tokens", self.mlp_chunk_tokens, "must be >= 0 (0 never chunks)")

