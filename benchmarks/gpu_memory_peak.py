"""Which tensors are live on the GPU at a step's peak, by the source line that allocated them.

    python benchmarks/gpu_memory_peak.py --config configs/shapes/llama-3.5b-bench.yaml --layers 4,12 \
        --set data.batch_size=4 --set engine.activation_offload=true

For each depth it trains `--steps` steps in this process (the local runtime: the GPU worker is a thread
here) with torch's allocator history on, replays the last step's allocations and frees, and prints the
live blocks at the moment of the peak grouped by their innermost megatrain frame. Comparing depths shows
what grows with the number of layers. Needs CUDA. JSON goes to --out.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import torch

OURS = ("megatrain_ray", "actors", "benchmarks")


def _site(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if any(f"/{part}/" in name for part in OURS):
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    return "(outside megatrain)"


def _by_site(blocks: dict[int, dict]) -> dict[str, int]:
    by_site: dict[str, int] = {}
    for event in blocks.values():
        site = _site(event.get("frames", []))
        by_site[site] = by_site.get(site, 0) + event["size"]
    return dict(sorted(by_site.items(), key=lambda kv: -kv[1]))


def live_at_peak(trace: list[dict], since: int) -> tuple[int, dict[str, int], dict[str, int]]:
    """Replay allocator events: the peak of allocated bytes from event `since` on (counting what was
    live at `since`), the live blocks then by site, and the live blocks at `since` by site."""
    live: dict[int, dict] = {}
    current = peak = 0
    at_peak: dict[int, dict] = {}
    at_since: dict[int, dict] = {}
    for i, event in enumerate(trace):
        if i == since:
            at_since, peak, at_peak = dict(live), current, dict(live)
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if i >= since and current > peak:
                peak, at_peak = current, dict(live)
        elif action == "free_requested" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
    return peak, _by_site(at_peak), _by_site(at_since)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--layers", default="4,12", help="comma-separated depths")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.common import provenance, write_result
    from megatrain_ray.config.load import load_config
    from megatrain_ray.driver.trainer import Trainer

    report = {**provenance(torch.cuda.get_device_name()), "config": args.config, "overrides": args.set, "depths": {}}
    for layers in [int(x) for x in args.layers.split(",")]:
        run_dir = tempfile.mkdtemp(prefix=f"memory-peak-{layers}-")
        cfg = load_config(args.config, [*args.set, f"model.num_layers={layers}", f"train.steps={args.steps}",
                                        f"train.output_dir={run_dir}", "runtime.mode=local",
                                        "runtime.dashboard=false"])
        torch.cuda.memory._record_memory_history(max_entries=500_000)
        with Trainer(cfg) as trainer:
            for s in range(args.steps - 1):
                trainer.step(s)
            torch.cuda.synchronize()
            between = torch.cuda.memory_allocated()
            gc.collect()
            between_gc = torch.cuda.memory_allocated()
            since = len(torch.cuda.memory._snapshot()["device_traces"][0])
            record = trainer.step(args.steps - 1)
            trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
        peak, by_site, between_sites = live_at_peak(trace, since)
        print(f"\n{layers} layers: engine-reported peak {record['gpu_peak_gib']:.3f} GiB, replayed {peak / 2**30:.3f} "
              f"GiB ({len(trace)} allocator events); between steps {between / 2**30:.3f} GiB allocated, "
              f"{between_gc / 2**30:.3f} GiB after gc.collect()")
        for title, sites in (("live at the peak", by_site), ("live between steps", between_sites)):
            print(f" {title}:")
            for site, size in list(sites.items())[:args.top]:
                print(f"  {size / 2**20:10.1f} MiB  {site}")
        report["depths"][layers] = {"gpu_peak_gib": record["gpu_peak_gib"], "replayed_peak_gib": peak / 2**30,
                                    "allocator_events": len(trace), "between_steps_gib": between / 2**30,
                                    "between_steps_after_gc_gib": between_gc / 2**30,
                                    "live_mib_by_site": {k: v / 2**20 for k, v in by_site.items()},
                                    "between_steps_mib_by_site": {k: v / 2**20 for k, v in between_sites.items()}}
        torch.cuda.empty_cache()
    write_result("gpu-memory-peak", report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
