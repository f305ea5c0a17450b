"""What every benchmark script shares: the commit measured and the results file."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def recorded_config(path: str) -> Path:
    """A config file named in a result file: results written before the shape configs moved into
    configs/shapes/ name them as configs/NAME.yaml."""
    recorded = ROOT / path
    moved = ROOT / "configs" / "shapes" / Path(path).name
    return recorded if recorded.is_file() or not moved.is_file() else moved


def git_commit() -> str:
    """The commit measured: MEGATRAIN_COMMIT when set (the GPU machine gets a copy of the tree without
    .git), else git's HEAD, marked -dirty when tracked files differ from it."""
    if os.environ.get("MEGATRAIN_COMMIT"):
        return os.environ["MEGATRAIN_COMMIT"]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=False).stdout.strip()
        return commit + ("-dirty" if dirty else "") if len(commit) == 40 else "unknown"
    except OSError:
        return "unknown"


def provenance(device: str) -> dict[str, Any]:
    return {"device": device, "host": socket.gethostname(), "cpu_count": os.cpu_count(), "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version()}


VARIANTS = {"megatrain-noclip": ("megatrain", ["optimizer.grad_clip=0"]),
            "megatrain-eager": ("megatrain", ["engine.compile=false"]),
            "megatrain-noclip-eager": ("megatrain", ["optimizer.grad_clip=0", "engine.compile=false"]),
            "megatrain-compile": ("megatrain", ["engine.compile=true"]),
            "megatrain-noclip-compile": ("megatrain", ["optimizer.grad_clip=0", "engine.compile=true"]),
            "megatrain-gather": ("megatrain", ["parallel.gather_weights=true"]),
            "megatrain-noclip-gather": ("megatrain", ["optimizer.grad_clip=0", "parallel.gather_weights=true"]),
            "megatrain-streamed": ("megatrain", ["engine.gpu_resident=none"]),
            "megatrain-streamed-lean": ("megatrain", ["engine.gpu_resident=none", "optimizer.state=lean"]),
            "megatrain-lora": ("megatrain", ["finetune.method=lora", "precision.stream_dtype=auto"]),
            "megatrain-lora-resident": ("megatrain", ["finetune.method=lora", "precision.stream_dtype=auto",
                                                      "engine.gpu_resident=auto"])}
"""benchmarks/run.py's variants: a system run with extra config overrides (the row keeps the variant's name)."""
RESIDENT_SYSTEMS = ("resident", "resident-compile", "resident-compile-ckpt")
"""The GPU-resident baselines of benchmarks/run.py (and benchmarks/vision_bench.py's resident-compile-ckpt: always with
activation checkpointing); ratios are over the fastest of them."""
LORA_RESIDENT_SYSTEMS = ("peft-resident", "peft-resident-compile")
"""The GPU-resident LoRA baselines (benchmarks/lora.py); a LoRA row's ratios are over the faster of them."""
STREAMED_SYSTEM = "megatrain-streamed"
"""The product with every stage streamed (engine.gpu_resident=none): a megatrain row's vs_streamed is over it."""
ONE_GPU_AS = {"megatrain-gather": "megatrain", "megatrain-noclip-gather": "megatrain-noclip"}
"""Variants that differ from another only with several GPUs: on one GPU they are that one, which the
harness runs instead (when it runs that one too), and their vs_one_gpu is over its row."""


def seq_len_overrides(base: Any, seq_len: int) -> list[str]:
    """Config overrides for a sequence length (benchmarks/run.py --seq-lens), RoPE's table grown to it:
    `base` is the config the length replaces."""
    return [f"data.seq_len={seq_len}",
            f"model.max_position_embeddings={max(seq_len, base.model.max_position_embeddings)}"]


def point_overrides(batch: int, gpus: int, layers: int) -> list[str]:
    """Config overrides of one benchmarks/run.py point: `batch` rows per GPU on `gpus` GPUs, `layers` deep."""
    return [f"data.batch_size={batch * gpus}", f"parallel.gpus={gpus}", f"model.num_layers={layers}"]


def host_memory(trainer: Any, params: int) -> dict[str, Any]:
    """What a run holds in host RAM, per parameter: the total (Trainer.host_memory_bytes), each shared segment kind's
    bytes, and the rest as the private memory of the driver and its actors. The disk tier's moment files
    (host.moments_tier=disk) are no host memory, as host_memory_bytes leaves them out."""
    from megatrain_ray.observe.metrics import shm_bytes

    total = trainer.host_memory_bytes()
    by_kind: dict[str, int] = {}
    for spec in trainer.specs:
        if not spec.on_disk:
            by_kind[spec.kind] = by_kind.get(spec.kind, 0) + shm_bytes([spec.path])
    return {"host_bytes_per_param": total / params,
            "host_breakdown_bytes_per_param": {**{k: v / params for k, v in by_kind.items()},
                                               "private_rss": (total - sum(by_kind.values())) / params}}


def write_result(name: str, result: dict[str, Any], out: str | Path = RESULTS, path: Path | None = None,
                 quiet: bool = False) -> Path:
    """benchmarks/results/<name>-<device>-<time>.json, written atomically; `path` rewrites a file an
    earlier call returned (a long run saves its rows as it goes)."""
    if path is None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        slug = result.get("device", "unknown").replace("NVIDIA ", "").replace(" ", "-").lower()
        path = out / f"{name}-{slug}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)
    if not quiet:
        print(f"wrote {path}")
    return path


def compiled_resident_run(build: Callable[[bool], tuple[Any, Callable]], timed: Callable[[Callable], dict]) \
        -> tuple[dict, bool, Any]:
    """The compiled GPU-resident baselines' rule: time `build(checkpointing)`'s train step without activation
    checkpointing, and with it only when that runs out of GPU memory. `build` returns (model, train_step).
    Returns (the timed row, whether checkpointing was on, the model)."""
    import torch

    for checkpointing in (False, True):
        out_of_memory = False
        try:
            model, train_step = build(checkpointing)
            return timed(train_step), checkpointing, model
        except torch.OutOfMemoryError:
            if checkpointing:
                raise
            out_of_memory = True
        if out_of_memory:  # outside the except block: its traceback no longer holds the first model's frames
            model = train_step = None  # noqa: F841 - the first attempt's references go
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    raise AssertionError("unreachable: the checkpointing attempt returns or raises")


def zero3_offload_config(optimizer: Any, micro_batch: int) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 with parameters and optimizer offloaded to pinned host memory, bf16, the run's AdamW and
    clipping: the offload baseline every benchmark compares with."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True}, "gradient_clipping": optimizer.grad_clip,
        "zero_optimization": {
            "stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": optimizer.lr, "betas": [optimizer.beta1, optimizer.beta2],
                                                  "eps": optimizer.eps, "weight_decay": optimizer.weight_decay}},
        "steps_per_print": 10**9,
    }


def deepspeed_train_step(engine: Any) -> Callable:
    """train_step(ids) -> loss of a DeepSpeed engine around a Hugging Face causal LM (labels = inputs)."""
    def train_step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss

    return train_step
