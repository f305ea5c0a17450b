"""How many operators one forward of Qwen2.5-VL-7B's vision tower dispatches (issue 44: is the tower launch-bound?).

    python benchmarks/vision_tower_ops.py [--images 8,32]

The tower of benchmarks/vision_shape.py (its 32 blocks, 112-pixel windows, full-attention blocks 7/15/23/31, the 2x2
merger) at a narrow width (hidden 64, 16 heads, MLP 64: the operator count does not depend on the width), its
attention through megatrain's segment attention (megatrain_ray/model/vision/attention.py) as megatrain runs it,
448x448 images, on the CPU without autocast, under no_grad (the frozen tower's forward). Every ATen operator the
forward dispatches is counted (TorchDispatchMode); `kernel_ops` leaves out views and other metadata-only operators,
i.e. about the kernels a GPU would launch (under CUDA autocast each linear adds its casts); `scalar_reads` are the
.item()-style reads that on a GPU wait for the device. Writes benchmarks/results/vision-tower-ops-cpu-<time>.json.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import provenance, write_result  # noqa: E402
from benchmarks.vision_shape import QWEN25_VL_7B_VISION  # noqa: E402

METADATA_OPS = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze",
    "slice", "select", "as_strided", "alias", "detach", "split", "split_with_sizes", "chunk", "unbind", "narrow",
    "lift_fresh", "empty", "empty_like", "empty_strided", "unflatten", "flatten", "sym_size", "sym_stride",
    "sym_numel", "is_same_size", "item", "_local_scalar_dense"}


def count_forward(images: int) -> dict:
    import torch
    import transformers
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from megatrain_ray.model.vision.attention import use_segment_attention

    cfg = transformers.Qwen2_5_VLVisionConfig(**{**QWEN25_VL_7B_VISION, "hidden_size": 64, "intermediate_size": 64,
                                                 "num_heads": 16, "out_hidden_size": 64})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg)
    use_segment_attention(tower)

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    grid = 448 // cfg.patch_size
    pixels = torch.randn(images * grid * grid, cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2)
    thw = torch.tensor([[1, grid, grid]] * images)
    with torch.no_grad(), Count() as counted:
        tower(pixels, grid_thw=thw)
    ops = counted.ops
    return {"images": images, "patches": images * grid * grid, "aten_ops": sum(ops.values()),
            "kernel_ops": sum(v for k, v in ops.items() if k not in METADATA_OPS),
            "scalar_reads": ops.get("_local_scalar_dense", 0) + ops.get("item", 0),
            "linear_ops": ops.get("addmm", 0) + ops.get("mm", 0) + ops.get("linear", 0),
            "sdpa_calls": sum(v for k, v in ops.items() if "scaled_dot_product" in k),
            "top": ops.most_common(12)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", default="8,32", help="images per forward, comma-separated (8: the 8k step)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    rows = [count_forward(int(n)) for n in args.images.split(",")]
    for r in rows:
        print({k: v for k, v in r.items() if k != "top"})
    write_result("vision-tower-ops", {**provenance("cpu"), "tower": "Qwen2.5-VL-7B vision (32 blocks), width 64",
                                      "attention": "megatrain segment attention", "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
