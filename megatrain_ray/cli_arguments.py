"""The arguments of each `megatrain` command (megatrain_ray/__main__.py runs them): their flags, defaults and help
texts, in one place. Nothing here imports torch at module level (plan's machine names are imported when plan's
arguments are added)."""

from __future__ import annotations

import argparse

GENERATION_DEFAULTS = {"generate": {"max_new_tokens": 256, "temperature": 0.0, "top_p": 1.0},
                       "chat": {"max_new_tokens": 512, "temperature": 0.7, "top_p": 0.9}}
"""generate: greedy (reproducible answers to check); chat: sampled, as chat models are usually run."""


def add_arguments(name: str, p: argparse.ArgumentParser) -> None:
    if name in ("train", "plan", "config"):
        p.add_argument("config", help="YAML config file (see configs/)")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a config key, e.g. --set optimizer.lr=1e-4 (repeatable)")
    if name == "train":
        p.add_argument("--address", help="Ray cluster address to attach to (default: a running local "
                                         "cluster, else a private one on 127.0.0.1)")
        p.add_argument("--local", action="store_true", help="run the actors in this process, without Ray")
        p.add_argument("--resume", metavar="auto|DIR",
                       help="continue from a checkpoint: a checkpoint directory, or auto for the newest complete "
                            "one under checkpoint.dir (starting afresh when there is none)")
    if name == "plan":
        from megatrain_ray.planning.profiles import PRESETS  # lazy: start-up time (torch), only for plan's arguments

        p.add_argument("--machine", metavar="NAME", help="plan for a described machine instead of this one: "
                       f"{', '.join(PRESETS)} (GPU kind and installed host RAM; the flags below override its sizes)")
        for flag, what in (("--host-memory", "host RAM"), ("--gpu-memory", "GPU memory"), ("--shm", "/dev/shm size")):
            p.add_argument(flag, metavar="SIZE", help=f"plan for a machine with this much {what} "
                                                      "(e.g. 512GB, 80GiB) instead of this one")
        p.add_argument("--optimizer-gparams", type=float, metavar="RATE",
                       help="CPU AdamW rate of the host in G params/s with fp32 moments and a bf16 streaming copy "
                            "(28 DRAM bytes/param; other formats are scaled by their bytes) for the speed estimate "
                            "(default: the measured box of the GPU kind; a 32-core H200 host measured 4.0-5.2)")
        p.add_argument("--disk-gbps", type=float, metavar="RATE",
                       help="read + write GB/s of host.disk_dir for the speed of the disk tier (default: "
                            "5, an NVMe assumption; benchmarks/moment_tiers.py measures a disk)")
    if name == "plot":
        p.add_argument("run_dir", help="run directory holding metrics.jsonl (train.output_dir)")
        p.add_argument("--out", help="directory for the PNG files (default: the run directory)")
    if name == "export":
        p.add_argument("source", help="a run directory (train.output_dir: its newest complete checkpoint, else its "
                                      "train.export_dir), a checkpoint directory (checkpoints/step-N), or a "
                                      "directory with model.safetensors* and config.json")
        p.add_argument("out_dir", help="the directory to create (must not exist or be empty)")
        p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                       help="format of the written weights (default: the source's config.json dtype, else float32)")
        p.add_argument("--shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB (default 5GB)")
    if name == "cluster":
        p.add_argument("action", choices=["start", "stop", "env"],
                       help="start: the head, writing ~/.megatrain/cluster.env; stop: end it; env: print the exports")
        p.add_argument("--num-gpus", type=int, help="GPUs the head offers (default: Ray counts them)")
        p.add_argument("--temp-dir", help="a directory of yours, made mode 0700, for Ray's temporary tree (default "
                                          "/tmp/megatrain-<uid>; keep it short: Ray's socket paths live below it)")
        p.add_argument("--allow-unauthenticated", action="store_true",
                       help="start without token auth when RAY_AUTH_MODE says so (refused otherwise)")
    if name in GENERATION_DEFAULTS:
        _add_generation_arguments(name, p)
    if name == "prepare":
        p.add_argument("--tokenizer", required=True,
                       help="the model's tokenizer (and chat template): a model directory, a hub name such as "
                            "Qwen/Qwen2.5-7B-Instruct, or a .gguf file; use the model you will train")
        p.add_argument("--revision", help="with a hub name in --tokenizer: the branch, tag or commit")
        p.add_argument("--format", choices=["text", "alpaca", "sharegpt", "messages", "preference", "prompts"],
                       help="record format (default: the registry entry's formatting, else text); preference: "
                            "prompt/chosen/rejected pairs for finetune.objective=dpo, in TRL's or LLaMA-Factory's "
                            "layouts (found per record; docs/fine-tuning.md); prompts: a `prompt` (text, or chat "
                            "messages) per record for finetune.objective=grpo, the other columns kept for the reward "
                            "functions")
        p.add_argument("--input", nargs="+", help="jsonl, json, parquet or txt files")
        p.add_argument("--output", required=True, help="directory to create for the shards and manifest.json")
        p.add_argument("--seq-len", type=int, default=0, help="truncate documents to this many tokens (0: never); "
                       "preference: each sequence keeps its first N tokens, a pair whose prompt fills N is dropped; "
                       "prompts: refused (finetune.grpo.max_prompt_length truncates when training)")
        p.add_argument("--seed", type=int, default=0, help="seed of the eval split and of the row order inside each "
                                                            "shard (training reshuffles by data.seed and epoch)")
        p.add_argument("--eval-fraction", type=float, default=0.0,
                       help="share of the records in the eval split (an exact sample seeded by --seed)")
        p.add_argument("--registry", help="a dataset_info.json (LLaMA-Factory style) naming datasets")
        p.add_argument("--dataset", help="the dataset of --registry to prepare")
        p.add_argument("--hf-dataset", metavar="NAME",
                       help="a dataset by hub name (owner/name: its parquet/json/jsonl/txt data files only, HF_HOME "
                            "and HF_HUB_OFFLINE honoured) or a local dataset directory, read through the datasets "
                            "library (pip install 'megatrain-ray[datasets]')")
        p.add_argument("--hf-split", default="train", help="the split of --hf-dataset (default train)")
        p.add_argument("--hf-subset", help="the configuration (subset) of --hf-dataset, when it has several")
        p.add_argument("--hf-dataset-revision", help="the branch, tag or commit of --hf-dataset")
        p.add_argument("--workers", type=int, default=0, metavar="N",
                       help="tokenizing processes (default 0: one per available core; 1: in this process); the "
                            "output is the same for any N")
        p.add_argument("--on-bad-record", choices=["skip", "fail"], default="skip",
                       help="a record the format cannot read (invalid JSON, a missing field, an unknown role, a "
                            "template error): skip it and count it by reason in manifest.json 'skipped' and the "
                            "final log line (default), or fail with one error naming the file and record")
        p.add_argument("--train-on-inputs", action="store_true",
                       help="chat formats: every token in the loss (system, user and tool turns too), not only "
                            "the assistant turns")
        p.add_argument("--min-pixels", type=int, default=0, metavar="N",
                       help="a vision-language model's images: the processor's lower cap on an image's pixels "
                            "(where it has one, as Qwen-VL's; default: the processor's own)")
        p.add_argument("--max-pixels", type=int, default=0, metavar="N",
                       help="a vision-language model's images: the processor's upper cap on an image's pixels, so "
                            "on its image tokens (where it has one, as Qwen-VL's; default: the processor's own)")


