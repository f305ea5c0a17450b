"""A GRPO step on the GPU machine in MegaTrain's published configuration (issue 49): the Qwen2.5-7B shape with
random-init weights, 8 prompts x 2 completions, prompts of 512 tokens, completions sampled to 1024 tokens (a random
model rarely stops; pass --stop to allow it), full fine-tuning (fp32 master and AdamW moments in host RAM, bf16
compute), through the Trainer's actors in process (runtime local). Each step is what driver/grpo.py does: the
rollout (GPUWorker.generate: the resident copy's refresh, prefill, decode), the batch (policy_batch; the rewards
drawn at random, group-normalised as TRL does: the scoring of a verifiable task costs milliseconds), the training
step, and the wait for the optimizer's updates that the next rollout reads. Then, in the same call, transformers'
`generate` (static cache, sampling, the same shape, random-init bf16 on the GPU) on the same number of sequences and
tokens: its generated tok/s against the rollout's.

    python benchmarks/grpo_step.py [--steps 3] [--config configs/shapes/qwen2.5-7b.yaml] [--set KEY=VALUE ...]

With --set finetune.method=lora ... the step is a LoRA one (the adapters train on the GPU; with every base layer
GPU-resident the decode step is one CUDA graph too). Each step records the GPU's peak allocation in the rollout and
in the training step beside `megatrain plan`'s figures for them (the training peak; for the rollout the plan's fixed
buffers plus its KV cache and prefill working set), and the host memory beside the plan's. --probe-lora
adapters,merged times a short decode under each engine.rollout_lora in the same call before the steps;
--lora-b-std draws B away from its zeros (where a merged adapter is exactly the base), so the step's
rollout/trainer log-prob gap includes the merge's rounding.

Writes benchmarks/results/grpo-step-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from common import RESULTS, ROOT, provenance, write_result  # noqa: E402

from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.driver.grpo import policy_batch, warn_vanished_weights  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from megatrain_ray.engine.rollout.interface import SamplingSettings  # noqa: E402
import megatrain_ray.engine.rollout.passes as passes  # noqa: E402
from megatrain_ray.model.policy_gradient import group_advantages  # noqa: E402
from megatrain_ray.planning.rollout import rollout_bytes  # noqa: E402

ACTIVATION_TERMS = ("kept layer inputs", "layer backward working set", "loss head working set", "kept layer graphs")
"""The plan's GPU terms that exist only during a training step (planning/gpu_memory.gpu_bytes)."""


