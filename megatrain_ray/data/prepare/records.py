"""Reading records: files -> (where, payload) items, and one record -> a chat conversation.

A jsonl file is read as raw lines (bytes): decoding and JSON parsing happen where the record is
tokenized (a worker process), so a bad line is one bad record, not a failed run. A record that the
format cannot read raises `BadRecord`, whose `reason` is the short name it is counted under.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatrain_ray.exceptions import DataError
from megatrain_ray.system.files import read_text_file

FORMATS = ("text", "alpaca", "sharegpt", "messages", "preference", "prompts")
# ShareGPT speaker names -> chat roles (LLaMA-Factory's defaults, its function-calling tags, and the OpenAI names).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}
# The messages format's roles: OpenAI's, tool and function results included, passed to the template as they are.
MESSAGE_ROLES = {r: r for r in ("system", "user", "assistant", "tool", "function")}


class BadRecord(DataError):
    """One record the format cannot read; `reason` names its kind in the manifest's "skipped" counts."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class Columns:
    """Field names of the record formats (a registry's `columns` and `tags` rename them)."""

    text: str = "text"
    prompt: str = "instruction"
    query: str = "input"
    response: str = "output"
    system: str = "system"
    messages: str = ""
    """Defaults to `conversations` (sharegpt) or `messages` (messages)."""
    role_tag: str = ""
    content_tag: str = ""
    roles: dict[str, str] = field(default_factory=dict)
    tools: str = "tools"
    """The field holding a conversation's tool (function) definitions, passed to the chat template."""


# An item: (where, payload, raw). `raw` is True for a jsonl line still to decode and parse.
Item = tuple[str, Any, bool]


INPUT_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
SCAN_ENTRIES = 10_000


def _files_inside(directory: Path, shown: int = 3) -> str:
    """What to name instead of `directory`: the input files below it (a few, and how many in all), or that it
    holds none."""
    entries = list(itertools.islice(directory.rglob("*"), SCAN_ENTRIES))  # a bound for a large tree (/ say)
    found = sorted(p for p in entries if p.suffix.lower() in INPUT_SUFFIXES and p.is_file())
    if not found:
        return "it holds none below it" if len(entries) < SCAN_ENTRIES else \
            f"none in the first {SCAN_ENTRIES:,} entries below it"
    names = " ".join(str(p) for p in found[:shown])
    more = f" ({len(found)}{'+' if len(entries) == SCAN_ENTRIES else ''} such files below it)" \
        if len(found) > shown else ""
    return f"name them, e.g. --input {names}{more}"


def read_records(path: Path) -> Iterator[Item]:
    """Items of a jsonl (one record a line, read as bytes), json (a list), parquet (row group by row group)
    or txt (the whole file is one text) file. File-level problems raise DataError at once."""
    if path.is_dir():
        raise DataError(f"input file {str(path)!r} is a directory; --input takes files (.jsonl, .json, .parquet or "
                        f".txt): {_files_inside(path)}")
    if not path.is_file():
        raise DataError(f"input file {str(path)!r} does not exist" if not path.exists() else
                        f"input file {str(path)!r} is not a regular file")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        yield f"{path} record 0", {"text": read_text_file(path, f"input file {str(path)!r}", DataError,
                                                          limit=1 << 40)}, False
    elif suffix == ".jsonl":
        with path.open("rb") as f:
            for line_number, line in enumerate(f, 1):
                if line.strip():
                    yield f"{path}:{line_number}", line, True
    elif suffix == ".json":
        try:
            data = json.loads(read_text_file(path, f"input file {str(path)!r}", DataError, limit=1 << 40))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(data, list):
            raise DataError(f"{path} must hold a JSON list of records (or use .jsonl, one record per line)")
        for n, record in enumerate(data):
            yield f"{path} record {n}", record, False
    elif suffix == ".parquet":
        import pyarrow.parquet as pq  # lazy: worker processes never import pyarrow (nor its allocator's thread)

        n = 0
        parquet = pq.ParquetFile(path)
        for group in range(parquet.num_row_groups):
            for record in parquet.read_row_group(group).to_pylist():
                yield f"{path} record {n}", record, False
                n += 1
    else:
        raise DataError(f"input file {str(path)!r}: unknown type {suffix!r}; use .jsonl, .json, .parquet or .txt")


