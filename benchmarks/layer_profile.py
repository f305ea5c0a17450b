"""Where one decoder layer's GPU time goes: forward, and recompute + backward, as the layer stream runs them.

    python benchmarks/layer_profile.py --config configs/shapes/qwen3-30b-a3b.yaml [--tokens 65536] [--seq-len 8192]
        [--layer 0] [--repeats 5] [--top 25] [--modes eager compiled] [--out benchmarks/results]

One stage's weights are drawn at random in the compute dtype in one flat buffer, bound to the native template
(model/templates.py, model/moe.py for a MoE layer) and run as engine/step.py runs a layer: decoder_layer under
no_grad, then decoder_layer_backward (recompute, autograd) with the router's record where the layer has one.
Times are CUDA-event medians; torch.profiler then records one repeat and the JSON keeps its heaviest CUDA
kernels (self CUDA time) and the host-side time of the call, which shows synchronisations and launch overhead.
`--modes`: one row per mode, side by side: the eager template, and the template through torch.compile as the
engine runs it (engine.compile; its first calls compile, outside the timing), each with its peak GPU memory.
Writes one JSON file naming the device and the commit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, provenance, write_result  # noqa: E402


def main() -> int:
    import torch

    from megatrain_ray.config.load import load_config
    from megatrain_ray.dtypes import TORCH_DTYPES
    from megatrain_ray.engine.compiled import CompiledDecoderLayer
    from megatrain_ray.model.layer_spec import LayerSpec
    from megatrain_ray.model.layout import build_layout
    from megatrain_ray.model.moe import RouterRecord
    from megatrain_ray.model.rope import rope_tables
    from megatrain_ray.model.templates import bind, decoder_layer, decoder_layer_backward

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager"])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    cfg = load_config(args.config, [*args.set, f"data.seq_len={args.seq_len}",
                                      f"model.max_position_embeddings={args.seq_len}"])
    device = torch.device("cuda")
    dtype = TORCH_DTYPES[cfg.precision.compute_dtype]
    stage = build_layout(cfg.model).layers[args.layer]
    spec = LayerSpec.from_config(cfg.model, args.layer)
    gen = torch.Generator(device=device).manual_seed(0)
    buffer = torch.randn(stage.numel, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(dtype)
    w = bind(buffer, stage)
    for slot in stage.slots:
        if slot.init == "ones":
            w[slot.name].fill_(1.0)
    batch = args.tokens // args.seq_len
    x = torch.randn(batch, args.seq_len, cfg.model.hidden_size, generator=gen, device=device, dtype=dtype)
    grad_y = torch.randn_like(x) * 1e-3
    rope = rope_tables(cfg.model, args.seq_len, device, dtype, local=spec.local_rope)
    moe = spec.moe is not None

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(args.repeats):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        return sorted(times)[len(times) // 2]

    rows = []
    for mode in args.modes:
        layer = CompiledDecoderLayer(fall_back=False) if mode == "compiled" else decoder_layer

        def forward() -> None:
            with torch.no_grad():
                layer(x, w, rope, spec, None, 0, RouterRecord() if moe else None)

        def backward() -> None:
            decoder_layer_backward(x, w, rope, spec, None, grad_y, layer=layer,
                                   router=RouterRecord() if moe else None)

        forward(), backward()  # compiles (once per graph), outside the timing
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        row = {"config": args.config, "layer": args.layer, "moe": moe,
               "token_mixer": "linear attention" if spec.linear is not None else "attention", "mode": mode,
               "tokens": args.tokens,
               "seq_len": args.seq_len, "dtype": str(dtype).removeprefix("torch."), "params": stage.numel,
               "forward_seconds": timed(forward), "recompute_backward_seconds": timed(backward)}
        row["peak_above_inputs_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            forward()
            backward()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        events.sort(key=lambda e: e.self_device_time_total, reverse=True)
        total = sum(e.self_device_time_total for e in events)
        row["profiled_cuda_seconds"] = total / 1e6
        row["kernels"] = [{"name": e.key[:120], "calls": e.count, "cuda_seconds": e.self_device_time_total / 1e6,
                           "share": e.self_device_time_total / total} for e in events[:args.top]]
        syncs = [e for e in prof.key_averages() if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                             "cudaMemcpyAsync", "aten::item",
                                                             "aten::_local_scalar_dense")]
        row["host_calls"] = {e.key: {"calls": e.count, "cpu_seconds": e.cpu_time_total / 1e6} for e in syncs}
        print(f"{mode}: forward {row['forward_seconds'] * 1e3:.1f} ms, recompute+backward "
              f"{row['recompute_backward_seconds'] * 1e3:.1f} ms ({args.tokens} tokens), "
              f"peak {row['peak_above_inputs_gib']:.2f} GiB above the inputs")
        for k in row["kernels"]:
            print(f"  {k['cuda_seconds'] * 1e3:8.2f} ms {k['share']:6.1%} x{k['calls']:<4} {k['name']}")
        print("  host:", row["host_calls"])
        rows.append(row)
    name = f"layer-profile-{Path(args.config).stem}-layer{args.layer}"
    write_result(name, {**provenance(torch.cuda.get_device_name()), "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
