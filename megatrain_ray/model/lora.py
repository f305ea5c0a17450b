"""LoRA's math: which projections get adapters, their shapes and initial values, the adapted projection,
PEFT's names, and the merge into the base weights.

An adapter on projection W [out, in] is a pair A [r, in], B [out, r]; the projection becomes
W x + b + scaling * B A x, with scaling = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA), as
peft.tuners.lora.Linear computes it: the adapter's input cast to the adapters' dtype (float32) and the
sum cast back to the base's dtype. A is drawn as PEFT draws it (kaiming_uniform_ with a = sqrt(5):
uniform in +-1/sqrt(in)), here from a generator seeded by the run seed, the layer and the projection (the
same values on any device and in any order); B starts at zero, so the adapted model starts as the base.

The templates bind adapters beside a stage's weights under `<module>.lora_A.weight` and
`<module>.lora_B.weight` (the names PEFT gives them inside a layer), and every projection goes through
`project`; a layer without them computes the plain projection.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from megatrain_ray.config.finetune_section import LoraConfig
from megatrain_ray.config.latent_attention_section import latent_projection_shapes
from megatrain_ray.config.lora_targets import (
    LINEAR_MIXER_PROJECTIONS,
    PARAM_TARGETS,
    SHARED_EXPERT_PROJECTIONS,
    SHARED_EXPERT_TARGETS,
)
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.config.sections import Config
from megatrain_ray.model.layout import linear_attention_tensors
from megatrain_ray.model.lora_moe import param_adapters

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
              "kv_b_proj")
_LINEAR_MIXER = frozenset(name for names in LINEAR_MIXER_PROJECTIONS.values() for name in names)
"""Every hybrid family's linear-attention projections (model/linear_attention.py), under `linear_attn.`."""
_PEFT_PREFIX = "base_model.model."


def module_name(short: str) -> str:
    """`q_proj` -> `self_attn.q_proj`, `in_proj_z` -> `linear_attn.in_proj_z`, `gate_proj` -> `mlp.gate_proj`: the
    module inside a decoder layer."""
    where = "self_attn" if short in _ATTENTION else "linear_attn" if short in _LINEAR_MIXER else "mlp"
    return f"{where}.{short}"


