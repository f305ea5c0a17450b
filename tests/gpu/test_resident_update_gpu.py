"""GPU-only (marker `gpu`; skipped without CUDA): the GPU-resident tier's one-pass update
(engine/resident_update.py, through torch.compile) against the per-chunk path it replaces (a float32 scratch,
torch._fused_adamw_ with clipping's grad_scale, the cast to the bf16 compute copy), both against float64; and
their times on one span of a 7B-width layer's size (printed: the figure the closing notes report).

    python -m pytest tests/gpu/test_resident_update_gpu.py -m gpu -s
"""

from __future__ import annotations

import pytest
import torch

from megatrain_ray.config.engine_sections import OptimizerConfig
from megatrain_ray.engine.resident_update import SpanScalars, resident_update_function
from tests.numerics import assert_within_noise

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CHUNK = 1 << 24  # config/resolved.RESIDENT_UPDATE_CHUNK_ELEMS


def per_chunk(p, m, v, grad, compute, step, lr, weight_decay, coef, cfg, scratch):
    """engine/resident.py _update_chunks for a float32 (or float64) master."""
    scale = torch.tensor(1.0 / coef, dtype=torch.float32, device=p.device) if coef != 1.0 and p.dtype == torch.float32 \
        else None
    steps = torch.tensor(float(step), dtype=torch.float32, device=p.device)
    for a in range(0, p.numel(), CHUNK):
        b = min(a + CHUNK, p.numel())
        g = scratch[:b - a].copy_(grad[a:b])
        if coef != 1.0 and scale is None:
            g.mul_(coef)
        torch._fused_adamw_([p[a:b]], [g], [m[a:b]], [v[a:b]], [], [steps], lr=lr, beta1=cfg.beta1, beta2=cfg.beta2,
                            weight_decay=weight_decay, eps=cfg.eps, amsgrad=False, maximize=False, grad_scale=scale,
                            found_inf=None)
        if compute is not None:
            compute[a:b].copy_(p[a:b])


def state(n, dtype, gen):
    p = torch.randn(n, generator=gen, device="cuda").to(dtype)
    return [p, torch.zeros_like(p), torch.zeros_like(p)]


def test_the_compiled_one_pass_update_tracks_the_fused_kernel_and_is_faster():
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    device = torch.device("cuda")
    fused = resident_update_function(device, True, torch.float32, fall_back=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = 3 * CHUNK + 4096
    ours = state(n, torch.float32, gen)
    ref32 = [t.clone() for t in ours]
    ref64 = [t.double() for t in ours]
    compute_ours, compute_ref = torch.empty(n, dtype=torch.bfloat16, device="cuda"), \
        torch.empty(n, dtype=torch.bfloat16, device="cuda")
    scratch32 = torch.empty(CHUNK, dtype=torch.float32, device="cuda")
    scratch64 = torch.empty(CHUNK, dtype=torch.float64, device="cuda")
    scalars = SpanScalars(cfg, torch.float32, device)
    for step in range(1, 6):
        grad = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16)
        lr, coef = cfg.lr * step / 5, (0.3 if step % 2 else 1.0)
        decay, no_decay = scalars.get(lr, step, coef)
        half = n // 2 // 64 * 64  # a decay span and a no-decay span, as a stage has
        for (a, b), row, wd in (((0, half), decay, cfg.weight_decay), ((half, n), no_decay, 0.0)):
            p, m, v = (t[a:b] for t in ours)
            fused(p, grad[a:b], m, v, compute_ours[a:b], row, None)
            per_chunk(*(t[a:b] for t in ref32), grad[a:b], compute_ref[a:b], step, lr, wd, coef, cfg, scratch32)
            per_chunk(*(t[a:b] for t in ref64), grad[a:b], None, step, lr, wd, coef, cfg, scratch64)
    for what, a, b, c in zip(("master", "exp_avg", "exp_avg_sq"), ours, ref32, ref64):
        err = assert_within_noise(what, a, b, c)
        print(f"one-pass {what}: {err:.2e} from the fused kernel's float32")
    assert torch.equal(compute_ours, ours[0].to(torch.bfloat16))
    assert not fused.failed

    # Times on a 7B-width layer's span (202 M parameters): the one pass against the three passes per chunk.
    n = 202_383_360
    ours, grad = state(n, torch.float32, gen), torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16)
    compute = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    decay, _ = scalars.get(1e-4, 7, 0.5)
    times = {}
    for name, run in (("one pass", lambda: fused(ours[0], grad, ours[1], ours[2], compute, decay, None)),
                      ("per chunk", lambda: per_chunk(*ours, grad, compute, 7, 1e-4, 0.1, 0.5, cfg, scratch32))):
        run()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            run()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 10
    print(f"update of {n:,} float32 parameters (bf16 gradients and compute copy): one pass {times['one pass']:.2f} ms, "
          f"per chunk {times['per chunk']:.2f} ms ({n * 28 / (times['one pass'] * 1e-3) / 1e9:,.0f} GB/s at 28 B/param)")
    assert times["one pass"] < times["per chunk"]
