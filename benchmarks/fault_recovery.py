"""Fault recovery and memory-plan accuracy on the GPU machine.

    python benchmarks/fault_recovery.py --config configs/shapes/llama-3.5b-bench.yaml --layers 4 --batch 8 \\
        --steps 15 --every 5 --kill-step 12 [--plan-points 8x16,16x32]

1. Runs the config uninterrupted, then again with the GPU worker SIGKILLed in the middle of step
   `--kill-step` (fault drill `kill:gpu`) and `fault.max_restarts: 1`: the run restarts its actors
   from the last checkpoint by itself. Reports the time lost (wall time against the uninterrupted
   run), the restart time, the steps redone, and whether the loss curves agree.
2. For each LAYERSxBATCH of `--plan-points`, a short run: `megatrain plan`'s predictions (GPU peak,
   host RAM) against the measured peaks.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import provenance, write_result  # noqa: E402
from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.config.resolved import RunSpec  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from megatrain_ray.planning.machine import Machine  # noqa: E402
from megatrain_ray.planning.memory import plan_run  # noqa: E402
from megatrain_ray.units import GiB  # noqa: E402


def timed_run(cfg) -> dict:
    t0 = time.perf_counter()
    with Trainer(cfg) as trainer:
        started = time.perf_counter()
        history = trainer.train()
        trained = time.perf_counter() - started
        device = trainer.device_name
        events = trainer.restart_events
    return {"wall_seconds": time.perf_counter() - t0, "train_seconds": trained, "device": device,
            "losses": [r["loss"] for r in history], "step_seconds": [r["step_seconds"] for r in history],
            "gpu_peak_gib": max(r["gpu_peak_gib"] for r in history),
            "host_mem_gib": max(r["host_mem_gib"] for r in history), "restarts": events}


def _compare(predicted: float, measured: float) -> dict:
    return {"predicted": predicted, "measured": measured, "error": predicted / measured - 1 if measured else None}


def plan_vs_measured(cfg, measured: dict) -> dict:
    plan = plan_run(cfg, Machine.detect(cfg.host.shm_dir))
    predicted_gpu, predicted_host = plan.gpu_peak / GiB, plan.host_total / GiB
    return {"layers": cfg.model.num_layers, "batch": cfg.data.batch_size, "tokens_per_step": cfg.data.tokens_per_step,
            "gpu_peak_gib": _compare(predicted_gpu, measured["gpu_peak_gib"]),
            "host_mem_gib": _compare(predicted_host, measured["host_mem_gib"]),
            "gpu_terms_gib": {k: v / GiB for k, v in plan.gpu.items()},
            "host_terms_gib": {k: v / GiB for k, v in plan.host.items()} | {"processes": plan.processes / GiB}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "shapes" / "llama-3.5b-bench.yaml"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--every", type=int, default=5, help="checkpoint.every")
    parser.add_argument("--kill-step", type=int, default=12)
    parser.add_argument("--plan-points", default="", help="LAYERSxBATCH,... short runs for the plan check")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--workdir", default="", help="where runs and checkpoints go (default: a temp dir)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="megatrain-fault-"))
    common = [*args.set, f"model.num_layers={args.layers}", f"data.batch_size={args.batch}",
              f"train.steps={args.steps}", f"checkpoint.every={args.every}", "checkpoint.keep=1",
              "schedule.warmup_steps=0", "runtime.dashboard=false", "train.log_every=1"]
    result: dict = {"config": os.path.relpath(args.config, ROOT), "overrides": common}
    clean = timed_run(load_config(args.config, [*common, f"train.output_dir={work / 'clean'}"]))
    killed = timed_run(load_config(args.config, [*common, f"train.output_dir={work / 'killed'}",
                                                  "fault.max_restarts=1", f"fault.drill=kill:gpu@{args.kill_step}"]))
    diffs = [abs(a - b) for a, b in zip(clean["losses"], killed["losses"])]
    result.update(provenance(clean["device"]))
    result["grad_dtype"] = RunSpec.resolve(load_config(args.config, common)).grad_dtype
    result["recovery"] = {
        "kill_step": args.kill_step, "checkpoint_every": args.every, "clean": clean, "killed": killed,
        "time_lost_seconds": killed["wall_seconds"] - clean["wall_seconds"],
        "restart_seconds": [e["restart_seconds"] for e in killed["restarts"]],
        "steps_redone": [e["noticed_at_step"] - e["resumed_at_step"] for e in killed["restarts"]],
        "loss_max_abs_diff": max(diffs) if diffs else None, "same_length": len(clean["losses"]) == len(
            killed["losses"])}
    recovery = result["recovery"]
    print(f"time lost {recovery['time_lost_seconds']:.1f} s; restart {recovery['restart_seconds']} s; "
          f"losses differ by at most {recovery['loss_max_abs_diff']}", flush=True)
    points = [plan_vs_measured(load_config(args.config, [*common, "train.output_dir=/unused"]), clean)]
    for point in filter(None, args.plan_points.split(",")):
        layers, batch = (int(x) for x in point.split("x"))
        cfg = load_config(args.config, [*args.set, f"model.num_layers={layers}", f"data.batch_size={batch}",
                                        "train.steps=3", "schedule.warmup_steps=0", "checkpoint.at_end=false",
                                        "runtime.dashboard=false", f"train.output_dir={work / f'plan-{point}'}"])
        points.append(plan_vs_measured(cfg, timed_run(cfg)))
        print(points[-1]["gpu_peak_gib"], points[-1]["host_mem_gib"], flush=True)
    result["plan_accuracy"] = points
    write_result("fault-recovery", result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
