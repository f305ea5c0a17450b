"""The CPU optimizer pass and the schedule, against torch.optim.AdamW and an independent formula."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatrain_ray.config.engine_sections import OptimizerConfig
from megatrain_ray.config.loop_sections import ScheduleConfig
from megatrain_ray.optim.adamw import FlatAdamW, noise_key, round_bf16_stochastic_, rounding_noise, split_span
from megatrain_ray.optim.schedule import lr_at
from tests.numerics import assert_within_noise
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


def torch_adamw(master: torch.Tensor, decay_end: int, grads: list[tuple[torch.Tensor, float]], dtype: torch.dtype,
                **hyper) -> torch.Tensor:
    """torch.optim.AdamW in `dtype` from `master`, decay on [0, decay_end), each gradient times its coefficient."""
    decay = master[:decay_end].to(dtype).clone().requires_grad_()
    other = master[decay_end:].to(dtype).clone().requires_grad_()
    ref = torch.optim.AdamW([{"params": [decay], "weight_decay": hyper.pop("weight_decay")},
                             {"params": [other], "weight_decay": 0}], foreach=False, **hyper)
    for grad, coef in grads:
        g = grad.to(dtype) * coef
        decay.grad, other.grad = g[:decay_end].clone(), g[decay_end:].clone()
        ref.step()
    return torch.cat([decay.detach(), other.detach()])


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("grad_dtype, master_dtype, kernel", [
    (torch.float64, torch.float64, "torch"), (torch.float32, torch.float64, "torch"),
    pytest.param(torch.bfloat16, torch.float32, "torch", marks=pytest.mark.float32_parity),
    pytest.param(torch.bfloat16, torch.float32, "native", marks=pytest.mark.float32_parity),
    pytest.param(torch.float32, torch.float32, "native", marks=pytest.mark.float32_parity)])
def test_flat_adamw_matches_torch_adamw(grad_dtype, master_dtype, kernel, threads):
    """Two workers' spans, chunks that do not divide the span, decay on a prefix, clipping coef,
    gradients in a lower precision, the streaming copy written in the same pass. A float64 master: within 1e-12
    of torch's AdamW in float64. A float32 one: the native kernel vectorizes (and fuses multiply-adds) by CPU,
    torch's kernel its own way, so within 4x the float32 noise of torch's AdamW (its float32 result against its
    float64 one, floor 16 float32 ulps; measured on an AVX-512 Xeon: noise 5.2e-8, ours 6e-11 (torch's kernel)
    and 4.5e-8 (native) from torch's float32 result; lr off by 1e-3: 1.65e-5, 8.6x the bound, here the floor)."""
    torch.manual_seed(0)
    n, decay_end = 5000, 3072
    cfg = OptimizerConfig(lr=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.3, chunk_elems=1024, kernel=kernel)
    master = torch.randn(n, dtype=master_dtype)
    start_values = master.clone()
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    stream = torch.full((n,), float("nan"), dtype=grad_dtype) if grad_dtype != master_dtype else None
    opts = [FlatAdamW(cfg, master_dtype, threads) for _ in range(2)]
    assert opts[0].kernel_name == kernel
    grads = [(torch.randn(n).to(grad_dtype), coef) for coef in (1.0, 0.37)]
    for step, (grad, coef) in enumerate(grads, 1):
        for k, opt in enumerate(opts):
            start, end = split_span(n, k, 2)
            opt.update(master=master, exp_avg=m, exp_avg_sq=v, grad=grad, stream_out=stream, start=start, end=end,
                       decay_end=decay_end, adam_step=step, lr=1e-2, grad_coef=coef)
    hyper = {"lr": 1e-2, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.3}
    expected = torch_adamw(start_values, decay_end, grads, master_dtype, **hyper)
    if master_dtype == torch.float64:
        assert (master - expected).abs().max().item() < 1e-12
    else:
        assert_within_noise("master after 2 steps", master, expected,
                            torch_adamw(start_values, decay_end, grads, torch.float64, **hyper))
    if stream is not None:
        assert torch.equal(stream, master.to(grad_dtype))  # the copy is the rounded master, bit for bit


@pytest.mark.float32_parity
@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_gradients_read_from_the_streaming_copy_they_are_replaced_in(kernel):
    """The engine's bf16 layout: the gradient arrives in the streaming copy, the update overwrites it. The float32
    master within 4x the float32 noise of torch's AdamW (float32 against float64, floor 16 ulps; measured: noise
    2.9e-8, ours bit-equal (torch's kernel) and 2.4e-8 (native) from torch's float32 result; lr off by 1e-3: 5x)."""
    torch.manual_seed(1)
    n = 3000
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, chunk_elems=1024, kernel=kernel)
    master = torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    shared = torch.randn(n).bfloat16()
    hyper = {"lr": 1e-2, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "weight_decay": 0.1}
    expected = {dtype: torch_adamw(master, n, [(shared, 1.0)], dtype, **hyper)
                for dtype in (torch.float32, torch.float64)}
    FlatAdamW(cfg, torch.float32, 2).update(master=master, exp_avg=m, exp_avg_sq=v, grad=shared, stream_out=shared,
                                            start=0, end=n, decay_end=n, adam_step=1, lr=1e-2, grad_coef=1.0)
    assert_within_noise("master after a step", master, expected[torch.float32], expected[torch.float64])
    assert torch.equal(shared, master.bfloat16())


# ----------------------------------------------------------------------------- bfloat16 moments


def reference_noise(start: int, end: int, key: int) -> np.ndarray:
    """The rounding noise as specified (mix32 of index XOR key), in numpy's wrapping uint32 arithmetic."""
    x = np.arange(start, end, dtype=np.uint64).astype(np.uint32) ^ np.uint32(key)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x21F0AAAD)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x735A2D97)
    x ^= x >> np.uint32(15)
    return x


