"""The static facts a decoder layer's templates need (LayerSpec), one per layer, derived from the model config."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.model.latent_attention import LatentSpec, latent_scale
from megatrain_ray.model.linear_attention import LinearAttentionSpec
from megatrain_ray.model.moe import MoeSpec
from megatrain_ray.model.rope import uses_local_rope


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """The static facts a decoder layer template needs (derived from ModelConfig)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    qk_norm: bool
    attention_bias: bool
    sliding_window: int
    """This layer's window (0: full causal attention)."""
    gemma: bool = False
    """Gemma's layer: (1 + weight) norms, post-attention and pre/post-feedforward norms, GeLU-tanh MLP."""
    scale: float = 0.0
    """The factor on q.k (0: head_dim ** -0.5)."""
    softcap: float = 0.0
    """Attention logit soft-cap, cap * tanh(score / cap) (0: off; on: explicit attention, not SDPA)."""
    local_rope: bool = False
    """The layer takes the local RoPE tables (Gemma 3's sliding layers)."""
    lora_scaling: float = 0.0
    """The factor on the LoRA adapters' output where adapters are bound (model/lora.py project)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input (finetune.lora.lora_dropout), applied where lora_seed >= 0."""
    lora_seed: int = -1
    """This layer's dropout seed in this training step (model/lora.dropout_mask draws every mask from it, in the
    forward and again in the recompute); -1: no dropout (evaluation)."""
    lora_inplace: bool = False
    """The adapters' scaled output added into the base product in place, the cast of an input shared by several
    projections made once (model/lora.py project_group): the rollout's decode step, where nothing needs autograd and
    each small kernel counts; the sum is the same up to rounding."""
    moe: MoeSpec | None = None
    """A mixture-of-experts layer's router and experts (model/moe.py); None: a dense MLP."""
    plus_one: bool = False
    """Its RMSNorms scale by (1 + weight) (Gemma; Qwen3.5 and Qwen3-Next: input, post-attention and q/k norms)."""
    output_gate: bool = False
    """q_proj also yields a gate per head and dimension: the attention's output times sigmoid(gate) before o_proj
    (Qwen3.5 and Qwen3-Next's full-attention layers; model/attention.py split_gated_query)."""
    linear: LinearAttentionSpec | None = None
    """A linear-attention (Gated DeltaNet) layer's token mixer in place of attention (model/linear_attention.py)."""
    latent: LatentSpec | None = None
    """DeepSeek-V3's multi-head latent attention in place of GQA (model/latent_attention.py; `scale` is its own)."""

    @classmethod
    def from_config(cls, cfg: ModelConfig, layer: int = 0) -> "LayerSpec":
        """The spec of decoder layer `layer` (from 0): Gemma's layers differ in window and RoPE by layer_types."""
        slides = cfg.layer_slides(layer)
        scale = latent_scale(cfg) if cfg.latent_attention is not None else cfg.attention_scale
        return cls(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.resolved_head_dim, cfg.rms_norm_eps,
                   cfg.qk_norm, cfg.attention_bias, cfg.sliding_window if slides else 0, gemma=cfg.is_gemma,
                   scale=scale, softcap=cfg.attn_logit_softcapping,
                   local_rope=slides and uses_local_rope(cfg),
                   moe=MoeSpec.from_config(cfg) if cfg.layer_is_moe(layer) else None,
                   plus_one=cfg.zero_centered_norms, output_gate=cfg.gated_attention,
                   linear=LinearAttentionSpec.from_config(cfg) if cfg.layer_is_linear(layer) else None,
                   latent=LatentSpec.from_config(cfg) if cfg.latent_attention is not None else None)


def layer_specs(cfg: ModelConfig) -> tuple[LayerSpec, ...]:
    """One spec per decoder layer (equal objects where the layers are alike)."""
    return tuple(LayerSpec.from_config(cfg, i) for i in range(cfg.num_layers))
