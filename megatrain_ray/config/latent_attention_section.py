"""`model.latent_attention` and `model.sigmoid_router`: DeepSeek-V3's multi-head latent attention (config.json's
q_lora_rank, kv_lora_rank, qk_*_head_dim, v_head_dim, rope_interleave) and the sigmoid router with group-limited
top-k (n_group, topk_group, routed_scaling_factor) of DeepSeek-V3 and GLM-4.5 MoE, and what these families fix or
cannot run yet, checked where the model section and the whole config are built."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from megatrain_ray.config.fields import refuse as _fail
from megatrain_ray.config.lora_targets import LATENT_PROJECTIONS

LATENT_FAMILIES = ("deepseek_v3",)
"""Families whose attention is multi-head latent attention (model/latent_attention.py)."""
SIGMOID_ROUTER_FAMILIES = ("deepseek_v3", "glm4_moe")
"""Families whose MoE layers route by sigmoid scores with a correction bias (model/sigmoid_router.py), beside shared
experts, after dense first layers."""


@dataclass(kw_only=True, slots=True)
class LatentAttentionConfig:
    """Multi-head latent attention (deepseek_v3): the query from a low-rank projection (q_a_proj, an RMSNorm, q_b_proj;
    or one q_proj when q_lora_rank is 0), keys and values from one compressed latent per token (kv_a_proj_with_mqa:
    kv_lora_rank values, normed, expanded per head by kv_b_proj, plus qk_rope_head_dim values of one key part that
    RoPE rotates and every head shares). Each head's query and key are qk_nope_head_dim unrotated dimensions then
    qk_rope_head_dim rotated ones; its value has v_head_dim."""

    SECTION: ClassVar[str] = "model.latent_attention"
    q_lora_rank: int = 1536
    """Rank of the query's low-rank projection (q_a_proj, q_a_layernorm, q_b_proj); 0: one q_proj (config.json's
    null, DeepSeek-V2-Lite's)."""
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent (kv_a_layernorm, kv_b_proj's input)."""
    qk_nope_head_dim: int = 128
    """Dimensions of each head's query and key that take no RoPE."""
    qk_rope_head_dim: int = 64
    """Dimensions of each head's query and key that RoPE rotates (the key's shared by every head)."""
    v_head_dim: int = 128
    """Width of each head's value (and of o_proj's input per head)."""
    rope_interleave: bool = True
    """RoPE over interleaved pairs (x0, x1), (x2, x3), ... of the rotated dimensions, as DeepSeek lays them out (its
    checkpoints: true); false: over halves, as Llama."""

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                _fail(f"{self.SECTION}.{name}", getattr(self, name), "must be >= 1")
        if self.q_lora_rank < 0:
            _fail(f"{self.SECTION}.q_lora_rank", self.q_lora_rank, "must be >= 0 (0: one q_proj)")
        if self.qk_rope_head_dim % 2:
            _fail(f"{self.SECTION}.qk_rope_head_dim", self.qk_rope_head_dim, "must be even for RoPE")

    @property
    def qk_head_dim(self) -> int:
        """Width of each head's query and key: the unrotated and the rotated dimensions."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(kw_only=True, slots=True)
class SigmoidRouterConfig:
    """The router of deepseek_v3's and glm4_moe's MoE layers: sigmoid scores of the router's logits (in float32); the experts chosen
    by the scores plus mlp.gate.e_score_correction_bias (a per-expert bias of the checkpoint, never trained), among
    the topk_group best of n_group expert groups (a group's score: its two best); the chosen experts weighted by
    their scores without the bias (renormalised when model.norm_topk_prob), times routed_scaling_factor."""

    SECTION: ClassVar[str] = "model.sigmoid_router"
    n_group: int = 8
    """Groups of experts (consecutive, equal); num_experts must be a multiple of it, each group of 2 or more."""
    topk_group: int = 4
    """Groups a token may choose its experts from."""
    routed_scaling_factor: float = 2.5
    """Factor on the routed experts' weights."""

    def __post_init__(self) -> None:
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            _fail(f"{self.SECTION}.topk_group", (self.n_group, self.topk_group),
                  "needs n_group >= 1 and 1 <= topk_group <= n_group")
        if not math.isfinite(self.routed_scaling_factor) or self.routed_scaling_factor <= 0:
            _fail(f"{self.SECTION}.routed_scaling_factor", self.routed_scaling_factor, "must be a finite number > 0")


def latent_projection_shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each projection of a latent-attention layer by PEFT's short name, in the
    layer's order: q_proj alone where q_lora_rank is 0, else q_a_proj and q_b_proj (LoRA's adapter shapes)."""
    la, h, heads = cfg.latent_attention, cfg.hidden_size, cfg.num_attention_heads
    query = {"q_a_proj": (la.q_lora_rank, h), "q_b_proj": (heads * la.qk_head_dim, la.q_lora_rank)} \
        if la.q_lora_rank else {"q_proj": (heads * la.qk_head_dim, h)}
    return {**query, "kv_a_proj_with_mqa": (la.kv_lora_rank + la.qk_rope_head_dim, h),
            "kv_b_proj": (heads * (la.qk_nope_head_dim + la.v_head_dim), la.kv_lora_rank),
            "o_proj": (h, heads * la.v_head_dim)}


def present_targets(model: Any, targets: tuple[str, ...]) -> tuple[str, ...]:
    """LoRA's resolved targets less the query projections a latent-attention model has not (all-linear names q_proj
    and q_a_proj / q_b_proj alike; a model has one or the other)."""
    if model.latent_attention is None:
        return targets
    have = latent_projection_shapes(model)
    return tuple(t for t in targets if t not in LATENT_PROJECTIONS or t in have)


def check_latent_model(model: Any) -> None:
    """ModelConfig's checks of deepseek_v3 and glm4_moe (called from its __post_init__): their sections set exactly
    for them, the shapes they must agree with, and the parts transformers fixes."""
    s = model.SECTION
    latent = model.family in LATENT_FAMILIES
    if (model.latent_attention is not None) != latent:
        _fail(f"{s}.latent_attention", model.latent_attention, f"is set for the {', '.join(LATENT_FAMILIES)} family "
              f"and only for it (family is {model.family})")
    sigmoid = model.family in SIGMOID_ROUTER_FAMILIES
    if (model.sigmoid_router is not None) != sigmoid:
        _fail(f"{s}.sigmoid_router", model.sigmoid_router, f"is set for the {', '.join(SIGMOID_ROUTER_FAMILIES)} "
              f"families and only for them (family is {model.family})")
    if latent:
        _check_latent_shape(model)
    if sigmoid:
        _check_sigmoid_moe(model)


def _check_latent_shape(model: Any) -> None:
    s, la = model.SECTION, model.latent_attention
    if model.resolved_head_dim != la.qk_rope_head_dim:
        _fail(f"{s}.head_dim", model.resolved_head_dim, f"is the rotated width of {model.family}'s heads, as "
              f"transformers sets it: set it to latent_attention.qk_rope_head_dim={la.qk_rope_head_dim}")
    if model.num_key_value_heads != model.num_attention_heads:
        _fail(f"{s}.num_key_value_heads", model.num_key_value_heads, f"{model.family}'s latent attention forms keys "
              f"and values for every head: set it to num_attention_heads={model.num_attention_heads}")
    for key, off in (("qk_norm", False), ("attention_bias", False), ("sliding_window", 0),
                     ("partial_rotary_factor", 1.0)):
        if getattr(model, key) != off:
            _fail(f"{s}.{key}", getattr(model, key), f"is not part of {model.family}'s attention: set it to {off}")


def _check_sigmoid_moe(model: Any) -> None:
    s, router = model.SECTION, model.sigmoid_router
    if not model.shared_expert_intermediate_size:
        _fail(f"{s}.shared_expert_intermediate_size", 0, f"{model.family}'s MoE layers have shared experts: set "
              "their width (n_shared_experts x moe_intermediate_size)")
    if model.num_experts % router.n_group or model.num_experts // router.n_group < 2:
        _fail(f"{s}.sigmoid_router.n_group", router.n_group, f"must divide num_experts={model.num_experts} into "
              "groups of 2 or more experts")
    if model.num_experts_per_tok > router.topk_group * model.num_experts // router.n_group:
        _fail(f"{s}.num_experts_per_tok", model.num_experts_per_tok, f"exceeds the experts of the "
              f"sigmoid_router.topk_group={router.topk_group} groups a token may choose from")
    if model.output_router_logits:
        _fail(f"{s}.output_router_logits", True, f"transformers computes no load-balancing loss for "
              f"{model.family} (nor DeepSeek's sequence-wise loss): set it false")
    if model.decoder_sparse_step != 1:
        _fail(f"{s}.decoder_sparse_step", model.decoder_sparse_step, f"{model.family}'s dense layers are the "
              "first ones (mlp_only_layers 0 .. first_k_dense_replace - 1): set it 1")
    if list(model.mlp_only_layers) != list(range(len(model.mlp_only_layers))):
        _fail(f"{s}.mlp_only_layers", model.mlp_only_layers, f"{model.family}'s dense layers are its first ones "
              "(first_k_dense_replace): list 0, 1, ... k - 1")
    if model.sliding_window:
        _fail(f"{s}.sliding_window", model.sliding_window, f"{model.family} attends fully: set it 0")


def _check_latent_lora_targets(cfg: Any) -> None:
    """A named LoRA target of the query's projections this model has not (q_proj with q_lora_rank > 0, q_a_proj or
    q_b_proj with 0): peft would leave it out in silence."""
    targets, have = cfg.finetune.lora.target_modules, latent_projection_shapes(cfg.model)
    if targets == "all-linear":
        return
    absent = [name for name in targets if name in LATENT_PROJECTIONS and name not in have]
    if absent:
        rank = cfg.model.latent_attention.q_lora_rank
        _fail("finetune.lora.target_modules", targets, f"{absent[0]!r} is not a projection of this model's latent "
              f"attention (latent_attention.q_lora_rank={rank}: its query is "
              f"{'q_a_proj, q_b_proj' if rank else 'one q_proj'}); choose from {', '.join(have)}")


def check_latent_run(cfg: Any) -> None:
    """The checks of a deepseek_v3 or glm4_moe run on load (Config.__post_init__): LoRA's named query projections."""
    family = cfg.model.family
    if family not in SIGMOID_ROUTER_FAMILIES or cfg.model.template == "generic":
        return
    if cfg.finetune.method == "lora" and family in LATENT_FAMILIES:
        _check_latent_lora_targets(cfg)
