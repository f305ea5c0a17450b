"""`megatrain prepare`: text and chat/instruction records -> tokenized pyarrow shards with a loss mask.

    records (jsonl / json / parquet / txt)          one of: text, alpaca, sharegpt, messages
      -> documents: token ids + loss mask         text: every token; chat: the assistant turns only
                                                  (--train-on-inputs: every token)
      -> seeded split train / eval, shards written as they fill (memory bounded by a shard)
      -> OUT/train-00000.parquet ..., OUT/eval-00000.parquet, OUT/manifest.json

Columns: `input_ids` (list<int32>) and `loss_mask` (list<uint8>, 1 where the token is a target).
Chat records go through the tokenizer's own chat template, tool and function-calling turns included
as the template renders them; the assistant's part of each turn is found by rendering the
conversation up to that turn, so any template that renders a conversation as a prefix of its
continuation works. Records the format cannot read are skipped and counted (--on-bad-record fail
stops at the first instead). Tokenizing runs in --workers processes. The output directory appears
at once, complete, or not at all. A `dataset_info.json` registry in LLaMA-Factory's style can name
files, format and columns.

A vision-language model's directory as --tokenizer: chat records with images (content parts, or `<image>`
placeholders with an `images` column) go through its processor, each document's image tensors kept in an `images`
column (vision_docs.py, image_records.py; docs/vision.md).

`--format preference` writes DPO pairs (preference.py), `--format prompts` GRPO prompts with their other columns
(prompts.py): token ids of the prompt alone, the prompt and the columns as JSON (shards.PROMPT_COLUMNS).

records.py reads and converts records, tokenize.py makes documents (chat_render.py: chat records without
transformers' per-call work; chat_assembled.py: ChatML-family templates without Jinja), tokenizing.py runs it in
worker processes (spec_check_cache.py: the tokenizer check's verdict kept between runs), shards.py writes the
documents, pipeline.py runs it all (its docstring explains the split and shuffle).
"""

from __future__ import annotations

import importlib
from typing import Any

# Exported lazily, so that a worker process importing tokenize.py never imports pyarrow (shards, pipeline).
_EXPORTS = {"MANIFEST": "pipeline", "PrepareOptions": "pipeline", "prepare": "pipeline", "resolve_inputs": "pipeline",
            "FORMATS": "records", "BadRecord": "records", "Columns": "records", "read_records": "records",
            "to_messages": "records", "Tokenizer": "tokenize"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
