"""Vision-language benchmark (issue 44): a random-init Qwen2.5-VL-7B shape trained by megatrain (streamed, and with
the GPU-resident tier), by transformers GPU-resident with compiled decoder layers and by DeepSpeed ZeRO-3 offload, on
the same image batches, side by side in one invocation.

    python benchmarks/vision_bench.py --tokens 8192,32768 --layers 4 [--steps 3 --warmup 2] [--budget-s 330]
    python benchmarks/vision_bench.py --tiny --systems megatrain,resident-compile --tokens 96   # the CPU check

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
  both fit). The row's `checkpointing` says which.
- deepspeed: the same model under DeepSpeed ZeRO-3, parameters and optimizer offloaded to pinned CPU memory
  (DeepSpeedCPUAdam), bf16, activation checkpointing (benchmarks/run.py's DeepSpeed config).

A baseline process runs every token count of the invocation in turn (DeepSpeed's start-up, its CPU Adam build
included, once); megatrain starts one run per token count (its plan, the tier's size included, is per batch shape).
vs_resident (over resident-compile) and vs_deepspeed are benchmarks/run.py's derive. --budget-s: a point is not
started once the invocation has run that long (the device call's limit); its row says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import compiled_resident_run, provenance, write_result  # noqa: E402
from benchmarks.run import RESULT_TAG, derive, summary_line  # noqa: E402

QWEN25_VL_7B_TEXT = {
    "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}}
QWEN25_VL_7B_VISION = {
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
    "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu"}
QWEN25_VL_TOKENS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
                    "vision_end_token_id": 151653}
TINY_TEXT = {**QWEN25_VL_7B_TEXT, "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "bos_token_id": None, "eos_token_id": None,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
TINY_VISION = {**QWEN25_VL_7B_VISION, "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
               "out_hidden_size": 64, "patch_size": 2, "window_size": 8, "fullatt_block_indexes": [1]}
TINY_TOKENS = {"image_token_id": 95, "video_token_id": 94, "vision_start_token_id": 93, "vision_end_token_id": 92}
"""The CPU check's shape (tests/reference_vision.py's tiny Qwen2.5-VL): 8x8-pixel images of 4 tokens."""
MEGATRAIN_SYSTEMS = {"megatrain": ["engine.gpu_resident=auto"], "megatrain-streamed": ["engine.gpu_resident=none"]}
BASELINES = ("resident-compile", "deepspeed")


def vl_config(layers: int, tiny: bool):
    """transformers' Qwen2_5_VLConfig of the benchmark shape with `layers` decoder layers."""
    import transformers

    text = {**(TINY_TEXT if tiny else QWEN25_VL_7B_TEXT), "num_hidden_layers": layers}
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=TINY_VISION if tiny else QWEN25_VL_7B_VISION,
                                         tie_word_embeddings=False, **(TINY_TOKENS if tiny else QWEN25_VL_TOKENS),
                                         architectures=["Qwen2_5_VLForConditionalGeneration"])


def random_model(config, device: str):
    """The model of `config` with transformers' random init, in bf16 on `device`, SDPA attention."""
    import torch
    import transformers

    config._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return transformers.Qwen2_5_VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(torch.float32)


# ----------------------------------------------------------------------------- the batches


class ImageBatches:
    """Seeded batches of `rows` rows of `seq_len` tokens, each row with `images` images evenly spaced (vision start,
    the image tokens, vision end), the rest random text; labels: the next token, -100 where it is an image token
    and at the end. `image_px` square images: the processor's patches (random pixels) and their grids."""

    def __init__(self, config, rows: int, seq_len: int, images: int, image_px: int, seed: int = 0):
        v = config.vision_config
        self.grid = image_px // v.patch_size
        self.image_tokens = self.grid * self.grid // v.spatial_merge_size ** 2
        if images * (self.image_tokens + 2) >= seq_len:
            raise ValueError(f"{images} images of {self.image_tokens} tokens do not fit rows of {seq_len} tokens")
        self.config, self.rows, self.seq_len, self.images, self.seed = config, rows, seq_len, images, seed
        self.patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2

    def parts(self, step: int):
        """(input_ids [rows, seq_len], labels [rows, seq_len], pixel_values [patches, patch_dim], image_grid_thw)."""
        import torch

        c = self.config
        g = torch.Generator().manual_seed(self.seed * 100003 + step)
        low = 3 if c.text_config.vocab_size < 1000 else 1000  # text ids clear of the special tokens
        ids = torch.randint(low, min(c.vision_end_token_id, c.text_config.vocab_size) - 8, (self.rows, self.seq_len),
                            generator=g)
        span = self.seq_len // self.images
        for i in range(self.images):
            start = i * span + 1
            ids[:, start - 1] = c.vision_start_token_id
            ids[:, start:start + self.image_tokens] = c.image_token_id
            ids[:, start + self.image_tokens] = c.vision_end_token_id
        labels = torch.cat([ids[:, 1:], torch.full((self.rows, 1), -100)], dim=1)
        labels[labels == c.image_token_id] = -100
        count = self.rows * self.images
        pixels = torch.randn(count * self.grid * self.grid, self.patch_dim, generator=g)
        grids = torch.tensor([[1, self.grid, self.grid]] * count)
        return ids, labels, pixels, grids

    def batch(self, step: int):
        from megatrain_ray.messages import Batch, ImageInputs

        ids, labels, pixels, grids = self.parts(step)
        return Batch(ids, labels, images=ImageInputs(pixels, {"image_grid_thw": grids}))

    def epoch_of(self, step: int) -> float:
        return 0.0  # endless synthetic batches: no epochs


