"""Model FLOPs per token: 6 per matmul parameter plus attention (forward and backward), whole model and per stage."""

from __future__ import annotations

from megatrain_ray.config.generic_shape import attention_width
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.model.delta_rule import delta_rule_flops_per_token
from megatrain_ray.model.layout import ModelLayout
from megatrain_ray.model.moe import active_fraction
from megatrain_ray.model.sigmoid_router import FIXED_TENSORS


def matmul_params(layout: ModelLayout) -> int:
    """Parameters that take part in a matrix product per token: every matrix but the embedding
    lookup, plus the LM head (counted once more when tied, since the product happens)."""
    n = sum(s.numel for stage in layout.layers for s in stage.slots if s.decay)
    return n + layout.embed.slots[0].numel


def active_params(cfg: ModelConfig, layout: ModelLayout) -> int:
    """Parameters one token uses: all of a dense model; a MoE model's without the experts it is not routed
    to (top-k of num_experts in each MoE layer), embedding and LM head included; no untrained buffer
    (FIXED_TENSORS)."""
    return round(sum(s.numel * active_fraction(cfg, s.name) for stage in layout.stages for s in stage.slots
                     if s.name not in FIXED_TENSORS))


def model_flops_per_token(cfg: ModelConfig, layout: ModelLayout, seq_len: int) -> float:
    """Model FLOPs (no recompute counted) per trained token: 6 N + 6 L T d_attn.

    6 N: forward (2 N) and backward (4 N) of the matrix products with N = matmul_params.
    6 L T d_attn: causal attention, QK^T and AV, 4 T d_attn per token and layer in the forward
    when full, halved for causality (2 T d_attn), times 3 for forward and backward.
    """
    return sum(stage_flops_per_token(cfg, layout, seq_len))


def stage_flops_per_token(cfg: ModelConfig, layout: ModelLayout, seq_len: int) -> list[float]:
    """The same model FLOPs per token split by stage (layout.stages order), summing to
    model_flops_per_token: the embedding lookup 0, each layer 6 x its matrices + 6 T d_attn, the
    head 6 x the LM head's matrix (the embedding's when tied). The speed model times each stage by it. MoE
    layers: their expert matrices count by the share a token uses (top-k of the experts), the router fully.
    Linear-attention layers (Qwen3.5, Qwen3-Next): no T-long attention; their chunked delta rule's products, 3x its
    forward (model/delta_rule.delta_rule_flops_per_token: independent of T); their depthwise convolution is a 3-d
    weight, so it counts as a matrix: 2 FLOPs per weight and token forward, as its products are."""
    d_attn = attention_width(cfg)
    flops = [0.0]
    for i, stage in enumerate(layout.layers):
        matmul = sum(s.numel * active_fraction(cfg, s.name) for s in stage.slots if s.decay)
        if cfg.template != "generic" and cfg.layer_is_linear(i):
            la = cfg.linear_attention
            mixer = 3.0 * delta_rule_flops_per_token(la.num_value_heads, la.key_head_dim, la.value_head_dim)
        else:
            mixer = 6.0 * seq_len * d_attn
        flops.append(6.0 * matmul + mixer)
    flops.append(6.0 * layout.embed.slots[0].numel)
    return flops
