"""GPU side of the memory plan: the bytes one GPU's torch allocations reach, and the choices made from them.

From the engine's buffers (exact) plus activations (a count of the tensors alive at the peak, per token):
- kept layer inputs: one [tokens, hidden] tensor per layer, kept from forward for recompute;
- the backward of one layer (`layer_backward_bytes`, from GPU traces at 64K and 128K tokens): the
  attention half's saved tensors per token, plus the larger of one MLP chunk's tensors and gradients
  and the attention half's gradients per token; with the layer compiled (engine.compile), that times
  COMPILED_WORKING_SET;
- the loss head (`loss_head_bytes`): the larger of its two phases over one chunk of logits (the
  logsumexp, and the LM head's gradient, which forms a [vocab, hidden] product beside the chunk's
  logits), plus the final hidden states and their gradient.
- the kept forward graphs of the resident layers that keep them (engine.kept_activations: `kept_layer_bytes`).
The choices: engine.activation_offload=auto, engine.gpu_resident=auto and engine.kept_activations=auto
(`resolve_run`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatrain_ray.config.resolved import RunSpec, kept_layer_count, resident_tier_refusal
from megatrain_ray.config.sections import Config
from megatrain_ray.dtypes import DTYPE_BYTES
from megatrain_ray.model.delta_rule import linear_mixer_saved_bytes
from megatrain_ray.model.latent_attention import latent_widths
from megatrain_ray.model.layout import build_layout
from megatrain_ray.model.moe import expert_numel, moe_pair_width
from megatrain_ray.planning.lora import LORA_ADAPTERS, lora_gpu_bytes, resident_base_bytes
from megatrain_ray.planning.vision import VISION_KEYS
from megatrain_ray.units import GiB

GPU_RESERVE_BYTES = int(1.5 * GiB)
"""GPU memory outside torch's allocations: CUDA context, cuBLAS workspaces, allocator fragmentation."""


RESIDENT_MARGIN_BYTES = 2 * GiB
"""What engine.gpu_resident=auto leaves free beyond the plan's peak and GPU_RESERVE_BYTES: the activation
terms are estimates (a few per cent off at the measured points), and the resident stages are allocated
before the first step, so an overrun would end the run in its first backward."""


COMPILED_WORKING_SET = 0.797
"""A compiled layer's recompute and backward working set over the eager one's: 10,782 / 13,535 MiB of
activations at the peak (all but the engine's buffers, the layer input coming back and RoPE's tables)
in two GPU traces of the same step, 8 layers of 7B width at 64K tokens on the H200 (eager and compiled;
docs/benchmarks.md lists the traces): Inductor fuses
the norms' and RoPE's intermediates and the MLP's activation away. Compiled rows have at most
engine.mlp_chunk_tokens tokens (config/resolved.takes_compiled_layer), so no longer sequence depends on it."""


MOE_PAIR_TENSORS = 3.19
"""Tensors of a MoE MLP's token-expert pairs (model/moe.moe_pair_width per token, compute dtype) that its
recompute and backward hold at the layer's peak, where a dense MLP holds 6 of [tokens, intermediate]: measured
on one Qwen3-30B-A3B-width layer at 64K tokens on the H200, 12.53 GiB above the layer's inputs run eagerly
(benchmarks/layer_profile.py, layer-profile-qwen3-30b-a3b-h200-20261126-034932.json), less the attention half's
saved tensors and the four hidden-wide ones per token that layer_backward_bytes counts, and less the experts'
weight gradients as autograd returns them (gpu_bytes counts those apart). The same layer compiled peaked at
9.38 GiB."""


MOE_PAIR_TENSORS_GPT_OSS = 5.04
"""The same for gpt-oss, whose clamped SwiGLU over interleaved gate and up columns keeps more expert-wide
tensors: fitted on one point, gpt-oss-20b width (9 layers, fused attention with sinks) at 32 x 4096 tokens on the
H200, whose layer backward peaked at 44.69 GiB (moe-gpt-oss-20b-9l-fused-sinks-h200-20261126-042409 and -043311;
MOE_PAIR_TENSORS planned 38.1). At 4 x 4096 tokens the loss head's working set is the larger (21.40 GiB measured,
21.59 planned)."""


