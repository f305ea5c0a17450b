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
(model/head.py: `head_logits`, or `head_loss_and_grads`, which computes the loss in token chunks so that
full logits never exist). The layers' parts live beside this module: RMSNorm in model/norms.py, RoPE in
model/rope.py, attention in model/attention.py, the per-layer facts (LayerSpec) in model/layer_spec.py.

The math follows Hugging Face's modeling code operation by operation (norms in float32,
RoPE tables in float32, the loss on float32 logits), so logits agree to rounding.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.model.attention import DocumentBucket, attention, per_document, split_gated_query
from megatrain_ray.model.head import HeadSpec, head_logits
from megatrain_ray.model.layer_spec import LayerSpec, layer_specs
from megatrain_ray.model.latent_attention import latent_output, latent_qkv
from megatrain_ray.model.layout import StageLayout, token_chunks
from megatrain_ray.model.linear_attention import linear_attention
from megatrain_ray.model.lora import chunk_spec, project, project_group, projection
from megatrain_ray.model.lora_moe import with_param_adapters
from megatrain_ray.model.moe import RouterRecord, moe_mlp
from megatrain_ray.model.norms import rms_norm
from megatrain_ray.model.rope import apply_rope, rope_tables
from megatrain_ray.model.sigmoid_router import trains, with_fixed_zeros
from megatrain_ray.model.sinks import sink_attention


def embed_scale(cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor | None:
    """Gemma's factor on the input embeddings, sqrt(hidden_size): as transformers, a float32 scalar cast to
    the model's dtype (so in bfloat16 it is rounded). None for the other families. Not on the tied LM head."""
    if not cfg.is_gemma:
        return None
    return torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32).to(dtype)


def bind(buffer: torch.Tensor, stage: StageLayout) -> dict[str, torch.Tensor]:
    """Views of one stage's tensors inside its flat buffer: no copy, no module."""
    return {s.name: buffer[s.offset:s.offset + s.numel].view(s.shape) for s in stage.slots}


