"""Causal attention of a decoder layer: through SDPA (GQA inside the kernel, sliding windows), explicit for
soft-capped scores (Gemma 2), and per document for packed rows (documents bucketed by length)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatrain_ray.model.decode_attention import decode_attention
from megatrain_ray.model.layer_spec import LayerSpec


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


@dataclass(frozen=True, slots=True)
class ExplicitMask:
    """Where attention is allowed, given whole in place of document buckets (a vision-language model's image
    blocks, model/vision/splice.py): [B, 1, T, T] booleans for the global layers and for the sliding ones."""

    full: torch.Tensor
    sliding: torch.Tensor | None = None
    """None: the model has no sliding layers."""

    def of(self, spec: LayerSpec) -> torch.Tensor:
        if spec.sliding_window:
            if self.sliding is None:
                raise ValueError("an explicit attention mask without its sliding-window part reached a sliding layer")
            return self.sliding
        return self.full


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
    if isinstance(documents, ExplicitMask):
        return masked_attention(q, k, v, documents.of(spec), spec)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])  # the values' width (latent attention's differs from q's)
    for bucket in documents:
        def gather(t: torch.Tensor, bucket: DocumentBucket = bucket) -> torch.Tensor:
            return t[bucket.rows, :, bucket.positions].transpose(1, 2)  # [n, heads, width, head_dim]

        per_doc = _causal_attention(gather(q), gather(k), gather(v), spec).transpose(1, 2)  # [n, width, H, D]
        rows = bucket.rows.expand_as(bucket.positions)[bucket.valid]
        out[rows, :, bucket.positions[bucket.valid]] = per_doc[bucket.valid]
    return out


def per_document(x: torch.Tensor, documents: tuple[DocumentBucket, ...], fn) -> torch.Tensor:
    """fn over each document of packed rows x [B, T, C] alone: gathered into its bucket's padded batch [n, width, C]
    (the padding after its tokens, which a causal fn never lets them see), fn's outputs [n, width, C'] put back in
    place. For token mixers that carry a state along the row (the linear attention's convolution and delta rule)."""
    out = None
    for bucket in documents:
        y = fn(x[bucket.rows, bucket.positions])
        if out is None:
            out = y.new_empty(*x.shape[:2], y.shape[-1])
        rows = bucket.rows.expand_as(bucket.positions)[bucket.valid]
        out[rows, bucket.positions[bucket.valid]] = y[bucket.valid]
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


def split_gated_query(projected: torch.Tensor, spec: LayerSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """q_proj's output [B, T, H * 2 D] of a gated attention (LayerSpec.output_gate: Qwen3.5, Qwen3-Next): per head its
    query [B, T, H, D] then its gate, flattened as the attention's output is [B, T, H * D], as transformers splits it."""
    batch, seq_len, _ = projected.shape
    q, gate = projected.view(batch, seq_len, spec.num_heads, 2 * spec.head_dim).chunk(2, dim=-1)
    return q, gate.reshape(batch, seq_len, spec.num_heads * spec.head_dim)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     spec: LayerSpec) -> torch.Tensor:
    """Attention of q [B, H, Tq, D] over k, v [B, H_kv, Tk, D] where `allowed` [B, 1, Tq, Tk] is True (the rollout's
    cached keys: left padding, causality and the sliding window already in the mask)."""
    scale = spec.scale or spec.head_dim ** -0.5
    if spec.softcap:
        return _softcapped_attention(q, k, v, spec, scale, allowed)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                          enable_gqa=spec.num_kv_heads != spec.num_heads)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     spec: LayerSpec) -> torch.Tensor:
    """masked_attention for the rollout's queries over its KV cache (model/decode.py), `allowed` [B, 1, Tq, Tk] the
    same for every head. With grouped-query heads, each KV head's query heads are folded into the query length
    ([B, H_kv, groups * Tq, D]) so SDPA sees as many query as key heads: torch's kernels that take a mask do not take
    enable_gqa, and its math fallback repeats the whole cache to every query head (for a 32B shape at a 12.8k-token
    cache that is about 1 GB of copies per layer in every decode step). The scores and weighted sums are the same.
    A decode step (one query per row) goes through decode_attention instead: split along the keys, as SDPA's masked
    kernels are not (model/decode_attention.py)."""
    if q.shape[2] == 1 and not spec.softcap:
        return decode_attention(q, k, v, allowed, spec.scale or spec.head_dim ** -0.5)
    return folded_masked_attention(q, k, v, allowed, spec)


def folded_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                            spec: LayerSpec) -> torch.Tensor:
    """cached_attention through SDPA for any query length: each KV head's query heads folded into the query length."""
    groups = spec.num_heads // spec.num_kv_heads
    scale = spec.scale or spec.head_dim ** -0.5
    if groups == 1 or spec.softcap:
        return masked_attention(q, k, v, allowed, spec)
    batch, heads, count, dim = q.shape
    folded = q.reshape(batch, spec.num_kv_heads, groups * count, dim)  # head h: kv head h // groups, as in GQA
    mask = allowed[:, :, None].expand(batch, 1, groups, count, allowed.shape[-1])
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask.reshape(batch, 1, groups * count, -1),
                                         scale=scale)
    return out.reshape(batch, heads, count, v.shape[-1])  # the values' width (latent attention's differs)


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: LayerSpec,
                          scale: float, allowed: torch.Tensor | None = None) -> torch.Tensor:
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
    if allowed is None:  # else the caller's mask (masked_attention)
        allowed = _sliding_mask(seq_len, spec.sliding_window, q.device) \
            if spec.sliding_window and seq_len > spec.sliding_window \
            else torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