def plan_figures(trainer, cfg) -> dict:
    """What `megatrain plan` predicts for this run, in GiB: the training peak, the rollout's (the fixed buffers, which
    stay allocated, plus the KV cache and the prefill's working set), the host memory."""
    plan, g = trainer.plan, 2**30
    fixed = sum(v for k, v in plan.gpu.items() if k not in ACTIVATION_TERMS)
    sizes = rollout_bytes(cfg, trainer.run_spec)
    kv, prefill = sizes["KV cache"], sizes["prefill working set"]
    return {"plan_gpu_peak_gib_train": plan.gpu_peak / g, "plan_gpu_peak_gib_rollout": (fixed + kv + prefill) / g,
            "plan_kv_cache_gib": kv / g, "plan_prefill_gib": prefill / g, "plan_host_gib": plan.host_total / g,
            "plan_gpu_terms_gib": {k: v / g for k, v in plan.gpu.items()}}


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def megatrain_steps(args, save=lambda setup, records, phase: None) -> tuple[dict, list[dict]]:
    """The GRPO steps; `save(setup, records, phase)` is called after the build, the probe and each rollout and
    training step, so a run cut off by the command's limit still leaves what it measured."""
    rows, width = args.prompts * args.generations, args.prompt_len + args.completion_len
    cfg = load_config(ROOT / args.config, [f"data.batch_size={rows}", f"data.seq_len={width}", "runtime.mode=local",
                                           f"train.output_dir={tempfile.mkdtemp(prefix='grpo-step-bench-')}",
                                           "checkpoint.at_end=false",
                                           f"finetune.grpo.num_generations={args.generations}",
                                           f"finetune.grpo.max_completion_length={args.completion_len}",
                                           *args.overrides])
    g = torch.Generator().manual_seed(0)
    vocab = cfg.model.vocab_size
    records = []
    t_start = time.perf_counter()
    with Trainer(cfg) as trainer:
        started = time.perf_counter() - t_start
        setup = {**plan_figures(trainer, cfg), "method": cfg.finetune.method, "config": args.config,
                 "completions": rows, "prompt_len": args.prompt_len, "completion_len": args.completion_len,
                 "params": trainer.layout.num_params, "startup_s": started, "probe": None}
        save(setup, records, "built")
        if args.lora_b_std:  # B away from its zeros (where a merged adapter is exactly the base): a trained B's scale
            b_gen = torch.Generator().manual_seed(1)
            trainer.set_adapters({k: torch.randn(v.shape, generator=b_gen, dtype=v.dtype) * args.lora_b_std
                                  if ".lora_B." in k else v for k, v in trainer.adapters().items()})
            setup["lora_b_std"] = args.lora_b_std
        if args.probe:  # a short rollout first: the decode rate (and whether it is a CUDA graph) shows early
            setup["probe"] = decode_probe(trainer, args, vocab, g)
            print({"probe": setup["probe"]}, flush=True)
            save(setup, records, "probed")
        if args.probe_lora:  # the same probe under each engine.rollout_lora, side by side in this call
            setup["probe_rollout_lora"] = {}
            for mode in args.probe_lora.split(","):
                with rollout_lora(trainer, mode):
                    setup["probe_rollout_lora"][mode] = decode_probe(trainer, args, vocab, g)
                print({"probe": mode, **setup["probe_rollout_lora"][mode]}, flush=True)
                save(setup, records, f"probed rollout_lora={mode}")
        for step in range(args.steps):
            prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
            prompt_ids = [p for p in prompts for _ in range(args.generations)]
            sampling = SamplingSettings(max_new_tokens=args.completion_len, temperature=1.0, seed=step,
                                        stop_token_ids=(0,) if args.stop else ())
            reset_peak()  # in process (runtime local): this process is the GPU worker's
            t0 = time.perf_counter()
            rollout = trainer.gpu.generate(prompt_ids, sampling).result()
            t1 = time.perf_counter()
            rollout_peak = peak_gib()
            save(setup, records + [{"step": step, "rollout_s": t1 - t0, **rollout.stats, "gpu_peak_gib_rollout":
                                    rollout_peak}], "rolled out")
            rewards = torch.rand(rows, 1, generator=g, dtype=torch.float64)
            advantages = group_advantages(rewards, torch.ones(1, dtype=torch.float64), args.generations).advantages
            batch = policy_batch(prompt_ids, rollout.completions(), rollout.logps, advantages, cfg.finetune.grpo, 0)
            t2 = time.perf_counter()
            result = trainer.gpu.train_step(batch, cfg.optimizer.lr, step + 1, batch.loss_tokens).result()
            t3 = time.perf_counter()
            trainer.flush()  # the next rollout reads the updated weights
            t4 = time.perf_counter()
            stats = rollout.stats
            sync = stats["weights_sync_s"] + stats.get("weights_restore_s", 0.0) + (t4 - t3)
            records.append({
                "split_s": {"rollout": stats["prefill_s"] + stats["decode_s"], "sync": sync, "train": t3 - t2,
                            "other": (t4 - t0) - (stats["prefill_s"] + stats["decode_s"]) - sync - (t3 - t2)},
                "step": step, "step_s": t4 - t0, "rollout_s": t1 - t0, "weights_sync_s": stats["weights_sync_s"],
                "weights_restore_s": stats.get("weights_restore_s"), "lora_merged": bool(stats.get("lora_merged")),
                "prefill_s": stats["prefill_s"], "decode_s": stats["decode_s"], "batch_s": t2 - t1,
                "train_s": t3 - t2, "optimizer_wait_s": t4 - t3, "generated_tokens": stats["generated_tokens"],
                "rollout_tokens_per_s": stats["generated_tokens"] / (t1 - t0),
                "decode_tokens_per_s": stats["generated_tokens"] / stats["decode_s"],
                "weights_resident": bool(stats["weights_resident"]), "kv_cache_gib": stats["kv_cache_bytes"] / 2**30,
                "train_tokens": int(batch.input_ids.numel()), "loss": result.loss, "grad_norm": result.grad_norm,
                "gpu_busy_train": result.busy_seconds / max(result.seconds, 1e-9),
                "gpu_peak_gib_train": result.gpu_peak_bytes / 2**30, "gpu_peak_gib_rollout": rollout_peak,
                "cuda_graph": bool(stats.get("cuda_graph")),
                "host_gib": trainer.host_memory_bytes() / 2**30,
                "logp_gap_max": result.objective_metrics.get("sampling/sampling_logp_difference/max"),
                "logp_gap_mean": result.objective_metrics.get("sampling/sampling_logp_difference/mean"),
                "is_ratio": {k: result.objective_metrics.get(f"sampling/importance_sampling_ratio/{k}")
                             for k in ("min", "mean", "max", "zero_fraction")},
                "is_mode": cfg.finetune.grpo.vllm_importance_sampling_mode,
                "skipped": result.skipped,
            })
            records[-1]["warning"] = warn_vanished_weights(  # what Trainer.step logs for such a step
                {"step": step, "loss": result.loss, "grad_norm": result.grad_norm, **(result.objective_metrics or {})},
                cfg.finetune.grpo)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in records[-1].items()}, flush=True)
            setup["host_bytes_per_param"] = records[-1]["host_gib"] * 2**30 / setup["params"]
            save(setup, records, f"step {step} trained")
    return setup, records


