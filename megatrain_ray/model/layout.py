"""Flat layout of the model: stages, and the tensors of each stage at fixed offsets.

A *stage* is the unit the engine streams: the embedding, each decoder layer, and the head
(final norm and LM head). Each stage's tensors live in one flat buffer per kind (master,
moments, streaming copy, gradient), at offsets fixed here, so a stage moves host->device in
one copy and the optimizer works on flat spans. Within a stage, tensors that get weight decay
(matrices) come first, so decay is one contiguous span `[0, decay_numel)`.

Tensor names are Hugging Face's, so loading and exporting checkpoints is a rename-free copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatrain_ray.config.hf_generic import architecture
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.config.linear_attention_section import FUSED_PROJECTIONS, LinearAttentionConfig
from megatrain_ray.model.moe import moe_mlp_tensors
from megatrain_ray.model.sigmoid_router import FIXED_TENSORS

# Offsets are multiples of this many elements (256 bytes in fp32): vectorised loops and
# device copies stay aligned for every dtype we use.
ALIGN_ELEMS = 64

StageKind = Literal["embed", "layer", "head"]


def align(n: int) -> int:
    return (n + ALIGN_ELEMS - 1) // ALIGN_ELEMS * ALIGN_ELEMS


@dataclass(frozen=True, slots=True)
class TensorSlot:
    name: str
    """Name within the stage (e.g. `self_attn.q_proj.weight`)."""
    shape: tuple[int, ...]
    offset: int
    """Element offset in the stage's flat buffer."""
    init: Literal["normal", "ones", "zeros"]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def decay(self) -> bool:
        return len(self.shape) >= 2


@dataclass(frozen=True, slots=True)
class StageLayout:
    index: int
    """Position in forward order: 0 is the embedding, 1..L the layers, L+1 the head."""
    kind: StageKind
    prefix: str
    """Prefix that turns a slot name into the Hugging Face name."""
    slots: tuple[TensorSlot, ...]
    numel: int
    """Length of the flat buffer, padding included."""
    decay_numel: int
    """[0, decay_numel) gets weight decay; the rest does not."""

    @property
    def name(self) -> str:
        return f"layer{self.index - 1}" if self.kind == "layer" else self.kind

    def slot(self, name: str) -> TensorSlot:
        for s in self.slots:
            if s.name == name:
                return s
        raise KeyError(f"stage {self.name} has no tensor {name!r}")

    def hf_name(self, slot: TensorSlot) -> str:
        return self.prefix + slot.name


def _stage(index: int, kind: StageKind, prefix: str, tensors: list[tuple[str, tuple[int, ...], str]]) -> StageLayout:
    ordered = sorted(tensors, key=lambda t: len(t[1]) < 2)  # matrices first; stable otherwise
    slots, offset, decay_numel = [], 0, 0
    for name, shape, init in ordered:
        slots.append(TensorSlot(name, shape, offset, init))  # type: ignore[arg-type]
        offset = align(offset + math.prod(shape))
        if len(shape) >= 2:
            decay_numel = offset
    return StageLayout(index, kind, prefix, tuple(slots), offset, decay_numel)


