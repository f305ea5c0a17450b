"""GRPO with the rollout on a GPU of its own (issue 49, nvidia-h200-x2): the same steps colocated (one GPU: rollout and
training take turns), separate on-policy (rl.rollout: separate, rl.async_steps: 0) and separate one step ahead
(rl.async_steps: 1), side by side in one call, through `megatrain train`'s Trainer on Ray (the rollout worker is a Ray
actor with a GPU of its own).

The model is a random-init shape (default MegaTrain's configuration: Qwen2.5-7B, 8 prompts x 2 completions, prompt
512, completion 1,024, full fine-tuning at full precision). The prompts are random words of a word-level tokenizer
built here with one word per token id (so any sampled id decodes), prepared by `megatrain prepare --format prompts`;
the reward is a fixed pseudo-random function of each completion's tokens (scoring costs nothing; time is what counts).
Per step: the wall time between the ends of two steps, the rollout's own seconds, the driver's wait for a batch
generated ahead, the weight sync, the training step; the mean after the first step and each mode against colocated.

    python benchmarks/grpo_two_gpus.py [--modes colocated,separate,separate-async] [--steps 3] [--set KEY=VALUE ...]
    python benchmarks/grpo_two_gpus.py --smoke   (CPU, a tiny Llama, runtime local: checks the script)

Writes benchmarks/results/grpo-two-gpus-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from common import RESULTS, ROOT, provenance, write_result  # noqa: E402

from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.data.prepare.pipeline import PrepareOptions, prepare  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402

MODES = {"colocated": ("colocated", 0), "separate": ("separate", 0), "separate-async": ("separate", 1)}
SMOKE = ["model.family=llama", "model.vocab_size=320", "model.hidden_size=64", "model.intermediate_size=128",
         "model.num_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
         "model.max_position_embeddings=256", "engine.device=cpu", "precision.compute_dtype=float32",
         "precision.stream_dtype=float32", "optimizer.workers=1", "data.seq_len=64"]


def random_reward(prompts, completions, completion_ids, **kwargs):
    """A fixed pseudo-random reward of each completion's tokens, in [0, 1) (Python hashes a tuple of ints the same
    in every process)."""
    return [(hash(tuple(ids)) % 1000) / 1000 for ids in completion_ids]


def word_tokenizer(vocab: int, out: Path) -> Path:
    """A word-level tokenizer with one word w<i> per token id 2 <= i < vocab, whitespace-split; 0 its end token, 1
    its unknown one (special tokens are matched inside words, so no word starts with theirs)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>",
                                               unk_token="<unk>")
    tok.save_pretrained(out)
    return out


def prepared_prompts(vocab: int, prompts: int, prompt_len: int, work: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    records = work / "prompts.jsonl"
    with records.open("w") as f:
        for _ in range(prompts):
            ids = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
            f.write(json.dumps({"prompt": " ".join(f"w{i}" for i in ids)}) + "\n")
    out = work / "prepared"
    prepare(PrepareOptions(tokenizer_dir=str(word_tokenizer(vocab, work / "tokenizer")), format="prompts",
                           inputs=[str(records)], output_dir=str(out), workers=1))
    return out


def run_mode(args, mode: str, data: Path, work: Path) -> dict:
    rollout, async_steps = MODES[mode]
    rows = args.prompts * args.generations
    cfg = load_config(ROOT / args.config, [
        *(SMOKE if args.smoke else []), f"runtime.mode={'local' if args.smoke else 'ray'}", "runtime.dashboard=false",
        f"data.path={data}", f"data.batch_size={rows}", f"data.seq_len={args.prompt_len + args.completion_len}",
        "finetune.objective=grpo", f"finetune.grpo.reward_funcs=[{Path(__file__).stem}:random_reward]",
        f"finetune.grpo.num_generations={args.generations}",
        f"finetune.grpo.max_completion_length={args.completion_len}", f"rl.rollout={rollout}",
        f"rl.async_steps={async_steps}", f"train.steps={args.steps}", "schedule.warmup_steps=1",
        f"train.output_dir={work / mode}",
        f"checkpoint.dir={work / mode / 'ckpt'}", "checkpoint.at_end=false", "checkpoint.every=0",
        *args.overrides])
    t0 = time.perf_counter()
    steps = []
    with Trainer(cfg) as trainer:
        startup = time.perf_counter() - t0
        last = time.perf_counter()
        for step in range(args.steps):
            record = trainer.step(step)
            trainer.next_step = step + 1
            now = time.perf_counter()
            keep = ("loss", "reward", "step_seconds", "rollout_s", "rollout_wait_s", "rollout_sync_s",
                    "rollout_sync_gb", "rollout_tokens", "rollout_tokens_per_s", "gpu_busy", "host_mem_gib",
                    "sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean")
            steps.append({"step": step, "wall_s": now - last, **{k: record.get(k) for k in keep}})
            last = now
            print({mode: {k: round(v, 3) if isinstance(v, float) else v for k, v in steps[-1].items()}}, flush=True)
        trainer.flush()
        device = trainer.device_name
    steady = steps[1:] or steps
    mean = {k: sum((r[k] or 0.0) for r in steady) / len(steady)
            for k in ("wall_s", "rollout_s", "rollout_wait_s", "rollout_sync_s", "step_seconds")}
    return {"mode": mode, "rl": {"rollout": rollout, "async_steps": async_steps}, "device": device,
            "startup_s": startup, "steps": steps, "mean_after_first": mean}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/shapes/qwen2.5-7b.yaml")
    parser.add_argument("--modes", default="colocated,separate,separate-async")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--completion-len", type=int, default=1024)
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU in process (checks the script)")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--work", default="/tmp/grpo-two-gpus")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--name", default="grpo-two-gpus")
    args = parser.parse_args()
    if args.smoke:
        args.prompt_len, args.completion_len, args.prompts, args.generations = 12, 8, 2, 2
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    vocab = load_config(ROOT / args.config, SMOKE if args.smoke else []).model.vocab_size
    data = prepared_prompts(vocab, args.prompts * (args.steps + 1), args.prompt_len, work)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {**provenance(device), "what": "GRPO colocated against the rollout on a GPU of its own "
              "(benchmarks/grpo_two_gpus.py)", "config": args.config, "overrides": args.overrides,
              "prompts": args.prompts, "generations": args.generations, "prompt_len": args.prompt_len,
              "completion_len": args.completion_len, "smoke": args.smoke, "modes": []}
    written = None
    for mode in args.modes.split(","):
        result["modes"].append(run_mode(args, mode, data, work))
        base = next((m for m in result["modes"] if m["mode"] == "colocated"), None)
        if base is not None:
            for m in result["modes"]:
                m["wall_vs_colocated"] = base["mean_after_first"]["wall_s"] / m["mean_after_first"]["wall_s"]
        written = write_result(args.name, result, args.out, written)  # rewritten after each mode


if __name__ == "__main__":
    main()
