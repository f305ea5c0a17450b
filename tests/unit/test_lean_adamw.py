"""The lean optimizer state's update (optim/lean_adamw.py, kernels/lean_adamw.cpp) and its 8-bit moments
(optim/quant8.py): against bitsandbytes' blockwise quantizer, the native kernel against the torch definition bit for
bit, both against an independent numpy step-by-step reference bit for bit, and what the compensation buys."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatrain_ray.config.engine_sections import OptimizerConfig
from megatrain_ray.optim.adamw import noise_key
from megatrain_ray.optim.lean_adamw import FlatLeanAdamW, LeanStage
from megatrain_ray.optim.quant8 import byte_code, dequantize, dynamic_map, quantize_
from tests.unit.test_adamw import reference_noise, reference_round

try:  # the test extra; its absence skips the comparisons with it, and the reference then takes our maps
    import bitsandbytes.functional as F
except ImportError:
    F = None
needs_bnb = pytest.mark.skipif(F is None, reason="bitsandbytes is not installed (pip install -e '.[test]')")


# ----------------------------------------------------------------------------- 8-bit blockwise quantization


def bnb_map(signed: bool) -> torch.Tensor:
    return F.create_dynamic_map(signed=signed) if F is not None else dynamic_map(signed)


@needs_bnb
@pytest.mark.parametrize("signed", [True, False])
def test_the_maps_are_bitsandbytes_dynamic_maps(signed):
    assert torch.equal(dynamic_map(signed), bnb_map(signed))
    code = byte_code(signed)
    assert code.values[0].item() == 0.0  # a zero-filled segment holds zero moments


@needs_bnb
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("block", [256, 2048])
def test_8bit_blocks_match_bitsandbytes_quantize_blockwise(signed, block):
    """Scales bit for bit, and the same code for all but a few elements, where ours is nearer: ours is always a
    nearest map value (checked in float64), bitsandbytes' CPU search now and then takes another (measured on these
    draws: 1 of 845 elements signed, 6 unsigned at block 256; up to 8 times as far). Values read back are
    bitsandbytes' wherever the codes agree, and zero in an all-zero block (where its code is map[0] times 0)."""
    gen = torch.Generator().manual_seed(block + signed)
    n = 3 * block + 77  # a partial last block
    x = torch.randn(n, generator=gen) * torch.logspace(-4, 1, n)
    x = x if signed else x.abs()
    zero = slice(block, 2 * block)
    x[zero] = 0.0
    q, scales = torch.empty(n, dtype=torch.uint8), torch.empty(4)
    code = byte_code(signed)
    quantize_(q, scales, x, block, code)
    theirs, state = F.quantize_blockwise(x, code=bnb_map(signed), blocksize=block)
    assert torch.equal(scales, state.absmax)
    ours = (q.long() + code.zero) % 256  # our stored byte -> bitsandbytes' index into the sorted map
    differ = ours != theirs.long()
    differ[zero] = False
    assert differ.sum().item() <= n // 50, differ.sum().item()
    ordered = bnb_map(signed).double()
    scaled = (x * torch.where(scales > 0, 1 / scales, 0).repeat_interleave(block)[:n]).double()
    distance = (scaled[:, None] - ordered[None, :]).abs()
    nearest = distance.min(dim=1).values
    assert torch.equal(distance.gather(1, ours[:, None])[:, 0], nearest)  # ours is always a nearest code
    assert (q[zero] == 0).all()
    back = dequantize(q, scales, block, code)
    reference = F.dequantize_blockwise(theirs, state)
    keep = ~differ
    keep[zero] = False
    assert torch.equal(back[keep], reference[keep]) and (back[zero] == 0).all()


@pytest.mark.parametrize("signed", [True, False])
def test_the_prefix_table_counts_the_bounds_below_each_float(signed):
    """The native kernel's encoding (one table entry per 16-bit prefix, one comparison of the low bits) gives
    searchsorted's count for every bound and its float32 neighbours (ties to the lower value), the two ends of
    every prefix of [-1.01, 1.01], both zeros and random values; a NaN counts all 255 bounds."""
    code = byte_code(signed)
    bounds = code.bounds.numpy()
    table = code.prefix.numpy().astype(np.uint32)
    bits = bounds.view(np.uint32).astype(np.int64)
    near = (bits[:, None] + np.arange(-3, 4)[None, :]).ravel()
    prefixes = np.arange(1 << 16, dtype=np.int64) << 16
    ends = np.concatenate([prefixes, prefixes | 0xFFFF])
    rng = np.random.default_rng(3)
    draws = rng.uniform(-1.01, 1.01, 200_000).astype(np.float32).view(np.uint32).astype(np.int64)
    x_bits = np.concatenate([near, ends, draws, [0, 0x80000000]]).astype(np.uint32)
    x = x_bits.view(np.float32)
    keep = (np.abs(x) <= 1.01) | np.isnan(x)
    x_bits, x = x_bits[keep], x[keep]
    entry = table[x_bits >> 16]
    low = (x_bits ^ np.where(x_bits >> 31 == 1, np.uint32(0xFFFFFFFF), np.uint32(0))) & 0xFFFF
    count = (entry >> 16) + (low > (entry & 0xFFFF))
    finite = ~np.isnan(x)
    assert np.array_equal(count[finite], np.searchsorted(bounds, x[finite], side="left"))
    assert (count[~finite] == 255).all() and (~finite).sum() >= 500


