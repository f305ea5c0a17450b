"""Memory plan of a run: what it needs against what the machine has, before anything is allocated.

`megatrain plan CONFIG` prints it; `Trainer` runs the same check and refuses with the same numbers.

Host side, exact: the shared-memory segments are the ones `plan_segments` lays out (the same
function the HostShards use). Pinned memory is the part of them the GPU worker registers. Process
memory (interpreters, torch, the CUDA context's host side) is an estimate per process. With the
disk tier the moments' files are counted on disk and the optimizers' staging buffers in RAM; the
plan also prints what each other choice of moment format and tier would cost (`tier_lines`).

With data parallelism (parallel.gpus) the host side is one node's (its store is shared by its GPU
workers, each one more process) and the GPU side one GPU's, which holds data.batch_size / gpus rows.
`parallel.gpus: auto` is planned as one GPU per node: the count is known only once Ray is up.

GPU side, from the engine's buffers (exact) plus activations (a count of the tensors alive at the
peak, per token):
- kept layer inputs: one [tokens, hidden] tensor per layer, kept from forward for recompute;
- the backward of one layer (`layer_backward_bytes`, from GPU traces at 64K and 128K tokens): the
  attention half's saved tensors per token, plus the larger of one MLP chunk's tensors and gradients
  and the attention half's gradients per token; with the layer compiled (engine.compile), that times
  COMPILED_WORKING_SET;
- the loss head (`loss_head_bytes`): the larger of its two phases over one chunk of logits (the
  logsumexp, and the LM head's gradient, which forms a [vocab, hidden] product beside the chunk's
  logits), plus the final hidden states and their gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field

from megatrain_ray.config.resolved import RunSpec, resident_tier_refusal
from megatrain_ray.config.sections import Config
from megatrain_ray.dtypes import DTYPE_BYTES
from megatrain_ray.exceptions import HostMemoryError
from megatrain_ray.model.flops import active_params
from megatrain_ray.model.layout import build_layout
from megatrain_ray.model.lora import lora_params
from megatrain_ray.model.moe import expert_numel, moe_token_width
from megatrain_ray.planning.lora import LORA_ADAPTERS, lora_gpu_bytes, lora_tier_lines, resident_base_bytes
from megatrain_ray.planning.machine import Machine
from megatrain_ray.planning.profiles import SpeedProfile
from megatrain_ray.planning.speed import GPU_ADAMW_GBPS, SpeedEstimate, estimate, speed_lines
from megatrain_ray.store.disk_tier import disk_problems, staging_bytes
from megatrain_ray.store.segments import plan_segments, shard_stages
from megatrain_ray.system.topology import detect_topology, plan_placement
from megatrain_ray.units import human_count

GiB = 2**30
PROCESS_BYTES = int(0.35 * GiB)
"""Private memory of a CPU actor or of the driver: the interpreter, torch and Ray (measured ~0.3 GiB)."""
GPU_PROCESS_BYTES = int(1.0 * GiB)
"""Private host memory of the GPU worker: the above plus the CUDA context's host side."""
GPU_RESERVE_BYTES = int(1.5 * GiB)
"""GPU memory outside torch's allocations: CUDA context, cuBLAS workspaces, allocator fragmentation."""
RESIDENT_MARGIN_BYTES = 2 * GiB
"""What engine.gpu_resident=auto leaves free beyond the plan's peak and GPU_RESERVE_BYTES: the activation
terms are estimates (a few per cent off at the measured points), and the resident stages are allocated
before the first step, so an overrun would end the run in its first backward."""


@dataclass
class Plan:
    cfg: Config
    machine: Machine
    host: dict[str, int] = field(default_factory=dict)
    """Shared-memory segments by kind."""
    disk: dict[str, int] = field(default_factory=dict)
    """Disk-tier files by kind (host.moments_tier=disk)."""
    staging: int = 0
    """RAM of the optimizers' disk-tier staging buffers."""
    workers: int = 1
    processes: int = 0
    pinned: int = 0
    gpu: dict[str, int] = field(default_factory=dict)
    offload: bool = False
    """Layer inputs offloaded to pinned host memory (engine.activation_offload, resolved)."""
    offloaded: int = 0
    """Bytes of the pinned host buffers holding the offloaded layer inputs."""
    run: RunSpec | None = None
    """The settings derived from the config on this machine (plan_run resolves them)."""
    problems: list[str] = field(default_factory=list)
    host_fixes: list[str] = field(default_factory=list)
    """When the host store does not fit: each change that shrinks it, with what it saves on its own."""

    @property
    def shm_total(self) -> int:
        return sum(self.host.values())

    @property
    def host_total(self) -> int:
        return self.shm_total + self.staging + self.processes + self.offloaded

    @property
    def gpu_peak(self) -> int:
        """Peak of torch's allocations on the GPU (what torch.cuda.max_memory_allocated reports)."""
        return _peak(self.gpu)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def profile(self) -> SpeedProfile | None:
        """The measured rates the speed model uses: none on the CPU device or for a GPU without them."""
        return self.machine.profile if self.cfg.engine.device != "cpu" else None

    @functools.cached_property
    def expected(self) -> SpeedEstimate | None:
        """The speed model's estimate of this run (offload and GPU-resident layers as resolved), computed once
        for every part of the printout that quotes it."""
        if self.profile is None:
            return None
        return estimate(self.cfg, self.profile, offload=self.offload, resident=self.run.resident_layers)




