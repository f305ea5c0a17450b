"""RMSNorm as Hugging Face computes it (float32 inside, or float64 when the engine computes in it), with a
lean autograd function whose backward keeps no [tokens, hidden] float32 tensor."""

from __future__ import annotations

import torch

from megatrain_ray.model.layout import token_chunks


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    # Norms and RoPE run in float32 as in Hugging Face, and in float64 when the engine does.
    return torch.promote_types(dtype, torch.float32)


def _plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(norm_dtype(dtype))
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
        upcast = x.to(norm_dtype(x.dtype))
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
