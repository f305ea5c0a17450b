"""The plan of a LoRA run (finetune.method=lora): its GPU buffers and the lines `megatrain plan` prints for it.

Host: the store is the base in the streaming dtype (store/segments.plan_segments lays it out; planning/memory
counts it), no moments, no gradient buffers, no optimizer workers. GPU: the two layer buffers and the
embedding's and head's weights as in a full run; no gradient buffers and no vocabulary-sized float32 sums; the
adapters (and modules_to_save) with their gradients and both AdamW moments (16 B per parameter), and with
modules_to_save the float32 sums of their gradients; with engine.gpu_resident the resident layers' base in the
compute dtype (engine/resident_base.py: 2 B/param in bf16; an NF4 base's packed, about 0.56 B/param), and no layer
buffers once every dense layer is resident; the kept layer inputs; the larger of one layer's recompute-backward
(the full run's estimate, which counts no weight gradient, plus what the adapters keep:
model/lora.adapter_activation_bytes) and the loss head, which forms no LM-head gradient.
"""

from __future__ import annotations

from typing import Any

from megatrain_ray.config.latent_attention_section import present_targets
from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.dtypes import DTYPE_BYTES
from megatrain_ray.model.layout import ModelLayout, StageLayout, build_layout
from megatrain_ray.model.lora import ADAPTER_STATE_BYTES, adapter_activation_bytes, adapter_shapes, lora_params
from megatrain_ray.model.moe import active_fraction
from megatrain_ray.quant.nf4_stage import dequantize_workspace_bytes
from megatrain_ray.store.nf4_base import packs_stage, stage_format
from megatrain_ray.units import human_count

LORA_ADAPTERS = "LoRA adapters (fp32, grads, AdamW)"
"""The plan's GPU line of the adapters' state."""


def input_grad_head_bytes(chunk: int, vocab: int, compute_b: int) -> int:
    """The loss head's chunk tensors at their peak when only the input's gradient is formed
    (head.head_loss_and_grads with input_grad_only): the larger of the logsumexp's float32 temporary beside
    the chunk's float32 logits, and those logits turned into their gradient beside its copy in the compute
    dtype. No [vocab, hidden] product."""
    grad_copy = compute_b if compute_b != 4 else 0
    return max(2 * chunk * vocab * 4, chunk * vocab * (4 + grad_copy))


def lora_gpu_bytes(cfg: Config, run: RunSpec, offload: bool, per_slot: int, mlp_tokens: int,
                   layer_backward: int) -> dict[str, int]:
    """planning/memory.gpu_bytes for a LoRA run (the same keys, the adapters' added). `per_slot`: bytes per
    streamed element on the device; `layer_backward`: the full run's estimate of one layer's working set."""
    layout, m = build_layout(cfg.model), cfg.model
    compute_b, tokens = DTYPE_BYTES[run.compute_dtype], run.rank_tokens
    chunk = min(cfg.engine.loss_chunk_tokens, tokens)
    acc_b = max(4, compute_b)
    adapters = adapter_activation_bytes(m, cfg.finetune.lora, tokens, mlp_tokens, compute_b)
    return {
        "weight buffers": weight_buffer_bytes(run, layout, per_slot),
        "gradient buffers": 0,
        # modules_to_save: their gradients summed in float32, as a full run's
        "vocabulary accumulator": m.vocab_size * m.hidden_size * acc_b if cfg.finetune.lora.modules_to_save else 0,
        "kept layer inputs": (2 if offload else m.num_layers) * tokens * m.hidden_size * compute_b,
        "layer backward working set": layer_backward + adapters,
        "loss head working set": input_grad_head_bytes(chunk, m.vocab_size, compute_b)
        + 2 * tokens * m.hidden_size * acc_b,
        "GPU-resident layers": resident_base_bytes(run, layout.resident_stages(run.resident_layers)),
        LORA_ADAPTERS: ADAPTER_STATE_BYTES * lora_params(cfg),
    }


def resident_base_bytes(run: RunSpec, stages: tuple[StageLayout, ...]) -> int:
    """Device bytes of a frozen base's GPU-resident layers (engine/resident_base.py): their weights in the
    compute dtype, or their packed bytes for an NF4 base (engine/packed_stream.py)."""
    dense = DTYPE_BYTES[run.compute_dtype]
    return sum(stage_format(s, run.compute_dtype).nbytes if packs_stage(run, s) else s.numel * dense for s in stages)


