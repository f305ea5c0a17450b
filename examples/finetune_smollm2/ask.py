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
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in questions]
    # All questions decode together (left-padded, masked): one pass per new token instead of one per question.
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    replies = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    return dict(zip(questions, replies))

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for question, answer in ask(sys.argv[1]).items():
        print(f"{question} -> {answer}")
