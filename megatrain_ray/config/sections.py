"""Configuration: one dataclass per concern, each checking its own values.

A run is described by a YAML file whose sections map one to one onto `Config`'s fields
(config/load.py reads it). Impossible values raise `ConfigError` naming the dotted key
(`optimizer.lr`), the value received and what to do, before anything is allocated. Settings
derived from several sections and the machine live in config/resolved.py (RunSpec).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from megatrain_ray.dtypes import DTYPE_RANK
from megatrain_ray.exceptions import ConfigError, excerpt

DType = Literal["bfloat16", "float16", "float32", "float64"]


def _fail(key: str, value: Any, why: str) -> None:
    raise ConfigError(f"config key '{key}' = {excerpt(value)}: {why}")


@dataclass(kw_only=True, slots=True)
class RopeScalingConfig:
    """RoPE frequency scaling, as in the `rope_scaling` entry of a Hugging Face config."""

    SECTION: ClassVar[str] = "model.rope_scaling"
    rope_type: Literal["llama3", "yarn", "linear", "longrope"] = "llama3"
    """llama3: Llama 3.1's wavelength-dependent scaling; yarn: YaRN (Qwen2.5 long context, as in
    transformers: interpolated and extrapolated frequencies blended over a ramp, cos/sin scaled by
    the attention factor); linear: positions divided by `factor`; longrope: Phi-3's LongRoPE (each
    frequency divided by its entry of short_factor, or of long_factor when a sequence is longer than
    original_max_position_embeddings; cos/sin scaled by the attention factor)."""
    factor: float = 8.0
    """How much longer the context is than the one the model was trained on (longrope: only derives
    the attention factor; Phi-3 configs leave it out and it is max_position_embeddings over
    original_max_position_embeddings)."""
    low_freq_factor: float = 1.0
    """llama3 only: wavelengths above original_max_position_embeddings / low_freq_factor are scaled fully."""
    high_freq_factor: float = 4.0
    """llama3 only: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """llama3, yarn and longrope: the context length of the unscaled model."""
    beta_fast: float = 32.0
    """yarn only: rotations at which the ramp from extrapolation starts."""
    beta_slow: float = 1.0
    """yarn only: rotations at which the ramp to interpolation ends."""
    attention_factor: float = 0.0
    """yarn and longrope: factor on cos and sin; 0 derives it from factor (yarn: and mscale, mscale_all_dim;
    longrope: sqrt(1 + ln(factor) / ln(original_max_position_embeddings)))."""
    mscale: float = 0.0
    """yarn only: with mscale_all_dim, derives attention_factor as in DeepSeek's configs; 0 when unused."""
    mscale_all_dim: float = 0.0
    """yarn only: see mscale."""
    truncate: bool = True
    """yarn only: round the ramp's ends to whole dimensions (transformers' default)."""
    short_factor: list[float] = field(default_factory=list)
    """longrope only: one divisor per rotated frequency (rotary dimensions / 2 of them), used while a
    sequence fits original_max_position_embeddings."""
    long_factor: list[float] = field(default_factory=list)
    """longrope only: the divisors used for sequences longer than original_max_position_embeddings."""

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            _fail(f"{self.SECTION}.factor", self.factor, "must be >= 1")
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            _fail(f"{self.SECTION}.low_freq_factor", self.low_freq_factor,
                  "must be > 0 and below high_freq_factor")
        if self.rope_type == "yarn" and not self.beta_fast > self.beta_slow > 0:
            _fail(f"{self.SECTION}.beta_slow", self.beta_slow, "must be > 0 and below beta_fast")
        if self.original_max_position_embeddings < 1:
            _fail(f"{self.SECTION}.original_max_position_embeddings", self.original_max_position_embeddings,
                  "must be >= 1")
        if self.rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                values = getattr(self, key)
                if not values or not all(math.isfinite(v) and v > 0 for v in values):
                    _fail(f"{self.SECTION}.{key}", values, "longrope needs a list of finite numbers > 0, one per "
                          "rotated frequency (rotary dimensions / 2)")

    @property
    def resolved_attention_factor(self) -> float:
        """The factor on cos and sin (1 except for yarn and longrope), as transformers derives it."""
        if self.rope_type not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor:
            return self.attention_factor
        if self.rope_type == "longrope":
            if self.factor <= 1:
                return 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))

        def mscale_of(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale_of(self.factor, self.mscale) / mscale_of(self.factor, self.mscale_all_dim)
        return mscale_of(self.factor)


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The decoder's shape. Field names follow Hugging Face's config.json where one exists."""

    SECTION: ClassVar[str] = "model"
    path: str = ""
    """The model to fine-tune: a Hugging Face model directory (config.json + safetensors weights), a hub
    name such as `Qwen/Qwen2.5-7B-Instruct` (resolved through huggingface_hub: HF_HOME, HF_TOKEN and
    HF_HUB_OFFLINE are honoured; only JSON, tokenizer and safetensors files are downloaded, the weights
    when a run starts), or a `.gguf` file (converted once to float32 into a cached directory under
    $MEGATRAIN_CACHE, default ~/.cache/megatrain). Its weights are loaded into the host store and every
    shape key below is read from its config.json (a shape key also set here must agree). Empty: random
    initialisation (pre-training from scratch). Relative paths are resolved like data.path; on a
    multi-node cluster every HostShard's node must see it. The resolved config.yaml of a run records
    the local directory it came to."""
    revision: str = ""
    """With a hub name in model.path: the branch, tag or commit to use. Empty: the default branch."""
    family: Literal["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3_moe", "mixtral",
                    "gpt_oss", "generic"] = "llama"
    """Architecture family; decides the Hugging Face class on export and the checks on load. gemma2 and
    gemma3 (Gemma3ForCausalLM, text only) also bring Gemma's fixed parts: RMSNorm scaling by (1 + weight),
    norms before and after attention and MLP, a GeLU-tanh MLP and embeddings scaled by sqrt(hidden_size).
    qwen3_moe, mixtral and gpt_oss are mixtures of experts (num_experts and the keys below it).
    generic: a model of model.path with no native template, run by the generic path (model.template);
    set from config.json, never by hand."""
    template: Literal["auto", "native", "generic"] = "auto"
    """How the decoder layers run. native: megatrain's own templates (the families above; fastest).
    generic: transformers' own decoder-layer class of the model in model.path, run statelessly on the
    streamed weights (torch.func.functional_call), with the model's own rotary embedding, masks, final
    norm and embedding module; any decoder-only causal LM that transformers ships, slower than native, no
    packed documents (data.packing), no torch.compile; needs model.path (docs/model-families.md). auto:
    native where config.json names a native family, else generic; the log says which. A run's resolved
    config records native or generic."""
    vocab_size: int = 32000
    """Rows of the embedding and of the LM head."""
    hidden_size: int = 4096
    """Width of the residual stream."""
    intermediate_size: int = 11008
    """Width of the gated MLP (SwiGLU; GeLU-tanh for Gemma). Mixtral and gpt-oss: the width of each expert;
    Qwen3-MoE: of its dense layers (mlp_only_layers), its experts take moe_intermediate_size."""
    num_layers: int = 32
    """Decoder layers; host memory grows with it, GPU memory does not (beyond kept activations)."""
    num_attention_heads: int = 32
    """Query heads."""
    num_key_value_heads: int = 32
    """Fewer than num_attention_heads means grouped-query attention."""
    head_dim: int = 0
    """0 means hidden_size // num_attention_heads (Qwen3 and Gemma set it explicitly)."""
    rope_theta: float = 10000.0
    """RoPE base: wavelengths grow geometrically from 2 pi to about 2 pi * rope_theta (Gemma 3: of the
    global layers)."""
    rope_scaling: RopeScalingConfig | None = None
    """null for plain RoPE, or a mapping of model.rope_scaling keys (below); Gemma 3: of the global layers."""
    rope_local_base_freq: float = 0.0
    """Gemma 3 only: the RoPE base of its sliding-window layers, which take no rope_scaling (10000 in
    Gemma 3's configs; 0: rope_theta). Other families: every layer uses rope_theta and rope_scaling."""
    partial_rotary_factor: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates (the first ones; the rest pass unrotated).
    Phi-3 only, as transformers: below 1 for other families is refused."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm's square root."""
    tie_word_embeddings: bool = False
    """True: the LM head reuses the embedding matrix (small Qwen models)."""
    attention_bias: bool = False
    """Bias on the q, k and v projections (Qwen2 / Qwen2.5)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    sliding_window: int = 0
    """Tokens each query may look back over (Mistral, Phi-3; Gemma: in its sliding layers only, see
    layer_types); 0 means full causal attention."""
    layer_types: list[Literal["full_attention", "sliding_attention"]] = field(default_factory=list)
    """Gemma and gpt-oss only: one entry per layer, sliding_attention (within sliding_window, Gemma 3: local
    RoPE) or full_attention (global), as Hugging Face's config.json lists them. Empty: from
    sliding_window_pattern (gpt-oss: every layer slides when sliding_window is set)."""
    sliding_window_pattern: int = 0
    """Gemma only, when layer_types is empty: every n-th layer (n, 2n, ...) is global, the others slide
    (6 for Gemma 3: 5 local to 1 global; 2 for Gemma 2). 0 with layer_types empty: every layer slides
    (when sliding_window is set), as for Mistral."""
    query_pre_attn_scalar: int = 0
    """Gemma only: attention scores are scaled by query_pre_attn_scalar ** -0.5. 0: head_dim ** -0.5."""
    attn_logit_softcapping: float = 0.0
    """Gemma 2 only (its checkpoints: 50): attention scores become cap * tanh(score / cap) before the softmax;
    attention then runs through explicit matrix products, not SDPA. 0: off."""
    final_logit_softcapping: float = 0.0
    """Gemma only (Gemma 2: 30): logits become cap * tanh(logit / cap), in the loss and its gradient too.
    0: off."""
    num_experts: int = 0
    """Mixture of experts (qwen3_moe, mixtral, gpt_oss; config.json's num_experts or num_local_experts):
    experts per MoE layer, each a gated MLP, kept fused per layer as transformers 5 keeps them
    (mlp.experts.gate_up_proj [E, ...], mlp.experts.down_proj [E, ...]). 0: a dense model."""
    num_experts_per_tok: int = 0
    """MoE: the experts each token is routed to (top-k of the router)."""
    moe_intermediate_size: int = 0
    """Qwen3-MoE: the width of each expert (intermediate_size is its dense layers'). 0: intermediate_size."""
    norm_topk_prob: bool = False
    """Qwen3-MoE: the top-k routing probabilities are renormalised to sum to 1 (Mixtral always does)."""
    decoder_sparse_step: int = 1
    """Qwen3-MoE: layer i (from 0) is a MoE layer when (i + 1) % decoder_sparse_step == 0 and i is not in
    mlp_only_layers; the others have a dense MLP of intermediate_size."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Qwen3-MoE: layers (from 0) with a dense MLP whatever decoder_sparse_step says."""
    output_router_logits: bool = False
    """MoE: add router_aux_loss_coef times the load-balancing loss (transformers' load_balancing_loss_func over
    all MoE layers, padding included as transformers does without an attention mask) to the training loss,
    as transformers does when config.json's output_router_logits is true; the step records log it apart as
    aux_loss. With several GPU workers the counts are summed over them: the loss of the whole batch."""
    router_aux_loss_coef: float = 0.001
    """MoE: the weight of the load-balancing loss (read when output_router_logits is true)."""
    swiglu_limit: float = 0.0
    """gpt-oss: the experts' clamped SwiGLU, gate clamped to at most limit, up to [-limit, limit] (7.0)."""
    swiglu_alpha: float = 0.0
    """gpt-oss: the experts' gate activation gate * sigmoid(alpha * gate) (1.702)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model is meant for; data.seq_len may not exceed it without rope_scaling."""
    initializer_range: float = 0.02
    """Standard deviation of the random initialisation of matrices (as in Hugging Face)."""

    def __post_init__(self) -> None:
        s = self.SECTION
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                _fail(f"{s}.{name}", getattr(self, name), "must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            _fail(f"{s}.num_key_value_heads", self.num_key_value_heads,
                  f"must divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim < 0:
            _fail(f"{s}.head_dim", self.head_dim, "must be >= 0 (0 derives it)")
        if self.head_dim == 0 and self.hidden_size % self.num_attention_heads:
            _fail(f"{s}.head_dim", 0, f"hidden_size={self.hidden_size} is not divisible by "
                  f"num_attention_heads={self.num_attention_heads}; set head_dim explicitly")
        if self.resolved_head_dim % 2:
            _fail(f"{s}.head_dim", self.resolved_head_dim, "must be even for RoPE")
        if self.rope_theta <= 0:
            _fail(f"{s}.rope_theta", self.rope_theta, "must be > 0")
        if not 0 < self.partial_rotary_factor <= 1:
            _fail(f"{s}.partial_rotary_factor", self.partial_rotary_factor, "must be > 0 and <= 1")
        if self.partial_rotary_factor != 1 and self.family != "phi3":
            _fail(f"{s}.partial_rotary_factor", self.partial_rotary_factor,
                  f"is read by the phi3 family only (family is {self.family}); leave it at 1")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            _fail(f"{s}.partial_rotary_factor", self.partial_rotary_factor,
                  f"rotates {self.rotary_dim} of the head's {self.resolved_head_dim} dimensions; RoPE needs an "
                  "even number >= 2")
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(getattr(scaling, key)) != self.rotary_dim // 2:
                    _fail(f"{s}.rope_scaling.{key}", getattr(scaling, key),
                          f"needs {self.rotary_dim // 2} entries (rotary dimensions {self.rotary_dim} / 2), "
                          f"has {len(getattr(scaling, key))}")
        if self.rms_norm_eps <= 0:
            _fail(f"{s}.rms_norm_eps", self.rms_norm_eps, "must be > 0")
        if self.sliding_window < 0:
            _fail(f"{s}.sliding_window", self.sliding_window, "must be >= 0 (0 disables it)")
        self._check_gemma()
        if self.template == "generic" and not self.path:
            _fail(f"{s}.template", self.template, "runs the model class of a Hugging Face directory: set model.path")
        if self.family == "generic" and self.template != "generic":
            _fail(f"{s}.family", self.family, "is the generic path's (model.template=generic); name a native family")
        self._check_moe()
        if self.initializer_range <= 0:
            _fail(f"{s}.initializer_range", self.initializer_range, "must be > 0")

    def _check_gemma(self) -> None:
        s = self.SECTION
        gemma_keys = {"layer_types": [], "sliding_window_pattern": 0, "query_pre_attn_scalar": 0.0,
                      "attn_logit_softcapping": 0.0, "final_logit_softcapping": 0.0, "rope_local_base_freq": 0.0}
        for key in ("sliding_window_pattern", "query_pre_attn_scalar", "attn_logit_softcapping",
                    "final_logit_softcapping", "rope_local_base_freq"):
            value = getattr(self, key)
            if not math.isfinite(value) or value < 0:
                _fail(f"{s}.{key}", value, "must be a finite number >= 0 (0: off)")
        if self.family == "gpt_oss":  # its layer_types alternate sliding and full attention
            del gemma_keys["layer_types"]
            if self.layer_types and len(self.layer_types) != self.num_layers:
                _fail(f"{s}.layer_types", self.layer_types, f"needs one entry per layer ({self.num_layers}), "
                      f"has {len(self.layer_types)}")
        if not self.is_gemma:
            for key, off in gemma_keys.items():
                if getattr(self, key) != off:
                    _fail(f"{s}.{key}", getattr(self, key),
                          f"is read by the gemma2 and gemma3 families only (family is {self.family}); leave it unset")
            return
        if self.attn_logit_softcapping and self.family != "gemma2":
            _fail(f"{s}.attn_logit_softcapping", self.attn_logit_softcapping,
                  "is read by the gemma2 family only (transformers' Gemma 3 does not apply it); leave it at 0")
        if self.rope_local_base_freq and self.family != "gemma3":
            _fail(f"{s}.rope_local_base_freq", self.rope_local_base_freq,
                  "is read by the gemma3 family only (Gemma 2 has one RoPE base); leave it at 0")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            _fail(f"{s}.layer_types", self.layer_types, f"needs one entry per layer ({self.num_layers}), "
                  f"has {len(self.layer_types)}")
        if self.qk_norm != (self.family == "gemma3"):
            _fail(f"{s}.qk_norm", self.qk_norm, f"{self.family} {'has' if self.family == 'gemma3' else 'has no'} "
                  f"q/k norms: set it {str(self.family == 'gemma3').lower()}")
        if self.attention_bias:
            _fail(f"{s}.attention_bias", True, "Gemma's templates have no projection biases (as Gemma's checkpoints)")

    def _check_moe(self) -> None:
        s = self.SECTION
        moe_families = ("qwen3_moe", "mixtral", "gpt_oss")
        if self.family not in moe_families:
            if self.num_experts:
                _fail(f"{s}.num_experts", self.num_experts, f"is read by the {', '.join(moe_families)} families only "
                      f"(family is {self.family}); leave it at 0")
            return
        if self.num_experts < 1:
            _fail(f"{s}.num_experts", self.num_experts, f"{self.family} is a mixture of experts: set it >= 1")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            _fail(f"{s}.num_experts_per_tok", self.num_experts_per_tok,
                  f"must be between 1 and num_experts={self.num_experts}")
        if self.moe_intermediate_size < 0 or self.decoder_sparse_step < 1:
            _fail(f"{s}.moe_intermediate_size/decoder_sparse_step",
                  (self.moe_intermediate_size, self.decoder_sparse_step), "must be >= 0 and >= 1")
        if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            _fail(f"{s}.mlp_only_layers", self.mlp_only_layers, f"lists layers from 0 to {self.num_layers - 1}")
        if not math.isfinite(self.router_aux_loss_coef) or self.router_aux_loss_coef < 0:
            _fail(f"{s}.router_aux_loss_coef", self.router_aux_loss_coef, "must be a finite number >= 0")
        fixed = {"qwen3_moe": ("qk_norm", True), "mixtral": ("qk_norm", False), "gpt_oss": ("attention_bias", True)}
        key, value = fixed[self.family]
        if getattr(self, key) != value:
            _fail(f"{s}.{key}", getattr(self, key), f"{self.family} {'always has' if value else 'has no'} "
                  f"{'q/k norms' if key == 'qk_norm' else 'attention biases'} in transformers: set it "
                  f"{str(value).lower()}")
        if self.family == "mixtral" and self.attention_bias:
            _fail(f"{s}.attention_bias", True, "Mixtral has no attention biases (as transformers' MixtralAttention)")
        if (self.family == "gpt_oss") != (self.swiglu_limit > 0 and self.swiglu_alpha > 0):
            _fail(f"{s}.swiglu_limit", (self.swiglu_limit, self.swiglu_alpha),
                  "swiglu_limit and swiglu_alpha are gpt_oss's (both > 0 there) and unset elsewhere")

    @property
    def is_moe(self) -> bool:
        """A mixture of experts (qwen3_moe, mixtral, gpt_oss): some or all layers route tokens to experts."""
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        """Whether decoder layer `layer` (from 0) has experts, as transformers decides (Qwen3-MoE's
        decoder_sparse_step and mlp_only_layers; every layer of Mixtral and gpt-oss)."""
        return self.is_moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def expert_intermediate_size(self) -> int:
        """The width of each expert's MLP."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def is_gemma(self) -> bool:
        """Gemma 2 and 3: (1 + w) norms, pre- and post-norms, GeLU-tanh MLP, embeddings scaled by sqrt(hidden)."""
        return self.family in ("gemma2", "gemma3")

    def layer_slides(self, layer: int) -> bool:
        """Whether decoder layer `layer` (from 0) attends within sliding_window (and, for Gemma 3 with
        rope_local_base_freq, takes the local RoPE tables), as transformers' layer_types says."""
        if self.layer_types:
            return self.layer_types[layer] == "sliding_attention"
        if self.sliding_window_pattern:
            return bool((layer + 1) % self.sliding_window_pattern)
        return True

    @property
    def attention_scale(self) -> float:
        """The factor on q.k: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.resolved_head_dim) ** -0.5

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (int(head_dim * partial_rotary_factor), as transformers)."""
        return int(self.resolved_head_dim * self.partial_rotary_factor)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where training tokens come from and how they are cut into batches."""

    SECTION: ClassVar[str] = "data"
    path: str = ""
    """A token file (.npy of integers, or .bin of `token_dtype`), a UTF-8 text file (.txt, byte-level
    tokens 0-255), a directory written by `megatrain prepare` (documents with a per-token loss mask), or
    the word `synthetic` for seeded random tokens (benchmarks). Relative paths are resolved against the
    config file's directory first, then the working directory."""
    token_dtype: Literal["uint16", "uint32", "int32", "int64"] = "uint16"
    """Element type of a raw .bin token file."""
    seq_len: int = 2048
    """Tokens per sequence (the model sees seq_len inputs and predicts seq_len next tokens)."""
    batch_size: int = 1
    """Sequences per optimizer step; the whole batch goes through each layer at once."""
    shuffle: bool = True
    """Visit the sequences of each epoch in a seeded random order."""
    seed: int = 0
    """Seed of the shuffle order (and of synthetic tokens)."""
    packing: bool = False
    """Prepared data only. true: documents are packed whole into rows of seq_len tokens; RoPE positions
    restart and attention stops at every document boundary. false: one document per row, padded."""
    eval_path: str = ""
    """A prepared directory for train.eval_every (its train split). Empty: the eval split of data.path."""

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            _fail("data.seq_len", self.seq_len, "must be >= 1")
        if self.batch_size < 1:
            _fail("data.batch_size", self.batch_size, "must be >= 1")
        if not self.path:
            _fail("data.path", self.path, "is required: a token file, a .txt file or 'synthetic'")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """AdamW on the CPU optimizer workers (decoupled weight decay, as torch.optim.AdamW)."""

    SECTION: ClassVar[str] = "optimizer"
    lr: float = 3e-4
    """Peak learning rate (after warmup)."""
    beta1: float = 0.9
    """Decay of the first moment (AdamW's beta1)."""
    beta2: float = 0.95
    """Decay of the second moment (AdamW's beta2)."""
    eps: float = 1e-8
    """Added to the square root of the second moment."""
    weight_decay: float = 0.1
    """Applied to matrices only (embeddings, projections, LM head); never to norms or biases."""
    grad_clip: float = 1.0
    """Exact global gradient-norm clipping threshold; 0 turns clipping off. With clipping on, updates
    wait for the whole backward and then run in layer order, overlapped with the next forward."""
    workers: int | Literal["auto"] = "auto"
    """Number of OptimizerWorker actors; each owns a slice of every layer and pins itself to its own
    cores. auto: min(2, usable cores // 2) on every NUMA node (CPU AdamW is bound by DRAM bandwidth,
    so more workers on one socket add no throughput; see megatrain_ray/system/topology.py). The choice and
    the core map are logged at start."""
    kernel: Literal["auto", "native", "torch"] = "auto"
    """native: a one-pass C++ AdamW (compiled on first use, cached in ~/.cache/megatrain_ray) that reads
    the bf16 or fp32 gradient and writes the bf16 streaming copy in the same pass; torch: torch's fused
    AdamW in cache-sized chunks; auto: native where it applies (fp32 master) and builds, else torch."""
    chunk_elems: int = 1 << 18
    """Elements per chunk of the torch kernel path: the cast of the gradient and the write of the
    streaming copy happen while the chunk is still in cache."""
    moment_dtype: Literal["float32", "bfloat16"] = "float32"
    """Format of both AdamW moments (exp_avg, exp_avg_sq) in host memory. float32: full precision (the
    moments have the master weights' format, float64 with a float64 master). bfloat16: NOT full
    precision; saves 4 bytes per parameter of RAM (or disk) and of DRAM traffic per step. The update
    still computes in float32 (moments widened in a cache-sized chunk) and rounds the new moments back
    to bfloat16 stochastically, with noise that is a fixed hash of the step, stage and element (so runs
    and resumes stay bit-reproducible): plain rounding to nearest would lose every change smaller than
    half a bfloat16 step (0.2 to 0.4 %), e.g. the decay of exp_avg_sq with beta2 = 0.999. The master weights
    stay full precision. Part of the saved state: a checkpoint resumes only with the same moment_dtype."""

    def __post_init__(self) -> None:
        s = self.SECTION
        if not self.lr > 0:
            _fail(f"{s}.lr", self.lr, "must be > 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                _fail(f"{s}.{name}", getattr(self, name), "must be in [0, 1)")
        if not self.eps > 0:
            _fail(f"{s}.eps", self.eps, "must be > 0")
        if self.weight_decay < 0:
            _fail(f"{s}.weight_decay", self.weight_decay, "must be >= 0")
        if self.grad_clip < 0:
            _fail(f"{s}.grad_clip", self.grad_clip, "must be >= 0 (0 turns clipping off)")
        if self.workers != "auto" and self.workers < 1:
            _fail(f"{s}.workers", self.workers, "must be >= 1, or auto to pick from the cores and NUMA nodes")
        if self.chunk_elems < 1024:
            _fail(f"{s}.chunk_elems", self.chunk_elems, "must be >= 1024")


@dataclass(kw_only=True, slots=True)
class ScheduleConfig:
    """Learning-rate schedule over `train.steps` optimizer steps (see megatrain_ray/optim/adamw.py)."""

    SECTION: ClassVar[str] = "schedule"
    kind: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape after warmup: cosine or linear decay to min_lr_ratio * lr, or constant."""
    warmup_steps: int = 0
    """Steps of linear warmup: step s (0-based) uses lr * (s + 1) / warmup_steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine and linear)."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            _fail("schedule.warmup_steps", self.warmup_steps, "must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail("schedule.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")


@dataclass(kw_only=True, slots=True)
class PrecisionConfig:
    """Number formats of each copy of the weights."""

    SECTION: ClassVar[str] = "precision"
    master_dtype: Literal["float32", "float64"] = "float32"
    """Master weights and both AdamW moments in host RAM. float64 exists for exact CPU tests."""
    compute_dtype: DType = "bfloat16"
    """Format of the layer math on the device."""
    stream_dtype: DType | Literal["auto"] = "auto"
    """Format of the host copy streamed to the device each step. auto = compute_dtype. When it equals
    master_dtype the master weights are streamed directly (no extra copy in RAM, twice the PCIe bytes
    for bf16 compute); otherwise the optimizer writes the copy in the same pass as the update and the
    layer's gradients land in it after backward."""
    grad_dtype: DType | Literal["auto"] = "auto"
    """Format of the gradients copied to the host when the master weights are streamed directly (with
    a separate streaming copy they land in it, in its format). auto = compute_dtype: the device
    computes them in that format, so a wider one only keeps the float32 sums of the embedding and LM
    head (and of a chunked MLP) unrounded, at twice the PCIe, DRAM and RAM bytes."""

    def __post_init__(self) -> None:
        if DTYPE_RANK[self.compute_dtype] > DTYPE_RANK[self.master_dtype]:
            _fail("precision.compute_dtype", self.compute_dtype,
                  f"is more precise than precision.master_dtype={self.master_dtype}; raise master_dtype")
        if self.resolved_stream_dtype not in DTYPE_RANK:
            _fail("precision.stream_dtype", self.stream_dtype, f"must be one of {sorted(DTYPE_RANK)} or 'auto'")
        if DTYPE_RANK[self.resolved_stream_dtype] > DTYPE_RANK[self.master_dtype]:
            _fail("precision.stream_dtype", self.stream_dtype,
                  f"is more precise than precision.master_dtype={self.master_dtype}")
        if DTYPE_RANK[self.compute_dtype] > DTYPE_RANK[self.resolved_stream_dtype]:
            _fail("precision.compute_dtype", self.compute_dtype,
                  f"is more precise than the streamed copy ({self.resolved_stream_dtype}); it would only "
                  "compute on rounded weights. Set precision.stream_dtype to match")
        if self.resolved_grad_dtype not in DTYPE_RANK:
            _fail("precision.grad_dtype", self.grad_dtype, f"must be one of {sorted(DTYPE_RANK)} or 'auto'")
        if DTYPE_RANK[self.resolved_grad_dtype] > DTYPE_RANK[self.master_dtype]:
            _fail("precision.grad_dtype", self.grad_dtype,
                  f"is more precise than precision.master_dtype={self.master_dtype}")

    @property
    def resolved_stream_dtype(self) -> str:
        return self.compute_dtype if self.stream_dtype == "auto" else self.stream_dtype

    @property
    def resolved_grad_dtype(self) -> str:
        return self.compute_dtype if self.grad_dtype == "auto" else self.grad_dtype

    @property
    def stream_is_master(self) -> bool:
        """The streaming copy is the master buffer itself (same format)."""
        return self.resolved_stream_dtype == self.master_dtype


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """The layer stream on the compute worker."""

    SECTION: ClassVar[str] = "engine"
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto: the GPU when CUDA is available, else the CPU (same code path, copies are plain memcpy)."""
    loss_chunk_tokens: int = 4096
    """Tokens per chunk of the LM-head loss: logits never exceed loss_chunk_tokens x vocab_size."""
    mlp_chunk_tokens: int = 65536
    """Tokens per chunk of each layer's MLP (forward and recomputed backward) when a step has more:
    the [tokens, intermediate_size] tensors then exist for one chunk at a time (long sequences).
    0 never chunks."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile the decoder-layer template (its forward, and the recomputed forward and backward):
    fuses the norms, RoPE and SwiGLU around the matrix products. The first step of each shape pays the
    compile time (the start-up log says when the layers compile); rows with packed documents, MoE models
    (their expert groups change size with the routing) or a chunked MLP run eagerly. auto: on when the engine runs on a GPU (on the H200, 7B-width layers at 64k
    tokens ran 1.24-1.25x faster compiled and peaked 5 GiB lower (docs/benchmarks.md); 1.08x at 32k with
    clipping on, where
    the optimizer bounds the step), off on the CPU; if torch.compile fails there (no Triton or C
    compiler), auto warns once and runs eagerly. true: always, and a compile failure is an error."""
    activation_offload: bool | Literal["auto"] = "auto"
    """Where the layer inputs kept for the backward live. false: on the GPU (one [tokens, hidden]
    tensor per layer); true: copied to pinned host memory during the forward and back during the
    backward on the copy streams, so GPU memory no longer grows with depth; auto: true when
    `megatrain plan` finds that keeping them on the GPU does not fit its memory."""
    grad_slabs: int = 4
    """Pinned host slabs for gradients in flight when the master weights are streamed directly and
    clipping is off (otherwise gradients land in the streaming copy or per-layer buffers), each the
    size of one layer's gradients."""
    vocab_grad_pieces: bool = True
    """With those slabs: the embedding's and LM head's gradients, when larger than a layer's (a large
    vocabulary), go through the layer slabs in layer-sized pieces, each copied and updated on its own
    (true), or through one slab of their own (false: on Llama-3-8B 1.05 GB more RAM, 0.13 bytes per
    parameter, and the layers never wait for their updates). Pieces need one GPU per node and the
    moments in RAM; otherwise the slab of their own is used."""
    update_trace: str | None = None
    """A directory (a relative path is from where megatrain runs): every GPU worker appends a JSON-lines
    timeline of each stage's update hand-offs there
    (gradients queued and on the host, update ordered, run and published, waits for it;
    megatrain_ray/engine/telemetry.py), and `python benchmarks/update_trace.py DIR` says which link keeps
    the optimizer from overlapping the backward. A few hundred bytes per stage and step."""
    poison_buffers: bool = False
    """Fill device and gradient buffers with NaN before first use, so that a read of memory nothing
    wrote fails loudly (tests)."""
    gpu_resident: int | Literal["none", "auto"] = "none"
    """Decoder layers whose whole training state lives on the compute device (the GPU-resident tier):
    their master weights, both AdamW moments and gradients stay there and they update there (torch's
    fused AdamW, the same math, step order and exact global-norm clipping as the streamed stages), so
    they cost no host->device or device->host copies and no CPU optimizer time. N: the first N layers
    (their updates are the ones the next forward needs first, and their backward comes last, so the CPU
    optimizer finishes the streamed layers' updates meanwhile). none: every stage streams. auto: as many
    layers as fit the GPU memory the plan leaves after its peak, the reserve and a margin (`megatrain plan`
    prints them and the expected tok/s); none on the CPU, or where the tier does not apply. About 16 bytes
    of device memory per resident parameter (fp32 master and moments, the gradient and compute copy in
    the streaming format), and no host memory: their segments are never allocated; the GPU worker fills
    them (initialisation, fine-tuning, resume, restart), writes their checkpoint files and serves them to
    export. One GPU worker, moments in RAM at the master's precision (not optimizer.moment_dtype=bfloat16)."""

    def __post_init__(self) -> None:
        if isinstance(self.gpu_resident, int) and self.gpu_resident < 0:
            _fail("engine.gpu_resident", self.gpu_resident, "must be none, auto or a number of layers >= 0")
        if self.loss_chunk_tokens < 1:
            _fail("engine.loss_chunk_tokens", self.loss_chunk_tokens, "must be >= 1")
        if self.grad_slabs < 2:
            _fail("engine.grad_slabs", self.grad_slabs, "must be >= 2 (one written, one read)")
        if self.mlp_chunk_tokens < 0:
            _fail("engine.mlp_chunk_tokens", self.mlp_chunk_tokens, "must be >= 0 (0 never chunks)")


@dataclass(kw_only=True, slots=True)
class HostConfig:
    """The host store: shared-memory segments owned by HostShard actors."""

    SECTION: ClassVar[str] = "host"
    num_shards: int = 1
    """HostShard actors; each owns a contiguous range of stages (one per NUMA node is the intent)."""
    shm_dir: str = "/dev/shm"
    """Directory of the shared-memory segments; must be a tmpfs large enough for the whole store."""
    moments_tier: Literal["ram", "disk"] = "ram"
    """Where the AdamW moments live. ram: shared-memory segments like the rest of the store. disk: files
    in host.disk_dir: 8 bytes of RAM per parameter fewer (4 with optimizer.moment_dtype=bfloat16). Each
    optimizer worker reads its share of a stage's moments ahead of the update, in update order, and
    writes them back behind it, through two buffers of its share of one decoder layer (the embedding and
    head go in layer-sized pieces): the staging RAM `megatrain plan` shows. Every step then reads and writes all
    moments on the disk (16 bytes per parameter, 8 with optimizer.moment_dtype=bfloat16): the disk's
    bandwidth bounds the optimizer (benchmarks/moment_tiers.py measures it). Results are bit-identical
    to ram; checkpoints move freely between the tiers. Master weights and the streaming copy stay in RAM."""
    disk_dir: str = ""
    """Directory for host.moments_tier=disk, on a fast local disk (NVMe), not a tmpfs or network share.
    Checked before allocating: it must exist, be writable and have room for both moments (the files are
    allocated in full at start and removed at the end)."""

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            _fail("host.num_shards", self.num_shards, "must be >= 1")
        if self.moments_tier == "disk" and not self.disk_dir:
            _fail("host.disk_dir", self.disk_dir, "is required with host.moments_tier=disk: a directory on a fast "
                  "local disk")


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    """How the actors are launched."""

    SECTION: ClassVar[str] = "runtime"
    mode: Literal["ray", "local"] = "ray"
    """ray: actors in a Ray cluster; local: the same classes in this process (debugging, fast tests)."""
    address: str = ""
    """Ray cluster to attach to. Empty: RAY_ADDRESS if set, else a cluster started with `ray start`
    on this machine, else a private local Ray bound to 127.0.0.1."""
    dashboard: bool = True
    """Start the Ray dashboard with a private local Ray (127.0.0.1 only)."""
    allow_unauthenticated: bool = False
    """Let a private local Ray start without token auth when RAY_AUTH_MODE says so (anyone who can reach
    its ports could then run code as you). By default that is refused before Ray starts."""
    object_store_mb: int = 512
    """Object store of a private local Ray. Bulk tensors never go through it, so it stays small."""
    heartbeat_interval_s: float = 5.0
    """Seconds between health checks of the actors (Ray mode); 0 turns them off."""
    heartbeat_timeout_s: float = 30.0
    """An actor that has not answered a heartbeat for this long is logged as slow, by name."""

    def __post_init__(self) -> None:
        if self.object_store_mb < 64:
            _fail("runtime.object_store_mb", self.object_store_mb, "must be >= 64")
        if self.heartbeat_interval_s < 0:
            _fail("runtime.heartbeat_interval_s", self.heartbeat_interval_s, "must be >= 0 (0 turns checks off)")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            _fail("runtime.heartbeat_timeout_s", self.heartbeat_timeout_s,
                  f"must exceed runtime.heartbeat_interval_s={self.heartbeat_interval_s}")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Data parallelism: one GPUWorker (rank) per GPU, each streaming its slice of the batch through the
    same layers of its node's host store; gradients are summed over the ranks layer by layer before the
    node's optimizer workers see them (megatrain_ray/engine/parallel.py). The global batch, the loss,
    the schedule and the checkpoints are the same whatever the number of GPUs."""

    SECTION: ClassVar[str] = "parallel"
    gpus: int | Literal["auto"] = 1
    """GPU workers (ranks) of the run, over all nodes; each takes data.batch_size / gpus sequences of every
    step, so data.batch_size must be divisible by it. auto: every GPU the Ray cluster offers on the nodes
    used (one rank per node on a CPU-only cluster). More than 1 needs runtime.mode=ray."""
    nodes: int = 1
    """Ray nodes the ranks are spread over, gpus / nodes on each. Every node keeps its own host store and
    optimizer workers (weights are stored once per node, never per GPU); each node's first rank orders the
    updates of its copy and the copies are compared by a checksum every step. Checkpoints are written by
    the first node and read by all: on several machines checkpoint.dir must be on a shared filesystem."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend of the gradient sums: auto = nccl on GPUs, gloo on the CPU."""
    gather_weights: bool = False
    """Several GPUs on a node: each copies only its 1/gpus-per-node piece of a stage's weights from host memory
    and the GPUs of the node exchange the pieces (an all-gather over NVLink), instead of each copying the
    whole stage. Host DRAM then serves every weight byte once per pass whatever the number of GPUs (the
    CPU optimizer shares that bandwidth), and each GPU's PCIe link carries 1/gpus of the weights. Training
    steps only: evaluation runs on the first GPU and copies whole stages. On two H200s (3.5B, 32k tokens per
    GPU): it helped while the GPU workers' threads ran on AdamW's cores (clipping on, 1.89x one GPU against
    1.83x, data-parallel-x2-h200-20261123-221348); with each GPU worker on cores of its own it gains nothing
    (1.98x and 1.99x against 2.00x and 1.99x, data-parallel-x2-h200-20261123-232913 and -233902). Off by
    default; measure it on more GPUs per node."""
    timeout_s: float = 600.0
    """Seconds a rank waits for the process group to form, for a collective, or for another rank's
    gradients or its node's update of a stage, before it stops the run with an error."""

    def __post_init__(self) -> None:
        s = self.SECTION
        if self.gpus != "auto" and self.gpus < 1:
            _fail(f"{s}.gpus", self.gpus, "must be >= 1, or auto for every GPU Ray offers")
        if self.nodes < 1:
            _fail(f"{s}.nodes", self.nodes, "must be >= 1")
        if self.gpus != "auto" and self.gpus % self.nodes:
            _fail(f"{s}.gpus", self.gpus, f"must be a multiple of parallel.nodes={self.nodes} (the same number "
                  "of GPUs on every node)")
        if not self.timeout_s > 0:
            _fail(f"{s}.timeout_s", self.timeout_s, "must be > 0")


TRACKERS = ("tensorboard", "mlflow", "wandb")
"""The experiment trackers train.report_to may name (driver/tracking.py)."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The loop around the steps."""

    SECTION: ClassVar[str] = "train"
    steps: int = 100
    """Optimizer steps to run."""
    seed: int = 0
    """Seed of the random initialisation."""
    output_dir: str = "runs/default"
    """Run directory: resolved config, metrics.jsonl, checkpoints. A relative path is taken under
    train.storage_root."""
    storage_root: str = "auto"
    """Where relative train.output_dir, checkpoint.dir and train.export_dir paths are taken from. auto: the
    working directory, except inside Ray's session tree (the copy of `--working-dir` that `ray job submit`
    runs in, deleted when Ray stops), where it is ~/megatrain. A path lying in Ray's session tree is refused."""
    log_every: int = 1
    """Steps between console log lines (metrics.jsonl gets every step)."""
    eval_every: int = 0
    """Steps between evaluations (forward-only loss over train.eval_batches batches of the eval data,
    written as eval_loss in metrics.jsonl, also after the last step); 0 turns evaluation off."""
    eval_batches: int = 4
    """Batches of data.batch_size rows per evaluation, always the same ones (the first of the eval data)."""
    export_dir: str = ""
    """Write the trained model there as a Hugging Face directory (safetensors + config.json + the
    tokenizer files of model.path) at the end of training. Empty: no export."""
    export_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Format of the exported weights. auto: the dtype model.path's config.json declares, else float32."""
    report_to: list[str] = field(default_factory=list)
    """Experiment trackers that get every metrics.jsonl record (loss, lr, grad_norm, tok_per_s, eval_loss, ...)
    at its step, and the config once: any of `tensorboard` (event files in <train.output_dir>/tensorboard),
    `mlflow` (the store MLFLOW_TRACKING_URI names; experiment MLFLOW_EXPERIMENT_NAME, default megatrain) and
    `wandb` (WANDB_PROJECT, default megatrain; WANDB_MODE=offline keeps it local; files under WANDB_DIR, default
    the run directory). Needs `pip install 'megatrain-ray[track]'`. A resume continues the same tracked runs
    (their ids are in the checkpoint manifest). Empty: no tracking."""
    run_name: str = ""
    """Name of the tracked run (MLflow run name, W&B display name). Empty: the run directory's name."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            _fail("train.steps", self.steps, "must be >= 1")
        if self.eval_every < 0:
            _fail("train.eval_every", self.eval_every, "must be >= 0 (0 turns evaluation off)")
        if self.eval_batches < 1:
            _fail("train.eval_batches", self.eval_batches, "must be >= 1")
        if self.log_every < 1:
            _fail("train.log_every", self.log_every, "must be >= 1")
        for name in self.report_to:
            if name not in TRACKERS:
                _fail("train.report_to", name, f"unknown tracker; expected a list of {', '.join(TRACKERS)}")
        if len(set(self.report_to)) != len(self.report_to):
            _fail("train.report_to", self.report_to, "names a tracker twice")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpoints of the whole training state (master weights, both moments, step, data position)."""

    SECTION: ClassVar[str] = "checkpoint"
    every: int = 0
    """Steps between checkpoints; 0 saves only at the end and on SIGTERM/SIGINT. Each one is written
    by the HostShard actors in the background while training goes on."""
    keep: int = 2
    """How many of the newest complete checkpoints to keep; older ones are deleted once a newer one is complete."""
    dir: str = ""
    """Where checkpoints go; empty means `<train.output_dir>/checkpoints`."""
    at_end: bool = True
    """Save a checkpoint after the last step."""
    on_signal: bool = True
    """On SIGTERM or SIGINT, finish the current step, save a checkpoint and exit (code 130 or 143)."""

    def __post_init__(self) -> None:
        if self.every < 0:
            _fail("checkpoint.every", self.every, "must be >= 0 (0: only at the end and on signals)")
        if self.keep < 1:
            _fail("checkpoint.keep", self.keep, "must be >= 1")


DRILL_ACTIONS = ("kill", "nan_grad", "kill_during_checkpoint")


@dataclass(kw_only=True, slots=True)
class FaultConfig:
    """What happens when something goes wrong: dead actors, non-finite numbers."""

    SECTION: ClassVar[str] = "fault"
    max_restarts: int = 0
    """Times the run may restart its actors and resume from the last good checkpoint by itself after an actor
    dies; 0 stops with a message naming the actor and the command that resumes."""
    nonfinite: Literal["skip", "stop"] = "skip"
    """Policy for a non-finite loss or gradient norm: `skip` drops the step (weights and moments untouched);
    `stop` saves the last good state as a checkpoint and exits non-zero. With optimizer.grad_clip = 0 a
    non-finite gradient under a finite loss is found only after some layers were updated, so the run stops."""
    drill: str = ""
    """Fault drills, for testing recovery only: comma-separated `ACTION@STEP` with ACTION one of
    `kill:ACTOR` (SIGKILL to `driver`, `gpu`, `gpuR` (rank R), `hostK` or `optimK` while step STEP runs), `nan_grad`
    (a NaN in one gradient of step STEP) or `kill_during_checkpoint` (the process writing the checkpoint
    taken after STEP steps dies after its first file). Steps count from 0. Empty in real runs."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            _fail("fault.max_restarts", self.max_restarts, "must be >= 0")
        parse_drill(self.drill)


def parse_drill(text: str) -> list[tuple[str, str, int]]:
    """`kill:optim0@5,nan_grad@3` -> [("kill", "optim0", 5), ("nan_grad", "", 3)]."""
    drills = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        action, _, step = item.partition("@")
        action, _, target = action.partition(":")
        if action not in DRILL_ACTIONS or not step.isdigit() or (action == "kill") != bool(target) \
                or (target and not re.fullmatch(r"driver|gpu\d*|host\d+|optim\d+", target)):
            _fail("fault.drill", item, "expected ACTION@STEP with ACTION one of kill:driver, kill:gpu, kill:gpuR, "
                  "kill:hostK, kill:optimK, nan_grad, kill_during_checkpoint")
        drills.append((action, target, int(step)))
    return drills


LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear modules of a decoder layer by PEFT's short names (Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj)."""
PHI3_LORA_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """LoRA adapters, with PEFT's names and meanings (peft.LoraConfig)."""

    SECTION: ClassVar[str] = "finetune.lora"
    r: int = 8
    """Rank of each adapter: A is [r, in_features], B is [out_features, r]."""
    lora_alpha: float = 16
    """The adapter's output is scaled by lora_alpha / r (lora_alpha / sqrt(r) with use_rslora)."""
    lora_dropout: float = 0.0
    """Dropout probability on the adapter's input in training (as PEFT's). The masks are drawn from a seed per
    step and layer, so the backward's recompute sees the forward's; with dropout the layers run eagerly
    (engine.compile does not apply)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """The projections that get adapters: `all-linear` (every linear module of the decoder layers, not the LM head,
    as PEFT's all-linear), or a list of PEFT short names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj (Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj)."""
    bias: Literal["none"] = "none"
    """PEFT's bias setting; only `none` (biases stay frozen)."""
    use_rslora: bool = False
    """Rank-stabilised LoRA: scale by lora_alpha / sqrt(r) instead of lora_alpha / r."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full beside the adapters (PEFT's modules_to_save): `embed_tokens`, `lm_head` (an untied
    LM head only). Each lives on the device in float32 with its gradient and AdamW moments (16 bytes per parameter)
    and starts as the base's."""
    base_quantization: Literal["none", "nf4"] = "none"
    """How the host stores the frozen base's decoder layers. none: in precision.stream_dtype. nf4: QLoRA's 4-bit
    base (bitsandbytes' load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, blocksize
    64): every matrix of the decoder layers is quantized once on the host when the run starts (from its values in
    precision.stream_dtype), streamed in 4 bits (about 0.52 B per parameter) and dequantized on the device into
    precision.compute_dtype as each layer arrives; norms, the embedding and the LM head stay unquantized
    (docs/fine-tuning.md, QLoRA). finetune.method=lora only."""

    def __post_init__(self) -> None:
        s = self.SECTION
        if self.r < 1:
            _fail(f"{s}.r", self.r, "must be >= 1")
        if not self.lora_alpha > 0:
            _fail(f"{s}.lora_alpha", self.lora_alpha, "must be > 0")
        if not 0.0 <= self.lora_dropout < 1.0:
            _fail(f"{s}.lora_dropout", self.lora_dropout, "must be in [0, 1)")
        if isinstance(self.target_modules, list) and not self.target_modules:
            _fail(f"{s}.target_modules", self.target_modules, "is empty; name projections or use all-linear")
        unknown = [name for name in self.modules_to_save if name not in ("embed_tokens", "lm_head")]
        if unknown or len(set(self.modules_to_save)) != len(self.modules_to_save):
            _fail(f"{s}.modules_to_save", self.modules_to_save, "may name embed_tokens and lm_head, each once")

    @property
    def scaling(self) -> float:
        """The factor on the adapter's output, as PEFT computes it."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def targets(self, family: str) -> tuple[str, ...]:
        """The targeted projections' short names for a model family, in the layer's order."""
        known = PHI3_LORA_PROJECTIONS if family == "phi3" else LORA_PROJECTIONS
        if self.target_modules == "all-linear":
            return known
        unknown = [name for name in self.target_modules if name not in known]
        if unknown:
            _fail(f"{self.SECTION}.target_modules", self.target_modules,
                  f"{unknown[0]!r} is not a linear module of a {family} layer; choose from {', '.join(known)}")
        return tuple(name for name in known if name in self.target_modules)




def check_finetune(cfg: "Config") -> None:
    """finetune.method=lora against the rest of the config."""
    if cfg.finetune.method != "lora":
        if cfg.finetune.lora.base_quantization != "none":
            _fail("finetune.lora.base_quantization", cfg.finetune.lora.base_quantization,
                  f"quantizes the frozen base of a LoRA run, and finetune.method is {cfg.finetune.method!r}: set "
                  "finetune.method=lora or finetune.lora.base_quantization=none")
        return
    cfg.finetune.lora.targets(cfg.model.family)
    why = ""
    if cfg.model.template == "generic":
        why = ("a native layer template (the adapters are bound into the native templates' projections; the generic "
               "path runs the model's own layer modules): model.template=generic cannot take them")
    elif cfg.model.is_moe:
        why = (f"a dense family: adapters on the fused expert tensors of {cfg.model.family} are not built yet "
               "(full fine-tuning of MoE models works)")
    elif cfg.parallel.nodes != 1:
        why = "one node (parallel.nodes=1; several GPUs of one node are fine)"
    elif cfg.engine.gpu_resident not in ("none", "auto", 0):
        why = "engine.gpu_resident=none (the frozen base has no training state to keep on the device)"
    elif cfg.host.moments_tier != "ram":
        why = "host.moments_tier=ram (the adapters' moments live on the device, the host holds none)"
    elif cfg.finetune.lora.modules_to_save and cfg.model.tie_word_embeddings:
        why = ("an untied LM head (model.tie_word_embeddings=false) for finetune.lora.modules_to_save: the tied "
               "matrix would be two trained copies")
    elif any(action == "kill" and target.startswith("optim") for action, target, _ in parse_drill(cfg.fault.drill)):
        why = "no fault.drill kill:optimK (a LoRA run has no optimizer workers)"
    if why:
        _fail("finetune.method", "lora", f"needs {why}")


@dataclass(kw_only=True, slots=True)
class DPOConfig:
    """Direct preference optimization (finetune.objective=dpo; docs/fine-tuning.md, megatrain_ray/model/preference.py)."""

    SECTION: ClassVar[str] = "finetune.dpo"
    beta: float = 0.1
    """How far the model may move from the reference (the initial model): the DPO loss is a function of
    beta * ((logp_chosen - logp_rejected) - (ref_chosen - ref_rejected)), log-probabilities summed over
    the completion tokens, as TRL's DPOTrainer."""
    label_smoothing: float = 0.0
    """The probability that a preference label is flipped. sigmoid: -(1 - e) logsigmoid(beta z) - e logsigmoid(-beta z)
    (conservative DPO; TRL 1.16's sigmoid has no label smoothing, so it equals it at 0 only); robust: TRL's robust DPO."""
    loss_type: Literal["sigmoid", "robust"] = "sigmoid"
    """sigmoid: DPO (with label_smoothing, conservative DPO); robust: robust DPO (unbiased under flipped labels)."""

    def __post_init__(self) -> None:
        s = self.SECTION
        if not self.beta > 0:
            _fail(f"{s}.beta", self.beta, "must be > 0")
        if not 0 <= self.label_smoothing < 0.5:
            _fail(f"{s}.label_smoothing", self.label_smoothing, "must be in [0, 0.5)")


@dataclass(kw_only=True, slots=True)
class FinetuneConfig:
    """What training changes (every weight, or low-rank adapters on a frozen base) and what it optimizes
    (cross-entropy, or a preference loss)."""

    SECTION: ClassVar[str] = "finetune"
    method: Literal["full", "lora"] = "full"
    """full: every weight trains (fp32 master and AdamW moments in host RAM, the CPU optimizer workers). lora: the
    base is frozen and streamed from host RAM in precision.stream_dtype only, or in NF4 (finetune.lora.base_quantization;
    no master, moments or gradient buffers); the adapters, their gradients and their AdamW state live on the compute
    device (with several GPUs of one node, on each: their gradients are summed in one all-reduce)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """The adapters' settings (method lora)."""
    objective: Literal["sft", "dpo"] = "sft"
    """sft: cross-entropy on the loss-mask tokens (pre-training, supervised fine-tuning). dpo: direct preference
    optimization on preference pairs from `megatrain prepare --format preference`; the reference log-probabilities
    come from one forward pass of the initial model before the first step (see finetune.dpo)."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """The DPO loss's settings (finetune.objective=dpo; read only then)."""


@dataclass(kw_only=True, slots=True)
class Config:
    """The root of a run's configuration: one field per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: HostConfig = field(default_factory=HostConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    def __post_init__(self) -> None:
        if self.schedule.warmup_steps > self.train.steps:
            _fail("schedule.warmup_steps", self.schedule.warmup_steps,
                  f"exceeds train.steps={self.train.steps}")
        if self.data.seq_len > self.model.max_position_embeddings and self.model.rope_scaling is None:
            _fail("data.seq_len", self.data.seq_len,
                  f"exceeds model.max_position_embeddings={self.model.max_position_embeddings}; "
                  "raise it or configure model.rope_scaling")
        if self.data.packing and self.model.family == "gpt_oss":
            _fail("data.packing", True, "gpt_oss's attention sinks run on plain rows only (model/sinks.py); "
                  "set data.packing false")
        if self.data.path.endswith(".txt") and self.model.vocab_size < 256:
            _fail("model.vocab_size", self.model.vocab_size, "must be >= 256 for byte-level text data")
        if self.optimizer.moment_dtype == "bfloat16" and self.precision.master_dtype != "float32":
            _fail("optimizer.moment_dtype", self.optimizer.moment_dtype,
                  f"needs precision.master_dtype=float32 (it is {self.precision.master_dtype}, which exists for "
                  "exact tests); use moment_dtype=float32")
        if self.model.template == "generic":
            check_generic(self)
        if self.precision.compute_dtype in ("bfloat16", "float16") and self.engine.device == "cpu":
            pass  # allowed (slow); tests of the bf16 path use it on purpose
        check_parallel(self)
        check_finetune(self)
        check_objective(self)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)


def check_parallel(cfg: Config, ranks: int | None = None) -> None:
    """The parallel section against the rest of the config: on load, and again in the trainer once
    `parallel.gpus: auto` is resolved to `ranks`."""
    p = cfg.parallel
    if ranks is None and p.gpus != "auto":
        ranks = p.gpus
    if cfg.runtime.mode == "local":
        if ranks is not None and ranks > 1:
            _fail("parallel.gpus", p.gpus, "more than one GPU worker needs runtime.mode=ray (each rank is a "
                  "process of its own); drop --local, or set parallel.gpus=1")
        if p.nodes > 1:
            _fail("parallel.nodes", p.nodes, "several nodes need runtime.mode=ray; drop --local")
    if ranks is not None and cfg.data.batch_size % ranks:
        _fail("parallel.gpus", p.gpus if p.gpus != "auto" else f"auto ({ranks} GPUs)",
              f"data.batch_size={cfg.data.batch_size} is not divisible by {ranks} ranks: each GPU takes an equal "
              f"slice of the global batch; set data.batch_size to a multiple of {ranks}")
    check_objective(cfg, ranks)
    if p.backend == "nccl" and cfg.engine.device == "cpu":
        _fail("parallel.backend", p.backend, "needs GPUs, but engine.device=cpu; use gloo or auto")
    if p.backend == "gloo" and cfg.engine.device == "cuda":
        _fail("parallel.backend", p.backend, "sums CPU tensors (tests); with engine.device=cuda use nccl or auto")


def check_objective(cfg: Config, ranks: int | None = None) -> None:
    """finetune.objective=dpo against the data and parallel sections (`ranks`: parallel.gpus once resolved)."""
    if cfg.finetune.objective != "dpo":
        return
    if cfg.model.template == "generic":
        _fail("finetune.objective", "dpo", "needs a native layer template (the DPO head works on the native final norm); "
              "model.template=generic cannot take it")
    if cfg.model.is_moe:
        _fail("finetune.objective", "dpo", f"is not tested with the router's load-balancing loss of {cfg.model.family} "
              "yet; use a dense family, or finetune.objective=sft")
    if cfg.data.packing:
        _fail("data.packing", True, "finetune.objective=dpo keeps one sequence per row (a pair's rows are scored "
              "whole); set data.packing=false")
    if cfg.data.batch_size % 2:
        _fail("data.batch_size", cfg.data.batch_size, "finetune.objective=dpo counts rows, two per preference pair "
              "(chosen and rejected): set an even data.batch_size")
    if ranks is None and cfg.parallel.gpus != "auto":
        ranks = cfg.parallel.gpus
    if ranks is not None and (cfg.data.batch_size // 2) % ranks:
        _fail("data.batch_size", cfg.data.batch_size, f"finetune.objective=dpo gives each of the {ranks} ranks "
              f"whole pairs, the same number each: set data.batch_size to a multiple of {2 * ranks}")


def check_generic(cfg: Config) -> None:
    """What the generic layer path (model.template=generic) cannot do, refused on load."""
    if cfg.data.packing:
        _fail("data.packing", True, "needs per-document attention masks, which the generic path (model.template="
              "generic) does not build; set data.packing=false (one document per row)")
    if cfg.engine.compile is True:
        _fail("engine.compile", True, "compiles the native layer template; the generic path (model.template="
              "generic) runs the model's own layer class eagerly: set engine.compile to auto or false")


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return obj