def weight_buffer_bytes(run: RunSpec, layout: ModelLayout, per_slot: int) -> int:
    """The weight slots (engine/weights.py): two layers (none when every layer is GPU-resident), the embedding, the
    head at `per_slot` bytes per element. With an NF4 base (engine/packed_stream.py) the two layer slots hold the compute dtype only, beside one staging
    buffer of the largest packed layer and the dequantization's temporaries (quant/nf4_stage.py's chunking),
    counted all the time: they live on the H2D stream while compute runs."""
    vocab = (layout.embed.numel + layout.head.numel) * per_slot
    if run.base_quantization != "nf4":
        return vocab + (2 * layout.max_layer_numel * per_slot if run.resident_layers < len(layout.layers) else 0)
    formats = [stage_format(s, run.compute_dtype) for s in layout.layers]
    staging = max((f.nbytes for f in formats[run.resident_layers:]), default=0)  # resident layers need none
    return (2 * layout.max_layer_numel * DTYPE_BYTES[run.compute_dtype] + vocab + staging
            + max(dequantize_workspace_bytes(f) for f in formats))


def streamed_bytes(run: RunSpec, stage: StageLayout, resident: bool = False) -> int:
    """H2D bytes of one stage per pass of a LoRA run: none for a GPU-resident layer, its packed size for an NF4
    layer, else its streaming copy."""
    if resident:
        return 0
    if packs_stage(run, stage):
        return stage_format(stage, run.compute_dtype).nbytes
    return stage.numel * DTYPE_BYTES[run.stream_dtype]


def lora_tier_lines(plan: Any, params: int) -> list[str]:
    """What `plan` prints in place of the memory tiers for a LoRA run: the store is the frozen base only."""
    cfg, run = plan.cfg, plan.run
    store, adapters = plan.shm_total, lora_params(cfg)
    lora = cfg.finetune.lora
    targets = present_targets(cfg.model, lora.targets(cfg.model.family))
    return [f"LoRA (finetune.method=lora, r {lora.r}, targets {', '.join(targets)}): "
            f"{human_count(adapters)} adapter parameters ({adapters / params:.2%} of the model) "
            f"train on the {'GPU' if plan.on_gpu else 'CPU'}; the host store is the frozen base in "
            f"{base_storage(run)}, "
            f"{store / 2**30:.2f} GiB ({store / params:.1f} B/param), no moments, gradients or CPU optimizer"]


def base_storage(run: RunSpec) -> str:
    if run.base_quantization == "nf4":
        return f"NF4 (decoder layers, double quantization; embedding and LM head in {run.stream_dtype})"
    return run.stream_dtype


ADAPTER_UPDATE_BYTES = 4 * (2 + 2 + 2 + 1)
"""HBM bytes per adapter parameter of its AdamW step (float32): weight, both moments read and written, the
gradient read (torch.optim.AdamW's single-tensor path; a few milliseconds for millions of parameters)."""


def lora_stage_seconds(cfg: Config, stage: Any, forward: float, backward: float, tokens: int,
                       rate: float) -> tuple[float, float]:
    """A stage's forward and backward seconds in a LoRA run, from the full run's (planning/speed.stage_costs).

    Full fine-tuning costs a layer 8 N FLOPs per token and parameter of its matrices (forward 2 N, recompute
    2 N, input and weight gradients 4 N), of which the speed model's rates count 6 N as model FLOPs. With a
    frozen base the backward forms only the input's gradient: 6 N in all, so the backward loses the 2 N of the
    weight gradients (a quarter of the layer's matrix time); attention is unchanged (its inputs' gradients are
    all needed). The adapters add their own 8 r (in + out) per projection (counted as 6, as the rates count).
    The head loses the LM head's gradient (2 of its 6) unless it trains (modules_to_save), the embedding has none."""
    if stage.kind == "head":
        return (forward if "lm_head" in cfg.finetune.lora.modules_to_save else forward * 4 / 6), backward
    if stage.kind != "layer":
        return forward, 0.0
    # A MoE layer's expert matrices by the share a token uses (top-k of the experts), as the full run's FLOPs
    matrices = sum(s.numel * active_fraction(cfg.model, s.name) for s in stage.slots if s.decay)
    weight_grads = 6.0 * matrices * tokens / rate / 4
    lora = cfg.finetune.lora
    adapters = 6.0 * sum(lora.r * (o + i) for o, i in adapter_shapes(cfg.model, lora, stage.index - 1).values()) \
        * tokens / rate
    return forward + adapters / 4, backward - weight_grads + 3 * adapters / 4