def gpu_bytes(cfg: Config, run: RunSpec, offload: bool = False) -> dict[str, int]:
    """The engine's device buffers and the activation terms of the module docstring, in bytes (one GPU)."""
    layout = build_layout(cfg.model)
    m = cfg.model
    stream_b = DTYPE_BYTES[run.stream_dtype]
    compute_b = DTYPE_BYTES[run.compute_dtype]
    grad_b = DTYPE_BYTES[run.grad_dtype]
    acc_b = max(4, compute_b)
    per_slot = stream_b + (compute_b if stream_b != compute_b else 0)
    tokens = run.rank_tokens
    h, f, v = m.hidden_size, moe_token_width(m), m.vocab_size
    q = m.num_attention_heads * m.resolved_head_dim
    kv = m.num_key_value_heads * m.resolved_head_dim
    chunk = min(cfg.engine.loss_chunk_tokens, tokens)
    mlp_tokens = min(cfg.engine.mlp_chunk_tokens or tokens, tokens)
    # Chunked MLP backward: float32 sums of its three matrices' gradients.
    mlp_sums = max(3 * h * m.intermediate_size, *(expert_numel(s.slots) for s in layout.layers)) * acc_b \
        if mlp_tokens < tokens else 0
    grad_elems = 2 * layout.max_layer_numel + layout.embed.numel + layout.head.numel
    ranks = run.ranks_per_node
    grad_elems += grad_elems // ranks if ranks > 1 else 0  # each buffer's piece of the sum over the ranks
    backward = int(layer_backward_bytes(tokens, mlp_tokens, h, q, kv, f, compute_b)
                   * (COMPILED_WORKING_SET if run.layers_compiled else 1)) + explicit_attention_bytes(cfg, tokens, compute_b)
    if run.frozen_base:  # LoRA: no gradient leaves the device, the vocabulary-sized sums do not exist
        return lora_gpu_bytes(cfg, run, offload, per_slot, mlp_tokens, backward)
    layer_slots = 2 if run.resident_layers < len(layout.layers) else 0  # none when every layer is resident
    return {
        "weight buffers": (layer_slots * layout.max_layer_numel + layout.embed.numel + layout.head.numel) * per_slot,
        "gradient buffers": grad_elems * grad_b,
        "vocabulary accumulator": v * h * acc_b,
        # Offloaded: the input in use and the next one coming back (or going out in the forward).
        "kept layer inputs": (2 if offload else m.num_layers) * tokens * h * compute_b,
        "layer backward working set": backward + mlp_sums,
        "loss head working set": loss_head_bytes(chunk, v, h, compute_b, acc_b, m.final_logit_softcapping > 0)
        + 2 * tokens * h * acc_b,
        "GPU-resident layers": resident_bytes(run, layout.resident_stages(run.resident_layers)),
    }