def adapter_shapes(model: ModelConfig, lora: LoraConfig, layer: int | None = None) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each targeted linear projection of a layer, by module name, in the layer's
    order (a MoE family's router and expert adapters: layer_adapter_shapes). A hybrid family's layers differ:
    `layer` picks one (its attention or its linear-attention projections); None gives those of every kind."""
    h, f, hd = model.hidden_size, model.intermediate_size, model.resolved_head_dim
    q, kv = model.num_attention_heads * hd, model.num_key_value_heads * hd
    hybrid = model.linear_attention is not None
    dims = {"q_proj": (2 * q if hybrid else q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "qkv_proj": (q + 2 * kv, h), "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f),
            "gate_up_proj": (2 * f, h)}  # a hybrid's gated attention: q_proj holds each head's query and gate
    # a MoE family's MLP names are its router and experts (a dense Qwen3-Next's too: peft maps them so)
    linear = _ATTENTION if model.is_moe or model.family in PARAM_TARGETS else dims
    names = {short: module_name(short) for short in dims}
    if model.latent_attention is not None:  # DeepSeek-V3: the latent attention's projections this model has
        dims = linear = latent_projection_shapes(model)
    if hybrid:
        mixer = {name.split(".")[1]: shape for name, shape, _ in linear_attention_tensors(model)
                 if name.split(".")[1] in _LINEAR_MIXER}
        dims, linear = {**dims, **mixer}, (*linear, *mixer)
        shared = SHARED_EXPERT_TARGETS.get(model.family, ())
        if shared and (model.is_moe if layer is None else model.layer_is_moe(layer)):
            # names that reach the shared expert or its gate (config/lora_targets.SHARED_EXPERT_TARGETS)
            s = model.shared_expert_intermediate_size
            sizes = dict(gate_proj=(s, h), up_proj=(s, h), down_proj=(h, s), shared_expert_gate=(1, h))
            dims.update({n: sizes[n] for n in shared})
            names.update({n: SHARED_EXPERT_PROJECTIONS[n] for n in shared})
            linear = (*linear, *shared)
        if layer is not None:  # a linear-attention layer has no self_attn, a full-attention one no linear_attn
            mixes = model.layer_types[layer] == "linear_attention"
            linear = tuple(n for n in linear if (n in mixer) == mixes or (n not in mixer and n not in _ATTENTION))
    return {names.get(short) or module_name(short): dims[short] for short in lora.targets(model.family)
            if short in linear}


def layer_adapter_shapes(model: ModelConfig, lora: LoraConfig, layer: int) -> dict[str, tuple[tuple[int, int],
                                                                                             tuple[int, int]]]:
    """The shapes of A and B of every adapter of decoder layer `layer`, by module name (PEFT's), in the layer's
    order: the linear projections' and, on a MoE layer, the router's and experts' (model/lora_moe.py)."""
    shapes = {m: ((lora.r, inp), (out, lora.r)) for m, (out, inp) in adapter_shapes(model, lora, layer).items()}
    for p in param_adapters(model, lora.targets(model.family), lora.r, layer):
        shapes[p.module] = (p.a_shape, p.b_shape)
    return shapes


def adapter_numel(model: ModelConfig, lora: LoraConfig) -> int:
    """Adapter parameters of the whole model: r * (in + out) per targeted projection and layer (a stacked
    expert adapter: its experts' ranks)."""
    return sum(a[0] * a[1] + b[0] * b[1] for layer in range(model.num_layers)
               for a, b in layer_adapter_shapes(model, lora, layer).values())


SAVED_MODULES = {"embed_tokens": "model.embed_tokens.weight", "lm_head": "lm_head.weight"}
"""finetune.lora.modules_to_save: the Hugging Face name of each module's matrix."""


def saved_names(lora: LoraConfig) -> list[str]:
    """The Hugging Face names of the modules trained in full (modules_to_save), in layout order."""
    return [SAVED_MODULES[m] for m in ("embed_tokens", "lm_head") if m in lora.modules_to_save]


def lora_params(cfg: Config) -> int:
    """The parameters a LoRA run trains: the adapters and the modules_to_save (0 for full fine-tuning)."""
    if cfg.finetune.method != "lora":
        return 0
    saved = len(saved_names(cfg.finetune.lora)) * cfg.model.vocab_size * cfg.model.hidden_size
    return adapter_numel(cfg.model, cfg.finetune.lora) + saved


def lora_a(module: str) -> str:
    return f"{module}.lora_A.weight"


def lora_b(module: str) -> str:
    return f"{module}.lora_B.weight"


def _seed(run_seed: int, layer: int, module: str) -> int:
    """A generator seed per (run, layer, projection): independent of the order the adapters are made in."""
    return (run_seed * 1_000_003 + layer * 1_009 + sum(ord(c) * 31 ** i for i, c in enumerate(module))) % 2**63


def initial_adapters(model: ModelConfig, lora: LoraConfig, seed: int, layer: int,
                     dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """One layer's adapters at step 0 (CPU): A kaiming-uniform (a = sqrt(5)) as PEFT, B zeros."""
    out: dict[str, torch.Tensor] = {}
    for module, (a_shape, b_shape) in layer_adapter_shapes(model, lora, layer).items():
        gen = torch.Generator().manual_seed(_seed(seed, layer, module))
        a = torch.empty(a_shape, dtype=dtype)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
        out[lora_a(module)] = a
        out[lora_b(module)] = torch.zeros(b_shape, dtype=dtype)
    return out


def project(h: torch.Tensor, w: Mapping[str, torch.Tensor], module: str, spec: Any) -> torch.Tensor:
    """The projection `module` of the layer whose tensors are `w`, with its adapter when one is bound; `spec`:
    the layer's LayerSpec (lora_scaling, and the dropout: lora_dropout where lora_seed >= 0)."""
    out = F.linear(h, w[f"{module}.weight"], w.get(f"{module}.bias"))
    a = w.get(lora_a(module))
    if a is None:
        return out
    x = h.to(a.dtype)
    if spec.lora_inplace:
        return _add_inplace(out, x, w, module, spec)
    if spec.lora_dropout and spec.lora_seed >= 0:  # as nn.Dropout: kept inputs scaled by 1 / (1 - p)
        keep = dropout_mask(x.shape, spec.lora_seed, module, spec.lora_dropout, x.device)
        x = x * keep.to(x.dtype) / (1.0 - spec.lora_dropout)
    delta = F.linear(F.linear(x, a), w[lora_b(module)]) * spec.lora_scaling
    return (out + delta).to(out.dtype)


def projection(w: Mapping[str, torch.Tensor], spec: Any):
    """project bound to one layer's tensors: (input, module name) -> the product (model/linear_attention.Projection),
    with the module's adapter where one is bound."""
    return lambda h, module: project(h, w, module, spec)


def project_group(h: torch.Tensor, w: Mapping[str, torch.Tensor], modules: tuple[str, ...],
                  spec: Any) -> list[torch.Tensor]:
    """project of each of `modules` over the same input h (q, k and v; gate and up). With LayerSpec.lora_inplace the
    input's cast to the adapters' dtype is made once for all of them."""
    a = w.get(lora_a(modules[0]))
    if not spec.lora_inplace or a is None:
        return [project(h, w, module, spec) for module in modules]
    x = h.to(a.dtype)
    outs = []
    for module in modules:
        out = F.linear(h, w[f"{module}.weight"], w.get(f"{module}.bias"))
        outs.append(_add_inplace(out, x, w, module, spec) if lora_a(module) in w else out)
    return outs


def _add_inplace(out: torch.Tensor, x: torch.Tensor, w: Mapping[str, torch.Tensor], module: str,
                 spec: Any) -> torch.Tensor:
    """out + scaling * B A x into `out` (LayerSpec.lora_inplace; no dropout): the sum computed in the wider dtype and
    rounded once to out's, as project's, with the scaling applied in the same kernel."""
    return out.add_(F.linear(F.linear(x, w[lora_a(module)]), w[lora_b(module)]), alpha=spec.lora_scaling)


def dropout_mask(shape: torch.Size, seed: int, module: str, p: float, device: torch.device) -> torch.Tensor:
    """The kept inputs (True) of the adapter on `module`, drawn from (seed, module) alone: the forward and the
    recompute of the same layer in the same step draw the same mask."""
    gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(module.encode())) % 2**63)
    return torch.rand(shape, generator=gen, device=device) >= p


def layer_dropout_seed(run_seed: int, step: int, layer: int) -> int:
    """The dropout seed of a decoder layer in a training step (LayerSpec.lora_seed)."""
    return (run_seed * 1_000_003 + step) * 10_007 + layer


def chunk_spec(spec: Any, chunk: int) -> Any:
    """The spec of a chunk of the MLP's tokens: its own dropout seed (chunks of one size would draw one mask)."""
    if spec.lora_seed < 0 or not spec.lora_dropout or chunk == 0:
        return spec
    return replace(spec, lora_seed=spec.lora_seed * 131 + chunk)


def is_adapter(name: str) -> bool:
    """Whether a tensor name inside a layer is an adapter's."""
    return ".lora_A." in name or ".lora_B." in name


def peft_name(layer: int, name: str) -> str:
    """PEFT's name of a layer's adapter tensor in adapter_model.safetensors (e.g.
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)."""
    return f"{_PEFT_PREFIX}model.layers.{layer}.{name}"


def peft_saved_name(hf_name: str) -> str:
    """PEFT's name of a modules_to_save matrix in adapter_model.safetensors (base_model.model.lm_head.weight)."""
    return _PEFT_PREFIX + hf_name


def from_peft_name(key: str) -> tuple[int, str]:
    """(layer, name inside the layer) of a PEFT adapter key; the inverse of peft_name."""
    prefix = f"{_PEFT_PREFIX}model.layers."
    if not key.startswith(prefix):
        raise KeyError(f"{key!r} is not a decoder layer's adapter")
    layer, _, name = key[len(prefix):].partition(".")
    return int(layer), name


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling * B A, in float32 (or wider), as PEFT's merge computes the delta; the caller casts."""
    work = torch.promote_types(weight.dtype, torch.float32)
    return weight.to(work) + (b.to(work) @ a.to(work)) * scaling


MERGE_CHUNK_ELEMENTS = 2**24
"""merge_adapters' rows at a time: at most this many elements of a matrix (64 MiB in float32) per temporary."""


def merge_adapters(weights: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], scaling: float) -> None:
    """Each adapted projection's base matrix in `weights` overwritten with merged_weight (W + scaling * B A, rounded
    once to W's dtype), by blocks of rows (the temporaries stay under MERGE_CHUNK_ELEMENTS elements). `adapters`:
    the layer's `<module>.lora_A.weight` / `.lora_B.weight`, linear projections only."""
    for name, a in adapters.items():
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0]
        weight, b = weights[f"{module}.weight"], adapters[lora_b(module)]
        rows = max(1, MERGE_CHUNK_ELEMENTS // weight.shape[1])
        for r in range(0, weight.shape[0], rows):
            weight[r:r + rows].copy_(merged_weight(weight[r:r + rows], a, b[r:r + rows], scaling))


def peft_adapter_config(model: ModelConfig, lora: LoraConfig, base: str) -> dict:
    """adapter_config.json as peft.LoraConfig.save_pretrained writes the keys that matter for loading."""
    alpha = int(lora.lora_alpha) if float(lora.lora_alpha).is_integer() else lora.lora_alpha
    targets = lora.targets(model.family)
    linear = [module.rpartition(".")[2] for module in adapter_shapes(model, lora)]
    params = PEFT_PARAMETERS if model.is_moe else {}
    # the router and experts as peft's conversion leaves them: target_parameters, gate_up_proj at rank 2r
    fused = {r".*\.gate_up_proj": 2} if "gate_up_proj" in targets and model.is_moe else {}
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.r,
        "lora_alpha": alpha, "lora_dropout": lora.lora_dropout, "bias": lora.bias, "use_rslora": lora.use_rslora,
        "target_modules": sorted(linear), "modules_to_save": list(lora.modules_to_save) or None,
        # (a name that reaches an nn.Linear here is no parameter target: Qwen3.5-MoE's down_proj is its shared expert's)
        "target_parameters": sorted(params[t] for t in targets if t in params and t not in linear) or None,
        "fan_in_fan_out": False,
        "init_lora_weights": True, "inference_mode": True, "use_dora": False, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {k: n * lora.r for k, n in fused.items()},
        "alpha_pattern": {k: n * alpha for k, n in fused.items()}, "revision": None,
    }


