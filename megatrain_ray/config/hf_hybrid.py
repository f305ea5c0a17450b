"""The keys of a Qwen3.5 text, Qwen3-Next or Qwen3.5-MoE text config.json beyond the common ones, in and out: the
linear-attention shape (linear_*), layer_types, the partial rotary factor and the shared expert."""

from __future__ import annotations

from typing import Any

from megatrain_ray.config.linear_attention_section import HYBRID_FAMILIES, LinearAttentionConfig
from megatrain_ray.exceptions import CheckpointError, ConfigError, excerpt

# The config classes' defaults (Qwen3_5TextConfig, Qwen3NextConfig, Qwen3_5MoeTextConfig share them).
PARTIAL_ROTARY_DEFAULT = 0.25
FULL_ATTENTION_INTERVAL = 4
MULTIMODAL = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
"""The hub's Qwen3.5 checkpoints are multimodal (Qwen3_5ForConditionalGeneration, model_type qwen3_5): their text
model is text_config, its weights under model.language_model., as transformers' text class reads them."""
LANGUAGE_PREFIX, TEXT_PREFIX = "model.language_model.", "model."
SKIPPED_PREFIXES = ("model.visual.", "mtp.")
"""A multimodal checkpoint's vision tower and the multi-token-prediction head: not read (nor by transformers' text
class), not exported."""
LINEAR_DEFAULTS = {"conv_kernel_dim": 4, "key_head_dim": 128, "value_head_dim": 128, "num_key_heads": 16,
                   "num_value_heads": 32}


def _whole(hf: dict[str, Any], key: str, where: str, default: int) -> int:
    value = hf.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{where}: {key} = {excerpt(value)} must be a whole number >= 1")
    return value


def text_part(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json's text model: a multimodal Qwen3.5 one's text_config under its text class, else `hf` itself."""
    text = hf.get("text_config")
    if hf.get("model_type") not in MULTIMODAL or not isinstance(text, dict):
        return hf
    out = {"tie_word_embeddings": hf.get("tie_word_embeddings", False), **text,
           "architectures": [MULTIMODAL[hf["model_type"]]]}
    out.setdefault("model_type", f"{hf['model_type']}_text")
    return out


def multimodal_names(names: list[str]) -> tuple[dict[str, str], set[str]]:
    """For a multimodal Qwen3.5 checkpoint's tensor names: {text model's name: name on disk} of its language model
    and LM head, and the names not read (the vision tower, the multi-token-prediction head)."""
    aliases, skipped = {}, set()
    for name in names:
        if name.startswith(SKIPPED_PREFIXES):
            skipped.add(name)
        elif name.startswith(LANGUAGE_PREFIX):
            aliases[TEXT_PREFIX + name.removeprefix(LANGUAGE_PREFIX)] = name
        else:
            aliases[name] = name
    return aliases, skipped


def hybrid_from_hf(hf: dict[str, Any], family: str, where: str) -> dict[str, Any]:
    """ModelConfig keys of a hybrid family's config.json (layer_types as its config class derives them when absent:
    every full_attention_interval-th layer full, the others linear)."""
    activation = hf.get("hidden_act") or "silu"
    if activation != "silu":
        raise ConfigError(f"{where}: {family} with hidden_act {excerpt(activation)} is not supported (its template "
                          "runs silu in the MLP and after the convolution, as the checkpoints do)")
    layers = _whole(hf, "num_hidden_layers", where, 1)
    layer_types = hf.get("layer_types")
    if layer_types is None:
        interval = _whole(hf, "full_attention_interval", where, FULL_ATTENTION_INTERVAL)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(layer_types, list) or len(layer_types) != layers or \
            any(t not in ("full_attention", "linear_attention") for t in layer_types):
        raise CheckpointError(f"{where}: layer_types = {excerpt(layer_types)} must list full_attention or "
                              f"linear_attention for each of the {layers} layers")
    linear = LinearAttentionConfig(**{key: _whole(hf, f"linear_{key}", where, default)
                                      for key, default in LINEAR_DEFAULTS.items()})
    params = hf.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or PARTIAL_ROTARY_DEFAULT
    if isinstance(partial, bool) or not isinstance(partial, (int, float)):
        raise CheckpointError(f"{where}: partial_rotary_factor = {excerpt(partial)} must be a number in (0, 1]")
    out: dict[str, Any] = {"linear_attention": linear, "layer_types": list(layer_types),
                           "partial_rotary_factor": float(partial)}
    if family in ("qwen3_next", "qwen3_5_moe") and hf.get("num_experts"):
        out["shared_expert_intermediate_size"] = _whole(hf, "shared_expert_intermediate_size", where, 512)
    return out


def hybrid_to_hf(cfg: Any) -> dict[str, Any]:
    """The hybrid keys of config.json for a ModelConfig of a hybrid family (transformers 5 names)."""
    linear = cfg.linear_attention
    out: dict[str, Any] = {f"linear_{key}": getattr(linear, key) for key in LINEAR_DEFAULTS}
    out.update(layer_types=list(cfg.layer_types), attention_bias=False, head_dim=cfg.resolved_head_dim)
    if cfg.num_experts:
        out["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    elif cfg.family == "qwen3_next":
        out["num_experts"] = 0  # Qwen3NextConfig's default is 512: a dense model says so
    return out


__all__ = ["HYBRID_FAMILIES", "hybrid_from_hf", "hybrid_to_hf"]