@contextmanager
def rollout_lora(trainer, mode: str):
    """engine.rollout_lora set to `mode` on the in-process GPU worker's engine (runtime local) inside the block."""
    engine = trainer.gpu.instance.engine
    kept = engine.engine_cfg
    engine.engine_cfg = dataclasses.replace(kept, rollout_lora=mode)
    try:
        yield
    finally:
        engine.engine_cfg = kept


def decode_probe(trainer, args, vocab: int, g: torch.Generator) -> dict:
    """The decode rate at the run's own KV-cache size: the prompts and max_new_tokens of a step, every token id a
    stop token, so each row stops at its first token and the rollout ends at its first check of whether all rows
    have (passes.SYNC_EVERY tokens, --probe-passes + 1 here: that many minus one decode passes, each over the whole
    cache as a CUDA graph replay attends to it). decode_s also holds the first replay's one-off cost: more passes
    spread it thinner."""
    ids = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()] * (args.prompts * args.generations)
    sampling = SamplingSettings(max_new_tokens=args.completion_len, temperature=1.0, seed=99,
                                stop_token_ids=tuple(range(vocab)))
    every = args.probe_passes + 1
    kept, passes.SYNC_EVERY = passes.SYNC_EVERY, every
    try:
        short = trainer.gpu.generate(ids, sampling).result()
    finally:
        passes.SYNC_EVERY = kept
    probe = {k: short.stats.get(k) for k in ("decode_s", "cuda_graph", "weights_resident", "kv_cache_bytes",
                                             "weights_sync_s", "weights_restore_s", "lora_merged")}
    probe["decode_passes"] = min(every, args.completion_len) - 1
    probe["decode_ms_per_step"] = 1e3 * probe["decode_s"] / max(probe["decode_passes"], 1)
    probe["kv_cache_gib"] = probe.pop("kv_cache_bytes") / 2**30
    return probe


