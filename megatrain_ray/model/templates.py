"""Stateless layer templates: the model's math as pure functions of (activations, weights).

No function here owns a weight. The engine binds each stage's weights as views into the
flat device buffer it just streamed in (`bind`) and calls the template of that stage's kind:
`embed`, `decoder_layer` (the Llama family: GQA, RoPE with Llama 3.1 or YaRN scaling, RMSNorm, SwiGLU,
optional qkv bias for Qwen2, optional q/k norm for Qwen3, optional sliding window for
Mistral; Phi-3: fused qkv_proj and gate_up_proj split after their matrix product, LongRoPE,
partial rotary factor, optional sliding window; Gemma 2 and 3: RMSNorm scaling by (1 + weight),
norms before and after attention and MLP, GeLU-tanh MLP, embeddings scaled by sqrt(hidden),
attention scaled by query_pre_attn_scalar ** -0.5, sliding and global layers by layer_types;
Gemma 3: q/k norms and a local RoPE base in the sliding layers; Gemma 2: attention logit
soft-capping through explicit attention, and the final logit soft-cap in the head) and the head
(`head_logits`, or `head_loss_and_grads`, which computes the loss in token chunks so that full logits
never exist).

The math follows Hugging Face's modeling code operation by operation (norms in float32,
RoPE tables in float32, the loss on float32 logits), so logits agree to rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from megatrain_ray.config.sections import ModelConfig, RopeScalingConfig
from megatrain_ray.messages import IGNORE_INDEX
from megatrain_ray.model.layout import StageLayout, token_chunks
from megatrain_ray.model.lora import chunk_spec, project
from megatrain_ray.model.lora_moe import with_param_adapters
from megatrain_ray.model.moe import MoeSpec, RouterRecord, moe_mlp
from megatrain_ray.model.sinks import sink_attention


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """The static facts a decoder layer template needs (derived from ModelConfig)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    qk_norm: bool
    attention_bias: bool
    sliding_window: int
    """This layer's window (0: full causal attention)."""
    gemma: bool = False
    """Gemma's layer: (1 + weight) norms, post-attention and pre/post-feedforward norms, GeLU-tanh MLP."""
    scale: float = 0.0
    """The factor on q.k (0: head_dim ** -0.5)."""
    softcap: float = 0.0
    """Attention logit soft-cap, cap * tanh(score / cap) (0: off; on: explicit attention, not SDPA)."""
    local_rope: bool = False
    """The layer takes the local RoPE tables (Gemma 3's sliding layers)."""
    lora_scaling: float = 0.0
    """The factor on the LoRA adapters' output where adapters are bound (model/lora.py project)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input (finetune.lora.lora_dropout), applied where lora_seed >= 0."""
    lora_seed: int = -1
    """This layer's dropout seed in this training step (model/lora.dropout_mask draws every mask from it, in the
    forward and again in the recompute); -1: no dropout (evaluation)."""
    moe: MoeSpec | None = None
    """A mixture-of-experts layer's router and experts (model/moe.py); None: a dense MLP."""

    @classmethod
    def from_config(cls, cfg: ModelConfig, layer: int = 0) -> "LayerSpec":
        """The spec of decoder layer `layer` (from 0): Gemma's layers differ in window and RoPE by layer_types."""
        slides = cfg.layer_slides(layer)
        return cls(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.resolved_head_dim, cfg.rms_norm_eps,
                   cfg.qk_norm, cfg.attention_bias, cfg.sliding_window if slides else 0, gemma=cfg.is_gemma,
                   scale=cfg.attention_scale, softcap=cfg.attn_logit_softcapping,
                   local_rope=slides and uses_local_rope(cfg),
                   moe=MoeSpec.from_config(cfg) if cfg.layer_is_moe(layer) else None)


def layer_specs(cfg: ModelConfig) -> tuple[LayerSpec, ...]:
    """One spec per decoder layer (equal objects where the layers are alike)."""
    return tuple(LayerSpec.from_config(cfg, i) for i in range(cfg.num_layers))