def explicit_attention_bytes(cfg: Config, tokens: int, compute_b: int) -> int:
    """Attention through explicit products (gpt-oss's sinks, Gemma 2's soft-cap) keeps [rows, heads, T, T]
    tensors for its backward: the scores, the softmax's input (gpt-oss: with the sink column) and its
    output, in the compute dtype, and a T x T mask (counted, not measured). 0 for SDPA's attention."""
    m = cfg.model
    if m.family != "gpt_oss" and not m.attn_logit_softcapping:
        return 0
    seq = cfg.data.seq_len
    rows = max(1, tokens // seq)
    return 3 * rows * m.num_attention_heads * seq * (seq + 1) * compute_b + seq * seq


def resident_bytes(run: RunSpec, stages) -> int:
    """Device bytes of the GPU-resident tier holding `stages` (engine/resident.py), its scratch included; a frozen
    base's (LoRA): their weights only."""
    if run.frozen_base:
        return resident_base_bytes(run, stages)
    if not stages:
        return 0
    return sum(run.resident_stage_bytes(s.numel) for s in stages) + run.resident_scratch_bytes(
        max(s.numel for s in stages))


def resolve_gpu_resident(cfg: Config, run: RunSpec, gpu_memory: int | None) -> int:
    """engine.gpu_resident=auto: the layers that fit the GPU memory left after the plan's peak (without
    them), GPU_RESERVE_BYTES and RESIDENT_MARGIN_BYTES; none without a GPU or where the tier does not apply."""
    if not gpu_memory or cfg.engine.device == "cpu" or run.device_type != "cuda" \
            or resident_tier_refusal(cfg, run.world):
        return 0
    layout = build_layout(cfg.model)
    base = dataclasses.replace(run, resident_layers=0)
    free = gpu_memory - _peak(gpu_bytes(cfg, base, run.activation_offload)) - GPU_RESERVE_BYTES \
        - RESIDENT_MARGIN_BYTES
    count = 0
    while count < len(layout.layers) and resident_bytes(run, layout.resident_stages(count + 1)) <= free:
        count += 1
    return count


def loss_head_bytes(chunk: int, vocab: int, h: int, compute_b: int, acc_b: int, softcap: bool = False) -> int:
    """The loss head's chunk tensors at their peak (templates.head_loss_and_grads), the larger of two phases:
    - the logsumexp over a chunk's float32 logits, which allocates a temporary of their size;
    - the LM head's gradient: the float32 logits (turned in place into their gradient) stay referenced
      while their copy in the compute dtype feeds the product with the chunk's hidden states, a
      [vocab, hidden] matrix in the compute dtype, upcast to the accumulator's dtype before it is added.
    Read from the measured peaks of the Qwen2.5-14B width (vocab 152064; qwen14b-x2 and largest-x2,
    20261123-20*), where the head, not a layer, leads: the old count (2 x chunk x vocab float32) was
    2.7 GiB under them. With a final logit soft-cap (Gemma 2) the chunk's float32 tanh stays through both
    phases, for its derivative: one more chunk x vocab float32 tensor (counted, not measured)."""
    logsumexp = 2 * chunk * vocab * 4
    grad_copy = compute_b if compute_b != 4 else 0  # .to(compute dtype) is the same tensor in float32
    upcast = acc_b if acc_b != compute_b else 0
    lm_grad = chunk * vocab * (4 + grad_copy) + vocab * h * (compute_b + upcast)
    return max(logsumexp, lm_grad) + (chunk * vocab * 4 if softcap else 0)


def layer_backward_bytes(tokens: int, mlp_tokens: int, h: int, q: int, kv: int, f: int, compute_b: int) -> int:
    """Activation bytes of one layer's recompute and backward at its peak, as traced on the GPU at 64K and
    128K tokens (benchmarks/gpu_memory_peak.py: the live tensors by source line; `(outside megatrain)`
    there is the autograd engine's own thread, i.e. the gradients of the backward in progress).

    The attention half's saved tensors live through the whole layer backward: the norm's output (its
    input is the layer input, counted with the kept inputs, and it keeps one float32 scale per token),
    the rotated q and k and the v at their own widths, the attention output, the half's output and (MLP
    in pieces) its gradient. On top of them, the larger of two phases:
    - an MLP piece (`mlp_tokens`, one chunk): gate, up and the activation, their gradients in progress,
      and four h-wide tensors (the norm's output, the piece's output and the gradients of its input);
    - the attention half's own backward over the whole sequence: the output's gradient and a contiguous
      copy of it, dq with a float32 accumulator, and dk and dv formed at q's width before each group is
      summed (and then at their own), as FlashAttention-2's backward allocates them, though torch picks
      cuDNN's kernel on the H200, which allocates 23 % less (attention-backends-h200-20261123-203436.json).
      It leads past about 220K tokens of an 8B layer; not traced, but its
      60 KiB per token read the measured peaks at 256K and 512K tokens (long-context-*-20261123-18*.json)
      to -0.9 % and -0.8 %.
    No float32 tensor of [tokens, hidden] is kept (templates._LeanRMSNorm): the engine before it also kept
    each norm's float32 upcast and normalised copy, and k and v at q's width.
    """
    half_grad = h if mlp_tokens < tokens else 0  # the half's output gradient, assembled piece by piece
    saved = tokens * ((2 * h + half_grad + 2 * q + 2 * kv) * compute_b + 4)
    mlp_piece = mlp_tokens * (6 * f + 4 * h) * compute_b
    attention_grads = tokens * ((5 * q + 2 * kv) * compute_b + 4 * q)
    return saved + max(mlp_piece, attention_grads)






def offloaded_bytes(cfg: Config, run: RunSpec) -> int:
    """Pinned host memory of one GPU worker for its layer inputs when they are offloaded."""
    return cfg.model.num_layers * run.rank_tokens * cfg.model.hidden_size * DTYPE_BYTES[run.compute_dtype]


def resolve_activation_offload(cfg: Config, run: RunSpec, gpu_memory: int | None) -> bool:
    """engine.activation_offload with `auto` decided: offload when the kept layer inputs would not fit."""
    choice = cfg.engine.activation_offload
    if choice != "auto":
        return bool(choice)
    if not gpu_memory or cfg.engine.device == "cpu":
        return False
    return _peak(gpu_bytes(cfg, run, offload=False)) + GPU_RESERVE_BYTES > gpu_memory


def resolve_run(cfg: Config, gpu_memory: int | None, device_type: str = "cuda", ranks_per_node: int | None = None,
                nodes: int | None = None) -> RunSpec:
    """The run's RunSpec on a machine whose GPU has `gpu_memory` bytes (None: none or unknown): the
    config's derived settings, with engine.activation_offload=auto decided by this plan."""
    run = RunSpec.resolve(cfg, device_type=device_type, ranks_per_node=ranks_per_node, nodes=nodes)
    run = dataclasses.replace(run, activation_offload=resolve_activation_offload(cfg, run, gpu_memory))
    if cfg.engine.gpu_resident == "auto":  # from what the plan leaves once the layer inputs' place is decided
        run = dataclasses.replace(run, resident_layers=resolve_gpu_resident(cfg, run, gpu_memory))
    return run


COMPILED_WORKING_SET = 0.797
"""A compiled layer's recompute and backward working set over the eager one's: 10,782 / 13,535 MiB of
activations at the peak (all but the engine's buffers, the layer input coming back and RoPE's tables)
in two GPU traces of the same step, 8 layers of 7B width at 64K tokens on the H200 (eager and compiled;
docs/benchmarks.md lists the traces): Inductor fuses
the norms' and RoPE's intermediates and the MLP's activation away. Compiled rows have at most
engine.mlp_chunk_tokens tokens (config/resolved.takes_compiled_layer), so no longer sequence depends on it."""


def _peak(g: dict[str, int]) -> int:
    return (g["weight buffers"] + g["gradient buffers"] + g["vocabulary accumulator"] + g["kept layer inputs"]
            + g["GPU-resident layers"] + g.get(LORA_ADAPTERS, 0)
            + max(g["layer backward working set"], g["loss head working set"]))


def store_bytes(cfg: Config, run: RunSpec, workers: int) -> tuple[dict[str, int], dict[str, int], int]:
    """Bytes of the store by kind in RAM (shared memory) and on disk, and the disk tier's staging RAM."""
    layout = build_layout(cfg.model)
    ram: dict[str, int] = {}
    disk: dict[str, int] = {}
    for k, stages in enumerate(shard_stages(layout, cfg.host.num_shards)):
        for spec in plan_segments(layout, cfg.host, cfg.engine.grad_slabs, run, "plan", stages, k):
            where = disk if spec.on_disk else ram
            where[spec.kind] = where.get(spec.kind, 0) + spec.nbytes
    staging = staging_bytes([s.numel for s in layout.stages], layout.max_layer_numel, workers,
                            DTYPE_BYTES[run.moment_dtype]) if cfg.host.moments_tier == "disk" else 0
    return ram, disk, staging


def plan_run(cfg: Config, machine: Machine) -> Plan:
    plan = Plan(cfg, machine)
    plan.run = run = resolve_run(cfg, machine.gpu_memory)
    workers = len(plan_placement(detect_topology(), cfg.optimizer.workers, cfg.host.num_shards,
                                 gpu_ranks=run.ranks_per_node).workers)
    plan.workers = workers = 0 if run.frozen_base else workers  # LoRA: no CPU optimizer workers
    plan.host, plan.disk, plan.staging = store_bytes(cfg, run, workers)
    pinned_kinds = {"stream", "grad", "gradpool", "nf4"} | ({"master"} if run.stream_is_master else set())
    plan.pinned = sum(n for kind, n in plan.host.items() if kind in pinned_kinds)
    plan.processes = (1 + cfg.host.num_shards + workers) * PROCESS_BYTES + run.ranks_per_node * GPU_PROCESS_BYTES
    plan.offload = run.activation_offload
    plan.offloaded = run.ranks_per_node * offloaded_bytes(cfg, run) if plan.offload else 0
    plan.pinned += plan.offloaded  # page-locked like the registered segments
    plan.gpu = gpu_bytes(cfg, run, plan.offload)
    _check(plan)
    return plan


def _check(plan: Plan) -> None:
    cfg, machine = plan.cfg, plan.machine
    g = GiB
    if not machine.described and not os.path.isdir(cfg.host.shm_dir):
        plan.problems.append(f"host.shm_dir={cfg.host.shm_dir!r} is not a directory; point it at a tmpfs such as "
                             "/dev/shm")
    elif plan.shm_total > machine.shm_free:
        plan.problems.append(
            f"the host store needs {plan.shm_total / g:.1f} GiB in host.shm_dir={cfg.host.shm_dir!r}, "
            f"{machine.shm_free / g:.1f} GiB is free there: enlarge it (docker --shm-size, "
            "`mount -o remount,size=...`) or shrink the store (below)")
    if cfg.host.moments_tier == "disk" and not machine.described:
        plan.problems.extend(disk_problems(cfg.host.disk_dir, sum(plan.disk.values())))
    if plan.host_total > machine.host_available:
        plan.problems.append(
            f"host RAM: {plan.host_total / g:.1f} GiB needed, {machine.host_available / g:.1f} GiB available: "
            "shrink the store (below) or use a machine with more RAM")
    if plan.problems and (plan.shm_total > machine.shm_free or plan.host_total > machine.host_available):
        plan.host_fixes = host_fixes(plan)
    if machine.memlock is not None and cfg.engine.device != "cpu" and machine.gpu_memory \
            and plan.pinned > machine.memlock:
        plan.problems.append(f"pinned memory: {plan.pinned / g:.1f} GiB to register, RLIMIT_MEMLOCK is "
                             f"{machine.memlock / g:.1f} GiB: raise it (ulimit -l unlimited)")
    if machine.gpu_memory and cfg.engine.device != "cpu" and plan.gpu_peak + GPU_RESERVE_BYTES > machine.gpu_memory:
        plan.problems.append(
            f"GPU memory: {(plan.gpu_peak + GPU_RESERVE_BYTES) / g:.1f} GiB needed, the GPU has "
            f"{machine.gpu_memory / g:.1f} GiB: lower data.batch_size (now {cfg.data.batch_size}) or data.seq_len "
            f"(now {cfg.data.seq_len})" + ("" if plan.offload else "; the kept layer inputs grow with both and with the "
                                        "depth: engine.activation_offload=true moves them to host RAM"))


def host_fixes(plan: Plan) -> list[str]:
    """The changes that shrink the host store, each with the RAM it saves on its own, computed from the
    store this config would have (so a change that saves nothing here is left out: with clipping on,
    the streaming copy doubles as the gradients' landing place, and streaming the master keeps it)."""
    cfg, g = plan.cfg, GiB
    precision, optimizer, host = cfg.precision, cfg.optimizer, cfg.host
    candidates = []
    if plan.run.frozen_base:  # LoRA: the store is the base in the streaming dtype, nothing else to drop
        return ["train a smaller model, or use a machine with more RAM"]
    if not precision.stream_is_master:
        candidates.append((f"precision.stream_dtype={precision.master_dtype} (stream the master weights: no separate "
                           "streaming copy, twice the PCIe bytes per step)",
                           dataclasses.replace(cfg, precision=dataclasses.replace(
                               precision, stream_dtype=precision.master_dtype))))
    if precision.master_dtype == "float64":
        candidates.append(("precision.master_dtype=float32", dataclasses.replace(
            cfg, precision=dataclasses.replace(precision, master_dtype="float32"))))
    else:
        if optimizer.moment_dtype == "float32":
            candidates.append(("optimizer.moment_dtype=bfloat16 (not full precision)", dataclasses.replace(
                cfg, optimizer=dataclasses.replace(optimizer, moment_dtype="bfloat16"))))
        if host.moments_tier == "ram":
            candidates.append(("host.moments_tier=disk with host.disk_dir on an NVMe disk (slower: see the memory "
                               "tiers above)", dataclasses.replace(cfg, host=dataclasses.replace(
                                   host, moments_tier="disk", disk_dir=host.disk_dir or "DISK_DIR"))))
    ram_now = plan.shm_total + plan.staging
    fixes = []
    for text, other in [(text, without_refused_tier(other)) for text, other in candidates]:
        ram, _, staging = store_bytes(other, RunSpec.resolve(other), plan.workers)
        saved = ram_now - sum(ram.values()) - staging
        if saved >= GiB // 100:
            fixes.append(f"{text}: saves {saved / g:.1f} GiB")
    fixes.append("train a smaller model, or use a machine with more RAM (`megatrain plan --host-memory 1TB` shows "
                 "what a larger one needs)")
    return fixes


GRAD_HOMES = {"stream": "gradients land in the streaming copy", "stage": "gradients in per-stage buffers",
              "pool": "gradients in a pool of layer-sized slabs"}
"""Where the GPU's gradients land on the host (RunSpec.grad_home), as plan prints it."""

_LABELS = {"master": "master weights", "exp_avg": "AdamW first moment", "exp_avg_sq": "AdamW second moment",
           "stream": "streaming copy", "grad": "gradients (per stage)", "gradpool": "gradient slabs",
           "gate": "checkpoint gates", "sync": "data-parallel counters", "nf4": "frozen base layers (NF4)"}


def format_plan(plan: Plan) -> str:
    cfg, machine, run, g = plan.cfg, plan.machine, plan.run, GiB
    layout = build_layout(cfg.model)
    active = f" ({human_count(active_params(cfg.model, layout))} active per token)" if cfg.model.is_moe else ""
    lines = [f"megatrain plan: {cfg.model.family}, {human_count(layout.num_params)} parameters{active}"
             + ("" if cfg.model.path else " (random init: model.path is empty)") + ", "
             f"{cfg.model.num_layers} layers, {cfg.data.tokens_per_step:,} tokens/step "
             f"(batch {cfg.data.batch_size} x {cfg.data.seq_len})",
             f"machine{' (as described)' if machine.described else ''}: {machine.host_memory / g:.1f} GiB RAM "
             f"({machine.host_available / g:.1f} available), {machine.shm_free / g:.1f} GiB free in "
             f"{cfg.host.shm_dir}, GPU "
             + (f"{machine.gpu_name or ''} {machine.gpu_memory / g:.1f} GiB".strip() if machine.gpu_memory
                else "none visible"),
             *([f"data parallel: {run.ranks_per_node} GPU(s) on each of {run.nodes} node(s), "
                f"{cfg.data.batch_size // run.world} rows per GPU: host figures per "
                "node, GPU figures per GPU"] if run.world > 1 else []),
             "", "host (shared memory, per kind):"]
    dtypes = {"master": run.master_dtype, "exp_avg": run.moment_dtype, "exp_avg_sq": run.moment_dtype,
              "stream": run.stream_dtype, "nf4": "nf4"}
    for kind, nbytes in plan.host.items():
        if nbytes >= 2**20:
            label = (("frozen embedding, LM head" if run.base_quantization == "nf4" else "frozen base (streamed)")
                     if run.frozen_base and kind == "master" else _LABELS[kind])
            lines.append(f"  {label:<28}{dtypes.get(kind, run.grad_dtype):>9} {nbytes / g:10.2f} GiB")
    params = layout.num_params
    lines += [f"  {'shared memory total':<38}{plan.shm_total / g:10.2f} GiB  ({plan.shm_total / params:.1f} B/param)"]
    if plan.disk:
        lines.append(f"  {'disk-tier staging (optimizers)':<38}{plan.staging / g:10.2f} GiB")
    lines += [f"  {'processes (driver, actors)':<38}{plan.processes / g:10.2f} GiB  (estimate)",
              *([f"  {'offloaded layer inputs (pinned)':<38}{plan.offloaded / g:10.2f} GiB"] if plan.offload else []),
              f"  {'host RAM total':<38}{plan.host_total / g:10.2f} GiB  ({plan.host_total / params:.1f} B/param)",
              f"  {'of which pinned for the GPU':<38}{plan.pinned / g:10.2f} GiB  ({'the frozen base, streamed as it is' if run.frozen_base else GRAD_HOMES[run.grad_home]})",
              ""]
    if plan.disk:
        lines.append(f"disk (host.disk_dir={cfg.host.disk_dir}):")
        for kind, nbytes in plan.disk.items():
            lines.append(f"  {_LABELS[kind]:<28}{dtypes[kind]:>9} {nbytes / g:10.2f} GiB")
        total = sum(plan.disk.values())
        lines += [f"  {'disk total':<38}{total / g:10.2f} GiB  ({total / 1e9:.1f} GB)", ""]
    lines += [*tier_lines(plan), "",
              f"GPU (torch allocations; layer inputs {'offloaded to host' if plan.offload else 'kept on the GPU'}, "
              f"engine.activation_offload={str(cfg.engine.activation_offload).lower()}):"]
    for name, nbytes in plan.gpu.items():
        lines.append(f"  {name:<38}{nbytes / g:10.2f} GiB")
    fixed = sum(plan.gpu.get(k, 0) for k in ("weight buffers", "gradient buffers", "vocabulary accumulator",
                                             "GPU-resident layers", LORA_ADAPTERS))
    per_token = (plan.gpu_peak - fixed) / run.rank_tokens
    lines += [f"  {'peak allocated':<38}{plan.gpu_peak / g:10.2f} GiB",
              f"  {'+ context, workspaces, fragmentation':<38}{GPU_RESERVE_BYTES / g:10.2f} GiB",
              f"  {'activations per token (one GPU)':<38}{per_token / 1024:10.1f} KiB"
              + (f"  (+ {plan.offloaded / run.ranks_per_node / run.rank_tokens / 1024:.1f} KiB pinned host RAM)"
                 if plan.offload else ""), ""]
    lines += resident_lines(plan)
    lines += speed_lines(cfg, plan.expected, gpu_visible=bool(machine.gpu_memory))
    lines += stop_lines(plan, params)
    lines.append("(what each line means: docs/reading-the-plan.md)")
    if plan.fits:
        lines.append("fits.")
    else:
        lines += ["does NOT fit:", *(f"  - {p}" for p in plan.problems)]
        if plan.host_fixes:
            lines += ["to shrink the host store (each change on its own):",
                      *(f"  - {fix}" for fix in plan.host_fixes)]
    return "\n".join(lines) + "\n"


CHECKPOINT_WRITE_GBPS = 1.0
"""Disk write rate assumed for the stop time: a checkpoint is one sequential write per stage file."""


def stop_lines(plan: Plan, params: int) -> list[str]:
    """How long a stop takes (SIGTERM: finish the step, write a checkpoint), for RAY_JOB_STOP_WAIT_TIME_S."""
    checkpoint = plan.run.checkpoint_bytes(params, lora_params(plan.cfg))
    write_s = checkpoint / (CHECKPOINT_WRITE_GBPS * 1e9)
    step_s = plan.expected.step_seconds if plan.expected else None
    wait_s = int(2 * (write_s + (step_s or 60.0))) + 30
    return [f"stop (SIGTERM, ray job stop): the step ends ({f'~{step_s:.1f} s' if step_s else 'its time: 60 s assumed'}), "
            f"then a "
            f"checkpoint of {checkpoint / 1e9:.1f} GB (~{write_s:.0f} s at {CHECKPOINT_WRITE_GBPS:g} GB/s, an assumption); "
            f"submit with RAY_JOB_STOP_WAIT_TIME_S={wait_s} in the job's runtime env", ""]


def without_refused_tier(cfg: Config) -> Config:
    """An alternative config the plan weighs (bfloat16 moments, the disk tier) without engine.gpu_resident when
    the tier does not apply to it, so that it resolves instead of being refused."""
    if cfg.engine.gpu_resident == "none" or not resident_tier_refusal(cfg, 1):
        return cfg
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, gpu_resident="none"))


