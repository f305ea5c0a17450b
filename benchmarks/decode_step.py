"""One decode step of the rollout engine on the GPU (issue 49): the Qwen2.5-32B shape (random-init bf16 weights, every
layer distinct and GPU-resident, LoRA r 16 on every linear projection), 2 rows, the KV cache at several lengths, the
step as one CUDA graph (engine/rollout/graphs.DecodeGraph) through the product's own cached decoder layer
(model/decode.py), timed with CUDA events over replays.

Variants of the step: the attention over the cache before issue 49's change (SDPA with the query heads folded into
the query length and a mask: model/attention.folded_masked_attention) or now (model/decode_attention.py, split along
the keys); the LoRA adapters as training computes them (LayerSpec.lora_inplace off) or in place (on, the rollout's
default now); no adapters (the base alone: what the weights cost); and, as a floor for the attention, SDPA without a
mask (every row at full length: not the rollout's case, only a reference). Beside them the attention alone (64
layers' caches), the kernels one eager step launches, and the bytes a step must read against the device-to-device
copy rate measured here.

    python benchmarks/decode_step.py [--layers 64] [--lengths 1024,4096,12800] [--out DIR]

Writes benchmarks/results/decode-step-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from common import RESULTS, ROOT, provenance, write_result  # noqa: E402

import megatrain_ray.model.decode as decode_module  # noqa: E402
from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.engine.rollout.graphs import DecodeGraph  # noqa: E402
from megatrain_ray.engine.rope_cache import RopeCache  # noqa: E402
from megatrain_ray.model.attention import cached_attention, folded_masked_attention  # noqa: E402
from megatrain_ray.model.decode import KVCache, cache_mask, cached_decoder_layer, positions_of  # noqa: E402
from megatrain_ray.model.head import HeadSpec, head_logits  # noqa: E402
from megatrain_ray.model.layer_spec import LayerSpec  # noqa: E402
from megatrain_ray.model.layout import build_layout  # noqa: E402
from megatrain_ray.model.lora import layer_adapter_shapes, lora_a, lora_b  # noqa: E402
from megatrain_ray.model.templates import bind, embed  # noqa: E402

DTYPE = torch.bfloat16


def unmasked_sdpa(q, k, v, allowed, spec):
    """The attention floor: SDPA over the whole cache without a mask (flash, GQA in the kernel)."""
    return F.scaled_dot_product_attention(q, k, v, scale=spec.scale or spec.head_dim ** -0.5, enable_gqa=True)


ATTENTION = {"folded_sdpa_masked": folded_masked_attention, "split_keys": cached_attention,
             "sdpa_unmasked_floor": unmasked_sdpa}
VARIANTS = {  # name: (attention, adapters, in place)
    "before (folded SDPA, LoRA as in training)": ("folded_sdpa_masked", True, False),
    "split keys, LoRA as in training": ("split_keys", True, False),
    "split keys, LoRA in place (product)": ("split_keys", True, True),
    "split keys, no LoRA (base alone)": ("split_keys", False, True),
    "unmasked SDPA floor, LoRA in place": ("sdpa_unmasked_floor", True, True),
}


def random_stage(stage, device):
    buffer = torch.empty(stage.numel, dtype=DTYPE, device=device).normal_(0, 0.02)
    return bind(buffer, stage)


def timed(fn, iters: int) -> float:
    """ms per call of fn, by CUDA events over `iters` calls after two (on a CPU, --device cpu: a smoke run, by the
    clock)."""
    fn(), fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def copy_rate(device) -> float:
    """Device-to-device copy, bytes read plus written per second: the HBM's rate, which a step's reads can reach at
    most."""
    a = torch.empty(2 * 2**30 if device.type == "cuda" else 2**20, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms, a_bytes = timed(lambda: b.copy_(a), 10), a.numel()
    del a, b
    return 2 * a_bytes / (ms / 1e3)


def kernel_count(fn) -> dict:
    """CUDA kernels one eager call launches, and the five longest by name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in events:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time_total
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:6]
    return {"kernels": len(events), "top_us": {k[:90]: round(v, 1) for k, v in top}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/shapes/qwen2.5-32b.yaml")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's)")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lengths", default="1024,4096,12800")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--name", default="decode-step")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of a small --config (no graphs)")
    args = parser.parse_args()
    t_main = time.perf_counter()
    device = torch.device(args.device)
    cfg = load_config(ROOT / args.config, ["finetune.method=lora", f"finetune.lora.r={args.rank}",
                                           f"finetune.lora.lora_alpha={2 * args.rank}",
                                           "finetune.lora.target_modules=all-linear"])
    model, lora = cfg.model, cfg.finetune.lora
    layout = build_layout(model)
    n_layers = args.layers or model.num_layers
    spec = replace(LayerSpec.from_config(model, 0), lora_scaling=lora.lora_alpha / lora.r)
    torch.manual_seed(0)
    layers = [random_stage(stage, device) for stage in layout.layers[:n_layers]]
    adapters = []
    for i in range(n_layers):
        a = {}
        for module, (a_shape, b_shape) in layer_adapter_shapes(model, lora, i).items():
            a[lora_a(module)] = torch.randn(a_shape, device=device) * 0.01
            a[lora_b(module)] = torch.randn(b_shape, device=device) * 0.01
        adapters.append(a)
    embed_w = random_stage(layout.embed, device)["embed_tokens.weight"]
    head_w = random_stage(layout.head, device)
    lm_w = head_w.get("lm_head.weight", embed_w)
    head_spec = HeadSpec.from_config(model)
    weight_bytes = sum(s.numel for s in layout.layers[:n_layers]) * 2 + lm_w.numel() * 2
    adapter_bytes = sum(t.numel() * 4 for a in adapters for t in a.values())
    rate = copy_rate(device)
    result = {**provenance(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"), "what": "one rollout decode step as a CUDA graph "
              "(benchmarks/decode_step.py)", "config": args.config, "layers": n_layers, "decode_rows": args.rows,
              "lora_rank": lora.r, "torch": torch.__version__, "weight_gb": weight_bytes / 1e9,
              "adapter_gb": adapter_bytes / 1e9, "copy_tb_s": rate / 1e12, "lengths": {}}
    print({k: v for k, v in result.items() if k != "lengths"}, flush=True)
    written = []
    token = torch.randint(0, model.vocab_size, (args.rows,), device=device)
    for length in [int(x) for x in args.lengths.split(",")]:
        torch.cuda.empty_cache() if device.type == "cuda" else None
        caches = [KVCache.empty(args.rows, spec, length, DTYPE, device) for _ in range(n_layers)]
        for c in caches:  # keys and values of every slot (the timing does not depend on them)
            c.keys.normal_(), c.values.normal_()
        valid = torch.ones((args.rows, length), dtype=torch.bool, device=device)
        valid[1:, :7] = False  # a shorter prompt's left padding
        positions = positions_of(valid)
        rope_cache = RopeCache(model, (spec,), device, DTYPE)
        cache_bytes = sum(c.keys.numel() * 2 * 2 for c in caches)
        bound_ms = (weight_bytes + adapter_bytes + cache_bytes) / rate * 1e3  # HBM's reads and writes share the rate
        row = {"kv_cache_gb": cache_bytes / 1e9, "bytes_per_step_gb": (weight_bytes + adapter_bytes + cache_bytes) / 1e9,
               "bound_ms_at_copy_rate": bound_ms, "step_ms": {}, "attention_only_ms": {}}

        def step_fn(attention: str, with_adapters: bool, inplace: bool):
            layer_spec = replace(spec, lora_inplace=inplace)
            ws = [{**w, **a} if with_adapters else w for w, a in zip(layers, adapters)]
            impl = ATTENTION[attention]

            def decode(tok, index):
                decode_module.cached_attention = impl
                x = embed(tok[:, None], embed_w)
                here = positions.index_select(1, index.view(1)) if isinstance(index, torch.Tensor) \
                    else positions[:, index:index + 1]
                rope = rope_cache.tables(length, here)[False]
                mask = cache_mask(valid, index, 1, 0)
                for i in range(n_layers):
                    x = cached_decoder_layer(x, ws[i], rope, layer_spec, caches[i], index, mask)
                return head_logits(x[:, -1], head_w["model.norm.weight"], lm_w, head_spec).float()
            return decode

        with torch.no_grad():
            for name, (attention, with_adapters, inplace) in VARIANTS.items():
                decode = step_fn(attention, with_adapters, inplace)
                try:
                    graph = DecodeGraph(decode, args.rows, length - 8, device) if device.type == "cuda" else \
                        (lambda tok, i, d=decode: d(tok, torch.tensor(i)))
                    ms = timed(lambda: graph(token, length - 8), args.iters)
                    del graph
                except Exception as exc:  # noqa: BLE001 (a variant that cannot run is recorded, the rest go on)
                    ms = f"{type(exc).__name__}: {str(exc)[:200]}"
                row["step_ms"][name] = ms
                print(length, name, ms, flush=True)
                torch.cuda.empty_cache() if device.type == "cuda" else None
            if length == max(int(x) for x in args.lengths.split(",")) and device.type == "cuda":
                index = torch.tensor(length - 8, device=device)
                row["eager_kernels"] = {name: kernel_count(lambda d=step_fn(*VARIANTS[name]): d(token, index))
                                        for name in ("before (folded SDPA, LoRA as in training)",
                                                     "split keys, LoRA in place (product)")}
            q = torch.randn(args.rows, spec.num_heads, 1, spec.head_dim, dtype=DTYPE, device=device)
            mask = cache_mask(valid, torch.tensor(length - 8, device=device), 1, 0)
            for name, impl in ATTENTION.items():
                def attend(impl=impl):
                    for c in caches:
                        impl(q, c.keys, c.values, mask, spec)
                try:
                    if device.type == "cuda":
                        g = torch.cuda.CUDAGraph()
                        attend(), torch.cuda.synchronize()
                        with torch.cuda.graph(g):
                            attend()
                        row["attention_only_ms"][name] = timed(g.replay, args.iters)
                        del g
                        if length == max(int(x) for x in args.lengths.split(",")):
                            row.setdefault("attention_kernels", {})[name] = kernel_count(
                                lambda impl=impl: impl(q, caches[0].keys, caches[0].values, mask, spec))
                    else:
                        row["attention_only_ms"][name] = timed(attend, args.iters)
                except Exception as exc:  # noqa: BLE001
                    row["attention_only_ms"][name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        result["lengths"][str(length)] = row
        print(length, {k: v for k, v in row.items() if k != "eager_kernels"}, flush=True)
        del caches
        torch.cuda.empty_cache() if device.type == "cuda" else None
        result["elapsed_s"] = time.perf_counter() - t_main
        written[:] = [write_result(args.name, result, args.out, written[0] if written else None)]


if __name__ == "__main__":
    main()
