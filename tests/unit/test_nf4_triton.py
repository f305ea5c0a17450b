"""The NF4 Triton kernels (quant/nf4_triton.py) against torch references: decode_blocks / dequantize_nf4
(bit for bit) and float64 products of the dequantized weights.

The kernels run in Triton's interpreter, which reads TRITON_INTERPRET=1 when triton is imported, so all checks
run in ONE subprocess (CHECKS below) started with it; each test asserts on that run's verdict for its check.
CHECKS runs on CUDA too (no interpreter, no read tracing), given the device as its argument, without pytest:
    python3 -c "import ast; m = ast.parse(open('tests/unit/test_nf4_triton.py').read()); exec([n.value.value
        for n in m.body if isinstance(n, ast.Assign) and n.targets[0].id == 'CHECKS'][0])" cuda
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]

CHECKS = r'''
import importlib, sys, traceback
import torch
from megatrain_ray.quant import nf4_triton
from megatrain_ray.quant.nf4 import dequantize_nf4, nf4_absmax, nf4_byte_table, quantize_nf4
from megatrain_ray.quant.nf4_stage import decode_blocks
from megatrain_ray.quant.nf4_triton import NF4Experts, dequantize_blocks_into, triton_available

DEVICE = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
INTERPRETED = DEVICE.type == "cpu"
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def gen(seed):
    return torch.Generator().manual_seed(seed)


@check
def dequantize_bit_identical():
    pairs = nf4_byte_table(DEVICE)
    # odd n with a short last block (a second launch); whole blocks only; several programs (8192 values each at
    # blocksize 64); other block sizes
    for n, bs in ((2389, 64), (64 * 130, 64), (8192 * 2 + 64 * 3 + 1, 64), (1, 64), (1000, 32), (4097, 128)):
        for double in (True, False):
            x = torch.randn(n, generator=gen(n)) * torch.rand(n, generator=gen(n + 1)) * 3
            q = quantize_nf4(x.to(DEVICE), bs, double)
            absmax = nf4_absmax(q)
            # whole blocks of codes, padded with zero codes, as a stage's codes section holds them
            codes = torch.full((q.num_blocks * bs // 2,), 0x77, dtype=torch.uint8, device=DEVICE)
            codes[:q.packed.numel()] = q.packed
            ref32 = decode_blocks(codes, absmax, pairs, torch.float32)[:n]
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                buffer = torch.full((n + 7,), float("nan"), dtype=dtype, device=DEVICE)
                out = buffer[3:3 + n]  # an offset view: the kernel writes exactly out's n values
                dequantize_blocks_into(codes, absmax, out, bs)
                assert torch.equal(out, ref32.to(dtype)), (n, bs, double, dtype)
                assert torch.equal(out, dequantize_nf4(q, dtype).view(-1)), (n, bs, double, dtype)
                assert buffer[:3].isnan().all() and buffer[3 + n:].isnan().all(), "wrote outside out"
    # the bf16 rounding is to nearest even, not a truncation (the interpreter's own cast truncates)
    truncated = (ref32.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    assert not torch.equal(truncated, ref32.to(torch.bfloat16)), "the data never exercised the rounding"


def experts(E, A, B, double, seed, dtype=torch.bfloat16, blocksize=64):
    w = torch.randn(E, A, B, generator=gen(seed)) * 0.05
    q = quantize_nf4(w.to(dtype).to(DEVICE), blocksize, double)
    return q, NF4Experts.of(q)


def reference(q, rows, ends, transposed, dtype):
    """float64 products of the dequantized weights (rounded to their dtype), and the same in float32 by torch."""
    W = dequantize_nf4(q, dtype).double().cpu()
    rows = rows.double().cpu()
    out64 = torch.zeros(rows.shape[0], W.shape[2] if transposed else W.shape[1], dtype=torch.float64)
    out32, mags = out64.clone(), out64.clone()
    start = 0
    for e, end in enumerate(ends.tolist()):
        w = W[e] if transposed else W[e].T
        out64[start:end] = rows[start:end] @ w
        out32[start:end] = (rows[start:end].float() @ w.float()).double()
        mags[start:end] = rows[start:end].abs() @ w.abs()
        start = end
    return out64, out32, mags


ROUTING = [3, 0, 21, 1, 0]  # E = 5; experts 1 and 4 get no rows, expert 2 more than BLOCK_M (16); N = 25 (odd)
LAYOUTS = ((True, 48, 128), (False, 80, 128))  # (transposed, A, B): A off every tile size; 480 blocks: 2 scales


def routed(counts, width, seed, dtype=torch.float32):
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    rows = torch.randn(int(ends[-1]), width, generator=gen(seed)).to(dtype)
    return rows.to(DEVICE), ends.to(DEVICE)


@check
def products_float32_within_measured_float32_noise():
    for transposed, A, B in LAYOUTS:
        for double in (True, False):
            q, ex = experts(len(ROUTING), A, B, double, seed=A + double)
            rows, ends = routed(ROUTING, A if transposed else B, seed=B + double)
            out = ex.products(rows, ends, transposed)
            assert out.dtype == torch.float32 and out.shape == (rows.shape[0], B if transposed else A)
            ref, ref32, mags = reference(q, rows, ends, transposed, torch.bfloat16)
            noise = (ref32 - ref).abs().max().item()  # torch's own float32 error on these products
            floor = 2 ** -24 * mags.max().item()  # one float32 rounding of the largest sum of |products|
            err = (out.double().cpu() - ref).abs().max().item()
            assert err <= 4 * noise + floor, (transposed, double, err, noise, floor)


@check
def products_bfloat16_within_bfloat16_rounding():
    for transposed, A, B in LAYOUTS:
        q, ex = experts(len(ROUTING), A, B, True, seed=7 * A)
        rows, ends = routed(ROUTING, A if transposed else B, seed=7 * B, dtype=torch.bfloat16)
        out = ex.products(rows, ends, transposed)
        assert out.dtype == torch.bfloat16
        ref, _, _ = reference(q, rows, ends, transposed, torch.bfloat16)
        scale = ref.abs().max().item()
        own = (ref.to(torch.bfloat16).double() - ref).abs().max().item() / scale  # the reference's bf16 rounding
        err = (out.double().cpu() - ref).abs().max().item() / scale
        assert 0 < own <= 2 ** -8 and err <= 4 * own, (transposed, err, own)


@check
def products_of_unit_rows_are_the_dequantized_weights_bit_for_bit():
    """One-hot rows pick single weight values (1 * w plus exact zeros): each must be the dense path's value to
    the bit, absmax decode (two float32 roundings, no FMA) and rounding to the weights' dtype included."""
    E = 3
    cases = [(transposed, A, B, 64, double, weight_dtype) for transposed, A, B in LAYOUTS for double in (True, False)
             for weight_dtype in (torch.bfloat16, torch.float16)]
    # other block sizes: 128-value blocks straddling the rows of B = 192; B = 96 at blocksize 32 (a multiple of it)
    cases += [(True, 40, 192, 128, True, torch.bfloat16), (False, 24, 96, 32, True, torch.bfloat16)]
    for transposed, A, B, blocksize, double, weight_dtype in cases:
        width = A if transposed else B
        q, ex = experts(E, A, B, double, seed=41 + double, dtype=weight_dtype, blocksize=blocksize)
        dense = dequantize_nf4(q)  # in the weights' dtype
        ends = torch.arange(1, E + 1, dtype=torch.int32, device=DEVICE) * width
        for rows_dtype in (torch.float32, weight_dtype):
            rows = torch.eye(width, dtype=rows_dtype, device=DEVICE).repeat(E, 1)
            out = ex.products(rows, ends, transposed).view(E, width, -1)
            expect = dense if transposed else dense.transpose(1, 2)
            assert torch.equal(out.to(weight_dtype), expect), (transposed, B, blocksize, double, weight_dtype,
                                                               rows_dtype)


