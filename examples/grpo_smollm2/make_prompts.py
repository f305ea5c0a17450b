"""Writes the example's prompts: two-number additions as plain-text questions, each with its `answer` column (which
reaches the reward functions), to prompts.jsonl (training) and held_out.jsonl (never trained on: the mean reward is
measured there). Deterministic: the same files every time. Plain text, not chat messages: SmolLM2's chat template adds
a 50-token system prompt, which would cost a CPU run most of its time.

    python examples/grpo_smollm2/make_prompts.py OUT_DIR
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def records(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        out.append({"prompt": f"Question: What is {a} + {b}?\nAnswer:", "answer": str(a + b)})
    return out


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, count, seed in (("prompts.jsonl", 256, 0), ("held_out.jsonl", 32, 1)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in records(count, seed)))
        print(f"wrote {count} prompts to {out / name}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/grpo-prompts")