def reference_round(values: np.ndarray, noise16: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16): truncate(bits + noise), nearest-even for inf and NaN."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    out = ((bits + noise16.astype(np.uint64)) >> np.uint64(16)).astype(np.uint16)
    special = (bits & np.uint64(0x7F800000)) == np.uint64(0x7F800000)
    nearest = torch.from_numpy(values.astype(np.float32)).bfloat16().view(torch.int16).numpy().view(np.uint16)
    return np.where(special, nearest, out)


def as_bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


def test_stochastic_rounding_has_the_specified_bits_and_no_bias():
    torch.manual_seed(0)
    values = torch.randn(20000) * torch.logspace(-30, 30, 20000)
    values[:4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0])
    key = noise_key(7, 3)
    noise = rounding_noise(1000, 21000, key)
    assert np.array_equal(noise.numpy().astype(np.uint32), reference_noise(1000, 21000, key))
    for bits in (noise & 0xFFFF, noise >> 16):
        out = torch.empty(20000, dtype=torch.bfloat16)
        round_bf16_stochastic_(out, values, bits)
        expected = reference_round(values.numpy(), bits.numpy())
        assert np.array_equal(out.view(torch.int16).numpy().view(np.uint16), expected)
    assert torch.isinf(out[:2]).all() and torch.isnan(out[2]) and out[3] == 0
    # Unbiased: 1 + 2**-9 lies a quarter of the way from 1 to the next bfloat16 (1 + 2**-7).
    x = torch.full((1 << 16,), 1.0 + 2.0**-9)
    out = torch.empty(1 << 16, dtype=torch.bfloat16)
    round_bf16_stochastic_(out, x, rounding_noise(0, 1 << 16, 12345) & 0xFFFF)
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs(out.float().mean().item() - x[0].item()) < 1e-4  # 4 standard errors (2**-7 * sqrt(3/16) / 256)