def uses_local_rope(cfg: ModelConfig) -> bool:
    """Gemma 3: its sliding layers take their own RoPE tables (rope_local_base_freq, no scaling)."""
    return cfg.family == "gemma3"


def embed_scale(cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor | None:
    """Gemma's factor on the input embeddings, sqrt(hidden_size): as transformers, a float32 scalar cast to
    the model's dtype (so in bfloat16 it is rounded). None for the other families. Not on the tied LM head."""
    if not cfg.is_gemma:
        return None
    return torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32).to(dtype)


def bind(buffer: torch.Tensor, stage: StageLayout) -> dict[str, torch.Tensor]:
    """Views of one stage's tensors inside its flat buffer: no copy, no module."""
    return {s.name: buffer[s.offset:s.offset + s.numel].view(s.shape) for s in stage.slots}


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    # Norms and RoPE run in float32 as in Hugging Face, and in float64 when the engine does.
    return torch.promote_types(dtype, torch.float32)


def _plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(_norm_dtype(dtype))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:  # Gemma: the scale (1 + weight) applied before the cast back, as transformers does
        return (x * (1.0 + weight.to(x.dtype))).to(dtype)
    return weight * x.to(dtype)


NORM_BACKWARD_ELEMENTS = 1 << 25
"""Elements per slice of rows in the norm's backward: its float32 temporaries exist for one slice."""


class _LeanRMSNorm(torch.autograd.Function):
    """RMSNorm whose backward keeps only the input (alive anyway: the residual) and one float32 scale
    per row. Plain autograd keeps the float32 upcast and the normalised copy instead: 6 bytes per element
    in bfloat16, 3 GiB per norm at 128K tokens of an 8B layer. The forward is the same operations."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool) -> torch.Tensor:
        upcast = x.to(_norm_dtype(x.dtype))
        scale = torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, scale)
        ctx.plus_one = plus_one
        if plus_one:
            return (upcast * scale * (1.0 + weight.to(scale.dtype))).to(x.dtype)
        return weight * (upcast * scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight, scale = ctx.saved_tensors
        plus_one = ctx.plus_one
        width = x.shape[-1]
        rows, grads, scales = x.reshape(-1, width), grad.reshape(-1, width), scale.reshape(-1, 1)
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = torch.empty_like(rows) if need_x else None
        grad_w = torch.zeros(width, dtype=scale.dtype, device=x.device) if need_w else None
        for part in token_chunks(rows.shape[0], max(1, NORM_BACKWARD_ELEMENTS // width)):
            normed = rows[part].to(scale.dtype) * scales[part]
            g = grads[part]
            if need_w:
                if plus_one:  # Gemma: the product in float32, d/dw of n * (1 + w) is n
                    grad_w += (g.to(scale.dtype) * normed).sum(0)
                else:
                    grad_w += (g * normed.to(x.dtype)).sum(0, dtype=scale.dtype)
            if need_x:
                # d/dx of x * rsqrt(mean(x^2) + eps), through the cast: scale * (g' - n * mean(g' * n)).
                g_up = g.to(scale.dtype) * (1.0 + weight.to(scale.dtype)) if plus_one else (g * weight).to(scale.dtype)
                grad_x[part] = scales[part] * (g_up - normed * (g_up * normed).mean(-1, keepdim=True))
        return (grad_x.view_as(x) if need_x else None,
                grad_w.to(weight.dtype).view_as(weight) if need_w else None, None, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False) -> torch.Tensor:
    """weight * x / rms(x), in float32 as Hugging Face does; `plus_one` (Gemma): (1 + weight) * x / rms(x),
    the product in float32 before the cast, as Gemma's RMSNorm. With autograd on and not under torch.compile,
    through _LeanRMSNorm (same forward, a backward that keeps no [tokens, hidden] float32 tensor); the
    compiled layer gives Inductor the plain operations, whose partitioner already recomputes them."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling() and \
            (x.requires_grad or weight.requires_grad):
        return _LeanRMSNorm.apply(x, weight, eps, plus_one)
    return _plain_rms_norm(x, weight, eps, plus_one)


