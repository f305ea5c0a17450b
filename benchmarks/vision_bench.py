"""Vision-language benchmark (issue 44): a random-init Qwen2.5-VL-7B shape trained by megatrain (streamed, and with
the GPU-resident tier), by transformers GPU-resident with compiled decoder layers and by DeepSpeed ZeRO-3 offload, on
the same image batches, side by side in one invocation.

    python benchmarks/vision_bench.py --tokens 8192,32768 --layers 4 [--steps 3 --warmup 2] [--budget-s 480]
        [--point-limit-s deepspeed=200] [--systems deepspeed,resident-compile,megatrain,megatrain-streamed,...]
    python benchmarks/vision_bench.py --tiny --tokens 96,192 --seq-len 48 --images 2 --image-px 8   # the CPU check

The model: Qwen2.5-VL-7B's config (text: hidden 3584, GQA 28/4, MLP 18944, vocab 152064, untied head, M-RoPE sections
16/24/24; its whole 32-block window-attention ViT and patch merger) with --layers of its 28 decoder layers (the 128 GiB
host of the GPU machine holds neither DeepSpeed's 18 bytes per parameter nor the streamed store of all 28), built
with random weights once (transformers' own init, bf16) and saved with save_pretrained; megatrain reads that
directory (model.path), the baselines build the same config with random weights of their own (the speed does not
depend on them). Every sample holds --images images of 448x448 pixels (1024 patches of 14x14, 256 tokens each after
the 2x2 merger, between <|vision_start|> and <|vision_end|>), the rest random text; rows of --seq-len tokens, as many
rows as make the --tokens per step. Image tokens are never in the loss. The tower is frozen and the merger trains
everywhere (finetune.vision=frozen, megatrain's and LLaMA-Factory's default).

Systems (each point in a process of its own, as benchmarks/run.py runs them):
- megatrain: the product through its Ray path with engine.gpu_resident=auto (the GPU-resident tier: as many
  layers, and the embedding and head, as the plan fits); benchmarks/run.py's megatrain row and every figure in it,
  its Trainer fed these image batches.
- megatrain-streamed: the same with engine.gpu_resident=none (every stage streams, the CPU optimizer updates all).
- resident-compile: Qwen2_5_VLForConditionalGeneration on the GPU in bf16 with torch fused AdamW and
  clip_grad_norm_, each decoder layer through torch.compile, activation checkpointing only when the run with every
  activation kept runs out of GPU memory (benchmarks/common.py compiled_resident_run; without it is the faster where
  both fit). The row's `checkpointing` says which. Its tower runs transformers' own attention: SDPA once per
  window (transformers' path without flash-attn, which the GPU machine does not have).
- resident-compile-ckpt: resident-compile always with activation checkpointing (the other half of the issue's
  "best of with and without checkpointing" where both fit; vs_resident is over the faster row of the point).
- resident-compile-segments: the same with the tower's attention through megatrain's segment attention
  (megatrain_ray/model/vision/attention.py: one SDPA call per window length), megatrain's own tower path: what of
  megatrain's lead over resident-compile is that alone (vs_resident_segments).
- deepspeed: the same model under DeepSpeed ZeRO-3, parameters and optimizer offloaded to pinned CPU memory
  (DeepSpeedCPUAdam), bf16, activation checkpointing (benchmarks/run.py's DeepSpeed config).

The model directory (megatrain's model.path) is built only when a megatrain system runs. A baseline process runs
every token count of the invocation in turn (DeepSpeed's start-up, its CPU Adam build included, once); megatrain
starts one run per token count (its plan, the tier's size included, is per batch shape).
Points run in the order of --systems, the baselines first by default (DeepSpeed's start-up is the longest), then
megatrain's systems per token count. vs_resident (over resident-compile) and vs_deepspeed are benchmarks/run.py's
derive. --budget-s: a point is not started once the invocation has run that long (the device call's limit); its
row says so; --point-limit-s caps one system's process. The result file is rewritten after every point, so a
call cut short keeps the rows so far. megatrain's rows carry worker_seconds (the GPU worker's own time of the step;
the rest of step_seconds is the driver's call and Ray's hand-over) and vision_seconds (the tower and projector on
the device, forward and backward; not in compute_seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import provenance, write_result  # noqa: E402
from benchmarks.run import RESULT_TAG, derive, summary_line  # noqa: E402
from benchmarks.vision_shape import vl_config  # noqa: E402
from benchmarks.vision_systems import BASELINES, MEGATRAIN_SYSTEMS, child  # noqa: E402

# ----------------------------------------------------------------------------- the invocation (parent)


def run_rows(command: list[str], timeout: float) -> list[dict]:
    """Every result row a child printed; an error row after them when it timed out or died without one."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        ending = None if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        ending = f"timed out after {timeout:.0f} s"
    rows = [json.loads(ln[len(RESULT_TAG):]) for ln in stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if ending and not any(r["status"] != "ok" for r in rows):
        rows.append({"status": "error", "error": f"{ending}: {stderr[-2000:]}",
                     "log_tail": (stdout + stderr).splitlines()[-40:]})
    return rows


def segments_against(rows: list[dict]) -> None:
    """vs_resident_segments: a row's tok/s over resident-compile-segments' (transformers resident, compiled decoder
    layers, the tower's attention through megatrain's segment attention) of the same token count."""
    base = {r["tokens_per_step"]: r for r in rows if r.get("system") == "resident-compile-segments"
            and r["status"] == "ok"}
    for row in rows:
        other = base.get(row.get("tokens_per_step"))
        if other is not None and row["status"] == "ok" and row is not other:
            row["vs_resident_segments"] = row["tok_per_s"] / other["tok_per_s"]


def write_config(path: Path, model_dir: Path, seq_len: int, tiny: bool) -> None:
    """The megatrain run's config (model.path the saved model; its batches are the harness's)."""
    import yaml

    raw = {"model": {"path": str(model_dir)},
           "data": {"path": "synthetic", "seq_len": seq_len, "batch_size": 1},
           "optimizer": {"lr": 1.0e-5, "weight_decay": 0.1, "grad_clip": 1.0, **({"workers": 1} if tiny else {})},
           "schedule": {"kind": "cosine", "warmup_steps": 0},
           "precision": {"compute_dtype": "float32" if tiny else "bfloat16", "master_dtype": "float32"},
           "finetune": {"vision": "frozen"},
           "train": {"steps": 10, "output_dir": str(path.parent / "run")}}
    path.write_text(yaml.safe_dump(raw))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="deepspeed,resident-compile,megatrain,megatrain-streamed",
                        help="the baselines run first (each one process for every token count), in this order, then "
                        "megatrain's systems per token count")
    parser.add_argument("--tokens", default="8192,32768", help="tokens per step, comma-separated")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the 28 (the width is the 7B's)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--images", type=int, default=4, help="images per sample")
    parser.add_argument("--image-px", type=int, default=448, help="image side in pixels")
    parser.add_argument("--tiny", action="store_true", help="the CPU check's tiny shape (8x8 images of 4 tokens)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per point")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=0.0, help="start no point after this many seconds (0: no "
                        "limit); a child is stopped at it")
    parser.add_argument("--point-limit-s", default="", help="SYSTEM=SECONDS,...: stop that system's process after "
                        "so long (its rows so far are kept), e.g. deepspeed=200")
    parser.add_argument("--name", default="vision-qwen2.5-vl-7b")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--child", nargs=2, metavar=("SYSTEM", "SPEC_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], json.loads(args.child[1]))
        return 0
    started = time.perf_counter()
    systems = args.systems.split(",")
    unknown = set(systems) - set(MEGATRAIN_SYSTEMS) - set(BASELINES)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {sorted(MEGATRAIN_SYSTEMS) + list(BASELINES)}")
    token_counts = [int(x) for x in args.tokens.split(",")]
    if any(t % args.seq_len for t in token_counts):
        parser.error(f"--tokens {args.tokens}: each must be a multiple of --seq-len {args.seq_len}")
    limits = {k: float(v) for k, v in (item.split("=") for item in args.point_limit_s.split(",") if item)}
    # Points in the order of --systems (by default the baselines first: DeepSpeed's start-up is the longest and its
    # rows the scarcest): a baseline is one process for every token count; megatrain's systems listed one after
    # another run per token count, the first token count of each of them before the next count, so that a
    # cut-short invocation has the first token count's table whole.
    points: list[tuple[str, list[int]]] = []
    run: list[str] = []
    for s in [*systems, None]:
        if s in MEGATRAIN_SYSTEMS:
            run.append(s)
            continue
        points += [(m, [tokens]) for tokens in token_counts for m in run]
        run = []
        if s is not None:
            points.append((s, token_counts))
    rows: list[dict] = []
    path = None
    with tempfile.TemporaryDirectory() as tmp:
        base = {"layers": args.layers, "tiny": args.tiny, "seq_len": args.seq_len, "images": args.images,
                "image_px": args.image_px, "steps": args.steps, "warmup": args.warmup,
                "model_dir": str(Path(tmp) / "model"), "config": str(Path(tmp) / "megatrain.yaml"), "overrides": []}
        write_config(Path(base["config"]), Path(base["model_dir"]), args.seq_len, args.tiny)
        left = lambda: args.budget_s - (time.perf_counter() - started) if args.budget_s else 3600.0  # noqa: E731
        t0 = time.perf_counter()
        # The saved model directory is megatrain's model.path; the baselines build their own model and read only the
        # config's optimizer section (the config names the directory: its config.json alone then).
        if set(systems) & set(MEGATRAIN_SYSTEMS):
            built = run_rows([sys.executable, __file__, "--child", "build", json.dumps(base)], left())
        else:
            vl_config(args.layers, args.tiny).save_pretrained(base["model_dir"])
            built = [{"status": "not built (no megatrain system)"}]
        model = {**built[0], "build_seconds": time.perf_counter() - t0}
        print(f"model: {model}", flush=True)
        if built[0]["status"] not in ("ok", "not built (no megatrain system)"):
            points = []
        for system, counts in points:
            run_dir = Path(tmp) / f"run-{system}-{counts[0]}"
            spec = {**base, "tokens": counts[0], "token_counts": counts, "run_dir": str(run_dir)}
            t0 = time.perf_counter()
            found = run_rows([sys.executable, __file__, "--child", system, json.dumps(spec)],
                             min(left(), limits.get(system, left()))) \
                if left() > 30 else [{"status": "not run", "error": f"the invocation's --budget-s {args.budget_s:.0f} "
                                      "s was spent before this point started"}]
            done = [r for r in found if r["status"] == "ok"]
            failed = [r for r in found if r["status"] != "ok"]
            missing = [t for t in counts if t not in {r["tokens_per_step"] for r in done}]
            # A failure belongs to the first token count without a row; any after it did not run.
            failed += [{"status": "not run", "error": "its process ended before this token count"}] * len(missing)
            new = done + [{**f, "tokens_per_step": t} for f, t in zip(failed, missing)]
            for row in new:
                row.update(system=system, layers=args.layers, batch=row["tokens_per_step"] // args.seq_len,
                           seq_len=args.seq_len, images_per_sample=args.images, image_px=args.image_px,
                           wall_seconds=time.perf_counter() - t0)
            rows += new
            derive(rows, None)
            segments_against(rows)
            for row in new:
                print(summary_line(row), flush=True)
            device = next((r["device"] for r in rows if r.get("device")), "unknown")
            result = {**provenance(device), "shape": "Qwen2.5-VL-7B" if not args.tiny else "tiny Qwen2.5-VL",
                      "model": model, "layers_of_28": args.layers, "images_per_sample": args.images,
                      "image_px": args.image_px, "seq_len": args.seq_len, "token_counts": token_counts,
                      "steps": args.steps, "warmup": args.warmup, "finetune_vision": "frozen",
                      "commit_note": os.environ.get("COMMIT_NOTE", ""), "rows": rows}
            path = write_result(args.name, result, args.out, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