def layer_tensors(cfg: ModelConfig, layer: int = 0) -> list[tuple[str, tuple[int, ...], str]]:
    """The tensors of decoder layer `layer` (from 0): its name, shape and initialisation."""
    h, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.resolved_head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    if cfg.family == "phi3":
        # Phi-3 keeps Hugging Face's fused matrices as they are (rows q | k | v, and gate | up): a 1:1
        # name mapping on import and export; the template splits its output.
        return [
            ("self_attn.qkv_proj.weight", (q + 2 * kv, h), "normal"),
            ("self_attn.o_proj.weight", (h, q), "normal"),
            ("mlp.gate_up_proj.weight", (2 * f, h), "normal"),
            ("mlp.down_proj.weight", (h, f), "normal"),
            ("input_layernorm.weight", (h,), "ones"),
            ("post_attention_layernorm.weight", (h,), "ones"),
        ]
    projections = [
        ("self_attn.q_proj.weight", (q, h), "normal"),
        ("self_attn.k_proj.weight", (kv, h), "normal"),
        ("self_attn.v_proj.weight", (kv, h), "normal"),
        ("self_attn.o_proj.weight", (h, q), "normal"),
        ("mlp.gate_proj.weight", (f, h), "normal"),
        ("mlp.up_proj.weight", (f, h), "normal"),
        ("mlp.down_proj.weight", (h, f), "normal"),
    ]
    if cfg.linear_attention is not None:
        return _hybrid_layer_tensors(cfg, layer, projections)
    if cfg.latent_attention is not None:  # DeepSeek-V3: latent attention; dense first layers, then experts
        mlp = moe_mlp_tensors(cfg) if cfg.layer_is_moe(layer) else [t for t in projections if t[0].startswith("mlp.")]
        return [*latent_attention_tensors(cfg), *mlp, ("input_layernorm.weight", (h,), "ones"),
                ("post_attention_layernorm.weight", (h,), "ones")]
    if cfg.is_gemma:
        # Gemma: norms before and after attention and MLP, each scaled by (1 + weight): zeros are the identity
        # (as transformers initialises them); Gemma 3 adds the q/k norms, zeros too.
        norms = [(f"{name}.weight", (h,), "zeros") for name in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")]
        qk = [("self_attn.q_norm.weight", (hd,), "zeros"), ("self_attn.k_norm.weight", (hd,), "zeros")]
        return [*projections, *norms, *(qk if cfg.qk_norm else [])]
    tensors = [*projections, ("input_layernorm.weight", (h,), "ones"), ("post_attention_layernorm.weight", (h,), "ones")]
    if cfg.attention_bias:
        tensors += [("self_attn.q_proj.bias", (q,), "zeros"), ("self_attn.k_proj.bias", (kv,), "zeros"),
                    ("self_attn.v_proj.bias", (kv,), "zeros")]
    if cfg.qk_norm:
        tensors += [("self_attn.q_norm.weight", (hd,), "ones"), ("self_attn.k_norm.weight", (hd,), "ones")]
    if cfg.layer_is_moe(layer):  # experts in place of the dense MLP (model/moe.py); gpt-oss: o_proj bias, sinks
        tensors = [t for t in tensors if not t[0].startswith("mlp.")] + moe_mlp_tensors(cfg)
        if cfg.family == "gpt_oss":
            tensors += [("self_attn.o_proj.bias", (h,), "zeros"), ("self_attn.sinks", (cfg.num_attention_heads,),
                                                                    "normal")]
    return tensors


def latent_attention_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """The tensors of a latent-attention layer's attention half (besides input_layernorm; model/latent_attention.py), by
    transformers' names."""
    la, h, heads = cfg.latent_attention, cfg.hidden_size, cfg.num_attention_heads
    if la.q_lora_rank:
        query = [("self_attn.q_a_proj.weight", (la.q_lora_rank, h), "normal"),
                 ("self_attn.q_b_proj.weight", (heads * la.qk_head_dim, la.q_lora_rank), "normal"),
                 ("self_attn.q_a_layernorm.weight", (la.q_lora_rank,), "ones")]
    else:
        query = [("self_attn.q_proj.weight", (heads * la.qk_head_dim, h), "normal")]
    return [*query,
            ("self_attn.kv_a_proj_with_mqa.weight", (la.kv_lora_rank + la.qk_rope_head_dim, h), "normal"),
            ("self_attn.kv_b_proj.weight", (heads * (la.qk_nope_head_dim + la.v_head_dim), la.kv_lora_rank), "normal"),
            ("self_attn.o_proj.weight", (h, heads * la.v_head_dim), "normal"),
            ("self_attn.kv_a_layernorm.weight", (la.kv_lora_rank,), "ones")]


def linear_attention_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """The tensors of a linear-attention layer's token mixer (model/linear_attention.py), by transformers' names.
    Random initialisation takes A_log 0 (A = 1, a log-decay of -softplus(a + 1) per token) where transformers draws
    log U(0.01, 16)."""
    la: LinearAttentionConfig = cfg.linear_attention
    h, heads = cfg.hidden_size, la.num_value_heads
    if cfg.family in FUSED_PROJECTIONS:
        projections = [("linear_attn.in_proj_qkvz.weight", (2 * la.key_width + 2 * la.value_width, h), "normal"),
                       ("linear_attn.in_proj_ba.weight", (2 * heads, h), "normal")]
    else:
        projections = [("linear_attn.in_proj_qkv.weight", (la.conv_width, h), "normal"),
                       ("linear_attn.in_proj_z.weight", (la.value_width, h), "normal"),
                       ("linear_attn.in_proj_b.weight", (heads, h), "normal"),
                       ("linear_attn.in_proj_a.weight", (heads, h), "normal")]
    return [*projections,
            ("linear_attn.conv1d.weight", (la.conv_width, 1, la.conv_kernel_dim), "normal"),
            ("linear_attn.out_proj.weight", (h, la.value_width), "normal"),
            ("linear_attn.dt_bias", (heads,), "ones"), ("linear_attn.A_log", (heads,), "zeros"),
            ("linear_attn.norm.weight", (la.value_head_dim,), "ones")]


def _hybrid_layer_tensors(cfg: ModelConfig, layer: int, projections: list) -> list[tuple[str, tuple[int, ...], str]]:
    """Qwen3.5 and Qwen3-Next: a linear-attention token mixer (model/linear_attention.py) or a gated attention, whose
    q_proj yields each head's query and gate (twice the query width); (1 + weight) norms, zeros at the start, as
    transformers initialises them; the dense MLP or the experts with their shared expert."""
    h, hd = cfg.hidden_size, cfg.resolved_head_dim
    if cfg.layer_is_linear(layer):
        mixer = linear_attention_tensors(cfg)
    else:
        mixer = [(n, (2 * shape[0], shape[1]) if n == "self_attn.q_proj.weight" else shape, init)
                 for n, shape, init in projections if n.startswith("self_attn.")]
        mixer += [("self_attn.q_norm.weight", (hd,), "zeros"), ("self_attn.k_norm.weight", (hd,), "zeros")]
    mlp = moe_mlp_tensors(cfg) if cfg.layer_is_moe(layer) else [t for t in projections if t[0].startswith("mlp.")]
    norms = [("input_layernorm.weight", (h,), "zeros"), ("post_attention_layernorm.weight", (h,), "zeros")]
    return [*mixer, *mlp, *norms]


@dataclass(frozen=True, slots=True)
class ModelLayout:
    stages: tuple[StageLayout, ...]
    tied: bool
    buffers: tuple[str, ...] = ()
    """A generic model's persistent buffers by Hugging Face name (config/hf_generic.py): read from model.path
    into its modules where it holds them, and exported; none for the native templates."""
    frozen: tuple[str, ...] = ()
    """A generic model's parameters that it never trains (requires_grad=False), by Hugging Face name: in no stage,
    read from model.path (which must hold them) into its modules, and exported."""

    @property
    def embed(self) -> StageLayout:
        return self.stages[0]

    @property
    def head(self) -> StageLayout:
        return self.stages[-1]

    @property
    def layers(self) -> tuple[StageLayout, ...]:
        return self.stages[1:-1]

    def resident_stages(self, count: int, vocab: bool = False) -> tuple[StageLayout, ...]:
        """The stages the GPU-resident tier keeps (engine.gpu_resident): the first `count` decoder layers, and with
        `vocab` (RunSpec.resident_vocab) the embedding and the LM head, in stage order. The next forward needs the
        first layers' updates first, and their backward comes last, so while they compute and update on the device
        the CPU optimizer catches up with the streamed layers' updates."""
        return (self.embed,) * vocab + self.layers[:count] + (self.head,) * vocab

    def kept_stages(self, resident_layers: int, kept: int) -> tuple[StageLayout, ...]:
        """The resident layers whose forward keeps its autograd graph (RunSpec.kept_layers): the last `kept` of the
        first `resident_layers`, whose graphs the backward frees first."""
        kept = min(kept, resident_layers)
        return self.layers[resident_layers - kept:resident_layers]

    def speculative_stages(self, count: int, resident_layers: int, vocab: bool = False) -> tuple[int, ...]:
        """The stages updated before the step's gradient norm is known (optimizer.speculative_stages): the first
        `count` whose gradients land, the LM head's then the last layers', none of the GPU-resident tier's
        (updated on the device; the head too with `vocab`) nor the embedding's (the norm is known as it lands)."""
        streamed = [s.index for s in self.layers[resident_layers:]]
        return tuple([*([] if vocab else [self.head.index]), *reversed(streamed)][:count])

    @property
    def max_layer_numel(self) -> int:
        return max(s.numel for s in self.layers)

    @property
    def num_params(self) -> int:
        """The model's parameters: every slot's but the buffers a stage carries untrained (FIXED_TENSORS: DeepSeek-V3's
        routing bias), as transformers counts them."""
        return sum(s.numel for stage in self.stages for s in stage.slots if s.name not in FIXED_TENSORS)

    def stage_of(self, hf_name: str) -> tuple[StageLayout, TensorSlot]:
        for stage in self.stages:
            if hf_name.startswith(stage.prefix):
                for s in stage.slots:
                    if stage.prefix + s.name == hf_name:
                        return stage, s
        raise KeyError(f"no tensor named {hf_name!r} in this model")


def _generic_layout(cfg: ModelConfig) -> ModelLayout:
    """model.template generic: the stages of model.path's model class (config/hf_generic.py) under Hugging
    Face's names: the embedding matrix, each layer's parameters, the final norm's and an untied LM head."""
    arch = architecture(str(Path(cfg.path).resolve()))

    def tensors(prefix: str, module) -> list[tuple[str, tuple[int, ...], str]]:
        # Random initialisation is never used on this path (it needs model.path), but every slot has a kind.
        return [(prefix + n, tuple(p.shape), "normal" if p.dim() >= 2 else "zeros" if n.endswith("bias") else "ones")
                for n, p in module.named_parameters() if p.requires_grad]  # frozen ones: ModelLayout.frozen

    stages = [_stage(0, "embed", arch.base_prefix, [(arch.embed_weight_name, tuple(arch.embedding.weight.shape),
                                                     "normal")])]
    for i, layer in enumerate(arch.layers):
        stages.append(_stage(i + 1, "layer", f"{arch.base_prefix}{arch.layers_name}.{i}.", tensors("", layer)))
    head = tensors(arch.norm_prefix, arch.norm)
    if not arch.tied:
        head += tensors(f"{arch.lm_head_name}.", arch.model.get_output_embeddings())
    stages.append(_stage(len(arch.layers) + 1, "head", "", head))
    return ModelLayout(tuple(stages), arch.tied, tuple(arch.persistent_buffers), tuple(arch.frozen_parameters))


def build_layout(cfg: ModelConfig) -> ModelLayout:
    if cfg.template == "generic":
        return _generic_layout(cfg)
    v, h = cfg.vocab_size, cfg.hidden_size
    stages = [_stage(0, "embed", "model.", [("embed_tokens.weight", (v, h), "normal")])]
    for i in range(cfg.num_layers):
        stages.append(_stage(i + 1, "layer", f"model.layers.{i}.", layer_tensors(cfg, i)))
    # The head's prefix is empty: its tensors are `model.norm.weight` and `lm_head.weight`.
    head = [("model.norm.weight", (h,), "zeros" if cfg.zero_centered_norms else "ones")]  # (1 + weight)
    if not cfg.tie_word_embeddings:
        head.append(("lm_head.weight", (v, h), "normal"))
    stages.append(_stage(cfg.num_layers + 1, "head", "", head))
    return ModelLayout(tuple(stages), cfg.tie_word_embeddings)


def token_chunks(tokens: int, chunk_tokens: int) -> list[slice]:
    """Slices of at most chunk_tokens tokens (one slice when chunk_tokens is 0 or not smaller)."""
    if chunk_tokens <= 0 or tokens <= chunk_tokens:
        return [slice(0, tokens)]
    return [slice(a, min(a + chunk_tokens, tokens)) for a in range(0, tokens, chunk_tokens)]