# ----------------------------------------------------------------------------- RoPE


def uses_long_factors(cfg: ModelConfig, context: int) -> bool:
    """LongRoPE (Phi-3): whether a forward whose longest position is `context` - 1 takes the long
    factors; as transformers, all positions of the pass then use them (the short ones otherwise)."""
    scaling = cfg.rope_scaling
    return scaling is not None and scaling.rope_type == "longrope" and context > scaling.original_max_position_embeddings


def rope_inv_freq(cfg: ModelConfig, dtype: torch.dtype = torch.float32, long: bool = False,
                  local: bool = False) -> torch.Tensor:
    """Inverse frequencies of the rotated dimensions (cfg.rotary_dim / 2 of them); `long`: LongRoPE's
    long factors (see uses_long_factors); `local`: Gemma 3's sliding layers (rope_local_base_freq, unscaled)."""
    dim = cfg.rotary_dim
    if local:
        base = cfg.rope_local_base_freq or cfg.rope_theta
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype) / dim))
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.rope_type == "longrope":
        # As transformers: each frequency divided by its factor, 1 / (factor * theta^(2i/dim)).
        ext = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=dtype)
        return 1.0 / (ext * cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype) / dim))
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype) / dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, scaling, dim, cfg.rope_theta)
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: RopeScalingConfig, dim: int, base: float) -> torch.Tensor:
    """YaRN: dimensions that rotate more than beta_fast times over the original context keep their
    frequency, those rotating fewer than beta_slow times are interpolated (divided by factor), a linear
    ramp blends the ones in between (the paper's NTK-by-parts, as transformers computes it)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(inv_freq.dtype)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    # (1 - keep), not ramp: the same float32 roundings as transformers, so the tables agree bit for bit.
    return inv_freq / scaling.factor * (1 - keep) + inv_freq * keep


def rope_tables(cfg: ModelConfig, seq_len: int, device: torch.device, dtype: torch.dtype,
                long: bool | None = None, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq_len, rotary_dim] in `dtype`, computed in float32 (float64 for float64)
    and scaled by the YaRN or LongRoPE attention factor when it applies. `long`: LongRoPE's long factors
    (None: when seq_len is past the original context, as transformers decides for positions 0..seq_len-1).
    `local`: the tables of Gemma 3's sliding layers (see LayerSpec.local_rope)."""
    work = _norm_dtype(dtype)
    if long is None:
        long = uses_long_factors(cfg, seq_len)
    inv_freq = rope_inv_freq(cfg, work, long, local).to(device)
    positions = torch.arange(seq_len, device=device, dtype=work)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = cfg.rope_scaling.resolved_attention_factor if cfg.rope_scaling is not None and not local else 1.0
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos, sin: [seq, rotary_dim], or [batch, 1, seq, rotary_dim] when
    each row has its own positions (packed documents). A rotary_dim below head_dim (partial rotary factor)
    rotates the first rotary_dim dimensions and passes the rest through."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, kept), dim=-1)


# ----------------------------------------------------------------------------- attention


def _sliding_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    return (j <= i) & (i - j < window)


Segments = tuple[tuple[int, ...], ...]
"""Per row of a packed batch, the lengths of its documents in order (they sum to the row length)."""


@dataclass(frozen=True, slots=True)
class DocumentBucket:
    """Documents of about the same length, attended to as one padded SDPA batch."""

    rows: torch.Tensor
    """[n, 1] batch row of each document."""
    positions: torch.Tensor
    """[n, width] position in its row of each slot; padding repeats the document's last token."""
    valid: torch.Tensor
    """[n, width] True for the document's own tokens, False for padding."""