@pytest.mark.parametrize("kernel", ["torch", "native"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_bf16_moments_match_torch_adamw_with_moments_rounded_the_same_way(kernel, grad_dtype):
    """Reference: torch.optim.AdamW in float32; after each step its moments are rounded to bfloat16 with the
    specified noise (reference_round, numpy) and widened again. Ours keeps them in bfloat16 throughout."""
    torch.manual_seed(0)
    n, decay_end, stage, lr = 6000, 4096, 5, 1e-2
    cfg = OptimizerConfig(lr=lr, beta1=0.8, beta2=0.999, eps=1e-6, weight_decay=0.3, chunk_elems=1024,
                          kernel=kernel, moment_dtype="bfloat16")
    master = torch.randn(n)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    stream = torch.full((n,), float("nan"), dtype=torch.bfloat16) if grad_dtype == torch.bfloat16 else None
    ref_params = [master[:decay_end].clone().requires_grad_(), master[decay_end:].clone().requires_grad_()]
    ref = torch.optim.AdamW([{"params": [ref_params[0]], "weight_decay": 0.3},
                             {"params": [ref_params[1]], "weight_decay": 0}],
                            lr=lr, betas=(0.8, 0.999), eps=1e-6, foreach=False)
    opts = [FlatAdamW(cfg, torch.float32, 2) for _ in range(2)]
    assert opts[0].kernel_name == kernel
    for step, coef in ((1, 1.0), (2, 0.37), (3, 1.0), (4, 0.8)):
        grad = (torch.randn(n) * torch.logspace(-4, 1, n)).to(grad_dtype)
        for k, opt in enumerate(opts):
            start, end = split_span(n, k, 2)
            opt.update(master=master, exp_avg=m, exp_avg_sq=v, grad=grad, stream_out=stream, start=start, end=end,
                       decay_end=decay_end, adam_step=step, lr=lr, grad_coef=coef, stage=stage)
        g = grad.float() * coef
        for p, part in zip(ref_params, (g[:decay_end], g[decay_end:])):
            p.grad = part.clone()
        ref.step()
        noise = reference_noise(0, n, noise_key(step, stage))
        offset = 0
        for p in ref_params:
            state = ref.state[p]
            size = p.numel()
            for name, bits in (("exp_avg", noise & 0xFFFF), ("exp_avg_sq", noise >> 16)):
                state[name].copy_(as_bf16(reference_round(state[name].numpy(), bits[offset:offset + size])).float())
            offset += size
    expected = torch.cat([p.detach() for p in ref_params])
    ref_m = torch.cat([ref.state[p]["exp_avg"] for p in ref_params])
    ref_v = torch.cat([ref.state[p]["exp_avg_sq"] for p in ref_params])
    # Moments are bit-identical to the reference (measured: all 12000, for seeds 0-7, both kernels, both gradient
    # dtypes). The one way they may part: the float32 arithmetic of a kernel and torch's differs in the last bit
    # now and then (a fused multiply-add), and a moment one float32 ulp away rounds to the other bfloat16
    # neighbour for 1 noise value in 2**16; that element then differs by one bfloat16 step. Up to 2 such are
    # allowed. Any change of the rounding itself (nearest instead of stochastic, other noise bits, another
    # index) changes about half of them.
    differ = torch.zeros(n, dtype=torch.bool)
    for ours, theirs in ((m.float(), ref_m), (v.float(), ref_v)):
        off = ours != theirs
        assert off.sum().item() <= 2, off.sum().item()
        assert ((ours - theirs).abs()[off] <= theirs.abs()[off] * 2.0**-7).all()  # one bfloat16 step
        differ |= off
    # Weights: float32 rounding only (measured at most 9.5e-7), except where a moment differs.
    assert (master - expected).abs()[~differ].max().item() < 2e-6
    if stream is not None:
        assert torch.equal(stream, master.bfloat16())


def test_bf16_second_moment_decays_where_round_to_nearest_would_stall():
    """The reason for stochastic rounding: with beta2 = 0.999 a step changes exp_avg_sq by 0.1 %, less than
    half a bfloat16 step, so rounding to nearest keeps it where it is; ours decays as float32 would."""
    torch.set_num_threads(1)  # small tensors: intra-op threads only cost (restored by conftest)
    n, steps = 4096, 300
    cfg = OptimizerConfig(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, chunk_elems=1024, kernel="torch",
                          moment_dtype="bfloat16")
    master = torch.zeros(n)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    opt = FlatAdamW(cfg, torch.float32)
    for step in range(1, steps + 1):
        grad = torch.ones(n) if step == 1 else torch.zeros(n)
        opt.update(master=master, exp_avg=m, exp_avg_sq=v, grad=grad, stream_out=None, start=0, end=n,
                   decay_end=n, adam_step=step, lr=1e-3, grad_coef=1.0)
    exact = 1e-3 * 0.999 ** (steps - 1)  # float32 moments: (1 - beta2) g^2 after step 1, times beta2 since
    assert v.float().mean().item() == pytest.approx(exact, rel=0.01)
    nearest = torch.tensor(1e-3).bfloat16()
    for _ in range(steps - 1):
        nearest = (nearest.float() * 0.999).bfloat16()
    assert nearest.float().item() == pytest.approx(torch.tensor(1e-3).bfloat16().item())  # stalled at the start


def test_bf16_moments_cut_the_bytes_an_update_moves():
    opt32 = FlatAdamW(OptimizerConfig(), torch.float32)
    opt16 = FlatAdamW(OptimizerConfig(moment_dtype="bfloat16"), torch.float32)
    grad, copy = torch.empty(1, dtype=torch.bfloat16), torch.empty(1, dtype=torch.bfloat16)
    assert opt32.bytes_per_element(grad, copy) == 28 and opt16.bytes_per_element(grad, copy) == 20


# ----------------------------------------------------------------------------- speculative updates


@pytest.mark.parametrize("kernel", ["torch", "native"])
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grads", [torch.bfloat16, torch.float32])
def test_a_speculative_update_writes_the_other_set_and_a_redo_ends_as_the_clipped_update(kernel, moments, grads):
    """The engine's bf16 layout (gradients in the streaming copy the update overwrites; or float32 gradients apart):
    an update into the other set is the plain update there, bit for bit, and leaves the current set as it was;
    redone on the current set from the saved gradients with a clipping coefficient, it ends exactly where the
    clipped update alone ends. Spans of several of the native kernel's 16K-element blocks, split at odd edges."""
    torch.manual_seed(2)
    n, decay_end = 40_003, 23_001
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, chunk_elems=1024, kernel=kernel,
                          moment_dtype="bfloat16" if moments == torch.bfloat16 else "float32")
    opt = FlatAdamW(cfg, torch.float32, 3)
    assert opt.kernel_name == kernel

    def state() -> list[torch.Tensor]:  # master, exp_avg, exp_avg_sq, streaming copy, float32 gradients apart
        g = torch.Generator().manual_seed(5)
        tensors = [torch.randn(n, generator=g), (torch.randn(n, generator=g) * 0.1).to(moments),
                   torch.rand(n, generator=g).to(moments) * 0.01, torch.randn(n, generator=g).bfloat16()]
        return tensors + ([torch.randn(n, generator=g)] if grads == torch.float32 else [])

    def update(tensors, coef, grad=None, into=None, save_grad=None):
        master, m, v, stream, *apart = tensors
        for start, end in ((0, 17_011), (17_011, n)):  # two workers' spans
            opt.update(master=master, exp_avg=m, exp_avg_sq=v, grad=grad if grad is not None else (apart or [stream])[0],
                       stream_out=stream, start=start, end=end, decay_end=decay_end, adam_step=4, lr=1e-2,
                       grad_coef=coef, stage=3, into=into, save_grad=save_grad)

    before, clipped, plain = state(), state(), state()
    update(clipped, 0.37)
    update(plain, 1.0)
    current = state()
    other = [torch.full_like(t, float("nan")) for t in current]
    update(current, 1.0, into=other[:3], save_grad=other[-1])
    assert all(torch.equal(a, b) for a, b in zip(other[:3] + current[3:], plain))  # the streaming copy: new weights
    assert all(torch.equal(a, b) for a, b in zip(current[:3], before[:3]))
    assert torch.equal(other[-1], before[-1])  # the gradients, saved before the streaming copy was written
    update(current, 0.37, grad=other[-1])
    assert all(torch.equal(a, b) for a, b in zip(current, clipped))


def test_a_speculative_update_counts_its_saved_gradients_and_the_other_sets_reads():
    """Torch's stores into the other set read each line first; the native kernel streams it out."""
    opt = FlatAdamW(OptimizerConfig(kernel="torch"), torch.float32)
    grad = torch.zeros(1, dtype=torch.bfloat16)
    assert opt.bytes_per_element(grad, grad) == 2 * 12 + 2 + 2
    assert opt.bytes_per_element(grad, grad, speculative=True) == 28 + 12 + 2
    native = FlatAdamW(OptimizerConfig(kernel="native"), torch.float32)
    assert native.bytes_per_element(grad, grad, speculative=True) == 28 + 2
    assert native.bytes_per_element(grad.float(), grad, speculative=True) == 30 + 4
