"""GPU memory and time of a linear-attention (Gated DeltaNet) decoder layer's recompute and backward (Qwen3.5,
Qwen3-Next: model/linear_attention.py, model/delta_rule.py) against what the plan counts for it
(planning/gpu_memory.linear_layer_backward_bytes), beside a gated full-attention layer of the same model.

    python benchmarks/linear_layer_memory.py [--tokens 8192 32768] [--hidden 2048] [--intermediate 5120]

The layers are Qwen3.5's (dense MLP) at Qwen3-Next-80B's widths by default: 16 key heads of 128 for 32 value heads
of 128, a convolution of 4; 16 query and 2 key/value heads of 256 in the attention layer. Per layer kind and token
count (one row): the peak allocated bytes above the layer's weights, input and output gradient during
templates.decoder_layer_backward, the plan's figure, and the forward and backward times (CUDA events, median of 5);
one JSON file naming the device and the commit. First, the linear layer's output and input gradient on the GPU in
float32 and bfloat16 against the same layer in float64 on the CPU (1 row of 300 tokens, five chunks): the relative
errors of its update of the residual stream and of its input gradient, the first row.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import provenance, write_result  # noqa: E402
from megatrain_ray.config.linear_attention_section import LinearAttentionConfig  # noqa: E402
from megatrain_ray.config.model_section import ModelConfig  # noqa: E402
from megatrain_ray.model.layer_spec import layer_specs  # noqa: E402
from megatrain_ray.model.layout import build_layout  # noqa: E402
from megatrain_ray.model.rope import rope_tables  # noqa: E402
from megatrain_ray.model.templates import bind, decoder_layer, decoder_layer_backward  # noqa: E402
from megatrain_ray.planning.gpu_memory import layer_backward_bytes, linear_layer_backward_bytes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5120)
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    cfg = ModelConfig(family="qwen3_5", vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_layers=2, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                      max_position_embeddings=max(args.tokens), partial_rotary_factor=0.25, qk_norm=True,
                      layer_types=["linear_attention", "full_attention"],
                      linear_attention=LinearAttentionConfig(conv_kernel_dim=4, key_head_dim=128, value_head_dim=128,
                                                             num_key_heads=16, num_value_heads=32))
    layout, specs = build_layout(cfg), layer_specs(cfg)
    gen = torch.Generator(device).manual_seed(0)
    rows = [_check(cfg, layout.layers[0], specs[0])]
    for tokens in args.tokens:
        rope = rope_tables(cfg, tokens, device, dtype)
        for i, kind in enumerate(("linear", "full")):
            stage = layout.layers[i]
            buf = (torch.randn(stage.numel, device=device, generator=gen) * 0.02).to(dtype)
            w = bind(buf, stage)
            if kind == "linear":  # a decay of about exp(-0.3) a token
                w["linear_attn.A_log"].zero_()
                w["linear_attn.dt_bias"].fill_(-1.0)
            x = torch.randn(1, tokens, cfg.hidden_size, device=device, dtype=dtype, generator=gen)
            grad_y = torch.randn_like(x)
            for _ in range(2):  # the second pass is the measured one
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                grad_x, grads = decoder_layer_backward(x, w, rope, specs[i], None, grad_y)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                finite = bool(torch.isfinite(grad_x).all()) and all(bool(torch.isfinite(g).all()) for g in grads.values())
                del grad_x, grads
            m = cfg
            plan = linear_layer_backward_bytes(types.SimpleNamespace(model=m), tokens, tokens, 6 * m.intermediate_size,
                                               2) if kind == "linear" else layer_backward_bytes(
                tokens, tokens, m.hidden_size, 2 * 16 * 256, 2 * 256, 6 * m.intermediate_size, 2)
            row = {"layer": kind, "tokens": tokens, "hidden": m.hidden_size, "intermediate": m.intermediate_size,
                   "backward_peak_bytes": peak, "planned_bytes": plan, "planned_over_measured": plan / peak,
                   "finite": finite, **_times(x, w, rope, specs[i], grad_y)}
            rows.append(row)
            print(f"{kind} layer, {tokens} tokens: backward peak {peak / 2**30:.2f} GiB above its inputs, planned "
                  f"{plan / 2**30:.2f} GiB ({plan / peak:.2f}x); forward {row['forward_seconds'] * 1e3:.1f} ms, "
                  f"backward {row['backward_seconds'] * 1e3:.1f} ms; finite {finite}", flush=True)
            del w, buf, x, grad_y
    kwargs = {"out": args.out} if args.out else {}
    write_result("linear-layer-memory", {**provenance(torch.cuda.get_device_name()), "rows": rows}, **kwargs)


def _check(cfg, stage, spec) -> dict:
    """The linear layer on the GPU (float32, bfloat16) against float64 on the CPU: relative errors of its update of the
    residual stream (output less input) and of its input's gradient (norm of the difference over the norm)."""
    gen = torch.Generator().manual_seed(1)
    buf = torch.randn(stage.numel, generator=gen, dtype=torch.float64) * 0.02
    x = torch.randn(1, 300, cfg.hidden_size, generator=gen, dtype=torch.float64)
    grad_y = torch.randn(x.shape, generator=gen, dtype=torch.float64)

    def run(device, dtype):
        w = bind(buf.to(device, dtype), stage)
        w["linear_attn.A_log"].zero_()
        w["linear_attn.dt_bias"].fill_(-1.0)
        rope, x_in = rope_tables(cfg, 300, device, dtype), x.to(device, dtype)
        with torch.no_grad():  # the layer's update of the residual stream, y - x: what its own math adds
            delta = (decoder_layer(x_in, w, rope, spec).double() - x_in.double()).cpu()
        grad_x, _ = decoder_layer_backward(x_in, w, rope, spec, None, grad_y.to(device, dtype))
        return delta, grad_x.double().cpu()

    ref = run(torch.device("cpu"), torch.float64)
    out = {"check": "linear layer against float64 on the CPU, 300 tokens"}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        y, g = run(torch.device("cuda"), dtype)
        out[f"{name}_output_error"] = ((y - ref[0]).norm() / ref[0].norm()).item()
        out[f"{name}_input_grad_error"] = ((g - ref[1]).norm() / ref[1].norm()).item()
    print(out, flush=True)
    return out


def _times(x, w, rope, spec, grad_y) -> dict[str, float]:
    """Median forward and recompute-and-backward seconds of 5 repeats (CUDA events)."""
    forward, backward = [], []
    for _ in range(5):
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        marks[0].record()
        with torch.no_grad():
            decoder_layer(x, w, rope, spec)
        marks[1].record()
        decoder_layer_backward(x, w, rope, spec, None, grad_y)
        marks[2].record()
        torch.cuda.synchronize()
        forward.append(marks[0].elapsed_time(marks[1]) / 1e3)
        backward.append(marks[1].elapsed_time(marks[2]) / 1e3)
    return {"forward_seconds": sorted(forward)[2], "backward_seconds": sorted(backward)[2]}


if __name__ == "__main__":
    main()