def resident_lines(plan: Plan) -> list[str]:
    """The GPU-resident tier (engine.gpu_resident other than none): which layers, their GPU memory, and the
    expected tok/s with and without them (the speed model: no copies and no CPU update for them)."""
    cfg, run, g = plan.cfg, plan.run, GiB
    if cfg.engine.gpu_resident == "none":
        return []
    layout = build_layout(cfg.model)
    stages = layout.resident_stages(run.resident_layers)
    head = f"GPU-resident tier (engine.gpu_resident={cfg.engine.gpu_resident}): "
    if not stages:
        why = resident_tier_refusal(cfg, run.world) or ("no GPU" if not plan.machine.gpu_memory
                                                        or cfg.engine.device == "cpu" else
                                                        "no layer fits the GPU memory the plan leaves")
        return [head + f"none ({why})", ""]
    params = sum(s.numel for s in stages)
    tier = plan.gpu["GPU-resident layers"]
    first, last = stages[0].index - 1, stages[-1].index - 1
    where = ("the frozen base, copied once from the host store (which keeps it), no H2D for them" if run.frozen_base
             else "no host copy: the GPU worker checkpoints and exports them")
    lines = [head + f"layers {first}-{last} ({len(stages)} of {len(layout.layers)}, {human_count(params)} "
             f"params): {tier / g:.2f} GiB of GPU memory ({tier / params:.1f} B/param); {where}"]
    profile = plan.profile
    if profile is not None:
        with_tier = plan.expected.tok_per_s
        without = estimate(cfg, profile, offload=plan.offload, resident=0).tok_per_s
        lines.append(f"  expected {with_tier:,.0f} tok/s with them, {without:,.0f} tok/s with every layer streamed"
                     + ("" if run.frozen_base else f" (their updates on the GPU at "
                                                   f"{GPU_ADAMW_GBPS[profile.gpu.kind]:g} GB/s, an assumption)"))
    return [*lines, ""]


