"""examples/grpo_smollm2 as its README types it (make the prompts, prepare them, train), timed, with the held-out
mean reward before training (the console line) and at each evaluation, and each step's rewards, written to
benchmarks/results/example-grpo-smollm2-<device>-<time>.json with the machine and the commit.

    python benchmarks/example_grpo_smollm2.py [--set KEY=VALUE ...]    # extra overrides for `megatrain train`
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, provenance, write_result  # noqa: E402


def run(command: list[str]) -> str:
    print("$", " ".join(command), flush=True)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{command[0]} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args()
    smol = run([sys.executable, "examples/finetune_smollm2/where_is_smollm2.py"]).strip().splitlines()[-1]
    for stale in ("runs/grpo-prompts", "runs/grpo-smollm2"):
        shutil.rmtree(ROOT / stale, ignore_errors=True)
    run([sys.executable, "examples/grpo_smollm2/make_prompts.py", "runs/grpo-prompts"])
    for name, out in (("prompts.jsonl", "prepared"), ("held_out.jsonl", "held_out")):
        run(["megatrain", "prepare", "--tokenizer", smol, "--format", "prompts", "--input", f"runs/grpo-prompts/{name}",
             "--output", f"runs/grpo-prompts/{out}"])
    overrides = [f"model.path={smol}", *args.overrides]
    t0 = time.perf_counter()
    log = run(["megatrain", "train", "examples/grpo_smollm2/config.yaml", "--local",
               *[x for o in overrides for x in ("--set", o)]])
    wall = time.perf_counter() - t0
    found = re.search(r"held-out mean reward before training: ([0-9.]+) \(([^)]*)\)", log)
    before = {"eval_reward": float(found.group(1))}
    before.update({f"eval_rewards/{name}/mean": float(value) for name, value in
                   (part.rsplit(" ", 1) for part in found.group(2).split(", "))})
    records = [json.loads(line) for line in (ROOT / "runs/grpo-smollm2/metrics.jsonl").read_text().splitlines()]
    keep = ("step", "loss", "reward", "rewards/format_reward/mean", "rewards/correct_reward/mean",
            "completions/mean_length", "rollout_s", "step_seconds", "sampling/sampling_logp_difference/max",
            "eval_reward", "eval_rewards/format_reward/mean",
            "eval_rewards/correct_reward/mean")
    result = {**provenance("cpu"), "what": "examples/grpo_smollm2 as its README types it (megatrain train --local)",
              "overrides": args.overrides, "train_wall_s": round(wall, 1), "before_training": before,
              "eval_reward_after": records[-1].get("eval_reward"),
              "steps": [{k: r[k] for k in keep if k in r} for r in records]}
    write_result("example-grpo-smollm2", result)


if __name__ == "__main__":
    main()
