"""engine/resident_update.py: the GPU-resident tier's AdamW in one pass per span equals torch._fused_adamw_ (the
per-chunk path's kernel) in float64, with and without weight decay and clipping's coefficient, over several steps;
its compute copy is the new master through the streaming dtype. Where it is used: a GPU that compiles, float32
master (resident_update_function); every CPU run keeps the per-chunk path."""

from __future__ import annotations

import pytest
import torch

from megatrain_ray.config.engine_sections import OptimizerConfig
from megatrain_ray.engine.resident_update import SpanScalars, adamw_span, resident_update_function
from tests.numerics import EXACT, relative_error


def reference_step(p, m, v, grad, step, lr, weight_decay, coef, cfg):
    """The per-chunk path's math (engine/resident.py _update_chunks, float64 master): gradient times the
    coefficient, then torch._fused_adamw_."""
    g = grad.to(p.dtype) * coef
    torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(float(step), dtype=torch.float32)], lr=lr,
                        beta1=cfg.beta1, beta2=cfg.beta2, weight_decay=weight_decay, eps=cfg.eps, amsgrad=False,
                        maximize=False, grad_scale=None, found_inf=None)


@pytest.mark.parametrize("weight_decay,coef,grad_dtype,via", [
    (0.1, 1.0, torch.float64, None),
    (0.1, 0.37, torch.float32, torch.bfloat16),
    (0.0, 0.37, torch.bfloat16, None),
], ids=["decay-noclip", "decay-clip-bf16-compute", "nodecay-clip-bf16-grad"])
def test_one_pass_equals_the_fused_kernel_in_float64(weight_decay, coef, grad_dtype, via):
    cfg = OptimizerConfig(lr=1e-3, weight_decay=weight_decay, beta1=0.9, beta2=0.95, eps=1e-8)
    gen = torch.Generator().manual_seed(0)
    n = 4099  # not a multiple of anything the kernel might assume
    p0 = torch.randn(n, dtype=torch.float64, generator=gen)
    ours = [p0.clone(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)]
    ref = [t.clone() for t in ours]
    compute = torch.zeros(n, dtype=torch.float32)
    scalars = SpanScalars(cfg, torch.float64, torch.device("cpu"))
    for step in range(1, 5):
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        lr = cfg.lr * (0.5 + 0.25 * step)  # a schedule: the scalars change between steps
        decay_row, no_decay_row = scalars.get(lr, step, coef)
        adamw_span(*ours[:1], grad, *ours[1:], compute, decay_row if weight_decay else no_decay_row, via)
        reference_step(*ref, grad, step, lr, weight_decay, coef, cfg)
        for what, a, b in zip(("master", "exp_avg", "exp_avg_sq"), ours, ref):
            assert relative_error(a, b) <= EXACT, f"step {step} {what}: {relative_error(a, b):.2e}"
        expected = ours[0] if via is None else ours[0].to(via)
        assert torch.equal(compute, expected.to(torch.float32))
    assert relative_error(ours[0], p0) > 1e-4  # it trained


def test_the_span_scalars_are_made_once_per_step_and_the_decay_row_alone_decays():
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    scalars = SpanScalars(cfg, torch.float32, torch.device("cpu"))
    first = scalars.get(1e-3, 3, 0.5)
    assert scalars.get(1e-3, 3, 0.5) is first
    decay, no_decay = first
    assert decay.tolist() == pytest.approx([1e-3, 0.1, 0.9, 0.95, 1e-8, 3.0, 2.0])
    assert no_decay[1].item() == 0.0 and torch.equal(no_decay[2:], decay[2:])
    assert scalars.get(1e-3, 4, 0.5) is not first


def test_the_one_pass_update_is_for_a_compiling_gpu_with_a_float32_master(monkeypatch):
    import megatrain_ray.engine.resident_update as module

    # torch.compile's import alone takes seconds: the wrapper is recorded, not built.
    monkeypatch.setattr(module, "CompiledFunction", lambda *args, **kwargs: (args, kwargs))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resident_update_function(cpu, True, torch.float32, True) is None
    assert resident_update_function(cuda, False, torch.float32, True) is None
    assert resident_update_function(cuda, True, torch.float64, True) is None
    args, kwargs = resident_update_function(cuda, True, torch.float32, False)
    assert args[:2] == (adamw_span, False) and kwargs == {"dynamic": True}
