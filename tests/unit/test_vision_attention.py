"""The vision towers' segment attention (megatrain_ray/model/vision/attention.py): one SDPA call per segment length
where transformers' Qwen-VL vision attention makes one per segment, the same attention.

- Against plain PyTorch (softmax(q k^T * scale) v within each segment, float64): segments of mixed lengths, some of
  a length lying apart (gathered) and out of order, outputs and the gradients of q, k, v within 1e-10.
- A Qwen2.5-VL tower (transformers' own, windowed and full-attention blocks, two images of different grids):
  float64 features through the segment attention equal transformers' per-window SDPA path within 1e-10, with one
  SDPA call per segment length in each block instead of one per window (counted).
"""

from __future__ import annotations

import pytest
import torch

from megatrain_ray.model.vision.attention import SegmentPlan, segment_attention, takes_segments, use_segment_attention
from tests.numerics import assert_exact

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl  # noqa: E402


def reference(q, k, v, bounds, scale):
    """[1, heads, N, d] each; attention within each segment, plain softmax; [1, N, heads, d]."""
    out = torch.empty_like(q)
    for a, b in zip(bounds[:-1], bounds[1:]):
        scores = q[:, :, a:b] @ k[:, :, a:b].transpose(-1, -2) * scale
        out[:, :, a:b] = torch.softmax(scores, dim=-1) @ v[:, :, a:b]
    return out.transpose(1, 2)


def test_mixed_segments_match_plain_attention():
    bounds = [0, 4, 8, 11, 17, 21, 24, 27]  # lengths 4, 4, 3, 6, 4, 3, 3: the second 4 and the 3s lie apart
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, bounds[-1], 8, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    cu = torch.tensor(bounds, dtype=torch.int32)
    plan = SegmentPlan(cu)
    assert sorted(length for length, *_ in plan.groups) == [3, 4, 6] and plan.inverse is not None
    ours, _ = segment_attention(None, q, k, v, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    ref = reference(q, k, v, bounds, 0.3)
    assert_exact("segment attention", ours.detach(), ref.detach())
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ours_grads = torch.autograd.grad(ours, (q, k, v), grad)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, b in zip("qkv", ours_grads, ref_grads):
        assert_exact(f"grad of {name}", a, b)


def tiny_tower():
    config = transformers.Qwen2_5_VLVisionConfig(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2, spatial_merge_size=2,
        temporal_patch_size=2, window_size=8, fullatt_block_indexes=[1], out_hidden_size=32, in_channels=3)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel(config).double()


def test_qwen_tower_features_and_calls(monkeypatch):
    tower = tiny_tower()
    assert takes_segments(tower)
    grids = torch.tensor([[1, 8, 12], [1, 4, 4]])  # windows of 4x4 patches: 6 whole ones and one image of one
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 2 * 2, dtype=torch.float64)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(a[0].shape) or sdpa(*a, **kw))
    with torch.no_grad():
        theirs = tower(pixels, grid_thw=grids).pooler_output
        per_window = len(calls)
        calls.clear()
        assert use_segment_attention(tower)
        ours = tower(pixels, grid_thw=grids).pooler_output
    assert_exact("tower features", ours, theirs)
    assert per_window == 7 + 2  # transformers: the 7 windows in the windowed block, the 2 images in the full one
    assert len(calls) == 1 + 2  # ours: one length of window; two lengths of image (96 and 16 patches)