# ----------------------------------------------------------------------------- an independent reference


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (finite values)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


class Reference:
    """The lean update as the issue states it, in numpy float32 one operation at a time, with the state in plain
    arrays: sorted map indices (not our rotated bytes) and bits of bfloat16."""

    def __init__(self, master: np.ndarray, block: int):
        self.p, self.c = bf16_bits(master), np.zeros(master.size, np.uint16)
        self.block = block
        self.m = np.zeros(master.size, np.float32)  # the stored moments, read back
        self.v = np.zeros(master.size, np.float32)
        self.maps = [bnb_map(True).numpy(), bnb_map(False).numpy()]

    def quantize(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sorted index, scales, value read back) of each block of x: nearest map value of x / absmax."""
        values = self.maps[k]
        bounds = ((values[:-1] + values[1:]) / np.float32(2)).astype(np.float32)
        index, scales, back = np.empty(x.size, np.int64), [], np.empty(x.size, np.float32)
        for a in range(0, x.size, self.block):
            part = x[a:a + self.block]
            absmax = np.abs(part).max()
            inverse = np.float32(1) / absmax if absmax > 0 else np.float32(0)
            index[a:a + part.size] = np.searchsorted(bounds, part * inverse, side="left")
            back[a:a + part.size] = values[index[a:a + part.size]] * absmax
            scales.append(absmax)
        return index, np.array(scales, np.float32), back

    def step(self, grad: np.ndarray, t: int, lr: float, coef: float, cfg: OptimizerConfig, decay_end: int,
             key: int) -> None:
        f = np.float32
        g = grad.astype(np.float32) * f(coef)
        m = self.m + (g - self.m) * f(1 - cfg.beta1)
        v = self.v * f(cfg.beta2) + (g * f(1 - cfg.beta2)) * g
        denom = np.sqrt(v) / f(np.sqrt(1 - cfg.beta2 ** t)) + f(cfg.eps)
        wd = np.where(np.arange(g.size) < decay_end, f(lr * cfg.weight_decay), f(0))
        p = bf16_value(self.p)
        y = bf16_value(self.c) + (-(p * wd) - (m / denom) * f(lr / (1 - cfg.beta1 ** t)))
        new = bf16_bits(p + y)
        self.c, self.p = bf16_bits(y - (bf16_value(new) - p)), new
        if self.block:
            self.mi, self.ms, self.m = self.quantize(m, 0)
            self.vi, self.vs, self.v = self.quantize(v, 1)
        else:  # bfloat16 moments: stochastic rounding with the hashed noise (tests/unit/test_adamw.py's reference)
            noise = reference_noise(0, g.size, key)
            self.m = bf16_value(reference_round(m, noise & 0xFFFF))
            self.v = bf16_value(reference_round(v, noise >> 16))


def lean_state(n: int, block: int, master: torch.Tensor) -> LeanStage:
    moments = torch.uint8 if block else torch.bfloat16
    scales = (torch.zeros(-(-n // block)), torch.zeros(-(-n // block))) if block else None  # as fresh segments
    return LeanStage(master.bfloat16(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=moments),
                     torch.zeros(n, dtype=moments), scales)


def as_bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


MOMENTS = [("int8", 256), ("int8", 2048), ("bfloat16", 0)]
STEPS = ((1, 1.0), (2, 0.37), (3, 1.0), (4, 0.61))  # (adam step, clipping coefficient)


def run_lean(kernel: str, moments: str, block: int, grad_dtype: torch.dtype, n: int, decay_end: int, stage: int,
             cut: int, steps=STEPS) -> LeanStage:
    """Four steps of FlatLeanAdamW on a stage of n elements split between two workers' spans at `cut`."""
    cfg = OptimizerConfig(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.3, chunk_elems=4096,
                          kernel=kernel, state="lean", lean_moments=moments, lean_block=block or 256)
    opt = FlatLeanAdamW(cfg, threads=2)
    assert opt.kernel_name == kernel
    gen = torch.Generator().manual_seed(11)
    state = lean_state(n, block, torch.randn(n, generator=gen))
    for t, coef in steps:
        grad = (torch.randn(n, generator=gen) * torch.logspace(-5, 0, n)).to(grad_dtype)
        for start, end in ((0, cut), (cut, n)):
            opt.update(state=state, grad=grad, start=start, end=end, decay_end=decay_end, adam_step=t, lr=3e-3,
                       grad_coef=coef, stage=stage)
    opt.close()
    return state


