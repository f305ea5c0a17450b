"""MXFP4 dequantization against hand-computed values and transformers' own (convert_moe_packed_tensors, which
runs on the CPU, and a tiny gpt-oss checkpoint in MXFP4 that transformers' from_pretrained dequantizes);
the key lister against that checkpoint's names and shapes, and its errors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.model.mxfp4 import dequantize_gpt_oss_experts, dequantize_mxfp4, find_mxfp4_tensors

transformers = pytest.importorskip("transformers")
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402


def test_hand_computed_values():
    """E2M1 codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6, 8..15 their negatives; the low nibble comes first;
    scale s multiplies by 2^(s - 127)."""
    blocks = torch.zeros(2, 16, dtype=torch.uint8)
    blocks[0, :4] = torch.tensor([0x21, 0x43, 0x65, 0x87], dtype=torch.uint8)
    blocks[1, :3] = torch.tensor([0xF7, 0x9A, 0x0C], dtype=torch.uint8)
    scales = torch.tensor([127, 125], dtype=torch.uint8)
    got = dequantize_mxfp4(blocks, scales, torch.float32)  # one row of 2 groups of 32 values
    assert got.shape == (64,)
    got = got.view(2, 32)
    assert got[0, :8].tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0]
    assert got[1, :6].tolist() == [6.0 / 4, -6.0 / 4, -1.0 / 4, -0.5 / 4, -2.0 / 4, 0.0]
    assert torch.signbit(got[0, 7]) and not torch.signbit(got[0, 8])  # code 8 is -0.0, code 0 is +0.0
    assert got[:, 8:].abs().sum() == 0 and got[0, 8:].tolist() == [0.0] * 24
    assert dequantize_mxfp4(torch.full((1, 16), 0x77, dtype=torch.uint8), torch.tensor([130], dtype=torch.uint8),
                            torch.float32)[0] == 6.0 * 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equals_transformers_convert_moe_packed_tensors(dtype):
    """Random bytes and every scale from 0 to 255 (overflow to inf, subnormals, 0 * inf = NaN at 255 alike),
    gpt-oss-like shapes (experts, rows, groups, 16): bit for bit, NaN where transformers has NaN."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (4, 96, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.arange(4 * 96 * 4).remainder(256).to(torch.uint8).view(4, 96, 4)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = dequantize_gpt_oss_experts(blocks, scales, dtype)
    assert got.shape == ref.shape == (4, 128, 96) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(ref))
    assert torch.equal(got.signbit(), ref.signbit())


def tiny_gpt_oss_checkpoint(directory):
    """A GptOss checkpoint as released: experts in MXFP4 (gate_up (E, 2I, H/32, 16), down (E, H, I/32, 16)),
    the rest bf16, config.json with quantization_config mxfp4. Hidden 64 and intermediate 96 differ so a
    wrong transpose cannot pass."""
    cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=64, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).to(torch.bfloat16)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    for name in [k for k in tensors if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape  # transformers' (E, in, out)
        tensors[name + "_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8,
                                                  generator=g)
        tensors[name + "_scales"] = torch.randint(117, 130, (experts, outputs, inputs // 32), dtype=torch.uint8,
                                                  generator=g)
    cfg.quantization_config = {"quant_method": "mxfp4"}
    cfg.save_pretrained(directory)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def test_gpt_oss_checkpoint_loads_as_transformers_loads_it(tmp_path):
    """find_mxfp4_tensors lists the four expert pairs with the names and shapes transformers' model has, and
    dequantize_gpt_oss_experts gives the very tensors GptOssForCausalLM.from_pretrained dequantizes to on the
    CPU (it dequantizes there without triton)."""
    tensors = tiny_gpt_oss_checkpoint(tmp_path)
    found = find_mxfp4_tensors(tmp_path / "model.safetensors")
    assert [t.name for t in found] == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                       for p in ("down_proj", "gate_up_proj")]
    model = transformers.GptOssForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    loaded = model.state_dict()
    for t in found:
        assert t.shape == tuple(loaded[t.name].shape), t.name
        got = dequantize_gpt_oss_experts(tensors[t.blocks_key], tensors[t.scales_key], torch.bfloat16)
        assert torch.equal(got, loaded[t.name]), t.name
    assert {t.shape for t in found} == {(4, 64, 192), (4, 96, 64)}


def test_key_lister_errors_name_the_file(tmp_path):
    path = tmp_path / "broken.safetensors"
    save_file({"a.down_proj_blocks": torch.zeros(2, 4, 3, 16, dtype=torch.uint8)}, str(path))
    with pytest.raises(CheckpointError, match=r"broken\.safetensors: a\.down_proj_blocks has no a\.down_proj_scales"):
        find_mxfp4_tensors(path)
    with pytest.raises(CheckpointError, match="has no a.x_blocks"):
        find_mxfp4_tensors({"a.x_scales": (2, 4, 3)})
    with pytest.raises(CheckpointError, match="not an MXFP4 expert pair"):
        find_mxfp4_tensors({"a.x_blocks": (2, 4, 3, 16), "a.x_scales": (2, 4, 2)})
    with pytest.raises(CheckpointError, match="cannot read"):
        find_mxfp4_tensors(tmp_path / "missing.safetensors")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        find_mxfp4_tensors(tmp_path / "empty_dir")
    save_file({"a.down_proj_scales": torch.zeros(2, 4, 3, dtype=torch.uint8)}, str(tmp_path / "shard2.safetensors"))
    found = find_mxfp4_tensors(tmp_path)  # the pair straddles two shards of the directory
    assert [(t.name, t.shape) for t in found] == [("a.down_proj", (2, 96, 4))]
    assert find_mxfp4_tensors({"model.norm.weight": (8,)}) == []
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(torch.zeros(1, 16), torch.zeros(1, dtype=torch.uint8))