def mlp_piece_width(cfg: Config) -> int:
    """Elements per token of an MLP piece's tensors at the layer backward's peak (besides four hidden-wide ones):
    the larger of a dense layer's 6 x intermediate and a MoE layer's MOE_PAIR_TENSORS (gpt-oss:
    MOE_PAIR_TENSORS_GPT_OSS) x its pairs' width."""
    m = cfg.model
    dense = 6 * m.intermediate_size if any(not m.layer_is_moe(i) for i in range(m.num_layers)) else 0
    pairs = MOE_PAIR_TENSORS_GPT_OSS if m.family == "gpt_oss" else MOE_PAIR_TENSORS
    return max(dense, int(pairs * moe_pair_width(m)))


def attention_widths(m) -> tuple[int, int]:
    """(query width, key/value width) per token of a layer's attention: heads x head_dim; DeepSeek-V3's latent
    attention forms every head's keys and values from its latent (model/latent_attention.latent_widths)."""
    if m.latent_attention is not None:
        return latent_widths(m)
    return m.num_attention_heads * m.resolved_head_dim, m.num_key_value_heads * m.resolved_head_dim


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
    h, mlp_width, v = m.hidden_size, mlp_piece_width(cfg), m.vocab_size
    q, kv = attention_widths(m)
    chunk = min(cfg.engine.loss_chunk_tokens, tokens)
    mlp_tokens = min(cfg.engine.mlp_chunk_tokens or tokens, tokens)
    experts = max(expert_numel(s.slots) for s in layout.layers)  # a MoE layer's fused expert tensors (0: dense)
    # Chunked MLP backward: float32 sums of its three matrices' gradients.
    mlp_sums = max(3 * h * m.intermediate_size, experts) * acc_b if mlp_tokens < tokens else 0
    grad_elems = 2 * layout.max_layer_numel + layout.embed.numel + layout.head.numel
    ranks = run.ranks_per_node
    grad_elems += grad_elems // ranks if ranks > 1 else 0  # each buffer's piece of the sum over the ranks
    backward = int(layer_backward_bytes(tokens, mlp_tokens, h, q, kv, mlp_width, compute_b)
                   * (COMPILED_WORKING_SET if run.layers_compiled else 1)) + explicit_attention_bytes(cfg, tokens, compute_b)
    if m.linear_attention is not None:  # the hybrids' linear layers (never compiled) may lead
        backward = max(backward, linear_layer_backward_bytes(cfg, tokens, mlp_tokens, mlp_width, compute_b))
    if run.frozen_base:  # LoRA: no gradient leaves the device, the vocabulary-sized sums do not exist
        return lora_gpu_bytes(cfg, run, offload, per_slot, mlp_tokens, backward)
    layer_slots = 2 if run.resident_layers < len(layout.layers) else 0  # none when every layer is resident
    return {
        "weight buffers": (layer_slots * layout.max_layer_numel + layout.embed.numel + layout.head.numel) * per_slot,
        "gradient buffers": grad_elems * grad_b,
        "vocabulary accumulator": v * h * acc_b,
        # Offloaded: the input in use and the next one coming back (or going out in the forward).
        "kept layer inputs": (2 if offload else m.num_layers) * tokens * h * compute_b,
        # + the experts' gradients as autograd returns them, before they are written to the gradient buffer: for
        # a dense layer small beside its activations, for fused experts (hundreds of millions of values) not
        "layer backward working set": backward + mlp_sums + experts * compute_b,
        "loss head working set": loss_head_bytes(chunk, v, h, compute_b, acc_b, m.final_logit_softcapping > 0)
        + 2 * tokens * h * acc_b,
        "GPU-resident layers": resident_bytes(run, layout.resident_stages(run.resident_layers, run.resident_vocab)),
        "kept layer graphs": run.kept_layers * kept_layer_bytes(cfg, tokens, compute_b, run.layers_compiled),
    }


def peak_allocated(g: dict[str, int]) -> int:
    """Peak of torch's allocations on the GPU from the terms of gpu_bytes: the fixed buffers and kept inputs,
    plus the larger of the layer backward and the loss head."""
    return (g["weight buffers"] + g["gradient buffers"] + g["vocabulary accumulator"] + g["kept layer inputs"]
            + g["GPU-resident layers"] + g.get(LORA_ADAPTERS, 0) + g.get("kept layer graphs", 0)
            + sum(g.get(k, 0) for k in VISION_KEYS)
            + max(g["layer backward working set"], g["loss head working set"]))