def embed(ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of `ids`; times `scale` for Gemma (embed_scale: sqrt(hidden) in the weight's dtype)."""
    out = F.embedding(ids, weight)
    return out if scale is None else out * scale


def embed_backward(acc: torch.Tensor, ids: torch.Tensor, grad_y: torch.Tensor, scale: torch.Tensor | None = None,
                   padding_idx: int | None = None) -> None:
    """The lookup's weight gradient added into `acc` ([vocab, hidden]; with a tied head it holds the head's
    already): each input gradient onto its token's row, times `scale` (Gemma); none onto `padding_idx`'s row, as
    transformers' nn.Embedding(padding_idx=pad_token_id) gives that row none from the lookup."""
    rows, flat = grad_y.reshape(-1, grad_y.shape[-1]).to(acc.dtype), ids.reshape(-1)
    if scale is not None:
        rows = rows * scale.to(acc.dtype)
    if padding_idx is not None:  # in place where `rows` is a copy already (no second [tokens, hidden] temporary)
        pad = (flat == padding_idx).unsqueeze(-1)
        rows = rows.masked_fill(pad, 0) if rows.data_ptr() == grad_y.data_ptr() else rows.masked_fill_(pad, 0)
    acc.index_add_(0, flat, rows)


def attention_qkv(x: torch.Tensor, w: Mapping[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                  spec: LayerSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention's inputs from x [B, T, hidden]: q [B, H, T, D] and k [B, H_kv, T, D] rotated, v [B, H_kv, T, D]
    (shared by the training layer and the rollout's cached layer, model/decode.py)."""
    return gated_attention_inputs(x, w, rope, spec)[:3]


def gated_attention_inputs(x: torch.Tensor, w: Mapping[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                           spec: LayerSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """attention_qkv and the output gate [B, T, H * D] of a gated attention (LayerSpec.output_gate; else None)."""
    batch, seq_len, _ = x.shape
    cos, sin = rope
    gate = None
    h = rms_norm(x, w["input_layernorm.weight"], spec.eps, spec.plus_one)
    if "self_attn.qkv_proj.weight" in w:  # Phi-3: one product, split into views as transformers does
        q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        q, k, v = project(h, w, "self_attn.qkv_proj", spec).split((q_width, kv_width, kv_width), dim=-1)
    elif spec.output_gate:  # one product, each head's query then its gate
        q, gate = split_gated_query(project(h, w, "self_attn.q_proj", spec), spec)
        k = project(h, w, "self_attn.k_proj", spec)
        v = project(h, w, "self_attn.v_proj", spec)
    else:
        q, k, v = project_group(h, w, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), spec)
    q = q.view(batch, seq_len, spec.num_heads, spec.head_dim)
    k = k.view(batch, seq_len, spec.num_kv_heads, spec.head_dim)
    v = v.view(batch, seq_len, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    if spec.qk_norm:
        q = rms_norm(q, w["self_attn.q_norm.weight"], spec.eps, spec.plus_one)
        k = rms_norm(k, w["self_attn.k_norm.weight"], spec.eps, spec.plus_one)
    q = apply_rope(q.transpose(1, 2), cos, sin)
    k = apply_rope(k.transpose(1, 2), cos, sin)
    return q, k, v, gate


def attention_out(x: torch.Tensor, a: torch.Tensor, w: Mapping[str, torch.Tensor], spec: LayerSpec,
                  gate: torch.Tensor | None = None) -> torch.Tensor:
    """x plus the attention's output projection of `a` [B, H, T, D] (Gemma: normed before the add; a gated attention:
    times sigmoid(gate) before it)."""
    batch, seq_len, _ = x.shape
    a = a.transpose(1, 2).reshape(batch, seq_len, spec.num_heads * spec.head_dim)
    if gate is not None:
        a = a * torch.sigmoid(gate)
    out = project(a, w, "self_attn.o_proj", spec)
    if spec.gemma:  # Gemma: the attention's output normed before the residual add
        out = rms_norm(out, w["post_attention_layernorm.weight"], spec.eps, True)
    return x + out


def attention_block(x: torch.Tensor, w: Mapping[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                    spec: LayerSpec, documents: tuple[DocumentBucket, ...] | None = None) -> torch.Tensor:
    """The first half of a pre-norm decoder layer: x + attn(norm(x)), or a linear-attention layer's token mixer in
    place of attn. x: [B, T, hidden]."""
    if spec.linear is not None:  # Qwen3.5 / Qwen3-Next's Gated DeltaNet layers (no RoPE; packed rows: per document)
        h = rms_norm(x, w["input_layernorm.weight"], spec.eps, spec.plus_one)
        proj = projection(w, spec)  # LoRA adapters where bound
        if documents is None:
            return x + linear_attention(h, w, spec.linear, proj)
        return x + per_document(h, documents, lambda doc: linear_attention(doc, w, spec.linear, proj))
    if spec.latent is not None:  # DeepSeek-V3's multi-head latent attention (model/latent_attention.py)
        q, k, v = latent_qkv(rms_norm(x, w["input_layernorm.weight"], spec.eps), w, rope, spec)
        return x + latent_output(attention(q, k, v, spec, documents), w, spec)
    q, k, v, gate = gated_attention_inputs(x, w, rope, spec)
    if "self_attn.sinks" in w:  # gpt-oss: a learned logit per head in the softmax's denominator
        a = sink_attention(q, k, v, w["self_attn.sinks"], spec.head_dim ** -0.5, spec.sliding_window, documents)
    else:
        a = attention(q, k, v, spec, documents)
    return attention_out(x, a, w, spec, gate)


def mlp_block(x: torch.Tensor, w: Mapping[str, torch.Tensor], spec: LayerSpec,
              router: RouterRecord | None = None) -> torch.Tensor:
    """The second half: x + mlp(norm(x)), token by token (so it can run on any slice of tokens). A MoE layer's
    router statistics go to `router` when given (the load-balancing loss)."""
    if spec.moe is not None:
        w = with_param_adapters(w, spec.lora_scaling)  # LoRA on the router or experts (model/lora_moe.py)
        return x + moe_mlp(rms_norm(x, w["post_attention_layernorm.weight"], spec.eps, spec.plus_one), w, spec.moe,
                           router, projection(w, spec))
    if spec.gemma:  # norms before and after the GeLU-tanh MLP
        h = rms_norm(x, w["pre_feedforward_layernorm.weight"], spec.eps, True)
        m = F.gelu(project(h, w, "mlp.gate_proj", spec), approximate="tanh") * project(h, w, "mlp.up_proj", spec)
        out = project(m, w, "mlp.down_proj", spec)
        return x + rms_norm(out, w["post_feedforward_layernorm.weight"], spec.eps, True)
    h = rms_norm(x, w["post_attention_layernorm.weight"], spec.eps, spec.plus_one)
    if "mlp.gate_up_proj.weight" in w:  # Phi-3: gate and up from one product, halves of its output
        gate, up = project(h, w, "mlp.gate_up_proj", spec).chunk(2, dim=-1)
        m = up * F.silu(gate)
    else:
        gate, up = project_group(h, w, ("mlp.gate_proj", "mlp.up_proj"), spec)
        m = F.silu(gate) * up
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
    return mlp_in_chunks(attention_block(x, w, rope, spec, documents), w, spec, mlp_chunk_tokens, router)


def mlp_in_chunks(x: torch.Tensor, w: Mapping[str, torch.Tensor], spec: LayerSpec, mlp_chunk_tokens: int,
                  router: RouterRecord | None = None) -> torch.Tensor:
    """mlp_block over slices of `mlp_chunk_tokens` tokens (0: in one piece; no autograd across slices)."""
    chunks = token_chunks(x.shape[0] * x.shape[1], mlp_chunk_tokens)
    if len(chunks) == 1:
        return mlp_block(x, w, spec, router)
    flat = x.view(-1, x.shape[-1])
    out = torch.empty_like(flat)
    for k, part in enumerate(chunks):
        out[part] = mlp_block(flat[part], w, chunk_spec(spec, k), router)
    return out.view_as(x)


def decoder_layer_routing(x: torch.Tensor, w: Mapping[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                          spec: LayerSpec, documents: tuple[DocumentBucket, ...] | None = None,
                          mlp_chunk_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """decoder_layer of a MoE layer, its routing recorded in a RouterRecord of its own: (output, the record's
    expert counts, summed router probabilities and rows). A compiled version of it changes no object of its
    caller's (engine/compiled.py)."""
    record = RouterRecord()
    y = decoder_layer(x, w, rope, spec, documents, mlp_chunk_tokens, record)
    return y, record.counts, record.prob_sum, record.rows


def decoder_layer_backward(x: torch.Tensor, w: Mapping[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                           spec: LayerSpec, documents: tuple[DocumentBucket, ...] | None, grad_y: torch.Tensor,
                           mlp_chunk_tokens: int = 0, layer=None,
                           trainable=None, router_grad: torch.Tensor | None = None,
                           router: RouterRecord | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Recompute the layer from its input and return (grad of x, grads of the weights by name).

    `trainable(name)` picks the weights whose gradients are computed (None: all but the untrained ones, whose
    gradients are zeros: model/sigmoid_router.FIXED_TENSORS); the others are bound without requires_grad, so
    autograd computes no gradient for them (LoRA's frozen base).

    In one piece when the tokens fit one MLP chunk. Otherwise the attention half is recomputed once, the
    MLP half chunk by chunk (recompute, backward, add its weight gradients into float32 sums), and the
    attention half's backward takes the assembled gradient: the MLP's [tokens, intermediate] tensors
    then exist for one chunk at a time. `layer` replaces decoder_layer in the one-piece case (a compiled
    version of it). `router_grad` (a MoE layer with the load-balancing loss on): the loss's gradient with
    respect to the layer's summed router probabilities (RouterRecord.prob_sum), added to the backward. `router`:
    where a MoE layer's recompute records its routing (the expert counts of its gradients)."""
    x = x.detach().requires_grad_(True)
    params = {n: t.detach().requires_grad_(trains(n, trainable)) for n, t in w.items()}
    wanted = [n for n, t in params.items() if t.requires_grad]
    chunks = token_chunks(x.shape[0] * x.shape[1], mlp_chunk_tokens)
    with torch.enable_grad():
        if len(chunks) == 1:
            if router_grad is not None or router is not None:
                record = router or RouterRecord()
                y = (layer or decoder_layer)(x, params, rope, spec, documents, mlp_chunk_tokens, record)
                outputs, grad_outputs = ([y, record.prob_sum], [grad_y, router_grad]) if router_grad is not None \
                    else (y, grad_y)
                grads = torch.autograd.grad(outputs, [x, *(params[n] for n in wanted)], grad_outputs)
            else:
                # mlp_chunk_tokens as the forward passed it: one compiled graph for both (one piece either way)
                y = (layer or decoder_layer)(x, params, rope, spec, documents, mlp_chunk_tokens)
                grads = torch.autograd.grad(y, [x, *(params[n] for n in wanted)], grad_y)
            return grads[0], with_fixed_zeros(dict(zip(wanted, grads[1:])), w, trainable)
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
    return grads[0], with_fixed_zeros({**dict(zip(attn_params, grads[1:])), **mlp_grads}, w, trainable)


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