def document_buckets(segments: Segments, device: torch.device) -> tuple[DocumentBucket, ...]:
    """Group the documents of a packed batch by the power of two at or above their length: attention then
    costs one SDPA call per bucket (O(log seq_len) per layer, at most twice the work of exact lengths),
    not one per document and never a seq_len x seq_len mask. Built once per step, reused by every layer."""
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for row, lengths in enumerate(segments):
        start = 0
        for length in lengths:
            groups.setdefault(1 << (length - 1).bit_length(), []).append((row, start, length))
            start += length
    buckets = []
    for width, docs in sorted(groups.items()):
        table = torch.tensor(docs, dtype=torch.int64).to(device, non_blocking=True)
        rows, starts, lengths = table[:, :1], table[:, 1:2], table[:, 2:]
        offsets = torch.arange(width, device=device)[None, :]
        buckets.append(DocumentBucket(rows, starts + torch.minimum(offsets, lengths - 1), offsets < lengths))
    return tuple(buckets)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: LayerSpec,
              documents: tuple[DocumentBucket, ...] | None = None) -> torch.Tensor:
    """Causal attention; with `documents` (packed rows), causal within each document and never across.

    Each document is gathered into a padded batch of its bucket; padding follows the document's tokens,
    so causal attention never lets a real token see it, and its outputs are dropped.
    """
    if documents is None:
        return _causal_attention(q, k, v, spec)
    out = torch.empty_like(q)
    for bucket in documents:
        def gather(t: torch.Tensor, bucket: DocumentBucket = bucket) -> torch.Tensor:
            return t[bucket.rows, :, bucket.positions].transpose(1, 2)  # [n, heads, width, head_dim]

        per_doc = _causal_attention(gather(q), gather(k), gather(v), spec).transpose(1, 2)  # [n, width, H, D]
        rows = bucket.rows.expand_as(bucket.positions)[bucket.valid]
        out[rows, :, bucket.positions[bucket.valid]] = per_doc[bucket.valid]
    return out


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """Causal attention through SDPA (flash on GPU); q: [B, H, T, D], k and v: [B, H_kv, T, D]."""
    seq_len = q.shape[2]
    # GQA inside the kernel: k and v are never repeated to q's heads, so autograd keeps them at their own
    # width (flash attention takes the groups as they are; tests/gpu/test_gpu.py forces it to show so).
    gqa = spec.num_kv_heads != spec.num_heads
    scale = spec.scale or spec.head_dim ** -0.5
    if spec.softcap:
        return _softcapped_attention(q, k, v, spec, scale)
    if spec.sliding_window and seq_len > spec.sliding_window:
        mask = _sliding_mask(seq_len, spec.sliding_window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: LayerSpec,
                          scale: float) -> torch.Tensor:
    """Attention whose scores are soft-capped, cap * tanh(score / cap), before the mask and softmax (Gemma 2):
    SDPA cannot do it, so explicit products over a [B, H, T, T] score tensor, as transformers' eager path
    (k and v repeated to q's heads, the softmax in float32). Memory grows with T^2: for long sequences the
    planner's attention estimate does not hold."""
    groups = spec.num_heads // spec.num_kv_heads
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    seq_len = q.shape[2]
    if spec.sliding_window and seq_len > spec.sliding_window:
        allowed = _sliding_mask(seq_len, spec.sliding_window, q.device)
    else:
        allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


# ----------------------------------------------------------------------------- templates