SINK_ATTENTION_SCORES = 4.07
"""Score-sized tensors ([rows, heads, T, T + 1] in the compute dtype) that the explicit attention with sinks
(model/sinks.explicit_sink_attention) holds at its peak, its backward's (the forward's saved softmax among them): measured on the H200 at 4 x 64 heads x
4096 tokens, full and sliding (benchmarks/sink_attention_memory.py, sink-attention-memory-h200-20261126-020151.json:
forward 3.05, backward 4.07)."""
SOFTCAP_ATTENTION_SCORES = 3
"""The same for Gemma 2's soft-capped attention: the scores, the softmax's input and its output (counted, not
measured)."""


def explicit_attention_bytes(cfg: Config, tokens: int, compute_b: int) -> int:
    """Attention through explicit products (Gemma 2's soft-cap; gpt-oss's sinks in float32 on a GPU) holds
    [rows, heads, T, T] tensors: SINK_ATTENTION_SCORES or SOFTCAP_ATTENTION_SCORES of them, and a T x T mask.
    0 for fused attention (SDPA's, and the fused attention with sinks, whose extra tensors are [tokens, q]
    sized like the rest of the attention half's)."""
    m = cfg.model
    if not m.explicit_attention(cfg.precision.compute_dtype):
        return 0
    seq = cfg.data.seq_len
    rows = max(1, tokens // seq)
    scores = SINK_ATTENTION_SCORES if m.family == "gpt_oss" else SOFTCAP_ATTENTION_SCORES
    return int(scores * rows * m.num_attention_heads * seq * (seq + 1) * compute_b) + seq * seq


def resident_bytes(run: RunSpec, stages) -> int:
    """Device bytes of the GPU-resident tier holding `stages` (engine/resident.py), its scratch included; a frozen
    base's (LoRA): their weights only."""
    if run.frozen_base:
        return resident_base_bytes(run, stages)
    if not stages:
        return 0
    return sum(run.resident_stage_bytes(s.numel) for s in stages) + run.resident_scratch_bytes(
        max(s.numel for s in stages))


def resolve_gpu_resident(cfg: Config, run: RunSpec, gpu_memory: int | None) -> tuple[int, bool]:
    """engine.gpu_resident=auto: the layers that fit the GPU memory left after the plan's peak (without
    them), GPU_RESERVE_BYTES and RESIDENT_MARGIN_BYTES, and whether the embedding and LM head fit beside every
    layer (not for GRPO, whose rollout streams them, nor LoRA's frozen base); none without a GPU or where the tier
    does not apply."""
    if not gpu_memory or cfg.engine.device == "cpu" or run.device_type != "cuda" \
            or resident_tier_refusal(cfg, run.world):
        return 0, False
    layout = build_layout(cfg.model)
    base = dataclasses.replace(run, resident_layers=0, resident_vocab=False, kept_layers=0)
    free = gpu_memory - peak_allocated(gpu_bytes(cfg, base, run.activation_offload)) - GPU_RESERVE_BYTES \
        - RESIDENT_MARGIN_BYTES
    count = 0
    while count < len(layout.layers) and resident_bytes(run, layout.resident_stages(count + 1)) <= free:
        count += 1
    vocab = (count == len(layout.layers) and not run.frozen_base and cfg.finetune.objective != "grpo"
             and resident_bytes(run, layout.resident_stages(count, True)) <= free)
    return count, vocab


COMPILED_KEPT_GRAPH = 0.8
"""A compiled layer's kept forward graph over the eager one's count (kept_layer_bytes): Inductor's partition saves
less than eager autograd. Read from the GPU peaks of the 3.5B bench with every stage resident on the H200
(bench-3.5b-tier-kept-h200-20261202-034230.json): the eager count planned 134.0 and 129.2 GiB where 117.0 and
110.7 were measured at 32k (15 graphs kept) and 64k tokens (6 kept), 0.76 and 0.67 of the eager count per graph;
0.8 keeps the plan on the safe side of both (+2.5 % and +6.5 %)."""


def kept_layer_bytes(cfg: Config, tokens: int, compute_b: int, compiled: bool = False) -> int:
    """What one kept layer's forward graph holds for its backward (engine/kept_graphs.py), counted through
    autograd's saved-tensor hooks on the engine's eager layer (tests/unit/test_kept_activations.py): per token
    4 hidden-wide, 2 query-wide and 2 key/value-wide tensors, 4 of the MLP's intermediate width (gate, up, the
    activation, its product), in the compute dtype, and 8 bytes plus 4 per attention head of float32 (the norms'
    scales, attention's log-sum-exp). A MoE layer's MLP counts MOE_PAIR_TENSORS of its pairs' width instead
    (the tensors its backward holds, an upper bound of what its forward saves). The layer's input is counted with
    the kept inputs too. A compiled layer (`compiled`) keeps COMPILED_KEPT_GRAPH of it."""
    m = cfg.model
    q, kv = attention_widths(m)
    dense = 4 * m.intermediate_size if any(not m.layer_is_moe(i) for i in range(m.num_layers)) else 0
    mlp = max(dense, int(MOE_PAIR_TENSORS * moe_pair_width(m)))
    eager = tokens * ((4 * m.hidden_size + 2 * q + 2 * kv + mlp) * compute_b + 8 + 4 * m.num_attention_heads)
    return int(eager * COMPILED_KEPT_GRAPH) if compiled else eager


def resolve_kept_layers(cfg: Config, run: RunSpec, gpu_memory: int | None) -> int:
    """engine.kept_activations=auto: the resident layers whose forward graphs fit the GPU memory left after the
    plan's peak (resident tier included), GPU_RESERVE_BYTES and RESIDENT_MARGIN_BYTES; none without a GPU, for
    LoRA or the generic template."""
    if not gpu_memory or not run.resident_layers or run.frozen_base or cfg.model.template == "generic":
        return 0
    free = gpu_memory - peak_allocated(gpu_bytes(cfg, dataclasses.replace(run, kept_layers=0),
                                                 run.activation_offload)) - GPU_RESERVE_BYTES - RESIDENT_MARGIN_BYTES
    per_layer = kept_layer_bytes(cfg, run.rank_tokens, DTYPE_BYTES[run.compute_dtype], run.layers_compiled)
    return max(0, min(run.resident_layers, int(free // per_layer)))


def loss_head_bytes(chunk: int, vocab: int, h: int, compute_b: int, acc_b: int, softcap: bool = False) -> int:
    """The loss head's chunk tensors at their peak (head.head_loss_and_grads), the larger of two phases:
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


def layer_backward_bytes(tokens: int, mlp_tokens: int, h: int, q: int, kv: int, mlp_width: int,
                         compute_b: int) -> int:
    """Activation bytes of one layer's recompute and backward at its peak, as traced on the GPU at 64K and
    128K tokens (benchmarks/gpu_memory_peak.py: the live tensors by source line; `(outside megatrain)`
    there is the autograd engine's own thread, i.e. the gradients of the backward in progress).

    The attention half's saved tensors live through the whole layer backward: the norm's output (its
    input is the layer input, counted with the kept inputs, and it keeps one float32 scale per token),
    the rotated q and k and the v at their own widths, the attention output, the half's output and (MLP
    in pieces) its gradient. On top of them, the larger of two phases:
    - an MLP piece (`mlp_tokens`, one chunk): `mlp_width` elements per token (mlp_piece_width: a dense
      MLP's gate, up and activation and their gradients in progress, 6 x intermediate), and four h-wide
      tensors (the norm's output, the piece's output and the gradients of its input);
    - the attention half's own backward over the whole sequence: the output's gradient and a contiguous
      copy of it, dq with a float32 accumulator, and dk and dv formed at q's width before each group is
      summed (and then at their own), as FlashAttention-2's backward allocates them, though torch picks
      cuDNN's kernel on the H200, which allocates 23 % less (attention-backends-h200-20261123-203436.json).
      It leads past about 220K tokens of an 8B layer; not traced, but its
      60 KiB per token read the measured peaks at 256K and 512K tokens (long-context-*-20261123-18*.json)
      to -0.9 % and -0.8 %.
    No float32 tensor of [tokens, hidden] is kept (norms._LeanRMSNorm): the engine before it also kept
    each norm's float32 upcast and normalised copy, and k and v at q's width.
    """
    half_grad = h if mlp_tokens < tokens else 0  # the half's output gradient, assembled piece by piece
    saved = tokens * ((2 * h + half_grad + 2 * q + 2 * kv) * compute_b + 4)
    mlp_piece = mlp_tokens * (mlp_width + 4 * h) * compute_b
    attention_grads = tokens * ((5 * q + 2 * kv) * compute_b + 4 * q)
    return saved + max(mlp_piece, attention_grads)


def linear_layer_backward_bytes(cfg: Config, tokens: int, mlp_tokens: int, mlp_width: int, compute_b: int) -> int:
    """A linear-attention layer's recompute and backward at its peak (Qwen3.5, Qwen3-Next): the norm's output and
    the half's output (and its gradient with the MLP in pieces) as layer_backward_bytes counts them, the mixer's
    saved tensors (model/delta_rule.linear_mixer_saved_bytes: counted from autograd's saved tensors on the CPU), and
    an MLP piece on top. The mixer's own backward frees its saved tensors as it goes: on the H200 in bfloat16 a layer
    of Qwen3-Next-80B's widths (dense MLP of 5120) peaked at 3.50 and 13.93 GiB above its inputs at 8K and 32K
    tokens, this 1.14x of it (benchmarks/linear_layer_memory.py, linear-layer-memory-h200-20261201-220714.json)."""
    m = cfg.model
    la = m.linear_attention
    work_b = max(4, compute_b)
    mixer = linear_mixer_saved_bytes(la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_width,
                                     la.value_width, work_b, compute_b)
    h = m.hidden_size
    half_grad = h if mlp_tokens < tokens else 0
    saved = tokens * ((2 * h + half_grad) * compute_b + 4 + mixer)
    return int(saved + mlp_tokens * (mlp_width + 4 * h) * compute_b)


def resolve_activation_offload(cfg: Config, run: RunSpec, gpu_memory: int | None) -> bool:
    """engine.activation_offload with `auto` decided: offload when the kept layer inputs would not fit."""
    choice = cfg.engine.activation_offload
    if choice != "auto":
        return bool(choice)
    if not gpu_memory or cfg.engine.device == "cpu":
        return False
    return peak_allocated(gpu_bytes(cfg, run, offload=False)) + GPU_RESERVE_BYTES > gpu_memory


def resolve_run(cfg: Config, gpu_memory: int | None, device_type: str = "cuda", ranks_per_node: int | None = None,
                nodes: int | None = None, profile: Any = None) -> RunSpec:
    """The run's RunSpec on a machine whose GPU has `gpu_memory` bytes (None: none or unknown): the
    config's derived settings, with engine.activation_offload, engine.gpu_resident and engine.kept_activations
    auto decided by this plan; `profile` (the machine's SpeedProfile, None: none known): gpu_resident=auto keeps
    no stage on the GPU where the speed model predicts the streamed run faster."""
    run = RunSpec.resolve(cfg, device_type=device_type, ranks_per_node=ranks_per_node, nodes=nodes)
    run = dataclasses.replace(run, activation_offload=resolve_activation_offload(cfg, run, gpu_memory))
    if cfg.engine.gpu_resident == "auto":  # from what the plan leaves once the layer inputs' place is decided
        count, vocab = resolve_gpu_resident(cfg, run, gpu_memory)
        run = dataclasses.replace(run, resident_layers=count, resident_vocab=vocab)
    if cfg.engine.kept_activations == "auto":  # from what the plan leaves once the tier is decided
        run = dataclasses.replace(run, kept_layers=resolve_kept_layers(cfg, run, gpu_memory))
    else:  # a count, of the resident layers auto chose
        run = dataclasses.replace(run, kept_layers=kept_layer_count(cfg, run.resident_layers))
    if cfg.engine.gpu_resident == "auto" and run.resident_layers and profile is not None:
        from megatrain_ray.planning.speed import estimate  # lazy: planning.speed imports this module's terms

        if estimate(cfg, profile, offload=run.activation_offload, run=run).tok_per_s \
                < estimate(cfg, profile, offload=run.activation_offload, run=streamed(run)).tok_per_s:
            run = streamed(run)  # the speed model predicts streaming faster (planning/plan_text.resident_lines)
    return run


def streamed(run: RunSpec) -> RunSpec:
    """`run` without the GPU-resident tier."""
    return dataclasses.replace(run, resident_layers=0, resident_vocab=False, kept_layers=0)
