"""The keys of a DeepSeek-V3 or GLM-4.5 MoE config.json beyond the common ones, in and out: DeepSeek's latent
attention shape; GLM's q/k norms and partial rotary factor; both families' sigmoid router (groups, scale), shared
experts and dense first layers (first_k_dense_replace)."""

from __future__ import annotations

from typing import Any

from megatrain_ray.config.latent_attention_section import LatentAttentionConfig, SigmoidRouterConfig
from megatrain_ray.exceptions import CheckpointError, ConfigError, excerpt

# DeepseekV3Config's defaults, where config.json leaves a key out.
LATENT_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                   "v_head_dim": 128}
ROUTER_DEFAULTS = {"n_group": 8, "topk_group": 4}
MOE_DEFAULTS = {"n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                "n_shared_experts": 1, "first_k_dense_replace": 3}
# Glm4MoeConfig's, where they differ.
GLM_DEFAULTS = {"n_routed_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
                "n_shared_experts": 1, "first_k_dense_replace": 1}
GLM_ROUTER_DEFAULTS = {"n_group": 1, "topk_group": 1}
GLM_PARTIAL_ROTARY = 0.5


def _whole(hf: dict[str, Any], key: str, where: str, default: int | None, minimum: int = 1) -> int | None:
    value = hf.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"{where}: {key} = {excerpt(value)} must be a whole number >= {minimum}")
    return value


def _silu(hf: dict[str, Any], family: str, where: str) -> None:
    activation = hf.get("hidden_act") or "silu"
    if activation != "silu":
        raise ConfigError(f"{where}: {family} with hidden_act {excerpt(activation)} is not supported (its template "
                          "runs SwiGLU, as the checkpoints do)")


def sigmoid_moe_from_hf(hf: dict[str, Any], where: str, glm: bool = False) -> dict[str, Any]:
    """ModelConfig keys of the MoE part of a deepseek_v3 or glm4_moe config.json (its config class's defaults for
    the keys it leaves out)."""
    moe = {key: _whole(hf, key, where, default, 0 if key == "first_k_dense_replace" else 1)
           for key, default in (GLM_DEFAULTS if glm else MOE_DEFAULTS).items()}
    layers = _whole(hf, "num_hidden_layers", where, 46 if glm else 61)
    scaling = hf.get("routed_scaling_factor", 1.0 if glm else 2.5)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        raise CheckpointError(f"{where}: routed_scaling_factor = {excerpt(scaling)} must be a number > 0")
    norm = hf.get("norm_topk_prob", True)
    router = GLM_ROUTER_DEFAULTS if glm else ROUTER_DEFAULTS
    return dict(num_experts=moe["n_routed_experts"], num_experts_per_tok=moe["num_experts_per_tok"],
                moe_intermediate_size=moe["moe_intermediate_size"],
                shared_expert_intermediate_size=moe["n_shared_experts"] * moe["moe_intermediate_size"],
                norm_topk_prob=True if norm is None else bool(norm),
                mlp_only_layers=list(range(min(moe["first_k_dense_replace"], layers))),
                sigmoid_router=SigmoidRouterConfig(
                    **{key: _whole(hf, key, where, default) or default for key, default in router.items()},
                    routed_scaling_factor=float(scaling)))


def deepseek_from_hf(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig keys of a deepseek_v3 config.json (its config class's defaults for the keys it leaves out)."""
    _silu(hf, "deepseek_v3", where)
    latent = {key: _whole(hf, key, where, default) for key, default in LATENT_DEFAULTS.items()}
    latent["q_lora_rank"] = latent["q_lora_rank"] or 0  # null: one q_proj
    interleave = hf.get("rope_interleave", True)
    return {
        "latent_attention": LatentAttentionConfig(**latent, rope_interleave=bool(True if interleave is None
                                                                                 else interleave)),
        "head_dim": latent["qk_rope_head_dim"],  # as DeepseekV3Config: the rotated width (its RoPE tables')
        **sigmoid_moe_from_hf(hf, where),
    }


def glm4_moe_from_hf(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig keys of a glm4_moe config.json: the sigmoid MoE, q/k norms (use_qk_norm), the partial rotary
    factor (rope_parameters', else the top level's, else Glm4MoeConfig's 0.5)."""
    _silu(hf, "glm4_moe", where)
    params = hf.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or GLM_PARTIAL_ROTARY
    if isinstance(partial, bool) or not isinstance(partial, (int, float)):
        raise CheckpointError(f"{where}: partial_rotary_factor = {excerpt(partial)} must be a number in (0, 1]")
    return {"qk_norm": bool(hf.get("use_qk_norm") or False), "partial_rotary_factor": float(partial),
            **sigmoid_moe_from_hf(hf, where, glm=True)}


def sigmoid_moe_to_hf(cfg: Any) -> dict[str, Any]:
    """The MoE keys of config.json for a deepseek_v3 or glm4_moe ModelConfig (transformers 5 names)."""
    router, width = cfg.sigmoid_router, cfg.expert_intermediate_size
    if cfg.shared_expert_intermediate_size % width:
        raise ConfigError(f"model.shared_expert_intermediate_size={cfg.shared_expert_intermediate_size} is not a "
                          f"whole number of experts of moe_intermediate_size={width} (config.json's n_shared_experts)")
    return dict(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                moe_intermediate_size=width, n_shared_experts=cfg.shared_expert_intermediate_size // width,
                norm_topk_prob=cfg.norm_topk_prob, first_k_dense_replace=len(cfg.mlp_only_layers),
                n_group=router.n_group, topk_group=router.topk_group,
                routed_scaling_factor=router.routed_scaling_factor, output_router_logits=False,
                attention_bias=cfg.attention_bias, num_nextn_predict_layers=0)


def glm4_moe_to_hf(cfg: Any) -> dict[str, Any]:
    """The glm4_moe keys of config.json (the partial rotary factor goes into rope_parameters: config/hf.py)."""
    return {**sigmoid_moe_to_hf(cfg), "use_qk_norm": cfg.qk_norm, "head_dim": cfg.resolved_head_dim}


def deepseek_to_hf(cfg: Any) -> dict[str, Any]:
    """The deepseek_v3 keys of config.json for its ModelConfig (transformers 5 names)."""
    la = cfg.latent_attention
    return {"q_lora_rank": la.q_lora_rank or None, "kv_lora_rank": la.kv_lora_rank,
            "qk_nope_head_dim": la.qk_nope_head_dim, "qk_rope_head_dim": la.qk_rope_head_dim,
            "v_head_dim": la.v_head_dim, "rope_interleave": la.rope_interleave, "head_dim": la.qk_rope_head_dim,
            **sigmoid_moe_to_hf(cfg)}
