"""Whether the NF4 Triton kernels (quant/nf4_triton.py) work on this device: compiled and giving the torch
decoding's values, tried once per device and dtype on a small tensor before a run relies on them.

engine.nf4_kernels=auto falls back to the torch decoding when they do not (a Triton or driver version that
cannot compile them, an architecture they were never run on); engine.nf4_kernels=triton turns the failure into
one clear error at start-up instead of a crash inside the first layer's dequantization.
"""

from __future__ import annotations

from functools import cache

import torch

from megatrain_ray.quant import nf4_triton
from megatrain_ray.quant.nf4 import dequantize_nf4, nf4_absmax, quantize_nf4

# A fused [E, A, B] expert tensor of two experts: 768 blocks of 64 (three double-quantization scale groups of 256),
# two K tiles of 64 either way round, whole blocks on the contiguous axis, as the layers have
_PROBE_SHAPE = (2, 128, 192)
_PROBE_ROWS = 5  # 3 rows to expert 0, 2 to expert 1
_PRODUCT_RTOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}


def kernels_failure(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when both kernels run on `device` for `dtype` and agree with torch (the decoding bit for bit, the
    expert products within their rounding); else what went wrong, in a sentence."""
    return _probe(torch.device(device), dtype)


@cache
def _probe(device: torch.device, dtype: torch.dtype) -> str | None:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(_PROBE_SHAPE, generator=gen) * 0.05).to(dtype)
    q = quantize_nf4(weight.to(device))
    _, width_a, width_b = _PROBE_SHAPE
    rows = {True: torch.randn(_PROBE_ROWS, width_a, generator=gen).to(dtype).to(device),  # weight[e] is [in, out]
            False: torch.randn(_PROBE_ROWS, width_b, generator=gen).to(dtype).to(device)}  # [out, in]
    try:
        decoded = torch.empty(weight.numel(), dtype=dtype, device=device)
        nf4_triton.dequantize_blocks_into(q.packed, nf4_absmax(q), decoded, q.blocksize)
        reference = dequantize_nf4(q)
        ends = torch.tensor([3, _PROBE_ROWS], dtype=torch.int32, device=device)
        experts = nf4_triton.NF4Experts.of(q)
        products = {t: experts.products(rows[t], ends, transposed=t) for t in (True, False)}
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a kernel's launch error surfaces here, inside the try
    except Exception as err:  # noqa: BLE001 - any failure of the kernels means: do not use them
        text = str(err).strip()
        if "CUDA error" in text:  # a sticky device error: the torch decoding would fail as well
            raise
        return f"{type(err).__name__}: {text.splitlines()[0] if text else 'no message'}"
    if not torch.equal(decoded.view(_PROBE_SHAPE), reference):
        return "the block decoding's values differ from the torch decoding's"
    weights = reference.float()[torch.tensor([0, 0, 0, 1, 1], device=device)]
    expected = {True: torch.einsum("ra,rab->rb", rows[True].float(), weights),
                False: torch.einsum("rb,rab->ra", rows[False].float(), weights)}
    rtol = _PRODUCT_RTOL[dtype]
    for transposed, product in products.items():
        if not torch.allclose(product.float(), expected[transposed], rtol=rtol, atol=rtol * 0.1):
            layout = "[in, out] (gpt-oss)" if transposed else "[out, in] (Qwen3-MoE)"
            return f"the expert products of {layout} weights differ from a torch product of the same weights"
    return None
