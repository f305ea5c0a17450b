"""Create a random-init tiny Qwen2 model directory, as a stand-in for a downloaded one (no hub is reachable).

    python examples/finetune_qwen2/make_tiny_qwen2.py OUT_DIR

The directory is what `save_pretrained` writes for a real model: config.json, model.safetensors,
generation_config.json and a fast tokenizer (byte-level BPE trained on the example's alpaca file
with the `tokenizers` library) with a ChatML chat template, as Qwen2 uses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# ChatML, the format of Qwen2's chat template (without its default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(texts: list[str], vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on `texts` (deterministic), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def alpaca_texts(path: Path = HERE / "alpaca_tiny.json") -> list[str]:
    records = json.loads(path.read_text())
    return [f"{r['instruction']}\n{r['input']}\n{r['output']}" for r in records] + ["user", "assistant", "system"]


def make_tiny_qwen2(out_dir: str | Path, num_layers: int = 2, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    tokenizer = build_tokenizer(alpaca_texts())
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-6,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(make_tiny_qwen2(sys.argv[1]))