def _add_generation_arguments(name: str, p: argparse.ArgumentParser) -> None:
    d = GENERATION_DEFAULTS[name]
    p.add_argument("source", metavar="RUN_OR_MODEL", help="a run directory (its newest complete checkpoint; LoRA: "
                   "base and adapters), an export or model directory, a hub name or a .gguf file")
    if name == "generate":
        p.add_argument("--prompts", required=True, metavar="FILE", help="jsonl, an object a line: 'prompt' (text, as "
                       "is; or chat messages) or 'messages' (through the chat template); other fields are copied out")
        p.add_argument("--out", metavar="FILE", help="the jsonl to write (must not exist; default: stdout)")
        p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (default 8)")
    else:
        p.add_argument("--system", metavar="TEXT", help="a system message opening the conversation (kept on /reset)")
    p.add_argument("--max-new-tokens", type=int, default=d["max_new_tokens"], help="the most tokens of a completion, "
                   f"which ends earlier at the model's end-of-turn token (default {d['max_new_tokens']})")
    p.add_argument("--temperature", type=float, default=d["temperature"],
                   help=f"sampling temperature; 0 = greedy (default {d['temperature']:g})")
    p.add_argument("--top-p", type=float, default=d["top_p"],
                   help=f"nucleus sampling: the fewest tokens holding this probability (default {d['top_p']:g})")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most probable tokens; 0 = all (default 0)")
    p.add_argument("--seed", type=int, default=0, help="the sampling's seed: the same seed, the same output "
                                                        "(default 0)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="engine.device (default auto)")
    p.add_argument("--tokenizer", help="another tokenizer and chat template (default: the model's, a run's model.path)")
    p.add_argument("--set", action="append", dest="sets", metavar="KEY=VALUE",
                   help="override a config key of the session, e.g. precision.compute_dtype=float32 (repeatable)")


EPILOGS = {"train": "Every config key, its type, default and meaning: docs/config.md (or `megatrain config CONFIG` "
                    "for the resolved values). Configs to start from: configs/recipes/ (fine-tunes of real models) "
                    "and configs/shapes/ (random-init shapes for benchmarks).",
           "plan": "What each line means: docs/reading-the-plan.md.",
           "config": "Every key explained: docs/config.md."}
