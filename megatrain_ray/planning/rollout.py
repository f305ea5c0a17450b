"""GRPO's rollout in the plan (finetune.objective=grpo): the KV cache of a step's completions and the rollout's
resident weight copy (engine.rollout_weights, engine/rollout/), against the GPU memory the training leaves. The
rollout and the training take turns on the GPU; both stay allocated, so the copy must fit beside the training's
peak, as the engine decides at run time (auto: the copy and the cache within 90 % of the free memory)."""

from __future__ import annotations

from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.dtypes import DTYPE_BYTES, TORCH_DTYPES
from megatrain_ray.model.decode import cache_capacity
from megatrain_ray.model.layer_spec import LayerSpec
from megatrain_ray.model.lora_moe import param_adapters
from megatrain_ray.model.recurrent_decode import RecurrentCache
from megatrain_ray.model.layout import build_layout
from megatrain_ray.model.delta_rule import linear_mixer_saved_bytes
from megatrain_ray.planning.gpu_memory import GPU_RESERVE_BYTES, attention_widths, mlp_piece_width
from megatrain_ray.quant.nf4 import nf4_nbytes
from megatrain_ray.quant.nf4_stage import EXPERT_MATRICES, TRITON_DTYPES, experts_readable_in_nf4
from megatrain_ray.store.nf4_base import packs_stage
from megatrain_ray.units import GiB

MARGIN = 0.10
"""The share of the free GPU memory auto leaves unused (engine/rollout/weights.py's)."""
NF4_DEQUANT_VALUES_PER_S = {True: 132.6e9, False: 90.1e9}
"""NF4 values an H200 dequantizes per second into the compute dtype, compiled (engine.compile) and eager: one
gpt-oss-120b layer of 3.2 B values (benchmarks/nf4_dequant.py, nf4-dequant-gpt-oss-120b-qlora-h200-20261126-050500
.json). A LoRA rollout over an NF4 base dequantizes every layer at each decode step (engine/packed_stream.py)."""
NF4_TRITON_DEQUANT_VALUES_PER_S = 1070.9e9
"""The same layer dequantized by quant/nf4_triton's kernel (engine.nf4_kernels triton or auto on a GPU), bit for bit
the compiled torch decoding's values, on an H200 (nf4-decode-gpt-oss-120b-qlora-h200-20261207-040720.json)."""


def nf4_dequant_rate(cfg: Config, run: RunSpec, on_gpu: bool = True) -> tuple[float, str]:
    """(values per second, which code) a decode step dequantizes an NF4 base's layers at: the Triton kernel where
    engine.nf4_kernels lets it run (a GPU, a compute dtype it writes), else compiled or eager torch. `on_gpu`: the
    plan's machine has a GPU (engine.device auto on a machine without one computes on the CPU)."""
    if on_gpu and cfg.engine.device != "cpu" and cfg.engine.nf4_kernels != "torch" and \
            TORCH_DTYPES[run.compute_dtype] in TRITON_DTYPES:
        return NF4_TRITON_DEQUANT_VALUES_PER_S, "Triton"
    compiled = run.device_compiles
    return NF4_DEQUANT_VALUES_PER_S[compiled], "compiled torch" if compiled else "eager torch"


def prompt_tokens(cfg: Config) -> int:
    """The longest prompt: max_prompt_length, else what data.seq_len leaves after the completion."""
    grpo = cfg.finetune.grpo
    return grpo.max_prompt_length or max(cfg.data.seq_len - grpo.max_completion_length, 1)


def rollout_tokens(cfg: Config) -> int:
    """The KV cache's length: the longest prompt plus max_completion_length, rounded up to whole key chunks
    (model/decode.cache_capacity)."""
    return cache_capacity(prompt_tokens(cfg) + cfg.finetune.grpo.max_completion_length)


