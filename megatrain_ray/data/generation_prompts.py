"""The prompts of `megatrain generate`: a jsonl file, one JSON object a line, each with

  "prompt": "text"                                   the text as it is, through the tokenizer with its special
                                                     tokens (a BOS where it adds one), no chat template
  "prompt": [{"role": ..., "content": ...}, ...]     chat messages, as GRPO's prompts format takes them
  "messages": [{"role": ..., "content": ...}, ...]   the same, under the chat formats' name

Messages go through the model's chat template with the generation prompt (the assistant's turn opened), as
`megatrain prepare --format prompts` renders them (data/prepare/prompts.py). Every other field is kept and written
beside the completion. Blank lines are skipped. Every line is read and tokenized before the model loads: a bad one
is one error naming the file, the line and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatrain_ray.data.prepare.prompts import prompt_ids
from megatrain_ray.data.prepare.records import BadRecord
from megatrain_ray.exceptions import DataError

PROMPT_FIELDS = ("prompt", "messages")


@dataclass(slots=True)
class GenerationPrompt:
    """One line of the prompts file."""

    line: int
    """Its line number in the file (from 1)."""
    record: dict[str, Any]
    """The line's JSON object, every field as given."""
    ids: list[int]
    """The prompt's token ids (the chat template applied to messages)."""


def check_messages(messages: Any, field: str, where: str) -> list[dict[str, Any]]:
    """A non-empty list of {"role": str, "content": str | list of parts} (DataError naming `where` and `field`)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {field!r} must be a non-empty list of chat messages ({{\"role\", \"content\"}}), "
                        f"got {json.dumps(messages)[:80]}")
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
            raise DataError(f"{where}: {field!r} message {k} needs 'role' as a non-empty string, got "
                            f"{json.dumps(message)[:80]}")
        if not isinstance(message.get("content"), (str, list)):
            raise DataError(f"{where}: {field!r} message {k} needs 'content' as a string (or a list of content "
                            f"parts), got {type(message.get('content')).__name__}")
    return messages


def encode_prompt(tokenizer: Any, record: Any, where: str) -> list[int]:
    """A record's prompt as token ids (module docstring); DataError naming `where` and the field."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with 'prompt' or 'messages', got {type(record).__name__}")
    present = [name for name in PROMPT_FIELDS if name in record]
    if len(present) != 1:
        fields = ", ".join(sorted(record)) or "none"
        raise DataError(f"{where}: needs exactly one of 'prompt' (text or chat messages) and 'messages', "
                        f"{'found both' if present else 'found neither'} (fields: {fields})")
    field, value = present[0], record[present[0]]
    if field == "prompt" and isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: 'prompt' is empty")
        ids = list(tokenizer(value)["input_ids"])
    else:
        if field == "prompt" and not isinstance(value, list):
            raise DataError(f"{where}: 'prompt' must be text or a list of chat messages, got {type(value).__name__}")
        try:
            ids = prompt_ids(tokenizer, check_messages(value, field, where), where)
        except BadRecord as exc:
            raise DataError(str(exc).replace("'prompt' messages", f"{field!r} messages")) from None
    if not ids:
        raise DataError(f"{where}: {field!r} gives no tokens")
    return ids


def read_generation_prompts(path: str | Path, tokenizer: Any) -> list[GenerationPrompt]:
    """Every prompt of the file, tokenized, in order."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"--prompts {str(path)!r} does not exist" if not path.exists() else
                        f"--prompts {str(path)!r} is not a file")
    prompts = []
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            where = f"{path}:{number}"
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise DataError(f"{where} is not UTF-8 text: save the file as UTF-8") from None
            except json.JSONDecodeError as exc:
                raise DataError(f"{where} is not valid JSON: {exc}") from None
            prompts.append(GenerationPrompt(number, record, encode_prompt(tokenizer, record, where)))
    if not prompts:
        raise DataError(f"--prompts {str(path)!r} holds no prompts (one JSON object a line, with 'prompt' or "
                        "'messages')")
    return prompts