@check
def unrouted_experts_leave_the_rest_unchanged():
    for transposed, A, B in LAYOUTS:
        q, ex = experts(len(ROUTING), A, B, True, seed=11)
        rows, ends = routed(ROUTING, A if transposed else B, seed=12)
        full = ex.products(rows, ends, transposed)
        # expert 0's rows dropped: the others' results are the same bits
        fewer = [0] + ROUTING[1:]
        ends_fewer = torch.tensor(fewer, dtype=torch.int32, device=DEVICE).cumsum(0).to(torch.int32)
        part = ex.products(rows[ROUTING[0]:], ends_fewer, transposed)
        assert torch.equal(part, full[ROUTING[0]:]), transposed
        # a single routed expert (the last, so every other program exits at once)
        only = [0] * (len(ROUTING) - 1) + [5]
        rows1, ends1 = routed(only, A if transposed else B, seed=13)
        out1 = ex.products(rows1, ends1, transposed)
        ref, ref32, mags = reference(q, rows1, ends1, transposed, torch.bfloat16)
        noise, floor = (ref32 - ref).abs().max().item(), 2 ** -24 * mags.max().item()
        assert (out1.double().cpu() - ref).abs().max().item() <= 4 * noise + floor, transposed


@check
def unrouted_experts_read_no_weight_bytes():
    if not INTERPRETED:
        return "skipped: loads are traced in the interpreter only"
    from triton.runtime import interpreter
    loaded = []
    real = interpreter.InterpreterBuilder.create_masked_load

    def traced(self, ptrs, mask, *args, **kwargs):
        loaded.append(ptrs.data[mask.data].ravel().copy())
        return real(self, ptrs, mask, *args, **kwargs)

    for transposed, A, B in LAYOUTS:
        for double in (True, False):
            q, ex = experts(len(ROUTING), A, B, double, seed=21)
            rows, ends = routed(ROUTING, A if transposed else B, seed=22)
            loaded.clear()
            interpreter.InterpreterBuilder.create_masked_load = traced
            try:
                ex.products(rows, ends, transposed)
            finally:
                interpreter.InterpreterBuilder.create_masked_load = real
            addresses = set(int(a) for chunk in loaded for a in chunk)
            per_expert, size = A * B // 2, ex.absmax.element_size()  # an expert's code bytes; absmax item size
            blocks = A * B // 64
            for e, count in enumerate(ROUTING):
                codes = range(ex.codes.data_ptr() + e * per_expert, ex.codes.data_ptr() + (e + 1) * per_expert)
                absmax = range(ex.absmax.data_ptr() + e * blocks * size, ex.absmax.data_ptr() + (e + 1) * blocks * size,
                               size)
                read = sum(a in addresses for a in codes), sum(a in addresses for a in absmax)
                if count:  # the trace sees the loads: a routed expert's codes and absmax are read whole
                    assert read == (len(codes), len(absmax)), (transposed, double, e, read)
                else:
                    assert read == (0, 0), (transposed, double, e, read)


