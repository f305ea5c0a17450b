"""CPU AdamW throughput against the number of optimizer worker processes, with and without H2D traffic.

    python benchmarks/optimizer_scaling.py [--params 268435456] [--max-workers 32] [--repeats 8] [--speculative]

What it runs is what an OptimizerWorker runs: the product's FlatAdamW (native kernel where it
builds) in place on /dev/shm segments made by megatrain_ray.store.segments (fp32 master and moments, bf16
gradients landing in the bf16 streaming copy, which the update rewrites), each worker process
pinned to its cores by the topology plan (megatrain_ray/system/topology.py) and updating its
split_span share. For 1, 2, 4, ... up to --max-workers processes it times `--repeats` updates
of all `--params` elements (wall time from "go" to the last worker done), once alone and once
while a thread copies a pinned host buffer to the GPU in a loop (skipped without CUDA; the JSON
says so). With `--speculative` each point also runs as a speculative update does
(optimizer.speculative_stages): master and moments read from one set and written into a second set of
segments, the gradients saved aside first. The GPU machines have one NUMA node; on several nodes the
pages are first touched by this process, so spans are not node-local.

Output: benchmarks/results/optimizer-scaling-<device>-<time>.json (device, commit, cores, NUMA
nodes, one row per point with its core map) and a .png of G params/s against workers.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from benchmarks.common import provenance, write_result
from megatrain_ray.config.engine_sections import OptimizerConfig
from megatrain_ray.observe.plot import Line, line_chart
from megatrain_ray.optim.adamw import FlatAdamW, split_span
from megatrain_ray.store.segments import (
    ALT_KINDS,
    STATE_KINDS,
    SegmentSpec,
    create_segment,
    map_segment,
    unlink_segment,
)
from megatrain_ray.system.topology import bind_process, detect_topology, format_cpus, plan_placement

H2D_BUFFER_BYTES = 256 << 20


KINDS = (*((kind, "float32") for kind in STATE_KINDS), ("stream", "bfloat16"))
SPECULATIVE_KINDS = (*((kind, "float32") for kind in ALT_KINDS), ("saved_grad", "bfloat16"))
"""A speculative update's second set and saved gradients."""


def segments(params: int, shm_dir: str, speculative: bool) -> list[SegmentSpec]:
    tag = f"{shm_dir}/megatrain-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return [SegmentSpec(f"{tag}-{kind}", dtype, params, kind, 0)
            for kind, dtype in (*KINDS, *(SPECULATIVE_KINDS if speculative else ()))]


def worker(specs: list[SegmentSpec], conn) -> None:
    """One optimizer process: per round, pin to the given cores, update its span `repeats` times on "go" (into
    the second set, saving the gradients, when the round is speculative)."""
    torch.set_num_threads(1)
    master, exp_avg, exp_avg_sq, stream, *second = (map_segment(s) for s in specs)
    while (job := conn.recv()) is not None:
        cores, index, workers, repeats, speculative = job
        bind_process(cores)
        adamw = FlatAdamW(OptimizerConfig(), torch.float32, threads=len(cores))
        start, end = split_span(master.numel(), index, workers)
        tensors = {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "grad": stream, "stream_out": stream}
        if speculative:
            tensors |= {"into": tuple(second[:3]), "save_grad": second[3]}
        for step in range(repeats + 1):  # step 0 warms up (kernel loaded, threads started)
            if step == 1:
                conn.send(("ready", adamw.kernel_name))
                conn.recv()  # go
            adamw.update(**tensors, start=start, end=end, decay_end=end, adam_step=step + 1, lr=1e-4, grad_coef=1.0)
        conn.send(("done", None))
        if adamw.pool is not None:
            adamw.pool.shutdown()