def transformers_generate(args) -> dict:
    """transformers' generate on the same shape: static cache, sampling, every row to completion_len tokens."""
    import transformers

    cfg = load_config(ROOT / args.config)
    m = cfg.model
    config = transformers.Qwen2Config(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                                      intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers,
                                      num_attention_heads=m.num_attention_heads,
                                      num_key_value_heads=m.num_key_value_heads,
                                      max_position_embeddings=m.max_position_embeddings, rope_theta=m.rope_theta,
                                      rms_norm_eps=m.rms_norm_eps, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    rows = args.prompts * args.generations
    ids = torch.randint(0, m.vocab_size, (rows, args.prompt_len), device="cuda")
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.completion_len,
                  min_new_tokens=args.completion_len, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        model.generate(ids[:, :16], **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    generated = (out.shape[1] - args.prompt_len) * rows
    del model
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "transformers": transformers.__version__, "cache": "static"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/shapes/qwen2.5-7b.yaml")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--completion-len", type=int, default=1024)
    parser.add_argument("--stop", action="store_true", help="token 0 stops a row (else every row samples to the end)")
    parser.add_argument("--probe", action="store_true",
                        help="first time --probe-passes decode steps at the run's KV-cache size and print the rate "
                        "(decode_probe)")
    parser.add_argument("--probe-passes", type=int, default=15, help="decode passes of a probe")
    parser.add_argument("--probe-lora", default="",
                        help="comma-separated engine.rollout_lora values (adapters,merged): a probe under each, before "
                        "the steps (which run under the config's)")
    parser.add_argument("--lora-b-std", type=float, default=0.0,
                        help="LoRA: draw every B from N(0, std^2) before the steps (0: B's zeros, the base exactly)")
    parser.add_argument("--no-baseline", action="store_true", help="skip transformers' generate")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--name", default="grpo-step", help="the result file's name before -<device>-<time>.json")
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    written: list[Path] = []

    def save(setup: dict, records: list[dict], phase: str) -> None:
        """The result so far, rewritten in place (common.write_result's path) at each phase."""
        partial = {**provenance(device), "what": "GRPO step (benchmarks/grpo_step.py), INCOMPLETE: written after "
                   f"'{phase}'", "overrides": args.overrides, **setup, "steps": records, "completed": False,
                   "elapsed_s": time.perf_counter() - t_main}
        written[:] = [write_result(args.name, partial, args.out, written[0] if written else None, quiet=True)]

    t_main = time.perf_counter()
    setup, records = megatrain_steps(args, save)
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    baseline = None if args.no_baseline or not torch.cuda.is_available() else transformers_generate(args)
    steady = records[1:] or records
    mean = {k: sum(r[k] for r in steady) / len(steady) for k in ("step_s", "rollout_s", "weights_sync_s", "decode_s",
                                                                 "train_s", "optimizer_wait_s", "rollout_tokens_per_s")}
    last = records[-1]
    against_plan = {"gpu_train": last["gpu_peak_gib_train"] / setup["plan_gpu_peak_gib_train"],
                    "gpu_rollout": (last["gpu_peak_gib_rollout"] or 0) / setup["plan_gpu_peak_gib_rollout"],
                    "host": last["host_gib"] / setup["plan_host_gib"]}
    result = {**provenance(device), "what": "GRPO step, MegaTrain's configuration (benchmarks/grpo_step.py)",
              "overrides": args.overrides, **setup, "steps": records, "mean_after_first": mean,
              "measured_over_plan": against_plan,
              "transformers_generate": baseline,
              "rollout_vs_transformers": mean["rollout_tokens_per_s"] / baseline["tokens_per_s"] if baseline else None}
    result["completed"] = True
    result["elapsed_s"] = time.perf_counter() - t_main
    print({k: v for k, v in result.items() if k != "steps"}, flush=True)
    write_result(args.name, result, args.out, written[0] if written else None)


if __name__ == "__main__":
    main()
