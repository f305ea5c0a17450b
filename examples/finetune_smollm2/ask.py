"""Ask a model the held-out questions (and one real-world question) with greedy decoding. MODEL is a
model directory, or anything model.path takes (a .gguf file: its cached conversion is used):

    python examples/finetune_smollm2/ask.py "$(python examples/finetune_smollm2/where_is_smollm2.py)"   # before
    python examples/finetune_smollm2/ask.py runs/smollm2-facts-sft                                      # after
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

QUESTIONS = [r["instruction"] for r in json.loads((Path(__file__).parent / "held_out.json").read_text())] + [
    "What is the capital of France?"]


def ask(model_dir: str, questions: list[str] = QUESTIONS, max_new_tokens: int = 24) -> dict[str, str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatrain_ray.exceptions import ConfigError
    from megatrain_ray.system.model_sources import resolve_model_dir

    model_dir = resolve_model_dir(model_dir, "MODEL", Path.cwd(), None, ConfigError)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    answers = {}
    for question in questions:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        answers[question] = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return answers


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for question, answer in ask(sys.argv[1]).items():
        print(f"{question} -> {answer}")