PREFILL_SCORE_TENSORS = 2
"""Score-sized tensors [rows, heads, P, P + 1] that the rollout's explicit attention (gpt-oss's sinks: the prefill
always takes model/sinks.explicit_sink_attention; Gemma 2's soft-cap) holds at once without autograd: an operation's
input and its output. On an H100 the prefill of 32 rows x 512 tokens of gpt-oss-120b's shape peaked 1.66 GiB above
the fixed buffers and the cache with 8 layers and with 2, where two such bf16 tensors are 2.0 GiB
(gap-triton-2l-h100-80gb-hbm3-20261207-164951.json, gpt-oss-8l-gap-triton-h100-80gb-hbm3-20261207-164524.json)."""


def prefill_bytes(cfg: Config, run: RunSpec) -> int:
    """The rollout prefill's working set: the largest transient of one layer's forward over every row's prompt at
    once (no autograd, nothing kept between layers): the attention's q, k, v and output (a gated attention's gate
    too: LayerSpec.output_gate, the hybrids' full-attention layers; with an explicit
    attention, PREFILL_SCORE_TENSORS score tensors), a linear-attention layer's chunked delta rule with its
    projections (model/delta_rule.linear_mixer_saved_bytes, the tensors its forward makes), or an MLP piece's gate,
    up and product. The decode steps' own (one token a row) are small beside it."""
    m = cfg.model
    compute_b = DTYPE_BYTES[run.compute_dtype]
    rows, prompt = cfg.data.batch_size // max(run.world, 1), prompt_tokens(cfg)
    tokens = rows * prompt
    q, kv = attention_widths(m)
    # a gated attention's q_proj is twice the query's width: its gate half lives until the output is gated
    gate = q if m.gated_attention else 0
    attention = tokens * (2 * q + 2 * kv + gate) * compute_b
    if m.family == "gpt_oss" or m.attn_logit_softcapping:
        attention += PREFILL_SCORE_TENSORS * rows * m.num_attention_heads * prompt * (prompt + 1) * compute_b
    mixer = 0
    if m.linear_attention is not None:
        la = m.linear_attention
        mixer = int(tokens * linear_mixer_saved_bytes(la.num_value_heads, la.key_head_dim, la.value_head_dim,
                                                      la.conv_width, la.value_width, max(4, compute_b), compute_b))
    mlp_tokens = min(cfg.engine.mlp_chunk_tokens or tokens, tokens)
    mlp = mlp_tokens * (mlp_piece_width(cfg) // 2) * compute_b  # the forward's half of the backward's tensors
    return max(attention, mixer, mlp)


def rollout_bytes(cfg: Config, run: RunSpec) -> dict[str, int]:
    """{'KV cache': ..., 'prefill working set': ..., 'resident weights copy': ...} of one GPU worker (its
    data.batch_size / ranks rows). The KV cache includes the linear-attention layers' recurrent states, which do not
    grow with the tokens; the prefill's working set (prefill_bytes) exists while the prompts go through."""
    m = cfg.model
    compute_b = DTYPE_BYTES[run.compute_dtype]
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    rows = cfg.data.batch_size // max(run.world, 1)
    # a token's cached values a layer: its keys and values, or latent attention's compressed latent and rotated key
    la = m.latent_attention
    width = la.kv_lora_rank + la.qk_rope_head_dim if la is not None else 2 * m.num_key_value_heads * head_dim
    linear = [i for i in range(m.num_layers) if m.layer_is_linear(i)]
    kv = rows * rollout_tokens(cfg) * (m.num_layers - len(linear)) * width * compute_b
    if linear:  # the hybrids' linear-attention layers: a fixed state per row (model/recurrent_decode.py)
        spec = LayerSpec.from_config(m, linear[0])
        kv += rows * len(linear) * RecurrentCache.bytes_per_row(spec, TORCH_DTYPES[run.compute_dtype])
    layout = build_layout(m)
    resident_layers = set(range(1, 1 + run.resident_layers))  # stage indices of the GPU-resident tier's layers
    copy = 0 if run.frozen_base else sum(s.numel for s in layout.stages if s.index not in resident_layers) * compute_b
    return {"KV cache": kv, "prefill working set": prefill_bytes(cfg, run), "resident weights copy": copy}


def rollout_lines(cfg: Config, run: RunSpec, gpu_memory: int | None, training_peak: int) -> list[str]:
    """What `megatrain plan` prints for GRPO: the cache, the copy, and where the rollout will read its weights."""
    if cfg.finetune.objective != "grpo":
        return []
    sizes = rollout_bytes(cfg, run)
    rows = cfg.data.batch_size // max(run.world, 1)
    setting = cfg.engine.rollout_weights
    if cfg.rl.separate:
        return separate_lines(cfg, run, sizes, rows, gpu_memory)
    lines = [f"GRPO rollout ({rows} completions of up to {rollout_tokens(cfg):,} tokens with their prompt; "
             f"engine.rollout_weights={setting}):",
             f"  {'KV cache':<38}{sizes['KV cache'] / GiB:10.2f} GiB",
             f"  {'prefill working set':<38}{sizes['prefill working set'] / GiB:10.2f} GiB  (while the prompts go "
             "through)",
             f"  {'resident weights copy':<38}{sizes['resident weights copy'] / GiB:10.2f} GiB"
             + ("  (LoRA: the base is read where training keeps it)" if run.frozen_base else "")]
    if gpu_memory:
        free = gpu_memory - training_peak - GPU_RESERVE_BYTES
        # the engine's rule (engine/rollout/weights.choose_resident): its 10 % margin covers the prefill's transient
        fits = sizes["KV cache"] + sizes["resident weights copy"] <= free * (1 - MARGIN)
        if run.frozen_base:
            choice = ""  # the base is read where training keeps it: base_reads below
        elif setting == "auto":
            choice = "  -> weights resident (fits beside the training peak)" if fits else \
                "  -> weights streamed (the copy does not fit beside the training peak: every decode step copies " \
                "the model)"
        else:
            choice = f"  -> weights {'resident' if setting == 'resident' else 'streamed'}"
        lines.append(f"  {'free beside the training peak':<38}{free / GiB:10.2f} GiB{choice}")
        if sizes["KV cache"] + sizes["prefill working set"] > free:
            lines.append("  the KV cache and the prefill's working set do not fit beside the training peak: lower "
                         "data.batch_size, finetune.grpo.max_completion_length or max_prompt_length")
    if run.frozen_base:
        lines.append(base_reads(cfg, run, on_gpu=gpu_memory is not None))
    if cfg.engine.device != "cpu":  # a CPU run's plan has no speed section
        lines.append(f"  the expected speed below is the training pass alone: a step's rollout adds up to "
                     f"{cfg.finetune.grpo.max_completion_length:,} decode steps (measured ones: docs/benchmarks.md, "
                     "GRPO)")
    return lines + [""]


def separate_lines(cfg: Config, run: RunSpec, sizes: dict[str, int], rows: int, gpu_memory: int | None) -> list[str]:
    """rl.rollout: separate: the rollout worker's GPU holds the KV cache and the whole model (full fine-tuning; LoRA:
    the base as the trainer's GPU holds it, plus the adapters), nothing of the training's."""
    ahead = ("; rl.async_steps=1: each step's batch is generated while the step before trains, from the weights one "
             "update older" if cfg.rl.async_steps else "; rl.async_steps=0: generation and training take turns")
    lines = [f"GRPO rollout on a GPU of its own (rl.rollout=separate; {rows} completions of up to "
             f"{rollout_tokens(cfg):,} tokens with their prompt{ahead}):",
             f"  {'KV cache':<38}{sizes['KV cache'] / GiB:10.2f} GiB",
             f"  {'prefill working set':<38}{sizes['prefill working set'] / GiB:10.2f} GiB",
             f"  {'the model in ' + run.compute_dtype:<38}{sizes['resident weights copy'] / GiB:10.2f} GiB"
             if not run.frozen_base else "  the frozen base as the trainer's GPU holds it, and the adapters"]
    if gpu_memory and not run.frozen_base:
        need = sizes["KV cache"] + sizes["prefill working set"] + sizes["resident weights copy"]
        free = gpu_memory - GPU_RESERVE_BYTES
        lines.append(f"  {'of the rollout GPU':<38}{free / GiB:10.2f} GiB" + (
            "" if need <= free else "  -> does not fit: lower data.batch_size or finetune.grpo.max_completion_length, "
            "or set rl.rollout: colocated"))
    lines.append("  after each step the rollout worker copies the new weights from the host's streaming copy "
                 "(LoRA: the adapters from the trainer): rollout_sync_s in metrics.jsonl")
    return lines + [""]


def experts_read_in_place(cfg: Config, run: RunSpec, stage, on_gpu: bool = True) -> bool:
    """A decode step reads this packed layer's experts in NF4 (engine/packed_stream.PackedArrival.keeps_experts,
    engine/rollout/passes.py): engine.nf4_kernels triton or auto on a GPU (whose torch brings triton), the layer's
    packed bytes GPU-resident, MoE experts the kernels read, no adapter on them (the engine's own test: an adapter
    under mlp.experts; Qwen3.5-MoE's MLP names reach its shared expert), a compute dtype they take."""
    lora = cfg.finetune.lora
    adapted = any(p.module.startswith("mlp.experts")
                  for p in param_adapters(cfg.model, lora.targets(cfg.model.family), lora.r, stage.index - 1))
    return (on_gpu and cfg.engine.device != "cpu" and cfg.engine.nf4_kernels != "torch"
            and stage.index <= run.resident_layers
            and experts_readable_in_nf4(stage.slots) and not adapted
            and TORCH_DTYPES[run.compute_dtype] in TRITON_DTYPES)


def base_reads(cfg: Config, run: RunSpec, on_gpu: bool = True) -> str:
    """Where a LoRA rollout reads its frozen base at each decode step: the GPU-resident tier's layers where they
    are, the others copied in through the weight buffers; an NF4 base's layers dequantized at each use."""
    layers = cfg.model.num_layers
    resident = min(run.resident_layers, layers)
    where = ("every layer GPU-resident" if resident == layers else
             f"layers 0-{resident - 1} GPU-resident, the other {layers - resident} copied in at each decode step"
             if resident else "every layer copied in at each decode step (engine.gpu_resident keeps none)")
    packed = [s for s in build_layout(cfg.model).stages if packs_stage(run, s)]
    if packed:
        values, (rate, code) = sum(s.numel for s in packed), nf4_dequant_rate(cfg, run, on_gpu)
        in_place = [s for s in packed if experts_read_in_place(cfg, run, s, on_gpu)]
        if not in_place:
            return (f"  base in the rollout: {where}; in NF4, so each decode step dequantizes {values / 1e9:.1f} B "
                    f"values (about {values / rate:.2f} s a step at the {rate / 1e9:.0f} G values/s measured on an "
                    f"H200, {code})")
        experts = [slot for s in in_place for slot in s.slots if slot.name in EXPERT_MATRICES]
        values -= sum(slot.numel for slot in experts)
        m, rows = cfg.model, cfg.data.batch_size // max(run.world, 1)
        # experts a layer that at least one row routes to, if the routing were uniform: 1 - (1 - k/E)^rows of them
        share = 1 - (1 - m.num_experts_per_tok / m.num_experts) ** rows
        code_bytes = sum(nf4_nbytes(slot.numel) for slot in experts)
        return (f"  base in the rollout: {where}; in NF4: each decode step dequantizes {values / 1e9:.1f} B values "
                f"(about {values / rate:.2f} s a step at the {rate / 1e9:.0f} G values/s measured on an H200, {code}) "
                f"and "
                f"reads the routed experts of {len(in_place)} MoE layers in NF4 where they lie: {rows} rows to "
                f"{m.num_experts_per_tok} of {m.num_experts} experts reach {share:.0%} of them if routed uniformly, "
                f"{share * code_bytes / 1e9:.1f} of their {code_bytes / 1e9:.1f} GB a step")
    graph = "; with every layer resident a dense model's decode step is one CUDA graph" if resident == layers else ""
    return f"  base in the rollout: {where}{graph}"
