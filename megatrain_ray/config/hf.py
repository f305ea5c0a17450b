"""Hugging Face config.json <-> ModelConfig for the supported families."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from megatrain_ray.config.fields import FieldError
from megatrain_ray.config.hf_deepseek import deepseek_from_hf, deepseek_to_hf, glm4_moe_from_hf, glm4_moe_to_hf
from megatrain_ray.config.hf_fields import checked_layer_types
from megatrain_ray.config.hf_hybrid import HYBRID_FAMILIES, hybrid_from_hf, hybrid_to_hf, text_part
from megatrain_ray.config.hf_moe import MOE_FAMILIES, moe_from_hf, moe_to_hf
from megatrain_ray.config.hf_quantization import check_quantization_config
from megatrain_ray.config.hf_vision import vision_text_part
from megatrain_ray.config.model_section import ModelConfig, RopeScalingConfig
from megatrain_ray.exceptions import CheckpointError, ConfigError, excerpt
from megatrain_ray.system.files import read_json_object


class UnsupportedArchitectureError(ConfigError):
    """config.json names a model class megatrain has no templates for."""

FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
}
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
               "gemma2": "gemma2", "gemma3_text": "gemma3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral",
               "gpt_oss": "gpt_oss", "qwen3_5_text": "qwen3_5", "qwen3_next": "qwen3_next",
               "qwen3_5_moe_text": "qwen3_5_moe", "deepseek_v3": "deepseek_v3",
               "glm4_moe": "glm4_moe"}
HF_MODEL_TYPES = {family: model_type for model_type, family in MODEL_TYPES.items()}
# Gemma3TextConfig's RoPE bases when config.json names none (global layers, sliding layers).
GEMMA3_THETAS = (1_000_000.0, 10_000.0)
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", None)
# Phi3Config's own default for original_max_position_embeddings (a top-level key of its config.json).
PHI3_ORIGINAL_MAX_POSITIONS = 4096
# The config classes' pad_token_id where config.json has none (the other native families': None).
PAD_TOKEN_DEFAULTS = {"phi3": 32000, "gemma2": 0, "gemma3": 0}


def _family(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures")
    for arch in archs if isinstance(archs, list) else []:
        if isinstance(arch, str) and arch in FAMILIES:
            return FAMILIES[arch]
    if isinstance(hf.get("model_type"), str) and hf["model_type"] in MODEL_TYPES:
        return MODEL_TYPES[hf["model_type"]]
    raise UnsupportedArchitectureError(
        f"unsupported architecture {excerpt(hf.get('architectures') or hf.get('model_type'))}; "
        f"supported: {', '.join(FAMILIES)}")


def _rope(hf: dict[str, Any], family: str) -> tuple[float, RopeScalingConfig | None]:
    # transformers 5 nests theta and scaling in `rope_parameters`; 4.x has rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type") or scaling.get("type")
    if family == "phi3" and kind in ("su", "yarn", "longrope"):  # Phi3Config reads su and yarn as longrope
        # As transformers: Phi-3's top-level original_max_position_embeddings wins (Phi3Config's default
        # 4096 when absent); factor, when not given, is max_position_embeddings over it.
        original = int(hf.get("original_max_position_embeddings") or PHI3_ORIGINAL_MAX_POSITIONS)
        factor = scaling.get("factor") or hf.get("max_position_embeddings", 4096) / original
        return theta, RopeScalingConfig(
            rope_type="longrope", factor=float(factor), original_max_position_embeddings=original,
            attention_factor=float(scaling.get("attention_factor") or 0.0),
            short_factor=[float(v) for v in scaling["short_factor"]],
            long_factor=[float(v) for v in scaling["long_factor"]])
    if family == "phi3":
        raise ConfigError(f"rope scaling type {kind!r} is not supported for phi3 (transformers' Phi3 takes longrope)")
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, RopeScalingConfig(
            rope_type="llama3", factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    if kind == "yarn":
        optional = {key: float(scaling[key]) for key in ("beta_fast", "beta_slow", "attention_factor", "mscale",
                                                          "mscale_all_dim") if scaling.get(key)}
        # As transformers: without original_max_position_embeddings the model's own maximum is the original.
        original = scaling.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 4096)
        factor = scaling.get("factor") or hf["max_position_embeddings"] / original
        return theta, RopeScalingConfig(rope_type="yarn", factor=float(factor), original_max_position_embeddings=int(
            original), truncate=bool(scaling.get("truncate", True)), **optional)
    if kind == "linear":
        return theta, RopeScalingConfig(rope_type="linear", factor=float(scaling["factor"]))
    raise ConfigError(f"rope scaling type {kind!r} is not supported for {family} (supported: llama3, yarn, linear; "
                      "longrope for phi3)")


def _gemma3_rope(hf: dict[str, Any]) -> tuple[float, RopeScalingConfig | None, float]:
    """Gemma 3's two RoPEs: the global layers' base and scaling, and the sliding layers' base (transformers 5:
    rope_parameters by layer type; 4.x: rope_theta, rope_scaling and rope_local_base_freq at the top)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:  # transformers 4 spelling (or nothing: Gemma3TextConfig's defaults)
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta")}
        local = {"rope_theta": hf.get("rope_local_base_freq")}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"gemma3: RoPE scaling of the sliding layers ({local.get('rope_type')!r}) is not supported; "
                          "as in Gemma 3's checkpoints only the global layers may scale")
    full.setdefault("rope_type", full.pop("type", "default"))
    full["rope_theta"] = full.get("rope_theta") or GEMMA3_THETAS[0]
    theta, scaling = _rope({"rope_parameters": full, "max_position_embeddings": hf.get("max_position_embeddings")},
                           "gemma3")
    return theta, scaling, float(local.get("rope_theta") or GEMMA3_THETAS[1])