@contextlib.contextmanager
def h2d_traffic(enabled: bool):
    """While inside: a thread copies a pinned host buffer to the GPU in a loop. Yields a dict that
    holds `gbps` afterwards; does nothing when not enabled."""
    result: dict[str, float] = {}
    if not enabled:
        yield result
        return
    src = torch.empty(H2D_BUFFER_BYTES, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(H2D_BUFFER_BYTES, dtype=torch.uint8, device="cuda")
    stop = threading.Event()

    def copy_loop() -> None:
        copies, t0 = 0, time.perf_counter()
        while not stop.is_set():
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            copies += 1
        result["gbps"] = copies * H2D_BUFFER_BYTES / (time.perf_counter() - t0) / 1e9

    thread = threading.Thread(target=copy_loop, daemon=True)
    thread.start()
    time.sleep(0.2)  # copies in flight before the optimizer starts
    try:
        yield result
    finally:
        stop.set()
        thread.join()


def run_point(conns: list, topology, workers: int, repeats: int, params: int, h2d: bool,
              speculative: bool = False) -> dict:
    plan = plan_placement(topology, workers, num_shards=1)
    for slot, conn in zip(plan.workers, conns):
        conn.send((list(slot.cores), slot.index, workers, repeats, speculative))
    kernels = {conn.recv()[1] for conn in conns[:workers]}
    with h2d_traffic(h2d) as traffic:
        t0 = time.perf_counter()
        for conn in conns[:workers]:
            conn.send("go")
        for conn in conns[:workers]:
            conn.recv()
        seconds = time.perf_counter() - t0
    row = {"workers": workers, "h2d": h2d, "speculative": speculative, "seconds": seconds, "gparams_per_s": params * repeats / seconds / 1e9,
           "kernel": ",".join(sorted(kernels)), "shared_cores": plan.shared_cores,
           "core_map": {f"optim{w.index}": [w.node, format_cpus(w.cores)] for w in plan.workers}}
    if h2d:
        row["h2d_gbps"] = traffic["gbps"]
    print(f"{workers:3d} workers{' + H2D' if h2d else '      '}{' speculative' if speculative else ''}: "
          f"{row['gparams_per_s']:.2f} G params/s"
          + (f", H2D {traffic['gbps']:.1f} GB/s" if h2d else ""), flush=True)
    return row


def worker_counts(max_workers: int) -> list[int]:
    counts, n = [], 1
    while n < max_workers:
        counts.append(n)
        n *= 2
    return [*counts, max_workers]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=2**28, help="elements updated per step (all workers)")
    parser.add_argument("--max-workers", type=int, default=0, help="largest worker count (default: usable cores)")
    parser.add_argument("--repeats", type=int, default=8, help="timed updates per point")
    parser.add_argument("--speculative", action="store_true",
                        help="also time each point as a speculative update (into a second set, gradients saved)")
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    params = int(args.params)
    topology = detect_topology()
    max_workers = args.max_workers or topology.num_cpus
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    specs = segments(params, args.shm_dir, args.speculative)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    try:
        for spec in specs:
            create_segment(spec)
        master, exp_avg, exp_avg_sq, stream, *_ = (map_segment(s) for s in specs)
        master.fill_(0.01)
        exp_avg.zero_()
        exp_avg_sq.zero_()
        stream.fill_(1e-3)  # the gradients, read and then overwritten by the new bf16 weights
        for _ in range(max_workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(specs, child), daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
        rows = []
        for workers in worker_counts(max_workers):
            for speculative in (False, True) if args.speculative else (False,):
                for h2d in (False, True) if cuda else (False,):
                    rows.append(run_point(conns, topology, workers, args.repeats, params, h2d, speculative))
    finally:
        for conn in conns:
            conn.send(None)
        for proc in procs:
            proc.join(timeout=30)
        for spec in specs:
            unlink_segment(spec)
    result = {
        "benchmark": "optimizer_scaling", **provenance(device),
        "cores": topology.num_cpus, "numa_nodes": [{"node": n.index, "cpus": format_cpus(n.cpus)}
                                                   for n in topology.nodes],
        "topology_source": topology.source, "params": params, "repeats": args.repeats,
        "h2d": "ran: a thread copies a 256 MiB pinned buffer to the GPU in a loop during each '+ H2D' point" if cuda
        else "skipped: no CUDA device", "rows": rows,
    }
    path = write_result("optimizer-scaling", result, args.out)
    plot(result, path.with_suffix(".png"))
    return 0


def plot(result: dict, path: Path) -> None:
    lines = [Line(label, [(r["workers"], r["gparams_per_s"]) for r in result["rows"]
                          if r["h2d"] == h2d and r.get("speculative", False) == speculative], color)
             for label, h2d, speculative, color in (
                 ("AdamW alone", False, False, "tab:blue"), ("AdamW + H2D copies", True, False, "tab:red"),
                 ("speculative alone", False, True, "tab:green"), ("speculative + H2D copies", True, True, "tab:orange"))]
    line_chart(path, [line for line in lines if line.points], "optimizer worker processes", "G params / s",
               f"CPU AdamW on {result['device']} ({result['cores']} cores, {len(result['numa_nodes'])} NUMA node(s))",
               log2_x=True, y_from_zero=True)


if __name__ == "__main__":
    sys.exit(main())