PEFT_PARAMETERS = {"gate": "gate.weight", "gate_up_proj": "gate_up_proj", "down_proj": "down_proj"}
"""A MoE family's router and expert targets as peft's target_parameters name them."""


ADAPTER_STATE_BYTES = 16
"""Device bytes per adapter parameter: float32 weight, gradient and AdamW's two moments."""


def adapter_activation_bytes(model: ModelConfig, lora: LoraConfig, tokens: int, mlp_tokens: int,
                             compute_bytes: int) -> int:
    """What the adapters add to one layer's recompute-backward (project): per targeted projection, autograd
    keeps the input cast to float32 (a copy unless the layer computes in float32) and the [tokens, r]
    product with A. The MLP's projections see `mlp_tokens` at a time (engine.mlp_chunk_tokens). A MoE layer's
    router and expert adapters make the adapted tensor (its size in the compute dtype) and, in the backward, its
    gradient (model/lora_moe.py)."""
    def held(layer: int) -> int:
        return sum((mlp_tokens if module.startswith("mlp.") else tokens) *
                   ((in_features * 4 if compute_bytes != 4 else 0) + lora.r * 4)
                   for module, (_, in_features) in adapter_shapes(model, lora, layer).items())
    total = max(held(layer) for layer in range(model.num_layers))
    adapted = max((sum(p.experts * p.in_features * p.out_features for p in
                       param_adapters(model, lora.targets(model.family), lora.r, layer))
                   for layer in range(model.num_layers)), default=0)
    return total + 2 * adapted * compute_bytes
