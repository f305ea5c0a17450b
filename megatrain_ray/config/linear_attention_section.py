"""`model.linear_attention`: the Gated DeltaNet layers of Qwen3-Next and Qwen3.5 (config.json's linear_* keys), and
what these hybrid families fix or cannot run yet, checked where the model section and the whole config are built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from megatrain_ray.config.fields import refuse as _fail

HYBRID_FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")
"""Linear-attention (Gated DeltaNet) layers interleaved with gated full-attention layers by layer_types."""
FUSED_PROJECTIONS = ("qwen3_next",)
"""Qwen3-Next keeps q, k, v and z in one in_proj_qkvz (and b, a in in_proj_ba), grouped by key head; Qwen3.5 has
in_proj_qkv, in_proj_z, in_proj_b and in_proj_a apart."""


@dataclass(kw_only=True, slots=True)
class LinearAttentionConfig:
    """The linear-attention (Gated DeltaNet) layers of the qwen3_5, qwen3_next and qwen3_5_moe families:
    config.json's linear_* keys without their prefix. Each such layer projects the input to q, k and v (a short
    causal depthwise convolution and SiLU over them), a gate z and the per-head b and a; runs the gated delta rule
    (model/delta_rule.py) with beta = sigmoid(b) and log-decay -exp(A_log) * softplus(a + dt_bias); norms its output
    per head, gated by SiLU(z); and projects it back (model/linear_attention.py)."""

    SECTION: ClassVar[str] = "model.linear_attention"
    conv_kernel_dim: int = 4
    """Width of the causal depthwise convolution over q, k and v (linear_conv_kernel_dim)."""
    key_head_dim: int = 128
    """Width of each query/key head (linear_key_head_dim)."""
    value_head_dim: int = 128
    """Width of each value head (linear_value_head_dim)."""
    num_key_heads: int = 16
    """Query/key heads (linear_num_key_heads)."""
    num_value_heads: int = 32
    """Value heads, a multiple of num_key_heads: each query/key head serves num_value_heads / num_key_heads of them
    (linear_num_value_heads)."""

    def __post_init__(self) -> None:
        for name in ("conv_kernel_dim", "key_head_dim", "value_head_dim", "num_key_heads", "num_value_heads"):
            if getattr(self, name) < 1:
                _fail(f"{self.SECTION}.{name}", getattr(self, name), "must be >= 1")
        if self.num_value_heads % self.num_key_heads:
            _fail(f"{self.SECTION}.num_value_heads", self.num_value_heads,
                  f"must be a multiple of num_key_heads={self.num_key_heads}")

    @property
    def key_width(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_width(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_width(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_width + self.value_width


def check_hybrid_model(model: Any) -> None:
    """ModelConfig's checks of the hybrid families (called from its __post_init__): linear_attention set exactly
    for them, layer_types of full_attention and linear_attention, one per layer, and their fixed parts."""
    s = model.SECTION
    hybrid = model.family in HYBRID_FAMILIES
    if (model.linear_attention is not None) != hybrid:
        _fail(f"{s}.linear_attention", model.linear_attention, f"is set for the {', '.join(HYBRID_FAMILIES)} families "
              f"and only for them (family is {model.family})")
    if "linear_attention" in model.layer_types and not hybrid:
        _fail(f"{s}.layer_types", model.layer_types, f"linear_attention layers belong to the "
              f"{', '.join(HYBRID_FAMILIES)} families (family is {model.family})")
    shared = ("qwen3_next", "qwen3_5_moe", "deepseek_v3", "glm4_moe")
    if model.shared_expert_intermediate_size and model.family not in shared:
        _fail(f"{s}.shared_expert_intermediate_size", model.shared_expert_intermediate_size,
              f"is read by the {', '.join(shared)} families only (family is {model.family}); leave it at 0")
    if not hybrid:
        return
    if len(model.layer_types) != model.num_layers or \
            any(t not in ("full_attention", "linear_attention") for t in model.layer_types):
        _fail(f"{s}.layer_types", model.layer_types, f"{model.family} needs one entry per layer ({model.num_layers}), "
              "each full_attention or linear_attention")
    if not model.qk_norm:
        _fail(f"{s}.qk_norm", model.qk_norm, f"{model.family}'s full-attention layers always have q/k norms: set it "
              "true")
    if model.attention_bias:
        _fail(f"{s}.attention_bias", True, f"{model.family}'s templates have no projection biases (as its "
              "checkpoints); set it false")
    if model.sliding_window:
        _fail(f"{s}.sliding_window", model.sliding_window, f"{model.family} attends fully in its attention layers: "
              "set it 0")
    if model.rope_scaling is not None:
        _fail(f"{s}.rope_scaling", model.rope_scaling.rope_type, f"{model.family}'s template takes plain RoPE (as its "
              "checkpoints); set it null")
    if model.num_experts and not model.shared_expert_intermediate_size:
        _fail(f"{s}.shared_expert_intermediate_size", 0, f"{model.family}'s MoE layers have a shared expert: set "
              "its width")


def check_hybrid_run(cfg: Any) -> None:
    """What a run of a hybrid family cannot do yet, refused on load (Config.__post_init__)."""
    if cfg.model.family not in HYBRID_FAMILIES:
        return
    family = cfg.model.family
    if cfg.engine.compile is True:
        _fail("engine.compile", True, f"{family}'s layers run eagerly (the chunked delta rule is not tried through "
              "torch.compile yet); set engine.compile to auto or false")
