"""Load time and peak extra RAM of loading a sharded Hugging Face checkpoint into the host store.

    python benchmarks/load_checkpoint.py --dir /data/llama8b-random [--layers 32] [--shards 2]

Writes (once) a Llama 3.1 8B-shaped checkpoint with random bf16 weights, 5 GB shards plus index, one
tensor at a time, then starts a Trainer (actors in-process) with model.path pointing at it and reports
the time to a ready host store and the peak private memory (RssAnon, sampled every 50 ms) on top of
the shared segments. The host store needs 12 bytes/parameter with the fp32 master streamed directly
(about 96 GB for 8B): use --layers to scale the depth down on smaller machines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import provenance, write_result
from megatrain_ray.config.load import load_config
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.model.hf_io import export_hf
from megatrain_ray.model.layout import build_layout
from megatrain_ray.observe.metrics import rss_anon_bytes

LLAMA_8B = {"family": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}


# A shape small enough for a smoke test of this script on any machine (--smoke).
SMOKE = {**LLAMA_8B, "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
         "num_key_value_heads": 2}


class RandomTensors(Mapping[str, torch.Tensor]):
    """Random-looking bf16 tensors by name, made when asked for: export_hf takes one at a time.

    Each tensor is a window of one 64M-element random pool starting at a name-dependent offset: the
    values are irregular (no compression or zero-page shortcut helps the loader) but cost a memcpy, not
    a random draw per element, so writing 16 GB takes as long as the disk needs.
    """

    POOL = 1 << 26

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = shapes
        self.pool = (torch.randn(self.POOL, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
        self.started = time.perf_counter()
        self.written = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        numel = math.prod(shape)
        offset = zlib.crc32(name.encode()) % self.POOL
        reps = (offset + numel + self.POOL - 1) // self.POOL
        flat = self.pool.repeat(reps)[offset:offset + numel] if reps > 1 else self.pool[offset:offset + numel].clone()
        if (self.written + numel * 2) // 10**9 > self.written // 10**9:
            print(f"  {name}: {(self.written + numel * 2) / 1e9:.1f} GB made in "
                  f"{time.perf_counter() - self.started:.0f} s", flush=True)
        self.written += numel * 2
        return flat.view(shape)

    def __contains__(self, name: object) -> bool:  # Mapping's default would make the tensor
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def write_checkpoint(directory: Path, shape: dict, layers: int, shard_bytes: int) -> None:
    model = ModelConfig(**shape, num_layers=layers)
    layout = build_layout(model)
    shapes = {stage.hf_name(slot): slot.shape for stage in layout.stages for slot in stage.slots}
    export_hf(RandomTensors(shapes), model, directory, dtype="bfloat16", shard_bytes=shard_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--shards", type=int, default=1, help="host.num_shards (HostShard actors loading in parallel)")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape (checks the script, measures nothing)")
    parser.add_argument("--out", default="", help="also write the figures as JSON into this results directory")
    args = parser.parse_args()
    if not (args.dir / "config.json").is_file():
        t0 = time.perf_counter()
        write_checkpoint(args.dir, SMOKE if args.smoke else LLAMA_8B, args.layers,
                         10**6 if args.smoke else 5 * 10**9)
        print(f"wrote {args.dir} in {time.perf_counter() - t0:.0f} s")
    from megatrain_ray.driver.trainer import Trainer

    cfg = load_config(raw={
        "model": {"path": str(args.dir)}, "data": {"path": "synthetic", "seq_len": 1024, "batch_size": 1},
        "precision": {"master_dtype": "float32", "compute_dtype": "bfloat16", "stream_dtype": "float32"},
        "host": {"num_shards": args.shards}, "runtime": {"mode": "local"},
        "optimizer": {"workers": 1, "grad_clip": 0.0}, "train": {"steps": 1, "output_dir": f"/tmp/load-bench-{os.getpid()}"}})
    peak = {"bytes": 0}
    done = threading.Event()

    def sample() -> None:  # in-process actors (runtime.mode local): one process holds every loader thread
        while not done.is_set():
            peak["bytes"] = max(peak["bytes"], rss_anon_bytes())
            time.sleep(0.05)

    before = rss_anon_bytes()
    trainer = Trainer(cfg)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    trainer.start()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    size = sum(f.stat().st_size for f in args.dir.glob("*.safetensors"))
    figures = {"layers": args.layers, "checkpoint_gb": size / 1e9, "load_seconds": seconds,
               "load_gbps": size / seconds / 1e9, "peak_private_gib": peak["bytes"] / 2**30,
               "private_before_gib": before / 2**30, "host_store_gib": sum(s.nbytes for s in trainer.specs) / 2**30,
               "host_shards": args.shards,
               "largest_shard_gb": max(f.stat().st_size for f in args.dir.glob("*.safetensors")) / 1e9}
    print(json.dumps(figures))
    trainer.close()
    if args.out:
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        write_result("load-checkpoint", {**provenance(device), **figures}, args.out)


if __name__ == "__main__":
    main()
