"""The `model` section: the architecture (family, sizes, attention, RoPE scaling, mixtures of experts) and
where its weights come from. Derived from a Hugging Face config.json by config/hf.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megatrain_ray.config.fields import refuse as _fail
from megatrain_ray.config.latent_attention_section import (
    LatentAttentionConfig,
    SigmoidRouterConfig,
    check_latent_model,
)
from megatrain_ray.config.linear_attention_section import HYBRID_FAMILIES, LinearAttentionConfig, check_hybrid_model
from megatrain_ray.config.rope_section import RopeScalingConfig


def flash_attention_takes(compute_dtype: str, head_width: int) -> bool:
    """Whether flash attention's kernels take heads of this width in this compute dtype (on an sm80 or later GPU):
    what the fused attention with sinks needs (model/sinks.py) and the plan assumes (ModelConfig.explicit_attention)."""
    return compute_dtype in ("bfloat16", "float16") and head_width % 8 == 0 and head_width <= 256


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
                    "gpt_oss", "qwen3_5", "qwen3_next", "qwen3_5_moe", "deepseek_v3", "glm4_moe",
                    "generic"] = "llama"
    """Architecture family; decides the Hugging Face class on export and the checks on load. gemma2 and
    gemma3 (Gemma3ForCausalLM, text only) also bring Gemma's fixed parts: RMSNorm scaling by (1 + weight),
    norms before and after attention and MLP, a GeLU-tanh MLP and embeddings scaled by sqrt(hidden_size).
    qwen3_moe, mixtral and gpt_oss are mixtures of experts (num_experts and the keys below it). qwen3_5 (Qwen3.5 text),
    qwen3_next and qwen3_5_moe (Qwen3.5-MoE text) interleave linear-attention layers (model.linear_attention) with
    gated full-attention ones by layer_types, (1 + weight) norms; the latter two have experts with a shared expert.
    deepseek_v3 (DeepSeek-V3 / V3.2's dense part): multi-head latent attention (model.latent_attention), dense first
    layers (mlp_only_layers), then experts with shared experts and a sigmoid router (model.sigmoid_router);
    glm4_moe (GLM-4.5 MoE): the same dense first layers, experts and router beside Llama's attention (qkv bias,
    optional q/k norms, partial rotary factor).
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
    Phi-3, the qwen3_5 / qwen3_next / qwen3_5_moe families (their configs: 0.25) and glm4_moe (0.5) only, as
    transformers."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm's square root."""
    tie_word_embeddings: bool = False
    """True: the LM head reuses the embedding matrix (small Qwen models)."""
    pad_token_id: int | None = None
    """The padding token (config.json's; absent there, its family's default as transformers': 0 for Gemma,
    32000 for Phi-3). As transformers' nn.Embedding(padding_idx): its embedding row takes no gradient from the
    lookup (a tied LM head's still reaches it), so AdamW only decays it. null: none."""
    attention_bias: bool = False
    """Bias on the q, k and v projections (Qwen2 / Qwen2.5)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    sliding_window: int = 0
    """Tokens each query may look back over (Mistral, Phi-3; Gemma: in its sliding layers only, see
    layer_types); 0 means full causal attention."""
    layer_types: list[Literal["full_attention", "sliding_attention", "linear_attention"]] = field(default_factory=list)
    """Gemma and gpt-oss: one entry per layer, sliding_attention (within sliding_window, Gemma 3: local
    RoPE) or full_attention (global), as Hugging Face's config.json lists them. Empty: from
    sliding_window_pattern (gpt-oss: every layer slides when sliding_window is set). qwen3_5, qwen3_next and
    qwen3_5_moe: linear_attention or full_attention per layer (required)."""
    linear_attention: LinearAttentionConfig | None = None
    """qwen3_5, qwen3_next and qwen3_5_moe only (required there): the shape of their linear-attention layers."""
    latent_attention: LatentAttentionConfig | None = None
    """deepseek_v3 only (required there): the shape of its multi-head latent attention."""
    sigmoid_router: SigmoidRouterConfig | None = None
    """deepseek_v3 and glm4_moe only (required there): their router's expert groups and scale."""
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
    """Qwen3-MoE and Qwen3-Next: layers (from 0) with a dense MLP whatever decoder_sparse_step says; deepseek_v3 and
    glm4_moe: the first ones, 0 .. first_k_dense_replace - 1."""
    shared_expert_intermediate_size: int = 0
    """qwen3_next and qwen3_5_moe: the width of the shared expert every token of a MoE layer also passes through,
    its output scaled by sigmoid(mlp.shared_expert_gate(x)); deepseek_v3: of its shared experts (mlp.shared_experts,
    n_shared_experts x moe_intermediate_size, no gate; glm4_moe alike). 0: none (the other families)."""
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
        if self.partial_rotary_factor != 1 and self.family not in ("phi3", "glm4_moe", *HYBRID_FAMILIES):
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
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            _fail(f"{s}.pad_token_id", self.pad_token_id, f"must be a token below vocab_size={self.vocab_size} or null")
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
        check_hybrid_model(self)
        check_latent_model(self)
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
        if self.family in ("gpt_oss", *HYBRID_FAMILIES):  # their own layer_types (hybrid: linear_attention_section)
            del gemma_keys["layer_types"]
            if self.family == "gpt_oss" and self.layer_types and len(self.layer_types) != self.num_layers:
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
        moe_families = ("qwen3_moe", "mixtral", "gpt_oss", "qwen3_next", "qwen3_5_moe", "deepseek_v3",
                        "glm4_moe")
        if self.family == "qwen3_next" and not self.num_experts:
            return  # Qwen3NextConfig takes num_experts 0: every layer a dense MLP
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
        fixed = {"qwen3_moe": ("qk_norm", True), "mixtral": ("qk_norm", False), "gpt_oss": ("attention_bias", True),
                 "qwen3_next": ("qk_norm", True), "qwen3_5_moe": ("qk_norm", True), "deepseek_v3": ("qk_norm", False)}
        key, value = fixed.get(self.family, ("family", self.family))  # glm4_moe: q/k norms by config.json
        if getattr(self, key) != value:
            _fail(f"{s}.{key}", getattr(self, key), f"{self.family} {'always has' if value else 'has no'} "
                  f"{'q/k norms' if key == 'qk_norm' else 'attention biases'} in transformers: set it "
                  f"{str(value).lower()}")
        if self.family == "mixtral" and self.attention_bias:
            _fail(f"{s}.attention_bias", True, "Mixtral has no attention biases (as transformers' MixtralAttention)")
        if (self.family == "gpt_oss") != (self.swiglu_limit > 0 and self.swiglu_alpha > 0):
            _fail(f"{s}.swiglu_limit", (self.swiglu_limit, self.swiglu_alpha),
                  "swiglu_limit and swiglu_alpha are gpt_oss's (both > 0 there) and unset elsewhere")

    def explicit_attention(self, compute_dtype: str) -> bool:
        """Attention through explicit [rows, heads, T, T] products rather than fused kernels: Gemma 2's logit
        soft-cap, and gpt-oss's sinks where their fused path does not apply on the GPU (a float32 or float64
        compute dtype, a head width flash attention does not take; the GPU taken as sm80 or later:
        model/sinks.fused_sink_attention_applies)."""
        if self.family == "gpt_oss":
            return not flash_attention_takes(compute_dtype, self.resolved_head_dim)
        return bool(self.attn_logit_softcapping)

    @property
    def is_moe(self) -> bool:
        """A mixture of experts (qwen3_moe, mixtral, gpt_oss): some or all layers route tokens to experts."""
        return self.num_experts > 0

    def layers_compile(self, compute_dtype: str) -> bool:
        """Whether torch.compile can take this model's decoder layers (engine.compile). Dense layers can. MoE layers
        can where their expert products go through torch._grouped_mm, whose shapes stay fixed whatever the routing
        (bfloat16, hidden and expert widths multiples of 8; the GPU's sm90 is checked where a layer runs: the
        per-expert loop elsewhere has a shape per routing). gpt-oss stays eager: through torch.compile (bfloat16,
        torch 2.13 on the CPU, no graph break) its layer returned no gradient for the router's weight and bias once
        the routing record's summed probabilities were among the graph's outputs, as the recompute needs them; the
        Qwen3-MoE and Mixtral layers match the eager template with and without the load-balancing loss
        (tests/unit/test_moe_compile.py). On the CPU, computing the record's router logits apart from the routing's
        gave the right gradient; not yet tried on the GPU. DeepSeek-V3's MoE layer (latent attention, the sigmoid
        router's group-limited top-k) traces without a graph break and matches the eager template on the CPU
        (tests/unit/test_deepseek_compile.py; its dense first layer too, checked once by hand); GLM-4.5 MoE's layers
        share that MoE and Llama's attention. Neither is
        measured compiled on a GPU yet."""
        if self.family in HYBRID_FAMILIES:  # not tried through torch.compile yet
            return False
        if not self.is_moe:
            return True
        return self.family != "gpt_oss" and compute_dtype == "bfloat16" and \
            self.hidden_size % 8 == 0 and self.expert_intermediate_size % 8 == 0

    @property
    def zero_centered_norms(self) -> bool:
        """RMSNorms that scale by (1 + weight), their weights zeros at the start (Gemma, the hybrid families)."""
        return self.is_gemma or self.family in HYBRID_FAMILIES

    @property
    def gated_attention(self) -> bool:
        """The full-attention layers gate their output (the hybrid families: q_proj makes each head's query and its
        gate; model/attention.split_gated_query)."""
        return self.linear_attention is not None

    def layer_is_linear(self, layer: int) -> bool:
        """Whether decoder layer `layer` (from 0) is a linear-attention (Gated DeltaNet) layer, by layer_types."""
        return self.linear_attention is not None and self.layer_types[layer] == "linear_attention"

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
