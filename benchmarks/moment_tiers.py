"""Optimizer throughput of each memory tier: AdamW moments float32 or bfloat16, in RAM or on disk.

    python benchmarks/moment_tiers.py [--params 67108864] [--stages 8] [--disk-dir /var/tmp] [--steps 4]
                                      [--device cpu-dev-box]

What it runs is an OptimizerWorker's update loop, in this process: the product's FlatAdamW (native
kernel where it builds) over --stages equal stages of --params float32 master weights, with bf16
gradients landing in the bf16 streaming copy (the engine's layout with bf16 compute), the stages
taken in the engine's update order. The master weights and the streaming copy are /dev/shm segments
(megatrain_ray.store.segments). The moments are /dev/shm segments too (tier `ram`), or files in --disk-dir
staged through megatrain_ray.store.disk_tier.MomentStager (tier `disk`: read ahead, written back behind,
every range dropped from the page cache after use), in float32 or bfloat16 (optimizer.moment_dtype).
One warm-up step, then --steps timed steps; the time includes waiting for the last write-back.

It also measures the disk's sequential write and read bandwidth with the same calls the disk tier
uses (pwrite + fdatasync + drop from the page cache; pread + drop), so that the disk tier's figure
can be set against its bound: bandwidth / bytes per parameter (8 read + 8 written at float32, half
at bfloat16). The disk is whatever --disk-dir is on; the JSON records its file system and device as
/proc/mounts and /sys/block report them, and the load average of the machine before and after.

Output: benchmarks/results/moment-tiers-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from benchmarks.common import provenance, write_result
from megatrain_ray.config.engine_sections import OptimizerConfig
from megatrain_ray.optim.adamw import FlatAdamW
from megatrain_ray.store.disk_tier import (
    MOMENT_KINDS,
    MomentStager,
    byte_view,
    piece_elems,
    pread_into,
    pwrite_from,
    update_order,
)
from megatrain_ray.store.segments import SegmentSpec, create_segment, map_segment, unlink_segment

DTYPE_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def disk_description(path: str) -> dict[str, str]:
    """The mount /proc/mounts gives for `path` (longest prefix) and its block device's model, if any."""
    real = os.path.realpath(path)
    best = ("", "", "")
    for line in Path("/proc/mounts").read_text().splitlines():
        device, mount, fstype = line.split()[:3]
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[1]):
            best = (device, mount, fstype)
    device, mount, fstype = best
    info = {"path": real, "device": device, "mount": mount, "fstype": fstype}
    block = Path("/sys/block") / Path(device).name.rstrip("0123456789")
    for key, rel in (("rotational", "queue/rotational"), ("model", "device/model")):
        try:
            info[key] = (block / rel).read_text().strip()
        except OSError:
            pass
    return info


def disk_bandwidth(directory: str, nbytes: int) -> dict[str, float]:
    """Sequential GB/s of the disk tier's own I/O calls, on a file of `nbytes`."""
    buf = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8)
    view = byte_view(buf)
    fd, path = tempfile.mkstemp(dir=directory, prefix="megatrain-bench-bw-")
    try:
        t0 = time.perf_counter()
        for offset in range(0, nbytes, len(view)):
            pwrite_from(fd, view, offset)
        write = nbytes / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        for offset in range(0, nbytes, len(view)):
            pread_into(fd, view, offset)
        read = nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        os.unlink(path)
    return {"write_gbps": write, "read_gbps": read, "bytes": nbytes}