def batches_of(spec: dict, tokens: int):
    config = vl_config(spec["layers"], spec["tiny"])
    return ImageBatches(config, tokens // spec["seq_len"], spec["seq_len"], spec["images"], spec["image_px"])


# ----------------------------------------------------------------------------- the systems (child processes)


def build_model_dir(spec: dict) -> dict:
    """The random-init model saved with save_pretrained (bf16) where megatrain reads it (model.path)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(vl_config(spec["layers"], spec["tiny"]), device)
    model.save_pretrained(spec["model_dir"])
    n = sum(p.numel() for p in model.parameters())
    visual = sum(p.numel() for p in model.model.visual.parameters())
    return {"params_total": n, "params_vision": visual, "params_text": n - visual}


def run_megatrain_vision(spec: dict) -> dict:
    """benchmarks/run.py's megatrain row (its timing, memory and optimizer figures), the Trainer's batches these
    images: run_megatrain builds its Trainer by name from megatrain_ray.driver.trainer, which this child process
    points at a subclass that swaps the data in."""
    import megatrain_ray.driver.trainer as trainer_module
    from benchmarks.run import run_megatrain

    batches = batches_of(spec, spec["tokens"])
    base = trainer_module.Trainer

    class ImageTrainer(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.data = self.saver.data = batches

    trainer_module.Trainer = ImageTrainer
    try:
        row = run_megatrain({**spec, "batch": batches.rows})
    finally:
        trainer_module.Trainer = base
    row.update(tokens_per_step=spec["tokens"], image_tokens_per_step=batches.rows * batches.images * batches.image_tokens)
    return row


def timed_vision_steps(spec: dict, tokens: int, train_step) -> dict:
    """Warmup + measured steps of a baseline's `train_step(inputs) -> loss` on the same batches as megatrain's
    (moved to the device before the clock starts, as benchmarks/run.py's baselines). params and tflops as
    megatrain's rows count them (benchmarks/run.py _common: the language model's matrix products)."""
    import torch

    from benchmarks.run import _common
    from megatrain_ray.config.load import load_config

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    batches = batches_of(spec, tokens)
    image = batches.config.image_token_id
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(spec["warmup"] + spec["steps"]):
        ids, _, pixels, grids = batches.parts(step)
        inputs = {"input_ids": ids.to(device), "labels": ids.masked_fill(ids == image, -100).to(device),
                  "pixel_values": pixels.to(device, torch.bfloat16), "image_grid_thw": grids.to(device),
                  "mm_token_type_ids": (ids == image).to(torch.int32).to(device)}
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(train_step(inputs).item())
        times.append(time.perf_counter() - t0)
    wall = sum(times[spec["warmup"]:])
    row = _common(load_config(spec["config"]), tokens * spec["steps"] / wall)
    row.update({"step_seconds": wall / spec["steps"], "losses": losses, "tokens_per_step": tokens,
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                "image_tokens_per_step": batches.rows * batches.images * batches.image_tokens})
    return row


def freeze_tower(model) -> None:
    """finetune.vision=frozen: the ViT frozen, its patch merger (the projector) and the language model train."""
    for name, p in model.model.visual.named_parameters():
        p.requires_grad_(name.startswith("merger."))


def run_resident_compile(spec: dict) -> list[dict]:
    import torch

    from megatrain_ray.config.load import load_config

    o = load_config(spec["config"]).optimizer
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def build(checkpointing: bool):
        model = random_model(vl_config(spec["layers"], spec["tiny"]), device)
        freeze_tower(model)
        model.config.use_cache = False
        if checkpointing:
            model.gradient_checkpointing_enable()
        for layer in model.model.language_model.layers:
            layer.compile()
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trained, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                                fused=device == "cuda")

        def train_step(inputs):
            loss = model(**inputs).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, o.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return model, train_step

    rows = []
    for tokens in spec["token_counts"]:
        row, checkpointing, model = compiled_resident_run(build, lambda step: timed_vision_steps(spec, tokens, step))
        row.update(compiled=True, checkpointing=checkpointing,
                   precision="bf16 weights, bf16 AdamW states (torch fused AdamW on the GPU)")
        emit(row)
        rows.append(row)
        del model
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def run_deepspeed(spec: dict) -> list[dict]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import transformers

    from megatrain_ray.config.load import load_config

    o = load_config(spec["config"]).optimizer
    ds_config = {
        "train_micro_batch_size_per_gpu": spec["token_counts"][0] // spec["seq_len"], "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True}, "gradient_clipping": o.grad_clip,
        "zero_optimization": {
            "stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps,
                                                  "weight_decay": o.weight_decay}},
        "steps_per_print": 10**9,
    }
    deepspeed.init_distributed(dist_backend="nccl")
    config = vl_config(spec["layers"], spec["tiny"])
    config._attn_implementation = "sdpa"
    started = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    freeze_tower(model)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=ds_config)
    startup = time.perf_counter() - started

    def train_step(inputs):
        loss = engine(**inputs).loss
        engine.backward(loss)
        engine.step()
        return loss

    from megatrain_ray.observe.metrics import proc_status_bytes

    rows = []
    for tokens in spec["token_counts"]:
        row = timed_vision_steps(spec, tokens, train_step)
        row.update(host_gib=proc_status_bytes("VmRSS") / 2**30, startup_seconds=startup,
                   precision="bf16 compute, fp32 master and AdamW states on the CPU (ZeRO-3 offload)")
        emit(row)
        rows.append(row)
    return rows


def emit(row: dict) -> None:
    print(RESULT_TAG + json.dumps({**row, "status": "ok"}), flush=True)


def child(system: str, spec: dict) -> None:
    """One process's systems; every row it finishes is printed as it finishes (a later failure keeps them)."""
    try:
        if system == "build":
            emit(build_model_dir(spec))
        elif system in MEGATRAIN_SYSTEMS:
            emit(run_megatrain_vision({**spec, "overrides": [*spec["overrides"], *MEGATRAIN_SYSTEMS[system]]}))
        else:
            {"resident-compile": run_resident_compile, "deepspeed": run_deepspeed}[system](spec)
    except Exception as exc:  # noqa: BLE001 - a failed point is a result too
        text = f"{type(exc).__name__}: {exc}"
        print(RESULT_TAG + json.dumps({"status": "oom" if "out of memory" in text.lower() else "error",
                                       "error": text[-2000:], "traceback": traceback.format_exc()[-4000:]}),
              flush=True)


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
    parser.add_argument("--systems", default="megatrain,resident-compile,megatrain-streamed,deepspeed")
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
    # Points in the order they run: the baselines' one process each, megatrain's per token count, interleaved so
    # that a cut-short invocation has the first token count's table whole.
    points: list[tuple[str, list[int]]] = []
    for i, tokens in enumerate(token_counts):
        points += [(s, [tokens]) for s in systems if s in MEGATRAIN_SYSTEMS]
        if i == 0:
            points += [(s, token_counts) for s in systems if s in BASELINES]
    rows: list[dict] = []
    path = None
    with tempfile.TemporaryDirectory() as tmp:
        base = {"layers": args.layers, "tiny": args.tiny, "seq_len": args.seq_len, "images": args.images,
                "image_px": args.image_px, "steps": args.steps, "warmup": args.warmup,
                "model_dir": str(Path(tmp) / "model"), "config": str(Path(tmp) / "megatrain.yaml"), "overrides": []}
        write_config(Path(base["config"]), Path(base["model_dir"]), args.seq_len, args.tiny)
        left = lambda: args.budget_s - (time.perf_counter() - started) if args.budget_s else 3600.0  # noqa: E731
        t0 = time.perf_counter()
        built = run_rows([sys.executable, __file__, "--child", "build", json.dumps(base)], left())
        model = {**built[0], "build_seconds": time.perf_counter() - t0}
        print(f"model: {model}", flush=True)
        if built[0]["status"] != "ok":
            points = []
        for system, counts in points:
            run_dir = Path(tmp) / f"run-{system}-{counts[0]}"
            spec = {**base, "tokens": counts[0], "token_counts": counts, "run_dir": str(run_dir)}
            t0 = time.perf_counter()
            found = run_rows([sys.executable, __file__, "--child", system, json.dumps(spec)], left()) \
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
