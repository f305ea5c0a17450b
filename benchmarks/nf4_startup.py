"""Start-up of a randomly initialised NF4 base (finetune.lora.base_quantization=nf4, no model.path): each host
shard draws every decoder layer's weights (store/initial_values.init_slot_pieces, the values init_master writes) and
packs them (quant/nf4_stage.pack_stage_pieces), layers in parallel threads, each running torch
single-threaded, or, for a large base on more than two cores, in as many processes (store/nf4_base.fill_processes),
as actors/host_shard.py does. This times that work for a few layers and extrapolates to the model's.
--mode threads|processes forces one of the two (the processes' time includes their start).

    python benchmarks/nf4_startup.py --config configs/shapes/gpt-oss-120b-qlora.yaml --threads 16 --layers 16
    python benchmarks/nf4_startup.py --config configs/shapes/gpt-oss-120b-qlora.yaml --set model.num_experts=8 --threads 2

Not timed: allocating the segments (the kernel zero-fills them, in parallel threads) and pinning them for the GPU
(about 0.43 s per GiB measured on the H200 box).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import provenance, write_result  # noqa: E402
from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.config.resolved import RunSpec  # noqa: E402
from megatrain_ray.model.layout import build_layout  # noqa: E402
from megatrain_ray.store.nf4_base import (  # noqa: E402
    NF4_KIND,
    fill_base_stage,
    fill_base_stage_in_process,
    fill_processes,
    fill_threads,
    stage_format,
)
from megatrain_ray.store.segments import HostStore, SegmentSpec, create_segment  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--layers", type=int, default=0, help="layers to fill (default: --threads)")
    parser.add_argument("--mode", choices=("auto", "threads", "processes"), default="auto",
                        help="threads or processes (default: what the host shard picks for the whole model)")
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    cfg = load_config(args.config, overrides=["finetune.method=lora", "finetune.lora.base_quantization=nf4",
                                              "precision.stream_dtype=bfloat16", *args.set])
    layout = build_layout(cfg.model)
    count = min(args.layers or args.threads, len(layout.layers))
    stages = layout.layers[:count]
    seed, std = cfg.train.seed, cfg.model.initializer_range
    fmts = [stage_format(s, cfg.precision.compute_dtype) for s in stages]
    threads, torch_threads = fill_threads(count, args.threads)
    total = sum(s.numel for s in layout.layers)
    processes = {"auto": fill_processes(args.threads, total), "threads": 0, "processes": threads}[args.mode]
    before = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        specs = [SegmentSpec(os.path.join(tmp, f"stage{i}"), "uint8", f.nbytes, NF4_KIND, s.index)
                 for i, (s, f) in enumerate(zip(stages, fmts))]
        for spec in specs:
            create_segment(spec)
        store = HostStore(specs)
        run = RunSpec.resolve(cfg, device_type="cpu")
        t0 = time.perf_counter()
        if processes:
            with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
                for future in [pool.submit(fill_base_stage_in_process, [spec], stage, run, "", seed, std)
                               for spec, stage in zip(specs, stages)]:
                    future.result()
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda stage: fill_base_stage(store, stage, run, None, seed, std), stages))
        seconds = time.perf_counter() - t0
    torch.set_num_threads(before)
    filled = sum(s.numel for s in stages)
    rounds = -(-len(layout.layers) // threads)
    row = {"config": args.config, "overrides": args.set, "layers_filled": count, "values_filled": filled,
           "seconds": seconds, "threads": threads, "torch_threads": torch_threads,
           "mode": "processes" if processes else "threads",
           "ns_per_value_per_thread": seconds * threads / filled * 1e9, "model_layers": len(layout.layers),
           "model_values": total, "extrapolated_seconds": rounds * seconds * threads / count}
    print(f"{count} layers ({filled / 1e9:.2f} G values) in {seconds:.1f} s on {threads} {row['mode']} x "
          f"{torch_threads} torch threads: {row['ns_per_value_per_thread']:.2f} ns per value per thread")
    print(f"the whole model's {len(layout.layers)} layers ({total / 1e9:.1f} G values) on {threads} {row['mode']}: "
          f"~{row['extrapolated_seconds']:.0f} s (rounds of {threads} layers; one layer per {'process' if processes else 'thread'})")
    kwargs = {"out": args.out} if args.out else {}
    write_result(f"nf4-startup-{Path(args.config).stem}", {**provenance("cpu"), "rows": [row]}, **kwargs)


if __name__ == "__main__":
    main()
