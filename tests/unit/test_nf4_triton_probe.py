"""The start-up probe of the NF4 Triton kernels (quant/nf4_triton_probe.py) and what engine.nf4_kernels does with
its verdict (engine/packed_stream.uses_triton): auto falls back to torch with a warning, triton is one clear error.

Triton is not needed: the kernels are replaced by torch stand-ins that are right, wrong or raise, so the probe's
own comparison against the torch decoding is what is tested.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatrain_ray.engine import packed_stream
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.quant import nf4_triton, nf4_triton_probe
from megatrain_ray.quant.nf4 import NF4Tensor, dequantize_nf4, nf4_byte_table

CPU = torch.device("cpu")


def decode_like_torch(codes, absmax, out, blocksize=64):
    values = nf4_byte_table(out.device)[codes.long()].view(-1)[:out.numel()]
    out.copy_((values.view(-1, blocksize) * absmax.view(-1, 1)[:out.numel() // blocksize]).view(-1))


def products_like_torch(self, rows, ends, transposed):
    weight = dequantize_nf4(NF4Tensor(self.codes, self.absmax, self.scales, self.offset, self.shape, self.dtype,
                                      self.blocksize))
    expert = torch.searchsorted(ends.long(), torch.arange(rows.shape[0]), right=True)
    w = weight.float()[expert]
    return torch.einsum("ra,rab->rb" if transposed else "rb,rab->ra", rows.float(), w).to(rows.dtype)


@pytest.fixture
def kernels(monkeypatch):
    """Stand-ins for the two kernels (right by default); the probe's cache cleared around each test."""
    nf4_triton_probe._probe.cache_clear()
    monkeypatch.setattr(nf4_triton, "dequantize_blocks_into", decode_like_torch)
    monkeypatch.setattr(nf4_triton.NF4Experts, "products", products_like_torch)
    monkeypatch.setattr(packed_stream, "triton_available", lambda device: True)
    yield monkeypatch
    nf4_triton_probe._probe.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernels_that_agree_with_torch_pass_and_are_used(kernels, dtype):
    assert nf4_triton_probe.kernels_failure(CPU, dtype) is None
    assert packed_stream.uses_triton("auto", CPU, dtype) and packed_stream.uses_triton("triton", CPU, dtype)


def test_a_decoding_one_value_off_fails_the_probe(kernels):
    def off_by_one_value(codes, absmax, out, blocksize=64):
        decode_like_torch(codes, absmax, out, blocksize)
        out[77] = out[77] * 2 + 1
    kernels.setattr(nf4_triton, "dequantize_blocks_into", off_by_one_value)
    assert "block decoding" in nf4_triton_probe.kernels_failure(CPU, torch.bfloat16)


@pytest.mark.parametrize("broken", [True, False], ids=["transposed", "not-transposed"])
def test_wrong_expert_products_of_either_layout_fail_the_probe(kernels, broken):
    def other_expert(self, rows, ends, transposed):  # every row through expert 0, in the broken layout only
        if transposed == broken:
            ends = torch.full_like(ends, rows.shape[0])
        return products_like_torch(self, rows, ends, transposed)
    kernels.setattr(nf4_triton.NF4Experts, "products", other_expert)
    failure = nf4_triton_probe.kernels_failure(CPU, torch.bfloat16)
    assert "expert products" in failure and ("gpt-oss" if broken else "Qwen3-MoE") in failure


def test_a_wrong_scale_group_fails_the_probe(kernels):
    """A decoding that reads every block's absmax from the first double-quantization group: the probe's tensor
    has three groups, so it is caught."""
    def first_group_only(codes, absmax, out, blocksize=64):
        decode_like_torch(codes, absmax[:256].repeat(absmax.numel() // 256 + 1)[:absmax.numel()], out, blocksize)
    kernels.setattr(nf4_triton, "dequantize_blocks_into", first_group_only)
    assert "block decoding" in nf4_triton_probe.kernels_failure(CPU, torch.bfloat16)


def test_a_sticky_cuda_error_is_raised_not_taken_for_a_fallback(kernels):
    def illegal_access(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    kernels.setattr(nf4_triton, "dequantize_blocks_into", illegal_access)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        nf4_triton_probe.kernels_failure(CPU, torch.bfloat16)


def test_a_kernel_that_does_not_compile_falls_back_under_auto_and_is_an_error_under_triton(kernels, caplog):
    def fails_to_compile(*args, **kwargs):
        raise RuntimeError("PassManager::run failed\nlong compiler output")
    kernels.setattr(nf4_triton, "dequantize_blocks_into", fails_to_compile)
    assert nf4_triton_probe.kernels_failure(CPU, torch.bfloat16) == "RuntimeError: PassManager::run failed"
    with caplog.at_level(logging.WARNING):
        assert not packed_stream.uses_triton("auto", CPU, torch.bfloat16)
    assert "decoded in torch" in caplog.text and "PassManager::run failed" in caplog.text
    with pytest.raises(ConfigError, match=r"engine.nf4_kernels=triton: the NF4 Triton kernels fail on cpu "
                                          r"\(RuntimeError: PassManager::run failed\); set engine.nf4_kernels to torch"):
        packed_stream.uses_triton("triton", CPU, torch.bfloat16)
    assert not packed_stream.uses_triton("torch", CPU, torch.bfloat16)  # torch never probes


def test_the_verdict_is_kept_per_device_and_dtype(kernels):
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        decode_like_torch(*args, **kwargs)
    kernels.setattr(nf4_triton, "dequantize_blocks_into", counted)
    for _ in range(3):
        nf4_triton_probe.kernels_failure(CPU, torch.bfloat16)
    nf4_triton_probe.kernels_failure(CPU, torch.float16)
    assert len(calls) == 2
