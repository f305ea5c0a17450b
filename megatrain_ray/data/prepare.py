"""`megatrain prepare`: text and chat/instruction records -> tokenized pyarrow shards with a loss mask.

    records (jsonl / json / parquet / txt)          one of: text, alpaca, sharegpt, messages
      -> documents: token ids + loss mask         text: every token; chat: the assistant turns only
      -> seeded shuffle, split train / eval
      -> OUT/train-00000.parquet ..., OUT/eval-00000.parquet, OUT/manifest.json

Columns: `input_ids` (list<int32>) and `loss_mask` (list<uint8>, 1 where the token is a target).
Chat records go through the tokenizer's own chat template; the assistant's part of each turn is
found by rendering the conversation up to that turn, so any template that renders a conversation
as a prefix of its continuation works. The output directory appears at once, complete, or not at
all. A `dataset_info.json` registry in LLaMA-Factory's style can name files, format and columns.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from megatrain_ray.exceptions import DataError
from megatrain_ray.observe.log import get_logger
from megatrain_ray.system.files import atomic_directory, contained, read_json_object, read_text_file, refuse_existing
from megatrain_ray.system.model_sources import resolve_model_dir

log = get_logger(__name__)

FORMATS = ("text", "alpaca", "sharegpt", "messages")
MANIFEST = "manifest.json"
DOCS_PER_SHARD = 50_000
# ShareGPT speaker names -> chat roles (LLaMA-Factory's defaults, plus the OpenAI names).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(slots=True)
class PrepareOptions:
    tokenizer_dir: str
    format: str | None
    """One of FORMATS; None takes the registry entry's `formatting`, else text."""
    inputs: list[str]
    output_dir: str
    seq_len: int = 0
    """Documents longer than this many tokens are truncated (and counted); 0 never truncates."""
    seed: int = 0
    eval_fraction: float = 0.0
    registry: str | None = None
    dataset: str | None = None
    revision: str | None = None
    """The hub revision of --tokenizer when it is a hub name."""


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


