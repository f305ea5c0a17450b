"""The expert products of one MoE layer: torch._grouped_mm against the per-expert loop, side by side.

    python benchmarks/moe_experts.py [--tokens 16384,65536] [--repeats 10] [--out benchmarks/results]

The MLP half of a Qwen3-30B-A3B layer (hidden 2048, 128 experts of width 768, top-8, softmax router with
norm_topk_prob) on random bf16 weights and inputs: route, group the rows by expert, the two expert products,
the SwiGLU and the weighted combine (megatrain_ray/model/moe.py), forward and backward (the gradients of the
rows, the router and the fused expert tensors), timed with CUDA events. The same call with the grouped GEMM
switched off runs the loop over the experts that megatrain uses where torch._grouped_mm is not available.
Both paths' outputs and gradients are compared (bf16: relative error of the norms). Writes one JSON file
naming the device and the commit.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, provenance, write_result  # noqa: E402

QWEN3_30B_A3B = {"hidden": 2048, "experts": 128, "width": 768, "top_k": 8}


def layer_weights(hidden: int, experts: int, width: int, device: str):
    import torch

    gen = torch.Generator(device=device).manual_seed(0)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).requires_grad_(True)

    return {"mlp.gate.weight": normal(experts, hidden), "mlp.experts.gate_up_proj": normal(experts, 2 * width, hidden),
            "mlp.experts.down_proj": normal(experts, hidden, width)}


def forward_backward(h, w, spec):
    """One forward and backward of the MoE MLP; returns (output, gradients of h and the weights)."""
    import torch

    from megatrain_ray.model.moe import moe_mlp

    h = h.detach().requires_grad_(True)
    out = moe_mlp(h, w, spec)
    grads = torch.autograd.grad(out, [h, *w.values()], torch.ones_like(out) * 1e-2)
    return out, grads


def time_path(h, w, spec, grouped: bool, repeats: int) -> tuple[float, tuple]:
    """Median seconds of forward + backward, and the last run's (output, gradients)."""
    import torch

    from megatrain_ray.model import moe

    # The loop path: grouped_mm_usable answers False, as it does off sm90 or in float32.
    patch = mock.patch.object(moe, "grouped_mm_usable", return_value=False) if not grouped else nullcontext()
    with patch:
        result = forward_backward(h, w, spec)  # warm-up (kernels, allocator)
        times = []
        for _ in range(repeats):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = forward_backward(h, w, spec)
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
    return sorted(times)[len(times) // 2], result


def main() -> int:
    import torch

    from megatrain_ray.model.moe import MoeSpec, grouped_mm_usable

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="16384,65536")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    shape = QWEN3_30B_A3B
    spec = MoeSpec(shape["experts"], shape["top_k"], "softmax_topk", True)
    w = layer_weights(shape["hidden"], shape["experts"], shape["width"], "cuda")
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        h = torch.randn(tokens, shape["hidden"], device="cuda").to(torch.bfloat16)
        usable = grouped_mm_usable(h, w["mlp.experts.gate_up_proj"], w["mlp.experts.down_proj"])
        grouped_s, (out_g, grads_g) = time_path(h, w, spec, True, args.repeats)
        loop_s, (out_l, grads_l) = time_path(h, w, spec, False, args.repeats)
        errors = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in
                  zip((out_g, *grads_g), (out_l, *grads_l))]
        # Active FLOPs of the expert products, forward (2 products) and backward (inputs and weights): 3 x forward.
        flops = 3 * 2 * tokens * shape["top_k"] * 3 * shape["hidden"] * shape["width"]
        row = {"tokens": tokens, "grouped_mm_usable": usable, "grouped_seconds": grouped_s, "loop_seconds": loop_s,
               "speedup": loop_s / grouped_s, "grouped_tflops": flops / grouped_s / 1e12,
               "loop_tflops": flops / loop_s / 1e12, "max_relative_error_vs_loop": max(errors)}
        rows.append(row)
        print(f"{tokens:>7} tokens: grouped {grouped_s * 1e3:8.2f} ms ({row['grouped_tflops']:.0f} TFLOPS), loop "
              f"{loop_s * 1e3:8.2f} ms ({row['loop_tflops']:.0f} TFLOPS), x{row['speedup']:.2f}, "
              f"max rel. error {row['max_relative_error_vs_loop']:.1e}", flush=True)
    write_result("moe-experts", {**provenance(torch.cuda.get_device_name()), "layer": shape,
                                 "what": "forward + backward of one Qwen3-30B-A3B MoE MLP (router, experts, combine)",
                                 "repeats": args.repeats, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