def assert_same_state(a: LeanStage, b: LeanStage) -> None:
    for name in ("master", "comp", "exp_avg", "exp_avg_sq"):
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (name, (x != y).sum().item())
    if a.scales is not None:
        assert all(torch.equal(x, y) for x, y in zip(a.scales, b.scales))


@pytest.mark.parametrize("moments, block", MOMENTS, ids=["int8-256", "int8-2048", "bf16"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32], ids=["bf16grad", "f32grad"])
def test_native_kernel_is_the_torch_definition_bit_for_bit(moments, block, grad_dtype):
    """Odd sizes (a partial last block, weight decay ending inside a block), two workers' spans, two threads each,
    clipping coefficients 1 and below: every byte of master, compensation, moments and scales equal."""
    n = 2 * max(block, 256) * 3 + 1001
    cut = 2 * max(block, 256)
    args = (moments, block, grad_dtype, n, n // 2 + 13, 5, cut)
    assert_same_state(run_lean("native", *args), run_lean("torch", *args))


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("moments, block", MOMENTS, ids=["int8-256", "int8-2048", "bf16"])
def test_lean_update_is_the_independent_reference_bit_for_bit(kernel, moments, block):
    """Step by step against Reference (numpy float32, the state in plain arrays), clipping on and off: master,
    compensation and the moments' codes and scales are the reference's, bit for bit, with no float64 anywhere."""
    n, decay_end, stage = 2 * max(block, 256) + 333, max(block, 256) + 5, 2
    cfg = OptimizerConfig(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.3)
    gen = torch.Generator().manual_seed(11)
    ref = Reference(torch.randn(n, generator=gen).bfloat16().float().numpy(), block)
    grads = []
    for t, coef in STEPS:
        grads.append((torch.randn(n, generator=gen) * torch.logspace(-5, 0, n)).bfloat16())
        ref.step(grads[-1].float().numpy(), t, 3e-3, coef, cfg, decay_end, noise_key(t, stage))
    ours = run_lean(kernel, moments, block, torch.bfloat16, n, decay_end, stage, max(block, 256))
    assert np.array_equal(as_bits(ours.master), ref.p) and np.array_equal(as_bits(ours.comp), ref.c)
    assert (ref.c != 0).mean() > 0.5  # the compensation is in use: most updates are below half a bf16 ulp
    if block:
        for stored, index, scales, signed, got in ((ours.exp_avg, ref.mi, ref.ms, True, ours.scales[0]),
                                                   (ours.exp_avg_sq, ref.vi, ref.vs, False, ours.scales[1])):
            assert np.array_equal((stored.numpy().astype(np.int64) + byte_code(signed).zero) % 256, index)
            assert np.array_equal(got.numpy(), scales)
    else:
        assert np.array_equal(ours.exp_avg.float().numpy(), ref.m)
        assert np.array_equal(ours.exp_avg_sq.float().numpy(), ref.v)


def test_the_compensation_keeps_updates_below_half_a_bfloat16_ulp():
    """A constant gradient, lr 1e-5 on weights at 1 (a bf16 ulp there is 2**-8 below, 2**-7 above): each Adam step
    moves a weight by about lr, 1/390 of an ulp. Plain bfloat16 rounding never moves it (each step rounds back);
    master + compensation move by 0.875 of what float32 would (measured; the compensation is itself rounded to
    nearest, which loses part of a constant update smaller than its own ulp: 0.81 at lr 3e-6, 0.994 at 1e-4)."""
    n, steps, lr = 4096, 400, 1e-5
    cfg = OptimizerConfig(lr=lr, beta1=0.9, beta2=0.999, weight_decay=0.0, kernel="native", state="lean")
    opt = FlatLeanAdamW(cfg)
    state = lean_state(n, 256, torch.ones(n))
    grad = torch.full((n,), 0.5, dtype=torch.bfloat16)
    for t in range(1, steps + 1):
        opt.update(state=state, grad=grad, start=0, end=n, decay_end=0, adam_step=t, lr=lr, grad_coef=1.0)
    moved = 1.0 - (state.master.float() + state.comp.float())
    share = moved / (steps * lr)  # Adam's step is lr times m_hat / sqrt(v_hat) = 1 for a constant gradient
    assert ((share > 0.85) & (share < 1.0)).all(), share.unique()
    assert (state.master.float() < 1.0).all()  # the bf16 master itself has moved (one ulp: 2**-8 below 1)


@pytest.mark.parametrize("moments, block, expected", [("int8", 256, 14 + 16 / 256), ("int8", 2048, 14 + 16 / 2048),
                                                       ("bfloat16", 256, 18)])
def test_a_lean_update_moves_its_bytes(moments, block, expected):
    opt = FlatLeanAdamW(OptimizerConfig(state="lean", lean_moments=moments, lean_block=block, kernel="torch"))
    assert opt.bytes_per_element(torch.zeros(1, dtype=torch.bfloat16)) == pytest.approx(expected)
    assert opt.bytes_per_element(torch.zeros(1, dtype=torch.bfloat16), apply=False) == 0