def embed(ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of `ids`; times `scale` for Gemma (embed_scale: sqrt(hidden) in the weight's dtype)."""
    out = F.embedding(ids, weight)
    return out if scale is None else out * scale


def attention_block(x: torch.Tensor, w: Mapping[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                    spec: LayerSpec, documents: tuple[DocumentBucket, ...] | None = None) -> torch.Tensor:
    """The first half of a pre-norm decoder layer: x + attn(norm(x)). x: [B, T, hidden]."""
    batch, seq_len, _ = x.shape
    cos, sin = rope
    h = rms_norm(x, w["input_layernorm.weight"], spec.eps, spec.gemma)
    if "self_attn.qkv_proj.weight" in w:  # Phi-3: one product, split into views as transformers does
        q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        q, k, v = project(h, w, "self_attn.qkv_proj", spec).split((q_width, kv_width, kv_width), dim=-1)
    else:
        q = project(h, w, "self_attn.q_proj", spec)
        k = project(h, w, "self_attn.k_proj", spec)
        v = project(h, w, "self_attn.v_proj", spec)
    q = q.view(batch, seq_len, spec.num_heads, spec.head_dim)
    k = k.view(batch, seq_len, spec.num_kv_heads, spec.head_dim)
    v = v.view(batch, seq_len, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    if spec.qk_norm:
        q = rms_norm(q, w["self_attn.q_norm.weight"], spec.eps, spec.gemma)
        k = rms_norm(k, w["self_attn.k_norm.weight"], spec.eps, spec.gemma)
    q = apply_rope(q.transpose(1, 2), cos, sin)
    k = apply_rope(k.transpose(1, 2), cos, sin)
    if "self_attn.sinks" in w:  # gpt-oss: a learned logit per head in the softmax's denominator
        a = sink_attention(q, k, v, w["self_attn.sinks"], spec.head_dim ** -0.5, spec.sliding_window, documents)
    else:
        a = attention(q, k, v, spec, documents)
    a = a.transpose(1, 2).reshape(batch, seq_len, spec.num_heads * spec.head_dim)
    out = project(a, w, "self_attn.o_proj", spec)
    if spec.gemma:  # Gemma: the attention's output normed before the residual add
        out = rms_norm(out, w["post_attention_layernorm.weight"], spec.eps, True)
    return x + out


def mlp_block(x: torch.Tensor, w: Mapping[str, torch.Tensor], spec: LayerSpec,
              router: RouterRecord | None = None) -> torch.Tensor:
    """The second half: x + mlp(norm(x)), token by token (so it can run on any slice of tokens). A MoE layer's
    router statistics go to `router` when given (the load-balancing loss)."""
    if spec.moe is not None:
        w = with_param_adapters(w, spec.lora_scaling)  # LoRA on the router or experts (model/lora_moe.py)
        return x + moe_mlp(rms_norm(x, w["post_attention_layernorm.weight"], spec.eps), w, spec.moe, router)
    if spec.gemma:  # norms before and after the GeLU-tanh MLP
        h = rms_norm(x, w["pre_feedforward_layernorm.weight"], spec.eps, True)
        m = F.gelu(project(h, w, "mlp.gate_proj", spec), approximate="tanh") * project(h, w, "mlp.up_proj", spec)
        out = project(m, w, "mlp.down_proj", spec)
        return x + rms_norm(out, w["post_feedforward_layernorm.weight"], spec.eps, True)
    h = rms_norm(x, w["post_attention_layernorm.weight"], spec.eps)
    if "mlp.gate_up_proj.weight" in w:  # Phi-3: gate and up from one product, halves of its output
        gate, up = project(h, w, "mlp.gate_up_proj", spec).chunk(2, dim=-1)
        m = up * F.silu(gate)
    else:
        m = F.silu(project(h, w, "mlp.gate_proj", spec)) * project(h, w, "mlp.up_proj", spec)
    return x + project(m, w, "mlp.down_proj", spec)


def is_mlp_weight(name: str, spec: LayerSpec) -> bool:
    """The weights mlp_block reads (the second half of a layer), of every family (Gemma's
    post_attention_layernorm norms the attention's output: the first half)."""
    if spec.gemma:
        return name in ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight") or \
            name.startswith("mlp.")
    return name == "post_attention_layernorm.weight" or name.startswith("mlp.")


def decoder_layer(x: torch.Tensor, w: Mapping[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                  spec: LayerSpec, documents: tuple[DocumentBucket, ...] | None = None,
                  mlp_chunk_tokens: int = 0, router: RouterRecord | None = None) -> torch.Tensor:
    """One pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.)). x: [B, T, hidden].

    With mlp_chunk_tokens > 0 (no autograd), the MLP runs over slices of that many tokens, so its
    [tokens, intermediate] tensors exist for one slice at a time (long sequences). `router`: where a MoE
    layer records its routing (the load-balancing loss)."""
    x = attention_block(x, w, rope, spec, documents)
    chunks = token_chunks(x.shape[0] * x.shape[1], mlp_chunk_tokens)
    if len(chunks) == 1:
        return mlp_block(x, w, spec, router)
    flat = x.view(-1, x.shape[-1])
    out = torch.empty_like(flat)
    for k, part in enumerate(chunks):
        out[part] = mlp_block(flat[part], w, chunk_spec(spec, k), router)
    return out.view_as(x)


def decoder_layer_backward(x: torch.Tensor, w: Mapping[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                           spec: LayerSpec, documents: tuple[DocumentBucket, ...] | None, grad_y: torch.Tensor,
                           mlp_chunk_tokens: int = 0, layer=None,
                           trainable=None, router_grad: torch.Tensor | None = None,
                           router: RouterRecord | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Recompute the layer from its input and return (grad of x, grads of the weights by name).

    `trainable(name)` picks the weights whose gradients are computed (None: all); the others are bound
    without requires_grad, so autograd computes no gradient for them (LoRA's frozen base).

    In one piece when the tokens fit one MLP chunk. Otherwise the attention half is recomputed once, the
    MLP half chunk by chunk (recompute, backward, add its weight gradients into float32 sums), and the
    attention half's backward takes the assembled gradient: the MLP's [tokens, intermediate] tensors
    then exist for one chunk at a time. `layer` replaces decoder_layer in the one-piece case (a compiled
    version of it). `router_grad` (a MoE layer with the load-balancing loss on): the loss's gradient with
    respect to the layer's summed router probabilities (RouterRecord.prob_sum), added to the backward. `router`:
    where a MoE layer's recompute records its routing (the expert counts of its gradients)."""
    x = x.detach().requires_grad_(True)
    params = {n: t.detach().requires_grad_(trainable is None or trainable(n)) for n, t in w.items()}
    wanted = [n for n, t in params.items() if t.requires_grad]
    chunks = token_chunks(x.shape[0] * x.shape[1], mlp_chunk_tokens)
    with torch.enable_grad():
        if len(chunks) == 1:
            if router_grad is not None or router is not None:
                record = router or RouterRecord()
                y = decoder_layer(x, params, rope, spec, documents, router=record)
                outputs, grad_outputs = ([y, record.prob_sum], [grad_y, router_grad]) if router_grad is not None \
                    else (y, grad_y)
                grads = torch.autograd.grad(outputs, [x, *(params[n] for n in wanted)], grad_outputs)
            else:
                y = (layer or decoder_layer)(x, params, rope, spec, documents)
                grads = torch.autograd.grad(y, [x, *(params[n] for n in wanted)], grad_y)
            return grads[0], dict(zip(wanted, grads[1:]))
        mid = attention_block(x, params, rope, spec, documents)
    mid_flat = mid.detach().view(-1, mid.shape[-1])
    grad_y_flat = grad_y.reshape(-1, grad_y.shape[-1])
    grad_mid = torch.empty_like(mid_flat)
    mlp_params = {n: t for n, t in params.items() if is_mlp_weight(n, spec)}
    mlp_wanted = [n for n in wanted if n in mlp_params]
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    mlp_grads = {n: torch.zeros(mlp_params[n].shape, dtype=acc_dtype, device=x.device) for n in mlp_wanted}
    for k, part in enumerate(chunks):
        with torch.enable_grad():
            piece = mid_flat[part].requires_grad_(True)
            record = RouterRecord() if router_grad is not None or router is not None else None
            out = mlp_block(piece, mlp_params, chunk_spec(spec, k), record)
            outputs, grad_outputs = ([out, record.prob_sum], [grad_y_flat[part], router_grad]) \
                if router_grad is not None else (out, grad_y_flat[part])
            if router is not None:
                router.add(record.counts, record.prob_sum.detach(), record.rows)
            grads = torch.autograd.grad(outputs, [piece, *(mlp_params[n] for n in mlp_wanted)], grad_outputs)
        grad_mid[part] = grads[0]
        for name, g in zip(mlp_wanted, grads[1:]):
            mlp_grads[name] += g
        del out, grads  # else this piece's output and gradients live through the next piece's backward
    attn_params = [n for n in wanted if n not in mlp_params]
    grads = torch.autograd.grad(mid, [x, *(params[n] for n in attn_params)], grad_mid.view_as(mid))
    return grads[0], {**dict(zip(attn_params, grads[1:])), **mlp_grads}


@dataclass(frozen=True, slots=True)
class HeadSpec:
    """The static facts of the head: the final norm's epsilon and kind, the final logit soft-cap."""

    eps: float
    plus_one: bool = False
    """Gemma's (1 + weight) final norm."""
    softcap: float = 0.0
    """Final logit soft-cap, cap * tanh(logit / cap) (Gemma 2); 0: off."""

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "HeadSpec":
        return cls(cfg.rms_norm_eps, cfg.is_gemma, cfg.final_logit_softcapping)


def head_logits(x: torch.Tensor, norm_weight: torch.Tensor, lm_weight: torch.Tensor,
                eps: float | HeadSpec) -> torch.Tensor:
    """Full logits, for evaluation and tests on small inputs only (training uses the chunked loss).
    `eps`: a HeadSpec, or the final norm's epsilon alone (plain RMSNorm, no soft-cap)."""
    spec = eps if isinstance(eps, HeadSpec) else HeadSpec(eps)
    logits = F.linear(rms_norm(x, norm_weight, spec.eps, spec.plus_one), lm_weight)
    if spec.softcap:  # in the model's dtype, as transformers
        logits = torch.tanh(logits / spec.softcap) * spec.softcap
    return logits


@dataclass(slots=True)
class HeadResult:
    loss_sum: torch.Tensor
    """Sum over valid tokens of the cross-entropy, divided by `n_valid` (so it is the mean)."""
    grad_x: torch.Tensor | None
    grad_norm_weight: torch.Tensor | None
    """Both None for a forward-only loss (evaluation)."""


def head_loss_and_grads(x: torch.Tensor, norm_weight: torch.Tensor | None, lm_weight: torch.Tensor,
                        labels: torch.Tensor, n_valid: int, eps: float | HeadSpec, chunk_tokens: int,
                        grad_lm_acc: torch.Tensor | None, input_grad_only: bool = False) -> HeadResult:
    """Mean cross-entropy over the valid labels and its gradients, in chunks of tokens.

    Logits exist for one chunk at a time (chunk_tokens x vocab, upcast to float32 as in Hugging
    Face's loss). The gradient of the LM head matrix is added into `grad_lm_acc` (float32 or
    float64), which with tied embeddings also collects the embedding's gradient later. With
    `grad_lm_acc=None` only the loss is computed (evaluation). `eps`: a HeadSpec, or the final norm's
    epsilon alone; `norm_weight=None`: x is normed already (no norm here). A final soft-cap (Gemma 2) is
    applied to the upcast logits, and its derivative, 1 - tanh^2, to their gradient (one more chunk-sized float32
    tensor while it is on). `input_grad_only` (a frozen head, LoRA): only the gradient of x, none of the weights
    (grad_lm_acc unused).
    """
    spec = eps if isinstance(eps, HeadSpec) else HeadSpec(eps)
    batch, seq_len, hidden = x.shape
    with_grads = grad_lm_acc is not None or input_grad_only
    x = x.detach().requires_grad_(with_grads)
    if norm_weight is None:  # x is normed already (the generic path's own norm module): grad_x is of the logits' input
        normed = x
    else:
        norm_weight = norm_weight.detach().requires_grad_(with_grads and not input_grad_only)
        with torch.set_grad_enabled(with_grads):
            normed = rms_norm(x, norm_weight, spec.eps, spec.plus_one)
    flat = normed.detach().reshape(-1, hidden)
    flat_labels = labels.reshape(-1)
    grad_flat = torch.empty_like(flat)
    loss_dtype = _norm_dtype(x.dtype)
    loss = torch.zeros((), dtype=loss_dtype, device=x.device)
    for start in range(0, flat.shape[0], chunk_tokens):
        h = flat[start:start + chunk_tokens]
        lab = flat_labels[start:start + chunk_tokens]
        logits = F.linear(h, lm_weight).to(loss_dtype)
        capped = None
        if spec.softcap:  # tanh kept (as `capped`) for the derivative; logits become cap * tanh
            capped = logits.div_(spec.softcap).tanh_()
            logits = capped * spec.softcap
        valid = lab != IGNORE_INDEX
        safe = torch.where(valid, lab, 0)
        lse = torch.logsumexp(logits, dim=-1)
        target = logits.gather(1, safe[:, None]).squeeze(1)
        loss += torch.where(valid, lse - target, 0).sum() / n_valid
        if not with_grads:
            continue
        # d(loss)/d(logits) = (softmax - onehot) / n_valid on valid rows, 0 elsewhere; built in place.
        grad_logits = logits.sub_(lse[:, None]).exp_()
        grad_logits.scatter_add_(1, safe[:, None], -torch.ones_like(lse[:, None]))
        grad_logits.mul_((valid.to(loss_dtype) / n_valid)[:, None])
        if capped is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh^2
            grad_logits.mul_(capped.square_().neg_().add_(1.0))
            del capped
        grad_logits = grad_logits.to(h.dtype)
        grad_flat[start:start + chunk_tokens] = grad_logits @ lm_weight
        if not input_grad_only:
            grad_lm_acc.add_((grad_logits.t() @ h).to(grad_lm_acc.dtype))
    if not with_grads:
        return HeadResult(loss, None, None)
    if norm_weight is None:
        return HeadResult(loss, grad_flat.view(batch, seq_len, hidden), None)
    if input_grad_only:
        (grad_x,) = torch.autograd.grad(normed, (x,), grad_flat.view(batch, seq_len, hidden))
        return HeadResult(loss, grad_x, None)
    grad_x, grad_norm = torch.autograd.grad(normed, (x, norm_weight), grad_flat.view(batch, seq_len, hidden))
    return HeadResult(loss, grad_x, grad_norm)


def model_logits(cfg: ModelConfig, stages: list[StageLayout], buffers: list[torch.Tensor],
                 ids: torch.Tensor) -> torch.Tensor:
    """Logits of the whole model from one flat buffer per stage (all resident): small models only."""
    embed_w = bind(buffers[0], stages[0])["embed_tokens.weight"]
    x = embed(ids, embed_w, embed_scale(cfg, embed_w.dtype))
    ropes = {local: rope_tables(cfg, ids.shape[1], x.device, x.dtype, local=local)
             for local in {spec.local_rope for spec in layer_specs(cfg)}}
    for spec, stage, buffer in zip(layer_specs(cfg), stages[1:-1], buffers[1:-1]):
        x = decoder_layer(x, bind(buffer, stage), ropes[spec.local_rope], spec)
    head = bind(buffers[-1], stages[-1])
    return head_logits(x, head["model.norm.weight"], head.get("lm_head.weight", embed_w), HeadSpec.from_config(cfg))
