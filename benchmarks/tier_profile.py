"""Where the GPU idles in a training step: a torch profiler trace of megatrain's steps, summarised.

    python benchmarks/tier_profile.py --config configs/shapes/qwen3-30b-a3b.yaml --set model.num_layers=4 \\
        --set data.batch_size=2 --set data.seq_len=8192 [--steps 2 --warmup 3] [--out DIR]

The run is in-process (runtime.mode=local), so the profiler sees the GPU worker's kernels. After `--warmup`
steps (compilation, the allocator's first growth), `--steps` steps are profiled (CUDA activity, with the host's
ops). The summary: each step's wall time, the GPU-busy time (the union of the kernels' spans on the device), the
idle gaps longer than 1 ms with the host op that ran just before each (what the device waited for), and the
kernels by total time. Written to DIR/tier-profile-<time>.json with the device and the commit; the Chrome trace
beside it (gzip) when it is small enough.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import provenance, write_result  # noqa: E402

GAP_S = 1e-3
"""Device gaps shorter than this are launch latency, not waiting."""


def busy_and_gaps(kernels: list[tuple[float, float, str]], start: float, end: float) -> tuple[float, list]:
    """Union of the kernels' [begin, end) spans (seconds) inside [start, end), and the gaps over GAP_S between
    them as (begin, length, the kernel before)."""
    busy, gaps, at, last = 0.0, [], start, "(step start)"
    for b, e, name in sorted(kernels):
        if e <= at:
            continue
        if b > at + GAP_S:
            gaps.append((at, b - at, last))
        busy += e - max(b, at)
        at, last = e, name
    if end > at + GAP_S:
        gaps.append((at, end - at, last))
    return busy, gaps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "shapes" / "qwen3-30b-a3b.yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--name", default="tier-profile")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    from megatrain_ray.config.load import load_config
    from megatrain_ray.driver.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(args.config, [*args.set, "runtime.mode=local", "runtime.dashboard=false",
                                        f"train.output_dir={tmp}/run", f"train.steps={args.warmup + args.steps}",
                                        "schedule.warmup_steps=0", "checkpoint.every=0", "checkpoint.at_end=false"])
        with Trainer(cfg) as trainer:
            for s in range(args.warmup):
                trainer.step(s)
            trainer.flush()
            sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
            sync()
            marks = []
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for s in range(args.warmup, args.warmup + args.steps):
                    t0 = time.perf_counter()
                    record = trainer.step(s)
                    marks.append((t0, time.perf_counter(), record))
                sync()
            run = trainer.run_spec
            device = trainer.device_name
    events = prof.events()
    kernels = [(e.time_range.start / 1e6, e.time_range.end / 1e6, e.name) for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA]
    origin = min((k[0] for k in kernels), default=0.0)
    host_ops = sorted((e.time_range.start / 1e6, e.name) for e in events if e.device_type != torch.autograd.DeviceType.CUDA)
    start, end = origin, max((k[1] for k in kernels), default=origin)
    busy, gaps = busy_and_gaps(kernels, start, end)
    by_kernel: dict[str, float] = {}
    for b, e, name in kernels:
        by_kernel[name] = by_kernel.get(name, 0.0) + e - b
    wall = sum(t1 - t0 for t0, t1, _ in marks)
    summary = {
        **provenance(device), "config": args.config, "overrides": args.set, "steps": args.steps,
        "warmup": args.warmup, "resident_layers": run.resident_layers, "resident_vocab": run.resident_vocab,
        "kept_layers": run.kept_layers, "compiled": run.layers_compiled,
        "tokens_per_step": cfg.data.tokens_per_step,
        "tok_per_s": cfg.data.tokens_per_step * args.steps / wall, "step_seconds": wall / args.steps,
        "device_span_seconds": end - start, "gpu_busy_seconds": busy, "gpu_busy": busy / max(end - start, 1e-9),
        "gaps_over_1ms": [{"at_s": round(a - origin, 6), "seconds": round(n, 6), "after_kernel": k[:120],
                           "host_ops_in_gap": sorted({name for t, name in host_ops if a <= t < a + n})[:12]}
                          for a, n, k in sorted(gaps, key=lambda g: -g[1])[:25]],
        "idle_seconds_in_gaps": sum(n for _, n, _ in gaps),
        "top_kernels_seconds": dict(sorted(by_kernel.items(), key=lambda kv: -kv[1])[:25]),
        "records": [{k: r.get(k) for k in ("loss", "step_seconds", "gpu_busy", "gpu_peak_gib")} for *_, r in marks],
    }
    path = write_result(args.name, summary, args.out)
    trace = Path(args.out) / (path.stem + ".trace.json")
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as f, gzip.open(str(trace) + ".gz", "wb") as g:
        g.write(f.read())
    trace.unlink()
    print(f"{summary['tok_per_s']:,.0f} tok/s, GPU busy {summary['gpu_busy']:.2f} of {end - start:.3f} s; "
          f"idle in gaps over 1 ms: {summary['idle_seconds_in_gaps']:.3f} s")
    for g in summary["gaps_over_1ms"][:10]:
        print(f"  gap {g['seconds'] * 1e3:7.1f} ms after {g['after_kernel'][:60]} | host: {', '.join(g['host_ops_in_gap'][:5])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