def check_plan(cfg: Config) -> Plan:
    """The check `train` runs before allocating: raises HostMemoryError with the whole plan when it does not fit."""
    plan = plan_run(cfg, Machine.detect(cfg.host.shm_dir))
    if not plan.fits:
        raise HostMemoryError("the run does not fit this machine:\n" + format_plan(plan))
    return plan


def tier_lines(plan: Plan) -> list[str]:
    """The host RAM of the configured memory tier, and what each other choice of moment format and tier
    would change (same shape, precision and workers): what `plan` prints for users to pick from."""
    cfg, g = plan.cfg, GiB
    params = build_layout(cfg.model).num_params
    if plan.run.frozen_base:
        return lora_tier_lines(plan, params)
    configured = (cfg.optimizer.moment_dtype, cfg.host.moments_tier)
    ram_now = plan.shm_total + plan.staging
    disk_now = sum(plan.disk.values())
    lines = [f"memory tiers (optimizer.moment_dtype={configured[0]}, host.moments_tier={configured[1]}): "
             f"store {ram_now / g:.2f} GiB RAM ({ram_now / params:.1f} B/param)"
             + (f" + {disk_now / 1e9:.1f} GB disk ({disk_now / params:.1f} B/param)" if disk_now else "")]
    profile = plan.profile
    if profile is not None:
        lines[0] += f"; expected {plan.expected.tok_per_s:,.0f} tok/s"
    alternatives = []
    for dtype in ("float32", "bfloat16") if cfg.precision.master_dtype == "float32" else ("float32",):
        for tier in ("ram", "disk"):
            if (dtype, tier) == configured:
                continue
            label = "moments" + (f" {dtype}" if dtype != configured[0] else "") \
                + ((" on disk" if tier == "disk" else " in RAM") if tier != configured[1] else "")
            alternatives.append((label, dataclasses.replace(
                cfg, optimizer=dataclasses.replace(cfg.optimizer, moment_dtype=dtype),
                host=dataclasses.replace(cfg.host, moments_tier=tier, disk_dir=cfg.host.disk_dir or "DISK_DIR"))))
    # The streaming copy: its own bf16 copy in RAM, or the fp32 master streamed (RAM for PCIe bytes).
    stream = cfg.precision.master_dtype if not cfg.precision.stream_is_master else cfg.precision.compute_dtype
    if stream != cfg.precision.resolved_stream_dtype:
        alternatives.append((f"streaming copy {'none (master streamed)' if stream == cfg.precision.master_dtype else stream}",
                             dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, stream_dtype=stream))))
    for label, other in [(label, without_refused_tier(other)) for label, other in alternatives]:
        ram, disk, staging = store_bytes(other, RunSpec.resolve(other), plan.workers)
        d_ram, d_disk = sum(ram.values()) + staging - ram_now, sum(disk.values()) - disk_now
        change = f"{d_ram / g:+.2f} GiB RAM" + (f", {d_disk / 1e9:+.1f} GB disk" if d_disk else "")
        speed = f"  {estimate(other, profile, offload=plan.offload).tok_per_s:9,.0f} tok/s" if profile else ""
        lines.append(f"  {label + ':':<40}{change:<34}{(sum(ram.values()) + staging) / params:5.1f} B/param RAM"
                     + speed + ("  (not full precision)" if other.optimizer.moment_dtype == "bfloat16" else ""))
    if profile is not None:
        lines.append(f"  (tok/s: the speed model; AdamW scaled by DRAM bytes per parameter, the disk tier at "
                     f"{profile.host.disk_gbps:g} GB/s read + write, an assumption unless --disk-gbps)")
    return lines
