"""The CPU update's rate with the full and the lean optimizer state (optimizer.state), one process, native kernels.

    python benchmarks/lean_optimizer.py [--elements 200000000] [--threads 16] [--repeats 5]

Each state updates one flat span of `elements` parameters in place (bf16 gradients, a bf16 streaming copy for the
full state), `threads` OpenMP threads, and the best of `repeats` timed updates after a warm-up is reported as
G params/s and GB/s of DRAM traffic (the bytes each update reads and writes per parameter: 28 full, 14.06 lean with
int8 moments, 18 with bf16 ones). Writes benchmarks/results/lean-optimizer-<device>-<time>.json with the commit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import provenance, write_result  # noqa: E402
from megatrain_ray.config.engine_sections import OptimizerConfig  # noqa: E402
from megatrain_ray.optim.adamw import FlatAdamW  # noqa: E402
from megatrain_ray.optim.lean_adamw import FlatLeanAdamW, LeanStage  # noqa: E402


def timed(update, repeats: int) -> float:
    update(1)  # warm-up: page faults and the kernel's first call
    best = float("inf")
    for step in range(2, repeats + 2):
        t0 = time.perf_counter()
        update(step)
        best = min(best, time.perf_counter() - t0)
    return best


def full_state(n: int, threads: int, repeats: int) -> tuple[float, float]:
    opt = FlatAdamW(OptimizerConfig(kernel="native"), torch.float32, threads)
    master, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    stream = torch.randn(n).bfloat16()  # the gradients land here and the update overwrites them

    def update(step: int) -> None:
        opt.update(master=master, exp_avg=m, exp_avg_sq=v, grad=stream, stream_out=stream, start=0, end=n,
                   decay_end=n, adam_step=step, lr=1e-4, grad_coef=1.0)
    return timed(update, repeats), opt.bytes_per_element(stream, stream)


def lean_state(n: int, threads: int, repeats: int, moments: str, block: int) -> tuple[float, float]:
    opt = FlatLeanAdamW(OptimizerConfig(kernel="native", state="lean", lean_moments=moments, lean_block=block),
                        threads)
    dtype = torch.uint8 if moments == "int8" else torch.bfloat16
    scales = (torch.zeros(-(-n // block)), torch.zeros(-(-n // block))) if moments == "int8" else None
    state = LeanStage(torch.randn(n).bfloat16(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=dtype),
                      torch.zeros(n, dtype=dtype), scales)
    grad = torch.randn(n).bfloat16()

    def update(step: int) -> None:
        opt.update(state=state, grad=grad, start=0, end=n, decay_end=n, adam_step=step, lr=1e-4, grad_coef=1.0)
    return timed(update, repeats), opt.bytes_per_element(grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=200_000_000)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, run in (("full", lambda: full_state(args.elements, args.threads, args.repeats)),
                      ("lean-int8-256", lambda: lean_state(args.elements, args.threads, args.repeats, "int8", 256)),
                      ("lean-int8-2048", lambda: lean_state(args.elements, args.threads, args.repeats, "int8", 2048)),
                      ("lean-bf16", lambda: lean_state(args.elements, args.threads, args.repeats, "bfloat16", 256))):
        seconds, per_element = run()
        rows.append({"state": name, "seconds": seconds, "gparams_per_s": args.elements / seconds / 1e9,
                     "bytes_per_param": per_element, "dram_gbps": args.elements * per_element / seconds / 1e9})
        print(f"{name:<16} {rows[-1]['gparams_per_s']:6.2f} G params/s  {rows[-1]['dram_gbps']:6.1f} GB/s "
              f"({per_element:.2f} B/param)", flush=True)
    result = {**provenance("cpu"), "elements": args.elements, "threads": args.threads, "repeats": args.repeats,
              "rows": rows}
    write_result("lean-optimizer", result, **({"out": args.out} if args.out else {}))


if __name__ == "__main__":
    main()