def _gemma(hf: dict[str, Any], family: str, where: str) -> dict[str, Any]:
    """The ModelConfig keys of a Gemma 2 or 3 config.json beyond the common ones."""
    activation = hf.get("hidden_activation") or hf.get("hidden_act")
    if activation not in GEMMA_ACTIVATIONS:
        raise ConfigError(f"{where}: {family} with hidden_activation {excerpt(activation)} is not supported "
                          "(the templates run gelu_pytorch_tanh, as Gemma's checkpoints)")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(f"{where}: {family} with use_bidirectional_attention=true is not supported (causal only)")
    out: dict[str, Any] = {
        "sliding_window": _count(hf, "sliding_window", where, default=0, minimum=0),
        "query_pre_attn_scalar": _count(hf, "query_pre_attn_scalar", where, default=256),
        # transformers' Gemma 3 keeps attn_logit_softcapping in its config but never applies it (Gemma 3's
        # checkpoints have none): read as it computes. Its final soft-cap is applied.
        "attn_logit_softcapping": float(hf.get("attn_logit_softcapping") or 0.0) if family == "gemma2" else 0.0,
        "final_logit_softcapping": float(hf.get("final_logit_softcapping") or 0.0),
    }
    layer_types = hf.get("layer_types")
    if layer_types:
        out["layer_types"] = checked_layer_types(layer_types, where)
    else:  # as Gemma2Config / Gemma3TextConfig derive them
        out["sliding_window_pattern"] = _count(hf, "sliding_window_pattern", where,
                                               default=6 if family == "gemma3" else 2)
    return out


def _count(hf: dict[str, Any], key: str, where: str, default: int | None = None, minimum: int = 1) -> int:
    """A whole-number field of config.json, present (unless it has a default) and at least `minimum`."""
    value = hf.get(key, default)
    if value is None and default is not None:
        value = default
    if value is None:
        raise CheckpointError(f"{where} has no {key!r}, which the architecture needs; the file is incomplete or "
                              "not a Hugging Face config.json")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"{where}: {key} = {excerpt(value)} must be a whole number >= {minimum}")
    return value


def _number(hf: dict[str, Any], key: str, where: str, default: float) -> float:
    value = hf.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{where}: {key} = {excerpt(value)} must be a finite number > 0")
    return float(value)


def _pad_token(hf: dict[str, Any], family: str, vocab: int, where: str) -> int | None:
    """config.json's pad_token_id (absent: the family's default), as transformers' nn.Embedding takes it for its
    padding_idx: a negative one counts from the end of the vocabulary, one outside it is refused."""
    value = hf["pad_token_id"] if "pad_token_id" in hf else PAD_TOKEN_DEFAULTS.get(family)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not -vocab <= value < vocab:
        raise CheckpointError(f"{where}: pad_token_id = {excerpt(value)} must be a token of the vocabulary "
                              f"(-{vocab} to {vocab - 1}, as transformers' embedding takes it) or null")
    return value % vocab


