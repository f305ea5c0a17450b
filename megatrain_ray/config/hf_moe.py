"""The mixture-of-experts keys of a Hugging Face config.json (Qwen3-MoE, Mixtral, gpt-oss, Qwen3-Next, Qwen3.5-MoE),
in and out."""

from __future__ import annotations

from typing import Any

from megatrain_ray.config.hf_fields import checked_layer_types
from megatrain_ray.exceptions import CheckpointError, ConfigError, excerpt

MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "qwen3_next", "qwen3_5_moe")
# transformers' names of the expert count: Qwen3MoeConfig's own key, and the one 5.x writes for all three.
EXPERT_COUNT_KEYS = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts", "gpt_oss": "num_local_experts",
                     "qwen3_next": "num_experts", "qwen3_5_moe": "num_experts"}


def _whole(hf: dict[str, Any], key: str, where: str, default: int, minimum: int) -> int:
    value = hf.get(key, default)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"{where}: {key} = {excerpt(value)} must be a whole number >= {minimum}")
    return value


def _real(hf: dict[str, Any], key: str, where: str, default: float) -> float:
    value = hf.get(key, default)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise CheckpointError(f"{where}: {key} = {excerpt(value)} must be a number >= 0")
    return float(value)


def moe_from_hf(hf: dict[str, Any], family: str, where: str) -> dict[str, Any]:
    """The ModelConfig keys of a MoE config.json beyond the common ones (sliding_window and layer_types
    included for Mixtral and gpt-oss)."""
    count_key = next((k for k in ("num_experts", "num_local_experts") if hf.get(k) is not None), None)
    if count_key is None:
        raise CheckpointError(f"{where} has no {EXPERT_COUNT_KEYS[family]!r} (nor "
                              f"{'num_local_experts' if family == 'qwen3_moe' else 'num_experts'}), the number of "
                              f"experts per layer a {family} model needs; the file is incomplete or not a Hugging Face "
                              "config.json")
    out: dict[str, Any] = {
        "num_experts": _whole(hf, count_key, where, 0, 1),
        "num_experts_per_tok": _whole(hf, "num_experts_per_tok", where, 2, 1),
        "output_router_logits": bool(hf.get("output_router_logits") or False),
        "router_aux_loss_coef": _real(hf, "router_aux_loss_coef", where, 0.001),
    }
    if family == "qwen3_5_moe":  # every layer sparse, the top-k always renormalised (MoeSpec)
        out["moe_intermediate_size"] = _whole(hf, "moe_intermediate_size", where, 512, 1)
    if family in ("qwen3_moe", "qwen3_next"):
        out.update(moe_intermediate_size=_whole(hf, "moe_intermediate_size", where, 0, 0),
                   norm_topk_prob=bool(hf.get("norm_topk_prob") or False),
                   decoder_sparse_step=_whole(hf, "decoder_sparse_step", where, 1, 1),
                   mlp_only_layers=list(hf.get("mlp_only_layers") or []))
    if family == "mixtral":
        if hf.get("router_jitter_noise"):
            raise ConfigError(f"{where}: router_jitter_noise = {excerpt(hf['router_jitter_noise'])} is not supported "
                              "(random noise on the router's input in training); set it to 0")
        out["sliding_window"] = _whole(hf, "sliding_window", where, 0, 0)
    if family == "gpt_oss":
        if hf.get("attention_bias") is False:
            raise ConfigError(f"{where}: gpt_oss with attention_bias=false is not supported (its checkpoints have "
                              "biases on every attention projection)")
        out.update(sliding_window=_whole(hf, "sliding_window", where, 128, 0),  # GptOssConfig's default
                   swiglu_limit=_real(hf, "swiglu_limit", where, 7.0), swiglu_alpha=_real(hf, "swiglu_alpha", where,
                                                                                         1.702))
        layers = _whole(hf, "num_hidden_layers", where, 1, 1)
        # As GptOssConfig: without layer_types, even layers (from 0) slide and odd ones attend fully.
        layer_types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                for i in range(layers)]
        out["layer_types"] = checked_layer_types(layer_types, where)
    return out


def moe_to_hf(cfg: Any) -> dict[str, Any]:
    """The MoE keys of config.json for a ModelConfig of a MoE family (transformers 5 names)."""
    out: dict[str, Any] = {
        EXPERT_COUNT_KEYS[cfg.family]: cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "output_router_logits": cfg.output_router_logits, "router_aux_loss_coef": cfg.router_aux_loss_coef,
    }
    if cfg.family in ("qwen3_moe", "qwen3_next"):
        out.update(moe_intermediate_size=cfg.expert_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
                   attention_bias=cfg.attention_bias)
    if cfg.family == "qwen3_moe":
        out["use_sliding_window"] = False
    if cfg.family == "qwen3_5_moe":
        out["moe_intermediate_size"] = cfg.expert_intermediate_size
    if cfg.family == "mixtral":
        out.update(sliding_window=cfg.sliding_window or None, router_jitter_noise=0.0)
    if cfg.family == "gpt_oss":
        out.update(sliding_window=cfg.sliding_window or None, attention_bias=True, swiglu_limit=cfg.swiglu_limit,
                   swiglu_alpha=cfg.swiglu_alpha,
                   layer_types=["sliding_attention" if cfg.layer_slides(i) else "full_attention"
                                for i in range(cfg.num_layers)])
    return out
