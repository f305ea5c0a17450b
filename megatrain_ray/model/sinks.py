"""Attention with sinks (gpt-oss): each head has a learned logit that joins every query's softmax as one more
column and is dropped after it, so a query may give part of its attention to nothing.

Fused (the default where it applies): with lse_i the log-sum-exp of query i's scores, the sink column takes
exp(s) / (exp(lse_i) + exp(s)) of the softmax and the rest is scaled by sigmoid(lse_i - s), so the output is
plain causal attention times sigmoid(lse_i - s_h). The attention and its lse come from a fused kernel: flash
attention on the GPU (its varlen entry point, which takes GQA and the sliding window as they are), torch's
flash kernel on the CPU. The backward needs the gradient through lse too: dS = P o (dP - (D - g)) with
g_i = (1 - sigma_i) rowsum(dy_i o y_i) and D_i = rowsum(dO_i o O_i) for dO = dy sigma; since D - g equals
rowsum(dO o y), the kernel's own backward computes it when it is handed y in place of its output O. The sink's
gradient is -sum_i g_i over the head's rows. Nothing of [T, T] size is kept; the softmax runs in float32.

Explicit (fallback: float32 on the GPU, head widths flash attention does not take): as transformers' eager
gpt-oss attention, products over a [B, H, T, T] score tensor (k and v repeated to q's heads), the sink column
appended, the row maximum subtracted, the softmax in the scores' dtype. Memory grows with T^2
(planning/gpu_memory.SINK_ATTENTION_SCORES).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megatrain_ray.config.model_section import flash_attention_takes
from megatrain_ray.dtypes import dtype_name
from megatrain_ray.exceptions import ConfigError


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float,
                   window: int, documents: object = None) -> torch.Tensor:
    """q: [B, H, T, D], k and v: [B, H_kv, T, D], sinks: [H]; causal, within `window` tokens when > 0."""
    if documents is not None:
        raise ConfigError("data.packing: attention with sinks (gpt_oss) runs on plain rows only; set "
                          "data.packing false")
    if fused_sink_attention_applies(q):
        return _FusedSinkAttention.apply(q, k, v, sinks, scale, window)
    return explicit_sink_attention(q, k, v, sinks, scale, window)


def fused_sink_attention_applies(q: torch.Tensor) -> bool:
    """The fused path: on the CPU always (torch's flash kernel takes every float dtype), on CUDA where flash
    attention does (sm80 or later, bfloat16 or float16, head width a multiple of 8 up to 256)."""
    if not q.is_cuda:
        return True
    return torch.cuda.get_device_capability(q.device) >= (8, 0) and \
        flash_attention_takes(dtype_name(q.dtype), q.shape[-1])


def explicit_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float,
                            window: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """As transformers' eager gpt-oss attention (module docstring). `allowed` [B, 1, Tq, Tk]: the caller's mask (the
    rollout's cached keys), else causal within `window`."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    seq_len = q.shape[2]
    scores = scores.masked_fill(~(_allowed(seq_len, window, q.device) if allowed is None else allowed), float("-inf"))
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, seq_len, 1).to(scores.dtype)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def _allowed(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    return (j <= i) & ((i - j < window) if window else True)


class _FusedSinkAttention(torch.autograd.Function):
    """y = attention(q, k, v) * sigmoid(lse - sink), forward and backward through a fused kernel (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, scale: float, window: int):
        kernel = _CudaFlash(q, k, window) if q.is_cuda else _CpuFlash(q, k, window)
        acc = torch.promote_types(q.dtype, torch.float32)
        out, lse, kernel_saved = kernel.forward(q, k, v, scale)  # out [B, H, T, D] (a view), lse [B, H, T]
        sigma = torch.sigmoid(lse.to(acc) - sinks.to(acc)[None, :, None])
        # In q's dtype: a float32 copy of [tokens, heads x width] would be the attention's largest tensor.
        y = out * sigma.to(q.dtype)[..., None]
        del out
        ctx.kernel, ctx.scale = kernel, scale
        ctx.save_for_backward(q, k, v, y, sigma, sinks, *kernel_saved)
        return y

    @staticmethod
    @once_differentiable  # the backward is the kernel's: no second derivative
    def backward(ctx, dy):
        q, k, v, y, sigma, sinks, *kernel_saved = ctx.saved_tensors
        d_out = dy * sigma.to(dy.dtype)[..., None]
        # y in place of the kernel's output: its rowsum(dO o y) is D - g (module docstring)
        dq, dk, dv = ctx.kernel.backward(d_out, q, k, v, y, ctx.scale, kernel_saved)
        # rowsum(dy o y) as a batched product: float32 accumulation, its result rounded to the compute dtype (it
        # reaches only g and the sinks' gradient), and no float32 [tokens, heads x width] tensor
        g = (1 - sigma) * torch.einsum("bhtd,bhtd->bht", dy, y).to(sigma.dtype)
        return dq, dk, dv, (-g.sum((0, 2))).to(sinks.dtype), None, None


class _CpuFlash:
    """torch's CPU flash kernel: [B, H, T, D], k and v repeated to q's heads, the window as an additive mask."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, window: int):
        self.groups = q.shape[1] // k.shape[1]
        seq_len = q.shape[2]
        self.mask = None
        if window and window < seq_len:
            allowed = _allowed(seq_len, window, q.device)
            self.mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))

    def _repeat(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(self.groups, dim=1) if self.groups > 1 else t

    def forward(self, q, k, v, scale):
        """(output, lse [B, H, T], what the backward needs besides q, k, v and y)."""
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, self._repeat(k), self._repeat(v), 0.0, self.mask is None, attn_mask=self.mask, scale=scale)
        return out, lse, (lse,)

    def backward(self, d_out, q, k, v, y, scale, saved):
        (lse,) = saved
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, q, self._repeat(k), self._repeat(v), y, lse, 0.0, self.mask is None, attn_mask=self.mask,
            scale=scale)
        if self.groups > 1:  # the repeated heads' gradients summed back onto their key/value head
            b, h, t, d = dk.shape
            dk = dk.view(b, h // self.groups, self.groups, t, d).sum(2)
            dv = dv.view(b, h // self.groups, self.groups, t, d).sum(2)
        return dq, dk, dv


class _CudaFlash:
    """Flash attention's varlen entry point on the batch's rows laid end to end ([B * T, H, D], one sequence per
    row): GQA and the sliding window (window - 1 keys to the left) as the kernel takes them."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, window: int):
        batch, _, seq_len, _ = q.shape
        self.shape = q.shape
        self.seq_bounds = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=q.device)
        self.left = window - 1 if window and window < seq_len else -1
        self.right = 0 if self.left >= 0 else -1

    @staticmethod
    def _pack(t: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [B * T, H, D]
        b, h, s, d = t.shape
        return t.transpose(1, 2).reshape(b * s, h, d)

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:  # [B * T, heads, D] -> [B, heads, T, D]
        b, _, s, d = self.shape
        return t.view(b, s, t.shape[1], d).transpose(1, 2)

    def _lse(self, lse: torch.Tensor) -> torch.Tensor:  # the varlen kernel's [H, B * T] -> [B, H, T]
        b, h, s, _ = self.shape
        if tuple(lse.shape) != (h, b * s):
            raise RuntimeError(f"flash attention returned a log-sum-exp of shape {tuple(lse.shape)} where "
                               f"[heads, tokens] = {[h, b * s]} was expected (torch {torch.__version__})")
        return lse.view(h, b, s).transpose(0, 1)

    def forward(self, q, k, v, scale):
        t = self.shape[2]
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            self._pack(q), self._pack(k), self._pack(v), self.seq_bounds, self.seq_bounds, t, t, 0.0, True, False,
            scale=scale, window_size_left=self.left, window_size_right=self.right)
        return self._unpack(out), self._lse(lse), (lse, rng, unused)

    def backward(self, d_out, q, k, v, y, scale, saved):
        t = self.shape[2]
        lse, rng, unused = saved
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            self._pack(d_out), self._pack(q), self._pack(k), self._pack(v), self._pack(y), lse,
            self.seq_bounds, self.seq_bounds, t, t, 0.0, True, rng, unused, scale=scale,
            window_size_left=self.left, window_size_right=self.right)
        return self._unpack(dq), self._unpack(dk), self._unpack(dv)
