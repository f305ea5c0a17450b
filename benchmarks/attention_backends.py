"""Time and memory of one causal attention forward + backward through each SDPA kernel, by sequence length.

    python benchmarks/attention_backends.py [--seq-lens 8192,65536,262144] [--heads 32] [--kv-heads 8]

The layers call SDPA without choosing a kernel (model/attention.py `_causal_attention`: is_causal, GQA
inside the kernel), so torch picks one by its priority. This runs the same call, shapes and dtype as an
8B-width layer (bf16, head_dim 128) under each kernel forced in turn (`sdpa_kernel`): the default pick,
FlashAttention, cuDNN, memory-efficient. Per point: median milliseconds of forward + backward over
--repeats, the peak of torch's allocations above the inputs (what the layer's backward adds), and the
output's and gradients' largest relative error against the flash kernel; a kernel that cannot take the
shape records its error. Long-context memory in megatrain_ray/planning/gpu_memory.py counts the allocations of
FlashAttention-2's backward; this says whether the kernel torch picks makes the same.

Output: benchmarks/results/attention-backends-<device>-<time>.json (device, commit, one row per point).
Needs CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from benchmarks.common import provenance, write_result  # noqa: E402
from megatrain_ray.model.attention import _causal_attention  # noqa: E402
from megatrain_ray.model.layer_spec import LayerSpec  # noqa: E402

KERNELS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION}


def run_point(seq_len: int, spec: LayerSpec, kernel: SDPBackend | None, repeats: int,
              reference: tuple[torch.Tensor, ...] | None) -> tuple[dict, tuple[torch.Tensor, ...]]:
    """One kernel at one length: the row, and the output and gradients of the last call (on the host, so
    that no earlier result counts in a later point's peak)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq_len, spec.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               .requires_grad_(True) for heads in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads))
    grad = torch.randn(1, spec.num_heads, seq_len, spec.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    times, results = [], ()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for i in range(repeats + 1):  # the first call warms the kernel up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with sdpa_kernel(kernel) if kernel is not None else contextlib.nullcontext():
            out = _causal_attention(q, k, v, spec)
        grads = torch.autograd.grad(out, (q, k, v), grad)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        if i == repeats:
            peak = torch.cuda.max_memory_allocated() - base
            results = tuple(t.detach().cpu() for t in (out, *grads))
        del out, grads
    row = {"ms": statistics.median(times[1:]), "peak_above_inputs_gib": peak / 2**30,
           "peak_bytes_per_token": peak / seq_len}
    if reference is not None:
        row["max_relative_error"] = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                                        for a, b in zip(results, reference))
    return row, results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="8192,65536,262144")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    spec = LayerSpec(args.heads, args.kv_heads, args.head_dim, 1e-5, qk_norm=False, attention_bias=False,
                     sliding_window=0)
    rows = []
    for seq_len in [int(x) for x in args.seq_lens.split(",")]:
        reference = None
        for name, kernel in sorted(KERNELS.items(), key=lambda kv: kv[0] != "flash"):  # flash first: the reference
            point = {"seq_len": seq_len, "kernel": name}
            try:
                row, results = run_point(seq_len, spec, kernel, args.repeats, reference)
                point.update(status="ok", **row)
                if name == "flash":
                    reference = results
                del results
            except (RuntimeError, torch.OutOfMemoryError) as e:  # a kernel that cannot take the shape
                point.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            torch.cuda.empty_cache()
            rows.append(point)
            extra = (f"{point['ms']:9.1f} ms  peak +{point['peak_above_inputs_gib']:6.2f} GiB"
                     f"{'  err %.1e' % point['max_relative_error'] if 'max_relative_error' in point else ''}"
                     if point["status"] == "ok" else point["error"][:100])
            print(f"{seq_len:>8} {name:<10} {extra}", flush=True)
    result = {"benchmark": "attention_backends", **provenance(torch.cuda.get_device_name()),
              "torch": torch.__version__, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
              "repeats": args.repeats, "rows": rows}
    write_result("attention-backends", result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
