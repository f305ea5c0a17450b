"""Prompt records (`--format prompts`) -> prompt token ids for GRPO, with every other column of the record.

Accepted layouts (TRL's GRPOTrainer datasets), found per record:
  standard        {"prompt": "What is 2 + 3?", "answer": "5", ...}
  conversational  {"prompt": [{"role": "system", "content": ...}, {"role": "user", "content": ...}], "answer": ...}

Tokenized as TRL 1.16's GRPOTrainer does (_tokenize_prompts): text through the tokenizer with its special tokens
(a BOS where the tokenizer adds one, as the text format does; no EOS), messages through the chat template with
add_generation_prompt=True. The prompt is stored whole: finetune.grpo.max_prompt_length truncates it when training
(data/prompts.py), so the stored ids and the stored prompt agree. Every other column is stored as JSON and reaches
the reward functions as a keyword argument; `completion` and `completion_ids` are left out as TRL leaves them out,
and `prompts` and `completions` are refused (TRL's reward call passes arguments of those names itself).
This module runs in the tokenizing workers: no pyarrow here.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from megatrain_ray.data.prepare.records import BadRecord, parse_item

PROMPT_FIELD = "prompt"
DROPPED_COLUMNS = ("completion", "completion_ids")
"""Columns TRL's GRPOTrainer does not pass to the reward functions (_calculate_rewards); left out here too."""
RESERVED_COLUMNS = ("prompts", "completions")
"""The reward functions' own arguments: a column of that name would be passed twice."""
NO_TEMPLATE = ("the tokenizer has no chat template, so a prompt of chat messages cannot be rendered; give the "
               "prompt as plain text, or add a template to the model directory")


def _messages(prompt: list, where: str) -> None:
    """A conversational prompt: a non-empty list of {"role": str, "content": str | list of parts} messages."""
    for k, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise BadRecord("bad 'prompt'", f"{where}: 'prompt' message {k} must be a JSON object with 'role' and "
                            f"'content', got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise BadRecord("bad 'prompt'", f"{where}: 'prompt' message {k} needs 'role' as a non-empty string, got "
                            f"{role!r}")
        if not isinstance(content, (str, list)) and not (content is None and message.get("tool_calls")):
            raise BadRecord("bad 'prompt'", f"{where}: 'prompt' message {k} needs 'content' as a string (or a list of "
                            f"content parts), got {type(content).__name__}")


def read_prompt(record: Any, where: str) -> tuple[str | list, dict[str, Any]]:
    """(prompt, the record's other columns) of one record, checked; BadRecord names the record and the field."""
    if not isinstance(record, dict):
        raise BadRecord("not a JSON object", f"{where}: expected a JSON object, got {type(record).__name__}")
    prompt = record.get(PROMPT_FIELD)
    if prompt is None:
        raise BadRecord("missing 'prompt'", f"{where}: the prompts format needs the field 'prompt' (text, or a list "
                        f"of chat messages); fields present: {', '.join(sorted(record)) or 'none'}")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRecord("empty 'prompt'", f"{where}: 'prompt' is empty")
    elif isinstance(prompt, list):
        if not prompt:
            raise BadRecord("empty 'prompt'", f"{where}: 'prompt' is an empty list of messages")
        _messages(prompt, where)
    else:
        raise BadRecord("bad 'prompt'", f"{where}: 'prompt' must be a string or a list of chat messages "
                        f"({{role, content}}), got {type(prompt).__name__}")
    columns = {name: value for name, value in record.items() if name != PROMPT_FIELD and name not in DROPPED_COLUMNS}
    for name in RESERVED_COLUMNS:
        if name in columns:
            raise BadRecord("reserved column", f"{where}: the column {name!r} would be passed to the reward functions "
                            f"beside their own {name!r} argument; rename it")
    return prompt, columns


def to_json(value: Any, what: str, where: str) -> str:
    """JSON text of a value (safe to store and read back); BadRecord naming `what` when it has no JSON form."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise BadRecord("not JSON", f"{where}: {what} is not JSON-serialisable ({exc}); store it as text, numbers, "
                        "lists or objects") from None


def columns_json(columns: dict[str, Any], where: str) -> str:
    for name, value in columns.items():  # each alone first, so the error names the column
        to_json(value, f"the column {name!r}", where)
    return to_json(columns, "the columns", where)


def prompt_ids(tok: Any, prompt: str | list, where: str) -> list[int]:
    """A conversational prompt's ids: the chat template with the generation prompt, as TRL's apply_chat_template."""
    if tok.chat_template is None:
        raise BadRecord("no chat template", f"{where}: {NO_TEMPLATE}")
    try:
        out = tok.apply_chat_template(prompt, tokenize=True, return_dict=True, add_generation_prompt=True)
    except Exception as exc:  # the template's own raise_exception, or a field it cannot read
        raise BadRecord("chat template error", f"{where}: the chat template cannot render the 'prompt' messages: "
                        f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return list(out["input_ids"])


def _result(ids: list[int], stored: tuple, where: str) -> tuple:
    if not ids:
        raise BadRecord("no prompt tokens", f"{where}: 'prompt' gives no tokens")
    return ("prompt", np.array(ids, dtype=np.int32), *stored)


def prompts_chunk(tok: Any, chunk: list) -> list[tuple]:
    """tokenize.process_chunk for --format prompts: one result per record, in order, each
    ("prompt", ids, prompt JSON, columns JSON, column names) or ("skipped", reason, message).
    Text prompts go through one batched tokenizer call."""
    results: list[tuple | None] = [None] * len(chunk)
    texts, waiting = [], []
    for k, (item, number) in enumerate(chunk):
        try:
            where, record = parse_item(item, number)
            prompt, columns = read_prompt(record, where)
            stored = (to_json(prompt, "'prompt'", where), columns_json(columns, where), tuple(columns))
            if isinstance(prompt, str):
                texts.append(prompt)
                waiting.append((k, stored, where))
            else:
                results[k] = _result(prompt_ids(tok.tok, prompt, where), stored, where)
        except BadRecord as exc:
            results[k] = ("skipped", exc.reason, str(exc))
    for (k, stored, where), ids in zip(waiting, tok.tok(text=texts)["input_ids"] if texts else []):
        try:
            results[k] = _result(list(ids), stored, where)
        except BadRecord as exc:
            results[k] = ("skipped", exc.reason, str(exc))
    return results  # type: ignore[return-value]
