"""The CPU optimizer pass and the schedule, against torch.optim.AdamW and an independent formula."""

from __future__ import annotations

import pytest
import torch

from megatrain_ray.config import OptimizerConfig, ScheduleConfig
from megatrain_ray.optim import FlatAdamW, lr_at, split_span
from tests.reference_llama import reference_lr


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup", [0, 4])
def test_schedule_matches_independent_formula(kind, warmup):
    sched = ScheduleConfig(kind=kind, warmup_steps=warmup, min_lr_ratio=0.2)
    for step in range(30):
        assert lr_at(step, 1e-3, 30, sched) == pytest.approx(reference_lr(step, 1e-3, 30, warmup, kind, 0.2),
                                                             rel=1e-12)


def test_schedule_shape():
    sched = ScheduleConfig(kind="cosine", warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, 1.0, 110, sched) for s in range(110)]
    assert lrs[9] == 1.0 and lrs[10] == 1.0
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


@pytest.mark.parametrize("parts", [1, 3, 7])
def test_split_span_partitions_exactly(parts):
    for numel in (64, 1000, 4096 + 64):
        spans = [split_span(numel, k, parts) for k in range(parts)]
        assert spans[0][0] == 0 and spans[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert all(s[0] % 64 == 0 for s in spans)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("grad_dtype, master_dtype, kernel", [
    (torch.float64, torch.float64, "torch"), (torch.float32, torch.float64, "torch"),
    (torch.bfloat16, torch.float32, "torch"), (torch.bfloat16, torch.float32, "native"),
    (torch.float32, torch.float32, "native")])
def test_flat_adamw_matches_torch_adamw(grad_dtype, master_dtype, kernel, threads):
    """Two workers' spans, chunks that do not divide the span, decay on a prefix, clipping coef,
    gradients in a lower precision, the streaming copy written in the same pass."""
    torch.manual_seed(0)
    n, decay_end = 5000, 3072
    cfg = OptimizerConfig(lr=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.3, chunk_elems=1024, kernel=kernel)
    master = torch.randn(n, dtype=master_dtype)
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    stream = torch.full((n,), float("nan"), dtype=grad_dtype) if grad_dtype != master_dtype else None
    ref_decay = master[:decay_end].clone().requires_grad_()
    ref_other = master[decay_end:].clone().requires_grad_()
    ref = torch.optim.AdamW([{"params": [ref_decay], "weight_decay": 0.3}, {"params": [ref_other], "weight_decay": 0}],
                            lr=1e-2, betas=(0.8, 0.9), eps=1e-6, foreach=False)
    opts = [FlatAdamW(cfg, master_dtype, threads) for _ in range(2)]
    assert opts[0].kernel_name == kernel
    for step, coef in ((1, 1.0), (2, 0.37)):
        grad = torch.randn(n).to(grad_dtype)
        for k, opt in enumerate(opts):
            start, end = split_span(n, k, 2)
            opt.update(master=master, exp_avg=m, exp_avg_sq=v, grad=grad, stream_out=stream, start=start, end=end,
                       decay_end=decay_end, adam_step=step, lr=1e-2, grad_coef=coef)
        g = grad.to(master_dtype) * coef
        ref_decay.grad, ref_other.grad = g[:decay_end].clone(), g[decay_end:].clone()
        ref.step()
    expected = torch.cat([ref_decay.detach(), ref_other.detach()])
    assert (master - expected).abs().max().item() < (1e-12 if master_dtype == torch.float64 else 1e-6)
    if stream is not None:
        assert torch.equal(stream, master.to(grad_dtype))  # the copy is the rounded master, bit for bit


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_gradients_read_from_the_streaming_copy_they_are_replaced_in(kernel):
    """The engine's bf16 layout: the gradient arrives in the streaming copy, the update overwrites it."""
    torch.manual_seed(1)
    n = 3000
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, chunk_elems=1024, kernel=kernel)
    master = torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    shared = torch.randn(n).bfloat16()
    expected = master.clone().requires_grad_()
    expected.grad = shared.float()
    torch.optim.AdamW([expected], lr=1e-2, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=0.1).step()
    FlatAdamW(cfg, torch.float32, 2).update(master=master, exp_avg=m, exp_avg_sq=v, grad=shared, stream_out=shared,
                                            start=0, end=n, decay_end=n, adam_step=1, lr=1e-2, grad_coef=1.0)
    assert (master - expected.detach()).abs().max().item() < 1e-6
    assert torch.equal(shared, master.bfloat16())
