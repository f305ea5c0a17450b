"""Attention with sinks (model/sinks.py): the fused path (torch's flash kernel and its log-sum-exp, the output scaled
by sigmoid(lse - sink), the backward through lse by handing the kernel the scaled output) against the explicit
products of transformers' eager gpt-oss attention, float64: output and the gradients of q, k, v and the sinks,
with GQA, with a window shorter than the sequence and one longer, on strided inputs as the layer passes them."""

from __future__ import annotations

import pytest
import torch

from megatrain_ray.model.sinks import _FusedSinkAttention, explicit_sink_attention, sink_attention


@pytest.mark.parametrize("window", [0, 5, 40], ids=["full", "window-5", "window-past-the-sequence"])
@pytest.mark.parametrize("groups", [1, 3], ids=["mha", "gqa"])
def test_fused_sink_attention_matches_the_explicit_products(window, groups):
    gen = torch.Generator().manual_seed(window + groups)
    batch, heads, seq_len, width = 2, 6, 17, 8

    def strided(kv_heads: int) -> torch.Tensor:  # [B, H, T, D] views of [B, T, H, D] tensors, as the template's
        t = torch.randn(batch, seq_len, kv_heads, width, generator=gen, dtype=torch.float64)
        return t.transpose(1, 2).requires_grad_(True)

    q, k, v = strided(heads), strided(heads // groups), strided(heads // groups)
    sinks = torch.randn(heads, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(batch, heads, seq_len, width, generator=gen, dtype=torch.float64)
    results = []
    for attend in (_FusedSinkAttention.apply, explicit_sink_attention):
        out = attend(q, k, v, sinks, 0.3, window)
        results.append([out, *torch.autograd.grad(out, (q, k, v, sinks), grad_out)])
    for label, fused, explicit in zip(("output", "dq", "dk", "dv", "dsinks"), *results):
        assert fused.shape == explicit.shape, label
        torch.testing.assert_close(fused, explicit, rtol=1e-12, atol=1e-12, msg=label)


def test_the_cpu_takes_the_fused_path(monkeypatch):
    calls = []
    monkeypatch.setattr(_FusedSinkAttention, "apply", lambda *args: calls.append(args) or args[0])
    q = torch.randn(1, 2, 4, 8)
    sink_attention(q, q, q, torch.zeros(2), 0.3, 0)
    assert len(calls) == 1