@check
def contiguous_axis_off_the_blocksize_is_a_clear_error():
    q, ex = experts(2, 8, 96, True, seed=31)
    ends = torch.tensor([2, 3], dtype=torch.int32, device=DEVICE)
    for transposed in (True, False):
        rows = torch.randn(3, 8 if transposed else 96, device=DEVICE)
        try:
            ex.products(rows, ends, transposed)
        except ValueError as error:
            assert "multiple of 64" in str(error) and "96" in str(error), str(error)
        else:
            raise AssertionError("no error for a contiguous axis of 96 at blocksize 64")


@check
def the_start_up_probe_passes_the_kernels():
    from megatrain_ray.quant.nf4_triton_probe import kernels_failure
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert kernels_failure(DEVICE, dtype) is None, (dtype, kernels_failure(DEVICE, dtype))


@check
def availability_follows_triton_and_the_device():
    import os
    assert triton_available(DEVICE)
    if INTERPRETED:
        del os.environ["TRITON_INTERPRET"]
        assert not triton_available(torch.device("cpu"))
        os.environ["TRITON_INTERPRET"] = "1"
    saved = sys.modules["triton"], sys.modules["triton.language"]
    sys.modules["triton"] = sys.modules["triton.language"] = None  # as if triton were not installed
    try:
        module = importlib.reload(nf4_triton)
        assert not module.triton_available(DEVICE)
        try:
            module.dequantize_blocks_into(torch.zeros(1, dtype=torch.uint8), torch.ones(1), torch.empty(2))
        except RuntimeError as error:
            assert "triton" in str(error)
        else:
            raise AssertionError("no error without triton")
    finally:
        sys.modules["triton"], sys.modules["triton.language"] = saved
        importlib.reload(nf4_triton)


for fn in CHECKS:
    try:
        note = fn()
        print(f"PASS {fn.__name__}" + (f" ({note})" if note else ""), flush=True)
    except Exception:
        print(f"FAIL {fn.__name__}\n{traceback.format_exc()}", flush=True)
'''


@pytest.fixture(scope="module")
def verdicts() -> dict[str, str]:
    """One interpreter run of all checks: check name -> its PASS line or its FAIL traceback."""
    proc = subprocess.run([sys.executable, "-c", CHECKS], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)})
    found, name = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith(("PASS ", "FAIL ")):
            name = line.split()[1]
            found[name] = line
        elif name is not None:
            found[name] += "\n" + line
    assert found, f"the checks did not run (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return found


@pytest.mark.parametrize("name", [
    "dequantize_bit_identical",
    "products_float32_within_measured_float32_noise",
    "products_bfloat16_within_bfloat16_rounding",
    "products_of_unit_rows_are_the_dequantized_weights_bit_for_bit",
    "unrouted_experts_leave_the_rest_unchanged",
    "unrouted_experts_read_no_weight_bytes",
    "contiguous_axis_off_the_blocksize_is_a_clear_error",
    "the_start_up_probe_passes_the_kernels",
    "availability_follows_triton_and_the_device",
])
def test_nf4_triton(verdicts: dict[str, str], name: str) -> None:
    assert name in verdicts, f"{name} did not report: {sorted(verdicts)}"
    assert verdicts[name].startswith("PASS"), verdicts[name]
