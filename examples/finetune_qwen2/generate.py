"""Load a model directory with transformers (as any serving tool would) and answer a few prompts.

    python examples/finetune_qwen2/generate.py runs/tiny-qwen2-sft
"""

from __future__ import annotations

import sys

PROMPTS = ["Spell the word backwards.\ncat", "What is the capital of France?", "Add the two numbers.\n2 + 3"]


def generate(model_dir: str, max_new_tokens: int = 8) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    answers = []
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return answers


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for prompt, answer in zip(PROMPTS, generate(sys.argv[1])):
        print(f"{prompt!r} -> {answer!r}")
