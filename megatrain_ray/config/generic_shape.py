"""model.template: which path runs a Hugging Face directory, and a generic model's shape as the planner reads it.

`model_config_for_template` resolves model.template (auto: native where config.json names a native family,
else generic; logged). A generic model's ModelConfig (generic_model_config) carries its shape for the planner;
the model itself is the meta model of config/hf_generic.py, which also tells the plan which tensors are routed
experts (expert_fractions) and how wide its attention is (attention_width).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from megatrain_ray.config.hf import UnsupportedArchitectureError, model_config_from_hf, read_hf_config
from megatrain_ray.config.hf_generic import architecture
from megatrain_ray.config.hf_quantization import check_quantization_config
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.exceptions import CheckpointError, excerpt
from megatrain_ray.observe.log import get_logger

log = get_logger(__name__)

# The intermediate width the planner assumes when config.json names none (a 4x MLP): memory estimates only.
DEFAULT_MLP_RATIO = 4


def planner_value(config: Any, key: str) -> Any:
    """config.`key` (None where it has none); where the config sets it per layer (Gemma 4's full-attention layers:
    another head_dim and key/value head count), the largest of its layers' values, which the plan's estimates
    take."""
    layered = getattr(config, "per_layer_attributes", None) or ()
    if key in layered:
        values = [getattr(layer, key, None) for layer in config.per_layer_config]
        values = [v for v in values if v is not None]
        return max(values) if values else None
    return getattr(config, key, None)


def _shape_value(config: Any, key: str, where: str) -> int:
    value = planner_value(config, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{where}: {key} = {excerpt(value)} must be a whole number >= 1 (the generic path "
                              "reads the model's shape from it)")
    return value


def generic_model_config(model_dir: str | Path) -> ModelConfig:
    """The ModelConfig of a directory run by the generic path (family generic, whatever its class): its shape as
    the planner reads it; the model itself is the meta model's."""
    where = str(Path(model_dir) / "config.json")
    check_quantization_config(read_hf_config(model_dir), "generic", where)  # before transformers builds it
    arch = architecture(str(Path(model_dir).resolve()))
    config = arch.model.config
    hidden = _shape_value(config, "hidden_size", where)
    if planner_value(config, "num_attention_heads") is None:  # no attention (Mamba): see attention_width
        heads = kv_heads = 1
        head_dim = hidden
    else:
        heads = _shape_value(config, "num_attention_heads", where)
        kv_heads = planner_value(config, "num_key_value_heads") or heads
        head_dim = planner_value(config, "head_dim") or hidden // heads
        mla = [planner_value(config, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")]
        if all(isinstance(v, int) and v > 0 for v in mla):  # DeepSeek's latent attention: q.k over nope + rope
            head_dim = (mla[0] + mla[1] + mla[2]) // 2      # dimensions, the values' own: their mean per product
    intermediate = planner_value(config, "intermediate_size")
    if not isinstance(intermediate, int) or intermediate < 1:
        intermediate = DEFAULT_MLP_RATIO * hidden
    return ModelConfig(
        path=str(model_dir), family="generic", template="generic",
        vocab_size=_shape_value(config, "vocab_size", where), hidden_size=hidden, intermediate_size=intermediate,
        num_layers=len(arch.layers), num_attention_heads=heads,
        num_key_value_heads=kv_heads if heads % kv_heads == 0 else heads,
        head_dim=head_dim + head_dim % 2,  # the planner's attention width; the model's own is used to run it
        max_position_embeddings=getattr(config, "max_position_embeddings", None) or 4096,
        tie_word_embeddings=arch.tied,
        initializer_range=float(getattr(config, "initializer_range", None) or 0.02))


def model_config_for_template(model_dir: str | Path, template: str) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory for model.template `template`: native (a native family, else
    UnsupportedArchitectureError), generic (transformers' own layers), or auto (native where there is a native
    family, else generic; the log says which)."""
    hf, where = read_hf_config(model_dir), str(Path(model_dir) / "config.json")
    if template != "generic":
        try:
            cfg = model_config_from_hf(hf, where)
        except UnsupportedArchitectureError as exc:
            if template == "native":
                raise UnsupportedArchitectureError(f"{exc}; model.template=native takes these only: set "
                                                   "model.template to auto or generic for any other decoder-only "
                                                   "model transformers ships") from None
        else:
            if template == "auto":
                log.info("model.template auto: %s runs on the native %s template", where, cfg.family)
            return dataclasses.replace(cfg, template="native")
    cfg = generic_model_config(model_dir)
    log.info("model.template %s: %s runs on the generic path (transformers' %s, its own decoder layers)", template,
             where, architecture(str(Path(model_dir).resolve())).class_name)
    return cfg


EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "top_k_experts", "moe_k", "moe_top_k")
"""config.json's names for a MoE model's routed experts and the number each token is routed to (DeepSeek-V3 and
GLM-4.5; Mixtral-like; Qwen2-MoE, OLMoE and Gemma 4; Ernie 4.5; DBRX's, under ffn_config)."""


def _config_number(config: Any, keys: tuple[str, ...]) -> int | None:
    for part in (config, getattr(config, "ffn_config", None)):
        for key in keys:
            value = getattr(part, key, None) if part is not None and not isinstance(part, dict) else \
                (part or {}).get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


@functools.lru_cache(maxsize=8)
def expert_fractions(model_dir: str) -> dict[str, float]:
    """The share of each routed-expert tensor of a generic MoE model's layers that one token uses (top-k of the
    experts), by its name in its layer's stage (`mlp.experts.gate_up_proj`): the tensors of 3 dimensions whose
    first is the expert count, in a module named for experts, as transformers 5 fuses them. Empty for a dense model
    (or one whose config.json names no expert count or top-k): the plan then counts every tensor as used."""
    arch = architecture(model_dir)
    experts, top_k = (_config_number(arch.model.config, keys) for keys in (EXPERT_COUNT_KEYS, TOP_K_KEYS))
    if not experts or not top_k or top_k >= experts:
        return {}
    out = {}
    for layer in arch.layers:
        for name, param in layer.named_parameters():
            if param.dim() == 3 and param.shape[0] == experts and "expert" in name.rpartition(".")[0]:
                out[name] = top_k / experts
    return out


def attention_width(cfg: ModelConfig) -> int:
    """The width of causal attention per layer the planner counts FLOPs for (query heads x head_dim; DeepSeek-V3's
    latent attention: the mean of its q.k and value widths, as its two products take them): a generic
    model's from its config.json, 0 when that names no attention heads (the plan then counts 6 FLOPs per
    matrix parameter and token alone; its memory estimate takes one head of hidden_size)."""
    if cfg.template == "generic" and \
            planner_value(architecture(str(Path(cfg.path).resolve())).model.config, "num_attention_heads") is None:
        return 0
    if cfg.latent_attention is not None:  # latent attention: q.k over qk_head_dim, the values' own v_head_dim
        la = cfg.latent_attention
        return cfg.num_attention_heads * (la.qk_head_dim + la.v_head_dim) // 2
    return cfg.num_attention_heads * cfg.resolved_head_dim
