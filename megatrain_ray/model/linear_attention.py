"""The linear-attention (Gated DeltaNet) token mixer of Qwen3.5 and Qwen3-Next, as a stateless function of its
normed input and its weights, following transformers' Qwen3_5GatedDeltaNet / Qwen3NextGatedDeltaNet operation by
operation (training: every row from a zero state, no cache):

- projections: q, k, v (q and k: num_key_heads x key_head_dim each, v: num_value_heads x value_head_dim), the output
  gate z (as v) and b, a (one per value head). Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a. Qwen3-Next:
  in_proj_qkvz and in_proj_ba, their rows grouped by key head ([q k v z] of each, [b a] of each), as it stores them;
- a causal depthwise convolution (conv1d, width linear_conv_kernel_dim, no bias) over [q k v] and SiLU;
- beta = sigmoid(b), log-decay g = -exp(A_log) * softplus(a + dt_bias) in float32 (float64 when computing in it);
- the chunked gated delta rule (model/delta_rule.py);
- a gated RMSNorm per value head: weight * norm(o) (plain weight, ones at the start), times SiLU(z) in float32;
- out_proj back to the hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from megatrain_ray.config.linear_attention_section import FUSED_PROJECTIONS
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.model.delta_rule import chunk_gated_delta_rule
from megatrain_ray.model.norms import norm_dtype

P = "linear_attn."
"""The token mixer's tensors' prefix in a layer (their list: model/layout.py linear_attention_tensors)."""


@dataclass(frozen=True, slots=True)
class LinearAttentionSpec:
    """The static facts of a linear-attention layer (from ModelConfig.linear_attention)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    eps: float
    """The gated output norm's epsilon (rms_norm_eps)."""
    fused: bool
    """Qwen3-Next's in_proj_qkvz / in_proj_ba (rows grouped by key head); else Qwen3.5's four projections."""

    @property
    def conv_channels(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "LinearAttentionSpec":
        la = cfg.linear_attention
        return cls(la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel_dim,
                   cfg.rms_norm_eps, cfg.family in FUSED_PROJECTIONS)


Projection = Callable[[torch.Tensor, str], torch.Tensor]
"""(input, module name) -> the module's product: the plain matrix, or with its LoRA adapter (model/lora.project)."""


def projections(h: torch.Tensor, w: Mapping[str, torch.Tensor], spec: LinearAttentionSpec, proj: Projection):
    """[q k v] side by side [B, T, conv channels], z [B, T, H_v, d_v], b and a [B, T, H_v]."""
    batch, seq_len, _ = h.shape
    nk, nv, dk, dv = spec.num_key_heads, spec.num_value_heads, spec.key_head_dim, spec.value_head_dim
    if not spec.fused:
        z = proj(h, f"{P}in_proj_z").view(batch, seq_len, nv, dv)
        return proj(h, f"{P}in_proj_qkv"), z, proj(h, f"{P}in_proj_b"), proj(h, f"{P}in_proj_a")
    per = nv // nk  # value heads per key head: Qwen3-Next's rows are [q k v z] and [b a] per key head
    qkvz = proj(h, f"{P}in_proj_qkvz").view(batch, seq_len, nk, 2 * dk + 2 * per * dv)
    q, k, v, z = qkvz.split((dk, dk, per * dv, per * dv), dim=-1)
    b, a = proj(h, f"{P}in_proj_ba").view(batch, seq_len, nk, 2 * per).split((per, per), dim=-1)
    mixed = torch.cat([t.reshape(batch, seq_len, -1) for t in (q, k, v)], dim=-1)
    return mixed, z.reshape(batch, seq_len, nv, dv), b.reshape(batch, seq_len, nv), a.reshape(batch, seq_len, nv)


def causal_conv(mixed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU of the causal depthwise convolution of mixed [B, T, C] (weight [C, 1, K]): each channel at t sees its own
    values at t - K + 1 .. t (zeros before the row's start), as transformers' causal_conv1d_fn."""
    seq_len = mixed.shape[1]
    out = F.conv1d(mixed.transpose(1, 2), weight, padding=weight.shape[-1] - 1, groups=mixed.shape[-1])
    return F.silu(out[..., :seq_len]).transpose(1, 2)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) (the norm in float32, the product in x's dtype) times SiLU(gate) in float32, cast back to
    x's dtype: transformers' Qwen3_5RMSNormGated / Qwen3NextRMSNormGated (float64 throughout when computing in it)."""
    work = norm_dtype(x.dtype)
    up = x.to(work)
    normed = weight * (up * torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * F.silu(gate.to(work))).to(x.dtype)


def split_heads(mixed: torch.Tensor, spec: LinearAttentionSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k [B, T, H_k, d_k], v [B, T, H_v, d_v] of the convolution's output [B, T, conv channels]."""
    batch, seq_len, _ = mixed.shape
    nk, dk, dv = spec.num_key_heads, spec.key_head_dim, spec.value_head_dim
    q, k, v = mixed.split((nk * dk, nk * dk, spec.num_value_heads * dv), dim=-1)
    return q.reshape(batch, seq_len, nk, dk), k.reshape(batch, seq_len, nk, dk), v.reshape(batch, seq_len, -1, dv)


def write_gates(b: torch.Tensor, a: torch.Tensor, w: Mapping[str, torch.Tensor],
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """beta = sigmoid(b) and the log-decay g = -exp(A_log) * softplus(a + dt_bias) (float32, float64 when computing
    in it) for the compute dtype `dtype`."""
    work = norm_dtype(dtype)
    # as transformers: A_log and a upcast before the exp and softplus (a low-precision A would overflow to -inf)
    return b.sigmoid(), -w[f"{P}A_log"].to(work).exp() * F.softplus(a.to(work) + w[f"{P}dt_bias"])


def mixer_output(out: torch.Tensor, z: torch.Tensor, w: Mapping[str, torch.Tensor], spec: LinearAttentionSpec,
                 proj: Projection) -> torch.Tensor:
    """The rule's output [B, T, H_v, d_v] normed per head, gated by SiLU(z), projected back [B, T, hidden]."""
    out = gated_rms_norm(out, z, w[f"{P}norm.weight"], spec.eps)
    return proj(out.reshape(out.shape[0], out.shape[1], -1), f"{P}out_proj")


def plain_projection(w: Mapping[str, torch.Tensor]) -> Projection:
    return lambda x, module: F.linear(x, w[f"{module}.weight"])


def linear_attention(h: torch.Tensor, w: Mapping[str, torch.Tensor], spec: LinearAttentionSpec,
                     proj: Projection | None = None) -> torch.Tensor:
    """The token mixer's output [B, T, hidden] of the normed input h [B, T, hidden] (the residual add is the
    caller's); `proj`: how a projection is computed (default: the plain matrix product)."""
    proj = proj or plain_projection(w)
    mixed, z, b, a = projections(h, w, spec, proj)
    q, k, v = split_heads(causal_conv(mixed, w[f"{P}conv1d.weight"]), spec)
    beta, g = write_gates(b, a, w, h.dtype)
    return mixer_output(chunk_gated_delta_rule(q, k, v, g, beta), z, w, spec, proj)
