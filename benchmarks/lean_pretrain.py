"""Pre-training from random init on real text with the full and the lean optimizer state (issue 46's convergence
at scale): a Llama shape (default 0.34 B parameters: 20 layers of width 1024, MLP 4096) trained byte-level on the
Python standard library's source, the same initialisation and batches in both runs, every step's loss of each.

    python benchmarks/lean_pretrain.py [--steps 2000] [--layers 20] [--full-cores 15] [--out DIR]

full: fp32 master and moments, every stage on the GPU-resident tier (engine.gpu_resident=all: torch's fused
AdamW on the device, the same math, step order and clipping as the CPU optimizer's; tests/integration/
test_gpu_resident.py). lean: optimizer.state=lean (bf16 master + bf16 compensation, int8 moments at block 256),
every stage streamed (the lean state lives on the host; the tier keeps its own float32 state). The two runs go side
by side, each a process of its own with its own private Ray (runtime.mode=ray, both), pinned to its own cores
(--full-cores, the rest to lean: its Ray and optimizer workers inherit the mask), so that the tier's run does not
wait for the CPU-bound lean one; --sequential runs them one after the other. Each run rewrites its partial file
(losses so far) every 100 steps and stops at --deadline-s, so a cut-off run keeps its figures; at its end it adds
its host memory per parameter (each shared segment kind, and the private memory of the driver and its actors).
With --state-dir DIR the runs, their figures and the corpus live in DIR: a run cut by the deadline saves a
checkpoint there, and a later call with the same arguments continues it from that step (--variants lean: the lean
run alone, on every core), so that 2,000 lean steps can span two calls (benchmarks/device_runs.sh lean-pretrain).

Tokens are the text's bytes (data.path=*.txt: vocab 256), no tokenizer needed. The "final loss" compared is the
mean over the last --tail steps (both runs see the same windows, none of them twice: one epoch is far more than
steps x tokens), beside the last step's loss. Writes <out>/lean-pretrain-<device>-<time>.json with the commit;
benchmarks/plot.py draws the curves.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, host_memory, provenance, write_result  # noqa: E402

VARIANTS = {"full": ["engine.gpu_resident=all", "runtime.mode=ray"],
            "lean": ["engine.gpu_resident=none", "optimizer.state=lean", "optimizer.lean_moments=int8",
                     "optimizer.lean_block=256", "runtime.mode=ray"]}
"""Both through Ray, as the product runs (each its own private Ray, inside its process's core mask). lean needs it:
an in-process optimizer worker is pinned nowhere and runs one thread (actors/optimizer_worker.py), so 4 workers
updated 0.336 B parameters in 0.307 s a step on 4 threads (lean-pretrain-h200-20261203-132652.json, cut at step
593). full's update is on the device, so the mode changes none of its numbers (on the CPU its 12 steps' losses are
the same bits in both modes); through Ray it runs the same actors as lean."""


def stdlib_corpus(path: Path) -> dict:
    """The standard library's .py files (sorted, site-packages left out), concatenated into `path`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts))
    digest = hashlib.sha256()
    with path.open("wb") as out:
        for file in files:
            data = file.read_bytes() + b"\n"
            out.write(data)
            digest.update(data)
    return {"root": str(root), "files": len(files), "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def config(args, name: str, corpus: Path, work: Path):
    from megatrain_ray.config.load import load_config

    raw = {
        "model": {"family": "llama", "vocab_size": 256, "hidden_size": args.hidden,
                  "intermediate_size": args.intermediate, "num_layers": args.layers,
                  "num_attention_heads": args.heads, "num_key_value_heads": args.heads,
                  "max_position_embeddings": args.seq_len, "rope_theta": 10000.0, "rms_norm_eps": 1e-5},
        "data": {"path": str(corpus), "seq_len": args.seq_len, "batch_size": args.batch, "seed": 0},
        "optimizer": {"lr": args.lr, "weight_decay": 0.1, "grad_clip": args.clip, "workers": args.workers},
        "schedule": {"kind": "cosine", "warmup_steps": args.warmup, "min_lr_ratio": 0.1},
        "precision": {"compute_dtype": "bfloat16", "master_dtype": "float32"},
        "engine": {"compile": False},
        "runtime": {"mode": "local", "dashboard": False},
        "checkpoint": {"at_end": False, "every": 0},
        "train": {"steps": args.steps, "seed": 0, "log_every": 100, "output_dir": str(work / name),
                  "export_dir": ""},
    }
    return load_config(raw=raw, overrides=VARIANTS[name] + args.set)


def run_one(args) -> None:
    """One variant in this process: its losses, rewritten to args.partial as it goes."""
    import torch

    from megatrain_ray.driver.trainer import Trainer

    started = time.time()
    cfg = config(args, args.worker, Path(args.corpus), Path(args.work))
    row: dict = {"overrides": VARIANTS[args.worker] + args.set, "cores": sorted(os.sched_getaffinity(0)),
                 "losses": [], "grad_norms": [], "step_seconds": [], "optimizer_seconds": []}
    earlier = json.loads(Path(args.partial).read_text()) if args.resumable and Path(args.partial).is_file() else None
    if earlier is not None and len(earlier["losses"]) >= args.steps and "cut_at_step" not in earlier:
        print(f"{args.worker}: already ran its {args.steps} steps in an earlier call ({args.partial})", flush=True)
        return
    # --state-dir: continue from the checkpoint an earlier call saved at its deadline (none: from step 0).
    with Trainer(cfg, resume="auto" if args.resumable else None) as trainer:
        row["params"] = trainer.layout.num_params
        row["startup_seconds"] = time.time() - started
        if trainer.next_step and earlier is not None:  # that call's figures up to its checkpoint, then this one's
            for key in ("losses", "grad_norms", "step_seconds", "optimizer_seconds"):
                row[key] = earlier[key][:trainer.next_step]
            row["calls"] = earlier.get("calls", []) + [{"resumed_at_step": trainer.next_step,
                                                        "cores": row["cores"]}]
        for step in range(trainer.next_step, args.steps):
            record = trainer.step(step)
            for key, value in (("losses", "loss"), ("grad_norms", "grad_norm"), ("step_seconds", "step_seconds"),
                               ("optimizer_seconds", "optimizer_seconds")):
                row[key].append(float(record[value]))
            row.update(host_mem_gib=record["host_mem_gib"], gpu_peak_gib=record["gpu_peak_gib"])
            cut = time.time() > args.deadline
            if (step + 1) % 100 == 0 or step + 1 == args.steps or cut:
                row["wall_seconds"] = time.time() - started
                write_result("", row, path=Path(args.partial), quiet=True)
            if cut:
                row["cut_at_step"] = step + 1
                if args.resumable:  # a later call (--state-dir, --variants) continues from here
                    trainer.next_step = step + 1
                    trainer.save(wait=True)
                break
        else:
            row.pop("cut_at_step", None)
        row.update(host_memory(trainer, row["params"]))
    row["wall_seconds"] = time.time() - started
    row["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    write_result("", row, path=Path(args.partial), quiet=True)
    print(f"{args.worker}: {len(row['losses'])} steps, loss {row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}, "
          f"{row['wall_seconds']:.0f} s", flush=True)


def summary(runs: dict, tail: int) -> dict:
    """Final losses (mean of the last `tail` steps both runs have, and the last one) and lean over full."""
    full, lean = runs["full"]["losses"], runs["lean"]["losses"]
    n = min(len(full), len(lean))
    if not n:
        return {"steps_compared": 0}
    tail = min(tail, n)
    mean = {name: sum(values[n - tail:n]) / tail for name, values in (("full", full), ("lean", lean))}
    windows = [(begin, sum(lean[begin:begin + 100]) / sum(full[begin:begin + 100]) - 1)
               for begin in range(0, n - 99, 100)]
    return {"steps_compared": n, "tail": tail, "final_full": mean["full"], "final_lean": mean["lean"],
            "final_ratio": mean["lean"] / mean["full"], "last_full": full[n - 1], "last_lean": lean[n - 1],
            "last_ratio": lean[n - 1] / full[n - 1],
            "max_abs_window_rel_diff": max((abs(d) for _, d in windows), default=None),
            "max_abs_window_from_step": max(windows, key=lambda w: abs(w[1]))[0] if windows else None,
            "per_100_steps_rel_diff": [{"from_step": b, "lean_over_full_minus_1": d} for b, d in windows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--workers", default="4")
    parser.add_argument("--tail", type=int, default=100)
    parser.add_argument("--set", action="append", default=[], help="more config overrides for both runs")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="seconds from the start; runs stop there")
    parser.add_argument("--full-cores", default="", help="cores of the full run (taskset), e.g. 15; lean the rest")
    parser.add_argument("--sequential", action="store_true")
    parser.add_argument("--variants", default="full,lean", help="which runs this call makes (full, lean or both)")
    parser.add_argument("--state-dir", default="",
                        help="keep the runs here: a run cut by --deadline-s saves a checkpoint, and a later call with "
                             "the same arguments continues it (e.g. --variants lean on every core)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--worker", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    for flag in ("--corpus", "--partial", "--work"):  # the main process's to its workers
        parser.add_argument(flag, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--resumable", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.workers = args.workers if args.workers == "auto" else int(args.workers)
        run_one(args)
        return
    started = time.time()
    variants = [v for v in args.variants.split(",") if v]
    if not variants or set(variants) - set(VARIANTS):
        sys.exit(f"--variants: a comma-separated subset of {', '.join(VARIANTS)}")
    if args.state_dir:
        work = Path(args.state_dir).resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="lean-pretrain-"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    partials = work if args.state_dir else out  # with --state-dir the rows outlive the call, beside the runs
    corpus = stdlib_corpus(work / "stdlib.txt")
    print(f"corpus: {corpus['files']} files, {corpus['bytes']:,} bytes from {corpus['root']}", flush=True)
    everything = set(os.sched_getaffinity(0))
    full_cores = {int(c) for c in args.full_cores.split(",") if c} & everything
    cores = {"full": full_cores or everything, "lean": (everything - full_cores) or everything}
    if len(variants) == 1:
        cores = {name: everything for name in VARIANTS}
    procs = {}
    for name in variants:
        command = [sys.executable, __file__, *sys.argv[1:], "--worker", name, "--corpus", str(work / "stdlib.txt"),
                   "--partial", str(partials / f"lean-pretrain-partial-{name}.json"), "--work", str(work),
                   "--deadline", str(started + args.deadline_s)] + (["--resumable"] if args.state_dir else [])
        if shutil.which("taskset") and cores[name] != everything:
            command = ["taskset", "-c", ",".join(map(str, sorted(cores[name]))), *command]
        procs[name] = subprocess.Popen(command)
        if args.sequential:
            procs[name].wait()
    codes = {name: proc.wait() for name, proc in procs.items()}
    runs = {}
    for name in VARIANTS:  # a variant not run in this call: its row from an earlier call (--state-dir), if any
        partial = partials / f"lean-pretrain-partial-{name}.json"
        runs[name] = json.loads(partial.read_text()) if partial.is_file() else {"losses": []}
        if name in codes:
            runs[name]["exit_code"] = codes[name]
    device = next((r["device"] for r in runs.values() if "device" in r), "unknown")
    shape = {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "seq_len", "batch")}
    result = {**provenance(device), "steps": args.steps, "lr": args.lr, "warmup": args.warmup, "clip": args.clip,
              "schedule": "cosine to 0.1", "weight_decay": 0.1, "betas": [0.9, 0.95], "shape": shape,
              "tokens_per_step": args.seq_len * args.batch, "vocab": "bytes (256)", "compute_dtype": "bfloat16",
              "data": {"what": "the Python standard library's .py source, concatenated", **corpus},
              "side_by_side": not args.sequential, "wall_seconds": time.time() - started,
              "summary": summary(runs, args.tail), "runs": runs}
    print(json.dumps(result["summary"] | {"per_100_steps_rel_diff": None}), flush=True)
    result["variants_this_call"] = variants
    write_result("lean-pretrain", result, out=out)
    if not args.state_dir:
        for name in VARIANTS:
            (out / f"lean-pretrain-partial-{name}.json").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