def run_tier(params: int, stages: int, moment_dtype: str, tier: str, disk_dir: str, steps: int,
             threads: int) -> dict:
    numel = params // stages
    tag = f"megatrain-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    specs = []
    for s in range(stages):
        specs.append(SegmentSpec(f"/dev/shm/{tag}-{s}-master", "float32", numel, "master", s))
        specs.append(SegmentSpec(f"/dev/shm/{tag}-{s}-stream", "bfloat16", numel, "stream", s))
        for kind in MOMENT_KINDS:
            on_disk = tier == "disk"
            where = disk_dir if on_disk else "/dev/shm"
            specs.append(SegmentSpec(f"{where}/{tag}-{s}-{kind}", moment_dtype, numel, kind, s, on_disk=on_disk))  # type: ignore[arg-type]
    stager = None
    try:
        for spec in specs:
            create_segment(spec)
        mapped = {(spec.kind, spec.stage): map_segment(spec) for spec in specs}
        for s in range(stages):  # touch every page before timing; bf16 gradients in the streaming copy
            mapped[("master", s)].normal_(0, 0.02)
            mapped[("stream", s)].copy_(torch.randn(numel) * 1e-3)
            if tier == "ram":
                for kind in MOMENT_KINDS:
                    mapped[(kind, s)].zero_()
        adamw = FlatAdamW(OptimizerConfig(moment_dtype=moment_dtype), torch.float32, threads)  # type: ignore[arg-type]
        order = update_order(stages, clipped=True)
        if tier == "disk":
            paths = {(spec.kind, spec.stage): spec.path for spec in specs if spec.on_disk}
            stager = MomentStager(paths, {s: (0, numel) for s in range(stages)}, order, DTYPE_NAME[moment_dtype],
                                  piece_elems(numel, 1))
        seconds = []
        t_start = None
        for step in range(1, steps + 2):
            if step == 2:
                if stager is not None:
                    stager.drain()
                    stager.wait_seconds = 0.0
                t_start = time.perf_counter()
            t0 = time.perf_counter()
            for s in order:
                master, stream = mapped[("master", s)], mapped[("stream", s)]
                pieces = stager.pieces(s) if stager is not None else [(0, numel)]
                for k, (lo, hi) in enumerate(pieces):
                    if stager is not None:
                        (m, v), base = stager.acquire((s, k)), lo
                    else:
                        m, v, base = mapped[("exp_avg", s)], mapped[("exp_avg_sq", s)], 0
                    adamw.update(master=master, exp_avg=m, exp_avg_sq=v, grad=stream, stream_out=stream, start=lo,
                                 end=hi, decay_end=numel, adam_step=step, lr=1e-4, grad_coef=1.0, stage=s,
                                 moments_base=base)
                    if stager is not None:
                        stager.release((s, k))
            if step >= 2:
                seconds.append(time.perf_counter() - t0)
        if stager is not None:
            stager.drain()  # the last write-backs count
        total = time.perf_counter() - t_start
        moment_bytes = 2 * DTYPE_NAME[moment_dtype].itemsize
        row = {"moment_dtype": moment_dtype, "tier": tier, "params": stages * numel, "stages": stages,
               "steps": steps, "threads": threads, "kernel": adamw.kernel_name, "seconds": total,
               "step_seconds": seconds, "params_per_s": stages * numel * steps / total,
               "dram_bytes_per_param": adamw.bytes_per_element(stream, stream),
               "disk_bytes_per_param": 2 * moment_bytes if tier == "disk" else 0}
        if stager is not None:
            row["read_wait_seconds"] = stager.wait_seconds
            row["staging_bytes"] = stager.staging_bytes
        if adamw.pool is not None:
            adamw.pool.shutdown()
        return row
    finally:
        if stager is not None:
            stager.close()
        for spec in specs:
            unlink_segment(spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=64 << 20)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--disk-dir", default="/var/tmp")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--device", default="cpu-dev-box")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the optimizer's own threads run single-threaded kernels, as in a worker
    load_before = os.getloadavg()
    bandwidth = disk_bandwidth(args.disk_dir, 1 << 30)
    print(f"disk {args.disk_dir}: write {bandwidth['write_gbps']:.2f} GB/s, read {bandwidth['read_gbps']:.2f} GB/s")
    rows = []
    for moment_dtype in ("float32", "bfloat16"):
        for tier in ("ram", "disk"):
            row = run_tier(args.params, args.stages, moment_dtype, tier, args.disk_dir, args.steps, args.threads)
            if tier == "disk":  # the disk's own bound: both directions share it
                per_param = row["disk_bytes_per_param"]
                row["disk_bound_params_per_s"] = 1e9 / (per_param / 2 / bandwidth["read_gbps"]
                                                        + per_param / 2 / bandwidth["write_gbps"])
            rows.append(row)
            print(f"{moment_dtype:>8} {tier:>4}: {row['params_per_s'] / 1e6:8.1f} Mparam/s "
                  f"({row['kernel']} kernel, {args.threads} threads)"
                  + (f", waited {row['read_wait_seconds']:.2f} s for reads, disk bound "
                     f"{row['disk_bound_params_per_s'] / 1e6:.1f} Mparam/s" if tier == "disk" else ""))
    result = {**provenance(args.device), "benchmark": "moment-tiers", "disk": disk_description(args.disk_dir),
              "disk_bandwidth": bandwidth, "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "note": args.note, "rows": rows}
    write_result("moment-tiers", result)


if __name__ == "__main__":
    main()
