"""How long the device takes to dequantize one packed decoder layer (engine/packed_stream.py runs it on the H2D
stream, before the layer computes, once in the forward and once in the backward's recompute), eagerly and with its
block decoding through torch.compile (as engine.compile runs it). The speed model does not count it yet: this
measures it for a shape, to compare with the layer's H2D time.

    python benchmarks/nf4_dequant.py --config configs/shapes/gpt-oss-120b-qlora.yaml            # on the GPU box
    python benchmarks/nf4_dequant.py --config configs/shapes/gpt-oss-120b-qlora.yaml --set model.num_experts=8 \\
        --device cpu                                                                             # a smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import provenance, write_result  # noqa: E402
from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.dtypes import TORCH_DTYPES  # noqa: E402
from megatrain_ray.model.layout import build_layout  # noqa: E402
from megatrain_ray.quant.nf4_stage import decode_blocks, dequantize_stage, pack_stage_pieces  # noqa: E402
from megatrain_ray.store.initial_values import init_slot_pieces  # noqa: E402
from megatrain_ray.store.nf4_base import stage_format  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    cfg = load_config(args.config, overrides=args.set)
    layout = build_layout(cfg.model)
    stage = max(layout.layers, key=lambda s: s.numel)
    fmt = stage_format(stage, cfg.precision.compute_dtype)
    torch.set_num_threads(1)  # as a host shard's filling thread (store/nf4_base.fill_threads)
    t0 = time.perf_counter()
    packed = pack_stage_pieces(fmt, lambda slot: init_slot_pieces(stage, slot, 0, 0.02, TORCH_DTYPES["bfloat16"]))
    pack_seconds = time.perf_counter() - t0
    device = torch.device(args.device)
    staged = packed.to(device)
    out = torch.empty(stage.numel, dtype=fmt.compute_dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    passes = 2 * len(layout.layers)
    rows, results = [], {}
    # Eager, and the block decoding through torch.compile as the engine runs it with engine.compile
    for mode, decode in (("eager", None), ("compiled", torch.compile(decode_blocks, dynamic=True))):
        dequantize_stage(staged, fmt, out=out, decode=decode)  # warm-up: the cached index tensors, the allocator
        sync()
        results[mode] = out.clone()
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            dequantize_stage(staged, fmt, out=out, decode=decode)
        sync()
        seconds = (time.perf_counter() - t0) / args.repeats
        print(f"{mode}: layer {stage.index}: {stage.numel / 1e9:.2f} G values, {fmt.nbytes / 1e9:.2f} GB packed "
              f"(packed on the CPU in {pack_seconds:.1f} s); dequantize on {device}: {seconds * 1e3:.1f} ms "
              f"({stage.numel / seconds / 1e9:.1f} G values/s); x {passes} passes a step: {seconds * passes:.2f} s")
        rows.append({"mode": mode, "config": args.config, "overrides": args.set, "layer": stage.index,
                     "values": stage.numel, "packed_bytes": fmt.nbytes, "pack_seconds": pack_seconds,
                     "dequantize_seconds": seconds, "gvalues_per_s": stage.numel / seconds / 1e9,
                     "passes_per_step": passes, "dequantize_seconds_per_step": seconds * passes})
    rows[-1]["bitwise_equal_to_eager"] = bool(torch.equal(results["compiled"], results["eager"]))
    print("compiled equals eager bit for bit:", rows[-1]["bitwise_equal_to_eager"])
    kwargs = {"out": args.out} if args.out else {}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    write_result(f"nf4-dequant-{Path(args.config).stem}", {**provenance(name), "rows": rows}, **kwargs)


if __name__ == "__main__":
    main()
