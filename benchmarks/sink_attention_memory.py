"""GPU memory and time of attention with sinks (model/sinks.py, gpt-oss), forward and backward, memory in units of
one score-sized tensor S = rows x heads x T x (T + 1) x the compute dtype's bytes: what
planning/gpu_memory.explicit_attention_bytes should count.

    python benchmarks/sink_attention_memory.py [--rows 4] [--heads 64] [--kv-heads 8] [--seq-len 4096] [--window 0]
        [--paths explicit fused]

Per path (the explicit products, the fused kernel): peak allocated bytes above the inputs (q, k, v) during the
forward under autograd and during the backward with the forward's saved tensors, the forward and backward times
(CUDA events, median of 5), and the fused output's and gradients' largest difference from the explicit one's
relative to their largest value; one JSON file naming the device and the commit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import provenance, write_result  # noqa: E402
from megatrain_ray.model.sinks import _FusedSinkAttention, explicit_sink_attention  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--window", type=int, default=0)
    parser.add_argument("--paths", nargs="+", choices=["explicit", "fused"], default=["explicit", "fused"])
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    b, h, hk, t, d = args.rows, args.heads, args.kv_heads, args.seq_len, args.head_dim
    q = torch.randn(b, h, t, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hk, t, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hk, t, d, device=device, dtype=dtype, requires_grad=True)
    sinks = torch.randn(h, device=device, dtype=dtype, requires_grad=True)
    score = b * h * t * (t + 1) * torch.finfo(dtype).bits // 8
    paths = {"explicit": explicit_sink_attention, "fused": _FusedSinkAttention.apply}
    rows, results = [], {}
    for name in args.paths:
        attend = paths[name]
        for _ in range(2):  # the second pass is the measured one (the first warms the allocator and kernels)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = attend(q, k, v, sinks, d ** -0.5, args.window)
            torch.cuda.synchronize()
            forward_peak, saved = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
            grad_out = torch.randn(out.shape, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(0))
            grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
            torch.cuda.synchronize()
            backward_peak = torch.cuda.max_memory_allocated() - base
            results[name] = [out.detach(), *grads]
            del out, grads
        row = {"path": name, "rows": b, "heads": h, "kv_heads": hk, "seq_len": t, "head_dim": d,
               "window": args.window, "score_bytes": score, "forward_peak_bytes": forward_peak, "saved_bytes": saved,
               "backward_peak_bytes": backward_peak, "forward_peak_scores": forward_peak / score,
               "saved_scores": saved / score, "backward_peak_scores": backward_peak / score,
               **_times(attend, q, k, v, sinks, d ** -0.5, args.window)}
        if name != "explicit" and "explicit" in results:
            row["relative_difference_from_explicit"] = {
                label: ((a.float() - e.float()).abs().max() / e.float().abs().max()).item()
                for label, a, e in zip(("output", "dq", "dk", "dv", "dsinks"), results[name], results["explicit"])}
        rows.append(row)
        print(f"{name}: S = {score / 2**30:.2f} GiB; forward peak {row['forward_peak_scores']:.2f} S, saved "
              f"{row['saved_scores']:.2f} S, backward peak {row['backward_peak_scores']:.2f} S (above q, k, v); "
              f"forward {row['forward_seconds'] * 1e3:.1f} ms, backward {row['backward_seconds'] * 1e3:.1f} ms"
              + (f"; vs explicit {row['relative_difference_from_explicit']}" if "relative_difference_from_explicit"
                 in row else ""))
    kwargs = {"out": args.out} if args.out else {}
    write_result("sink-attention-memory", {**provenance(torch.cuda.get_device_name()), "rows": rows}, **kwargs)


def _times(attend, q, k, v, sinks, scale: float, window: int) -> dict[str, float]:
    """Median forward and backward seconds of 5 repeats (CUDA events)."""
    forward, backward = [], []
    for _ in range(5):
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        marks[0].record()
        out = attend(q, k, v, sinks, scale, window)
        marks[1].record()
        torch.autograd.grad(out, (q, k, v, sinks), torch.ones_like(out))
        marks[2].record()
        torch.cuda.synchronize()
        forward.append(marks[0].elapsed_time(marks[1]) / 1e3)
        backward.append(marks[1].elapsed_time(marks[2]) / 1e3)
    return {"forward_seconds": sorted(forward)[2], "backward_seconds": sorted(backward)[2]}


if __name__ == "__main__":
    main()