def count_records(path: Path) -> int:
    """How many items read_records(path) yields, cheaply (jsonl: non-blank lines; parquet: its metadata)."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl" and path.is_file():
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())
    if suffix == ".parquet" and path.is_file():
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return sum(1 for _ in read_records(path))


def parse_item(item: Item, record_number: int) -> tuple[str, Any]:
    """(where, record): a jsonl line decoded and parsed (BadRecord when it cannot be)."""
    where, payload, raw = item
    if not raw:
        return where, payload
    path, line_number = where.rsplit(":", 1)
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRecord("not UTF-8", f"{where} is not UTF-8 text: save the file as UTF-8") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRecord("not valid JSON", f"{path}:{line_number} is not valid JSON: {exc}") from None
    return f"{path} record {record_number}", record


def _field(record: Any, name: str, where: str, fmt: str, required: bool = True) -> Any:
    if not isinstance(record, dict):
        raise BadRecord("not a JSON object", f"{where}: expected a JSON object, got {type(record).__name__}")
    value = record.get(name)
    if required and (value is None or value == ""):
        raise BadRecord(f"missing {name!r}", f"{where}: the {fmt} format needs the field {name!r}, which is "
                        f"missing or empty (fields present: {', '.join(sorted(record)) or 'none'})")
    return value


def record_text(record: Any, cols: Columns, where: str) -> str:
    return str(_field(record, cols.text, where, "text", required=False) or "")


def to_messages(record: Any, fmt: str, cols: Columns, where: str) -> tuple[list[dict[str, Any]], list | None]:
    """A chat record as ([{"role", "content", ...}], tools) with at least one assistant turn. As in
    LLaMA-Factory, a `system` field becomes the first message and alpaca's `history` ([prompt, reply]
    pairs) the turns before the instruction; every assistant turn is learned. A turn's other fields
    (an assistant's `tool_calls`, a tool result's `tool_call_id` or `name`) and the record's `tools`
    reach the chat template unchanged."""
    system = _field(record, cols.system, where, fmt, required=False)
    messages: list[dict[str, Any]] = [{"role": "system", "content": str(system)}] if system else []
    if fmt == "alpaca":
        prompt = str(_field(record, cols.prompt, where, fmt))
        query = _field(record, cols.query, where, fmt, required=False)
        for k, pair in enumerate(_field(record, "history", where, fmt, required=False) or []):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise BadRecord("bad history", f"{where}: history entry {k} must be a [prompt, reply] pair")
            messages += [{"role": "user", "content": str(pair[0])}, {"role": "assistant", "content": str(pair[1])}]
        messages.append({"role": "user", "content": f"{prompt}\n{query}" if query else prompt})
        messages.append({"role": "assistant", "content": str(_field(record, cols.response, where, fmt))})
        return messages, None
    turns = _field(record, cols.messages or ("conversations" if fmt == "sharegpt" else "messages"), where, fmt)
    role_tag = cols.role_tag or ("from" if fmt == "sharegpt" else "role")
    content_tag = cols.content_tag or ("value" if fmt == "sharegpt" else "content")
    roles = cols.roles or (SHAREGPT_ROLES if fmt == "sharegpt" else MESSAGE_ROLES)
    if not isinstance(turns, list):
        raise BadRecord("turns not a list", f"{where}: the {fmt} format needs a list of turns, got "
                        f"{type(turns).__name__}")
    for k, turn in enumerate(turns):
        speaker = _field(turn, role_tag, f"{where}, turn {k}", fmt)
        if not isinstance(speaker, str) or speaker not in roles:
            raise BadRecord("unknown role", f"{where}, turn {k}: unknown {role_tag} {speaker!r}; expected one of "
                            f"{', '.join(sorted(roles))}")
        content = _field(turn, content_tag, f"{where}, turn {k}", fmt, required=False)
        extra = {key: value for key, value in turn.items() if key not in (role_tag, content_tag)}
        messages.append({**extra, "role": roles[speaker], "content": str(content or "")})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no assistant turn", f"{where}: the conversation has no assistant turn, so nothing to "
                        "learn from")
    tools = _field(record, cols.tools, where, fmt, required=False)
    return messages, tools if isinstance(tools, list) and tools else None