def model_config_from_hf(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json mapping; every field is checked before it is used
    (`where` names the file in errors, with the file's own key names)."""
    hf = text_part(vision_text_part(hf, where))  # a vision-language or multimodal Qwen3.5 checkpoint: its text model
    try:
        return _model_config_from_hf(hf, where)
    except FieldError as exc:  # ModelConfig's own checks refused a value of this file: name the file and its key
        raise CheckpointError(f"{where}: {_hf_key(exc.key, hf)} = {excerpt(exc.value)}: {exc.why} (a value of this "
                              "file, not of the YAML config: correct the file, or point model.path at another "
                              "model)") from None


def _hf_key(key: str, hf: dict[str, Any]) -> str:
    """config.json's name of a ModelConfig key (`model.num_layers` -> num_hidden_layers)."""
    name = key.removeprefix("model.")
    experts = next((k for k in ("num_experts", "num_local_experts") if k in hf), "num_experts")
    if name.startswith("linear_attention."):  # the nested section of config.json's linear_* keys
        return "linear_" + name.removeprefix("linear_attention.")
    return {"num_layers": "num_hidden_layers", "num_experts": experts}.get(name, name)


def _model_config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    family = _family(hf)
    check_quantization_config(hf, family, where)
    hidden, heads = _count(hf, "hidden_size", where), _count(hf, "num_attention_heads", where)
    if hidden % heads and not hf.get("head_dim"):
        raise CheckpointError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                              "and no head_dim is given")
    kv_heads = _count(hf, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise CheckpointError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                              f"{kv_heads}")
    head_dim = _count(hf, "head_dim", where, default=0, minimum=0)
    if head_dim == hidden // heads:
        head_dim = 0
    gemma = _gemma(hf, family, where) if family in ("gemma2", "gemma3") else {}
    hybrid = hybrid_from_hf(hf, family, where) if family in HYBRID_FAMILIES else {}
    # Qwen3-Next with num_experts 0 is dense (Qwen3NextConfig allows it)
    sparse = family in MOE_FAMILIES and not (family == "qwen3_next" and hf.get("num_experts") == 0)
    moe = moe_from_hf(hf, family, where) if sparse else {}
    latent = deepseek_from_hf(hf, where) if family == "deepseek_v3" else \
        glm4_moe_from_hf(hf, where) if family == "glm4_moe" else {}
    if "head_dim" in latent:
        head_dim = latent.pop("head_dim")
    try:
        if family == "gemma3":
            theta, scaling, gemma["rope_local_base_freq"] = _gemma3_rope(hf)
        else:
            theta, scaling = _rope(hf, family)
        partial = float((hf.get("rope_parameters") or {}).get("partial_rotary_factor")
                        or hf.get("partial_rotary_factor") or 1.0) if family == "phi3" else 1.0
        partial = hybrid.pop("partial_rotary_factor", latent.pop("partial_rotary_factor", partial))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise CheckpointError(f"{where}: the RoPE settings (rope_scaling / rope_parameters) are incomplete or "
                              f"malformed ({excerpt(exc)})") from None
    sliding = 0
    if family in ("mistral", "phi3"):
        sliding = _count(hf, "sliding_window", where, default=0, minimum=0)
    elif gemma:
        sliding = gemma.pop("sliding_window")
    elif "sliding_window" in moe:  # Mixtral and gpt-oss
        sliding = moe.pop("sliding_window")
    elif hf.get("use_sliding_window"):
        raise ConfigError(f"{family} with use_sliding_window=true (per-layer windows) is not supported")
    vocab = _count(hf, "vocab_size", where)
    # Qwen3.5-MoE has no dense layer and no intermediate_size: its experts' width stands in (never read)
    intermediate = moe["moe_intermediate_size"] if family == "qwen3_5_moe" else _count(hf, "intermediate_size", where)
    return ModelConfig(
        family=family,  # type: ignore[arg-type]
        vocab_size=vocab, hidden_size=hidden, pad_token_id=_pad_token(hf, family, vocab, where),
        intermediate_size=intermediate, num_layers=_count(hf, "num_hidden_layers", where),
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial,
        rms_norm_eps=_number(hf, "rms_norm_eps", where, 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", bool(gemma))),  # Gemma ties by default
        # Qwen2 always has qkv bias; Phi-3's fused qkv_proj never has one, whatever config.json says.
        attention_bias={"qwen2": True, "phi3": False}.get(family, bool(hf.get("attention_bias") or False)),
        qk_norm=latent.pop("qk_norm", family in ("qwen3", "gemma3", "qwen3_moe", *HYBRID_FAMILIES)),
        sliding_window=sliding,
        max_position_embeddings=_count(hf, "max_position_embeddings", where, default=4096),
        initializer_range=_number(hf, "initializer_range", where, 0.02),
        **gemma, **moe, **hybrid, **latent,
    )


ARCHITECTURES = {family: arch for arch, family in FAMILIES.items()}


def hf_config_from_model(cfg: ModelConfig) -> dict[str, Any]:
    """A Hugging Face config.json mapping for a ModelConfig (transformers 5 spelling of RoPE)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope.update(rope_type=cfg.rope_scaling.rope_type, factor=cfg.rope_scaling.factor)
        if cfg.rope_scaling.rope_type == "llama3":
            rope.update(low_freq_factor=cfg.rope_scaling.low_freq_factor,
                        high_freq_factor=cfg.rope_scaling.high_freq_factor,
                        original_max_position_embeddings=cfg.rope_scaling.original_max_position_embeddings)
        if cfg.rope_scaling.rope_type == "yarn":
            yarn = cfg.rope_scaling
            rope.update(original_max_position_embeddings=yarn.original_max_position_embeddings,
                        beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow, truncate=yarn.truncate)
            rope.update({key: getattr(yarn, key) for key in ("attention_factor", "mscale", "mscale_all_dim")
                         if getattr(yarn, key)})
        if cfg.rope_scaling.rope_type == "longrope":
            long = cfg.rope_scaling
            rope.update(original_max_position_embeddings=long.original_max_position_embeddings,
                        short_factor=list(long.short_factor), long_factor=list(long.long_factor))
            if long.attention_factor:
                rope["attention_factor"] = long.attention_factor
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.family]], "model_type": HF_MODEL_TYPES[cfg.family],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.resolved_head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope, "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_word_embeddings,
        "pad_token_id": cfg.pad_token_id,
        "initializer_range": cfg.initializer_range, "hidden_act": "silu",
    }
    if cfg.family in ("llama", "qwen3"):
        out["attention_bias"] = cfg.attention_bias
    if cfg.family == "mistral":
        out["sliding_window"] = cfg.sliding_window or None
    if cfg.family in ("qwen2", "qwen3"):
        out["use_sliding_window"] = False
    if cfg.family == "phi3":
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
        out["sliding_window"] = cfg.sliding_window or None
        longrope = cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "longrope"
        # Top level, where Phi3Config reads it (it overrides the one in rope_parameters).
        out["original_max_position_embeddings"] = cfg.rope_scaling.original_max_position_embeddings if longrope \
            else cfg.max_position_embeddings
    if cfg.is_gemma:
        del out["hidden_act"]
        out.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False, use_bidirectional_attention=False,
                   sliding_window=cfg.sliding_window or None,
                   layer_types=["sliding_attention" if cfg.layer_slides(i) else "full_attention"
                                for i in range(cfg.num_layers)],
                   query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.resolved_head_dim,
                   attn_logit_softcapping=cfg.attn_logit_softcapping or None,
                   final_logit_softcapping=cfg.final_logit_softcapping or None)
    if cfg.is_moe and cfg.family in MOE_FAMILIES:
        out.update(moe_to_hf(cfg))
    if cfg.family in HYBRID_FAMILIES:
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
        out.update(hybrid_to_hf(cfg))
        if cfg.family == "qwen3_5_moe":  # its config class has no intermediate_size
            del out["intermediate_size"]
    if cfg.family == "deepseek_v3":
        out.update(deepseek_to_hf(cfg))
    if cfg.family == "glm4_moe":
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
        out.update(glm4_moe_to_hf(cfg))
    if cfg.family == "gemma3":
        local = cfg.rope_local_base_freq or cfg.rope_theta
        out["rope_parameters"] = {"full_attention": rope,
                                  "sliding_attention": {"rope_type": "default", "rope_theta": local}}
        out["rope_local_base_freq"] = local  # where transformers 4 reads it
    return out


def read_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"model.path={str(model_dir)!r} has no config.json; point model.path at a Hugging Face "
                              "model directory (config.json + model.safetensors or its index)")
    return read_json_object(path, str(path), CheckpointError)


def model_config_of_dir(model_dir: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory (UnsupportedArchitectureError for other families)."""
    return model_config_from_hf(read_hf_config(model_dir), str(Path(model_dir) / "config.json"))
