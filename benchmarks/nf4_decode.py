"""One MoE decoder layer of an NF4 base at a rollout's decode step, on the device: what a generated token costs
per layer (engine/packed_stream.py).

Rows, each in milliseconds for the config's largest layer, from packed bytes drawn at random on the device (the
kernels' time does not depend on the values; packing a real 120B layer on the CPU takes most of a minute):
- `dequantize`: the whole stage into its compute-dtype buffer, with the block decoding through torch.compile (the
  engine without Triton) and with quant/nf4_triton's kernel (the engine's path on a GPU); the two bit for bit equal.
- `experts`: the layer's routed experts for a decode batch of `--rows` tokens (each routed to top-k distinct
  experts at random): dense (the stage dequantized, by the compiled torch decoding as engine.nf4_kernels=torch
  does and by the Triton kernel, then model/moe.experts on the dense tensors) against in NF4
  (the stage less its experts dequantized, then model/moe.experts on NF4Experts views, which read only the routed
  experts' codes); the largest difference between the two outputs, relative to the dense output's largest value.
Times the layers: the MoE halves of a whole decode step (`decode_step_seconds_*`).

    python benchmarks/nf4_decode.py --config configs/shapes/gpt-oss-120b-qlora.yaml              # on the GPU box
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
from megatrain_ray.engine.packed_stream import stage_experts  # noqa: E402
from megatrain_ray.model.layout import build_layout  # noqa: E402
from megatrain_ray.model.moe import MoeSpec, experts  # noqa: E402
from megatrain_ray.model.templates import bind  # noqa: E402
from megatrain_ray.quant.nf4 import nf4_nbytes  # noqa: E402
from megatrain_ray.quant.nf4_stage import EXPERT_MATRICES, decode_blocks, dequantize_stage  # noqa: E402
from megatrain_ray.quant.nf4_triton import dequantize_blocks_into  # noqa: E402
from megatrain_ray.store.nf4_base import stage_format  # noqa: E402


def random_packed(fmt, device: torch.device, seed: int) -> torch.Tensor:
    """A packed stage of random codes with plausible block maxima, scales and offsets, and small dense values."""
    g = torch.Generator(device=device).manual_seed(seed)
    packed = torch.randint(0, 256, (fmt.nbytes,), dtype=torch.uint8, device=device, generator=g)
    if fmt.double_quant:
        fmt.section(packed, "scales", torch.float32).uniform_(0.005, 0.01, generator=g)
        fmt.section(packed, "offsets", torch.float32).uniform_(0.02, 0.03, generator=g)
    else:
        fmt.section(packed, "absmax", torch.float32).uniform_(0.01, 0.03, generator=g)
    for name in ("kept", "vectors"):
        fmt.section(packed, name, fmt.compute_dtype).normal_(0, 0.02, generator=g)
    return packed


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 8, 1], help="decode batch sizes")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    cfg = load_config(args.config, overrides=args.set)
    layout, device = build_layout(cfg.model), torch.device("cuda")
    stage = max(layout.layers, key=lambda s: s.numel)
    fmt = stage_format(stage, cfg.precision.compute_dtype)
    packed = random_packed(fmt, device, 0)
    dense = torch.empty(stage.numel, dtype=fmt.compute_dtype, device=device)
    layers = len(layout.layers)
    rows = []

    compiled = torch.compile(decode_blocks, dynamic=True)
    reference = None
    for mode, kwargs in (("compiled", {"decode": compiled}), ("triton", {"decode_into": dequantize_blocks_into})):
        seconds = timed(lambda: dequantize_stage(packed, fmt, out=dense, **kwargs), args.repeats)
        row = {"row": "dequantize", "mode": mode, "values": stage.numel, "packed_bytes": fmt.nbytes,
               "ms": seconds * 1e3, "gvalues_per_s": stage.numel / seconds / 1e9}
        if reference is None:
            reference = dense.clone()
        else:
            row["bitwise_equal_to_compiled"] = bool(torch.equal(dense, reference))
        print(row)
        rows.append(row)

    spec = MoeSpec.from_config(cfg.model)
    views = {m.slot.name: stage_experts(packed, fmt, i) for i, m in enumerate(fmt.matrices)
             if m.slot.name in EXPERT_MATRICES}
    for count in args.rows:
        g = torch.Generator(device=device).manual_seed(count)
        h = torch.randn(count, cfg.model.hidden_size, device=device, generator=g).to(fmt.compute_dtype)
        index = torch.rand(count, spec.num_experts, device=device, generator=g).topk(spec.top_k, dim=1).indices
        weights = torch.softmax(torch.randn(count, spec.top_k, device=device, generator=g), dim=1).to(h.dtype)

        def dense_step():
            dequantize_stage(packed, fmt, out=dense, decode_into=dequantize_blocks_into)
            return experts(h, weights, index, bind(dense, stage), spec)

        def dense_torch_step():  # engine.nf4_kernels=torch: the block decoding compiled, every expert
            dequantize_stage(packed, fmt, out=dense, decode=compiled)
            return experts(h, weights, index, bind(dense, stage), spec)

        def nf4_step():
            dequantize_stage(packed, fmt, out=dense, decode_into=dequantize_blocks_into, skip=EXPERT_MATRICES)
            return experts(h, weights, index, {**bind(dense, stage), **views}, spec)

        dense_s, nf4_s = timed(dense_step, args.repeats), timed(nf4_step, args.repeats)
        torch_s = timed(dense_torch_step, args.repeats)
        want, got = dense_step().float(), nf4_step().float()
        routed = int(index.unique().numel())
        expert_bytes = sum(nf4_nbytes(m.slot.numel, fmt.blocksize, fmt.double_quant) for m in fmt.matrices
                           if m.slot.name in EXPERT_MATRICES) * routed / spec.num_experts
        row = {"row": "experts", "rows": count, "top_k": spec.top_k, "experts_routed": routed,
               "dense_torch_ms": torch_s * 1e3, "dense_ms": dense_s * 1e3, "nf4_ms": nf4_s * 1e3,
               "speedup": dense_s / nf4_s, "speedup_vs_torch": torch_s / nf4_s,
               "routed_expert_bytes": expert_bytes, "nf4_gbs_routed": expert_bytes / nf4_s / 1e9,
               "max_abs_diff_over_max": float((got - want).abs().max() / want.abs().max()),
               "decode_step_seconds_torch": torch_s * layers, "decode_step_seconds_dense": dense_s * layers,
               "decode_step_seconds_nf4": nf4_s * layers}
        print(row)
        rows.append(row)
    name = torch.cuda.get_device_name(device)
    write_result(f"nf4-decode-{Path(args.config).stem}",
                 {**provenance(name), "config": args.config, "overrides": args.set, "layer": stage.index,
                  "layers": layers, "rows": rows}, **({"out": args.out} if args.out else {}))


if __name__ == "__main__":
    main()
