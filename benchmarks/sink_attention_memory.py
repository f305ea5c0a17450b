"""GPU memory of attention with sinks (model/sinks.py, gpt-oss), forward and backward, in units of one score-sized
tensor S = rows x heads x T x (T + 1) x the compute dtype's bytes: what planning/gpu_memory.explicit_attention_bytes
should count.

    python benchmarks/sink_attention_memory.py [--rows 4] [--heads 64] [--kv-heads 8] [--seq-len 4096] [--window 0]

Peak allocated bytes above the inputs (q, k, v) during the forward under autograd, and during the backward with the
forward's saved tensors; one JSON file naming the device and the commit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import provenance, write_result  # noqa: E402
from megatrain_ray.model.sinks import sink_attention  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--window", type=int, default=0)
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    b, h, hk, t, d = args.rows, args.heads, args.kv_heads, args.seq_len, args.head_dim
    q = torch.randn(b, h, t, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hk, t, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hk, t, d, device=device, dtype=dtype, requires_grad=True)
    sinks = torch.randn(h, device=device, dtype=dtype, requires_grad=True)
    score = b * h * t * (t + 1) * torch.finfo(dtype).bits // 8
    rows = []
    for _ in range(2):  # the second pass is the measured one (the first warms the allocator and kernels)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = sink_attention(q, k, v, sinks, d ** -0.5, args.window)
        torch.cuda.synchronize()
        forward_peak, saved = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        backward_peak = torch.cuda.max_memory_allocated() - base
        rows = [{"rows": b, "heads": h, "kv_heads": hk, "seq_len": t, "head_dim": d, "window": args.window,
                 "score_bytes": score, "forward_peak_bytes": forward_peak, "saved_bytes": saved,
                 "backward_peak_bytes": backward_peak, "forward_peak_scores": forward_peak / score,
                 "saved_scores": saved / score, "backward_peak_scores": backward_peak / score}]
        del out
        q.grad = k.grad = v.grad = sinks.grad = None
    r = rows[0]
    print(f"S = {score / 2**30:.2f} GiB; forward peak {r['forward_peak_scores']:.2f} S, saved {r['saved_scores']:.2f} S, "
          f"backward peak {r['backward_peak_scores']:.2f} S (above q, k, v)")
    kwargs = {"out": args.out} if args.out else {}
    write_result("sink-attention-memory", {**provenance(torch.cuda.get_device_name()), "rows": rows}, **kwargs)


if __name__ == "__main__":
    main()