# ----------------------------------------------------------------------------- reading records


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a jsonl, json (a list), parquet or txt (the whole file is one text) file."""
    if not path.is_file():
        raise DataError(f"input file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        yield {"text": read_text_file(path, f"input file {str(path)!r}", DataError, limit=1 << 40)}
    elif suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            n = 0
            try:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        yield json.loads(line)
            except UnicodeDecodeError:
                raise DataError(f"{path}:{n + 1} is not UTF-8 text: save the file as UTF-8") from None
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{n} is not valid JSON: {exc}") from None
    elif suffix == ".json":
        try:
            data = json.loads(read_text_file(path, f"input file {str(path)!r}", DataError, limit=1 << 40))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(data, list):
            raise DataError(f"{path} must hold a JSON list of records (or use .jsonl, one record per line)")
        yield from data
    elif suffix == ".parquet":
        yield from pq.read_table(path).to_pylist()
    else:
        raise DataError(f"input file {str(path)!r}: unknown type {suffix!r}; use .jsonl, .json, .parquet or .txt")


def _field(record: Any, name: str, where: str, fmt: str, required: bool = True) -> Any:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    value = record.get(name)
    if required and (value is None or value == ""):
        raise DataError(f"{where}: the {fmt} format needs the field {name!r}, which is missing or empty "
                        f"(fields present: {', '.join(sorted(record)) or 'none'})")
    return value


def to_messages(record: Any, fmt: str, cols: Columns, where: str) -> list[dict[str, str]]:
    """A chat record as [{"role", "content"}] with at least one assistant turn. As in LLaMA-Factory, a
    `system` field becomes the first message and alpaca's `history` ([prompt, reply] pairs) the turns
    before the instruction; every assistant turn is learned."""
    system = _field(record, cols.system, where, fmt, required=False)
    messages = [{"role": "system", "content": str(system)}] if system else []
    if fmt == "alpaca":
        prompt = str(_field(record, cols.prompt, where, fmt))
        query = _field(record, cols.query, where, fmt, required=False)
        for k, pair in enumerate(_field(record, "history", where, fmt, required=False) or []):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise DataError(f"{where}: history entry {k} must be a [prompt, reply] pair")
            messages += [{"role": "user", "content": str(pair[0])}, {"role": "assistant", "content": str(pair[1])}]
        messages.append({"role": "user", "content": f"{prompt}\n{query}" if query else prompt})
        messages.append({"role": "assistant", "content": str(_field(record, cols.response, where, fmt))})
        return messages
    turns = _field(record, cols.messages or ("conversations" if fmt == "sharegpt" else "messages"), where, fmt)
    role_tag = cols.role_tag or ("from" if fmt == "sharegpt" else "role")
    content_tag = cols.content_tag or ("value" if fmt == "sharegpt" else "content")
    roles = cols.roles or (SHAREGPT_ROLES if fmt == "sharegpt" else {r: r for r in ("system", "user", "assistant")})
    if not isinstance(turns, list):
        raise DataError(f"{where}: the {fmt} format needs a list of turns, got {type(turns).__name__}")
    for k, turn in enumerate(turns):
        speaker = _field(turn, role_tag, f"{where}, turn {k}", fmt)
        if speaker not in roles:
            raise DataError(f"{where}, turn {k}: unknown {role_tag} {speaker!r}; expected one of "
                            f"{', '.join(sorted(roles))}")
        messages.append({"role": roles[speaker], "content": str(_field(turn, content_tag, f"{where}, turn {k}",
                                                                       fmt, required=False) or "")})
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing to learn from")
    return messages


# ----------------------------------------------------------------------------- tokenizing


class Tokenizer:
    """The model's tokenizer (transformers AutoTokenizer from a model directory, hub name or GGUF file) and
    its chat template."""

    def __init__(self, source: str, revision: str | None = None):
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise DataError("megatrain prepare needs transformers: pip install 'megatrain-ray[hf]'") from exc
        directory = resolve_model_dir(source, "--tokenizer", Path.cwd(), revision, DataError)
        path = Path(directory)
        self.tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        if not self.tok.is_fast:
            raise DataError(f"the tokenizer in {directory} has no fast (tokenizer.json) version; prepare needs "
                            "token offsets to place the loss mask")
        self.vocab_size = len(self.tok)
        self.hash = _files_hash(path, ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                       "chat_template.jinja"))

    def text(self, text: str) -> tuple[list[int], list[int]]:
        ids = self.tok(text, add_special_tokens=True)["input_ids"]
        if self.tok.eos_token_id is not None:
            ids = [*ids, self.tok.eos_token_id]  # documents end, so the model learns to stop
        return ids, [1] * len(ids)

    def chat(self, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[int]]:
        if not self.tok.chat_template:
            raise DataError("the tokenizer has no chat template (chat_template in tokenizer_config.json or "
                            "chat_template.jinja); use --format text, or add a template to the model directory")
        render = self._render
        full = render(messages, generation_prompt=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = render(messages[:i], generation_prompt=True), render(messages[:i + 1], False)
            if not (through.startswith(before) and full.startswith(through)):
                raise DataError(f"{where}: the chat template does not render a conversation as a prefix of its "
                                "continuation, so the assistant turns cannot be located")
            spans.append((len(before), len(through)))
        encoded = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(a <= start < b for a, b in spans)) for start, _ in encoded["offset_mapping"]]
        return list(encoded["input_ids"]), mask

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _files_hash(directory: Path, names: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for name in names:
        if (directory / name).is_file():
            digest.update(name.encode() + b"\0" + (directory / name).read_bytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------- the command


def resolve_inputs(opts: PrepareOptions) -> tuple[list[Path], str, Columns]:
    """Files, format and field names, from the command line or a dataset_info.json entry."""
    cols = Columns()
    if not opts.registry:
        if not opts.inputs:
            raise DataError("give --input FILE... or --registry dataset_info.json --dataset NAME")
        fmt = opts.format or "text"
        return [Path(p) for p in opts.inputs], fmt, cols
    registry = Path(opts.registry)
    if not registry.is_file():
        raise DataError(f"--registry {opts.registry!r} is not a file; give a dataset_info.json")
    entries = read_json_object(registry, f"--registry {opts.registry!r}", DataError)
    if opts.dataset not in entries:
        raise DataError(f"--dataset {opts.dataset!r} is not in {registry}; it names: {', '.join(sorted(entries))}")
    entry = entries[opts.dataset]
    if not isinstance(entry, dict):
        raise DataError(f"--registry {opts.registry!r}: the entry of {opts.dataset!r} is not a JSON object")
    where = f"--registry {opts.registry!r} ({opts.dataset})"
    files = [contained(registry.parent, entry["file_name"], where, DataError)] if "file_name" in entry else []
    files += [Path(p) for p in opts.inputs]
    fmt = opts.format or entry.get("formatting", "alpaca")
    renames = entry.get("columns", {})
    tags = entry.get("tags", {})
    cols = Columns(prompt=renames.get("prompt", cols.prompt), query=renames.get("query", cols.query),
                   response=renames.get("response", cols.response), system=renames.get("system", cols.system),
                   messages=renames.get("messages", ""), role_tag=tags.get("role_tag", ""),
                   content_tag=tags.get("content_tag", ""))
    if tags:
        cols.roles = {tags.get("user_tag", "human"): "user", tags.get("assistant_tag", "gpt"): "assistant",
                      tags.get("system_tag", "system"): "system"}
    if fmt == "sharegpt" and cols.role_tag == "role":  # LLaMA-Factory spells the OpenAI format this way
        fmt = "messages"
    return files, fmt, cols


def prepare(opts: PrepareOptions) -> dict[str, Any]:
    """Tokenize, shuffle, split and write; returns the manifest."""
    t0 = time.perf_counter()
    files, fmt, cols = resolve_inputs(opts)
    if fmt not in FORMATS:
        raise DataError(f"format {fmt!r} is not supported; use one of {', '.join(FORMATS)}")
    if not 0 <= opts.eval_fraction < 1:
        raise DataError(f"--eval-fraction {opts.eval_fraction} must be in [0, 1)")
    if opts.seq_len < 0:
        raise DataError(f"--seq-len {opts.seq_len} must be >= 0 (the longest document in tokens; 0: never truncate)")
    out = Path(opts.output_dir)
    refuse_existing(out, DataError, "--output")  # before the tokenizing, which takes the time
    tok = Tokenizer(opts.tokenizer_dir, opts.revision)
    docs: list[tuple[list[int], list[int]]] = []
    dropped: Counter[str] = Counter()
    truncated = records = 0
    for path in files:
        before = records
        for n, record in enumerate(read_records(path)):
            records += 1
            where = f"{path} record {n}"
            if fmt == "text":
                text = str(_field(record, cols.text, where, fmt, required=False) or "")
                if not text.strip():
                    dropped["empty text"] += 1
                    continue
                ids, mask = tok.text(text)
            else:
                ids, mask = tok.chat(to_messages(record, fmt, cols, where), where)
            if opts.seq_len and len(ids) > opts.seq_len:
                ids, mask = ids[:opts.seq_len], mask[:opts.seq_len]
                truncated += 1
            if not any(mask[1:]):  # the first token is never a target: it has no context
                dropped["no loss tokens (after truncation)" if opts.seq_len else "no loss tokens"] += 1
                continue
            docs.append((ids, mask))
            if records % 10_000 == 0:
                log.info("prepare: %d records, %d documents (%.0f s)", records, len(docs), time.perf_counter() - t0)
        if records == before:
            raise DataError(f"input file {str(path)!r} holds no records")
    if not docs:
        raise DataError(f"no usable documents in {', '.join(map(str, files))} (dropped: {dict(dropped)})")
    order = np.random.default_rng(opts.seed).permutation(len(docs))
    n_eval = min(len(docs) - 1, round(len(docs) * opts.eval_fraction)) if opts.eval_fraction else 0
    splits = {"train": [docs[i] for i in order[n_eval:]]}
    if n_eval:
        splits["eval"] = [docs[i] for i in order[:n_eval]]
    manifest: dict[str, Any] = {
        "format_version": 1, "format": fmt, "inputs": [str(p) for p in files], "tokenizer": str(opts.tokenizer_dir),
        "tokenizer_hash": tok.hash, "vocab_size": tok.vocab_size, "seed": opts.seed, "seq_len": opts.seq_len,
        "records": records, "documents": len(docs), "truncated": truncated, "dropped": dict(dropped), "splits": {},
    }
    with atomic_directory(out, DataError, "--output") as tmp:
        for split, split_docs in splits.items():
            manifest["splits"][split] = _write_split(tmp, split, split_docs)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    summary = ", ".join(f"{k}: {v['documents']} documents, {v['tokens']} tokens ({v['loss_tokens']} in the loss)"
                        for k, v in manifest["splits"].items())
    log.info("prepare: %d records -> %s; %d truncated, dropped %s; wrote %s (%.1f s)", records, summary, truncated,
             dict(dropped) or "none", out, time.perf_counter() - t0)
    return manifest


def _write_split(directory: Path, split: str, docs: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    files = []
    for k, start in enumerate(range(0, len(docs), DOCS_PER_SHARD)):
        chunk = docs[start:start + DOCS_PER_SHARD]
        table = pa.table({"input_ids": pa.array([d[0] for d in chunk], type=pa.list_(pa.int32())),
                          "loss_mask": pa.array([d[1] for d in chunk], type=pa.list_(pa.uint8()))})
        name = f"{split}-{k:05d}.parquet"
        pq.write_table(table, directory / name)
        files.append(name)
    return {"files": files, "documents": len(docs), "tokens": sum(len(d[0]) for d in docs),
            "loss_tokens": sum(sum(d[1]) for d in docs), "max_document_tokens": max(len(d[0]) for d in docs)}
