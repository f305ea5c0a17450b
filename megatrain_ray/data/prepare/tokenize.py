"""Tokenizing: records -> (input_ids, loss_mask) documents, a chunk of records at a time.

`process_chunk` is what a worker process runs (and what one process runs with --workers 1), so the
parallel and the single-process paths give the same documents by construction. Chat records are
rendered and tokenized from a TokenizerSpec (chat_render.py): transformers' own template rendering
without its per-call work, one batched Rust tokenizer call a chunk, and the loss mask (a token is in
the loss iff its start offset falls in an assistant span) placed with numpy for the whole chunk.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatrain_ray.data.prepare.chat_render import (
    ChatRenderer,
    TokenizerSpec,
    chat_documents,
    load_backend,
    spec_from_tokenizer,
    token_byte_lengths,
)
from megatrain_ray.data.prepare.preference import preference_chunk
from megatrain_ray.data.prepare.prompts import prompts_chunk
from megatrain_ray.data.prepare.records import BadRecord, Columns, Item, parse_item, record_text, to_messages
from megatrain_ray.data.prepare.vision_docs import VisionJob, vision_chunk
from megatrain_ray.exceptions import DataError
from megatrain_ray.extras import install_hint

NO_TEMPLATE = ("the tokenizer has no chat template (chat_template in tokenizer_config.json or chat_template.jinja); "
               "use --format text, or add a template to the model directory")


class Tokenizer:
    """The model's tokenizer: chat records through a `TokenizerSpec` (chat_render.py), text, preference and prompt
    records through transformers' AutoTokenizer (from a model directory, hub name or GGUF file), loaded when first
    needed. Without `spec` the spec is taken from AutoTokenizer, so it is exact; a worker gets one checked against
    it."""

    def __init__(self, directory: str, spec: TokenizerSpec | None = None):
        self.directory = directory
        self._tok = None if spec is not None else load_tokenizer(directory)
        self.spec = spec if spec is not None else spec_from_tokenizer(self._tok)
        self._chat: ChatRenderer | None = None
        self._backend: Any = None
        self._byte_lengths: np.ndarray | None | bool = False  # False: not taken yet

    @property
    def tok(self) -> Any:
        """transformers' tokenizer (text, preference and prompts formats, the vocabulary size)."""
        if self._tok is None:
            self._tok = load_tokenizer(self.directory)
        return self._tok

    @property
    def backend(self) -> Any:
        """The Rust tokenizer that transformers' own call runs, truncation and padding off."""
        if self._backend is None:
            self._backend = load_backend(self.spec)
        return self._backend

    @property
    def chat(self) -> ChatRenderer:
        if self._chat is None:
            self._chat = ChatRenderer(self.spec)
        return self._chat

    def info(self) -> tuple[int, bool]:
        """(vocabulary size, whether it has a chat template)."""
        return len(self.tok), self.spec.has_template

    def texts(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Text documents: every token in the loss, an EOS at the end so the model learns to stop."""
        encoded = self.tok(texts, add_special_tokens=True)["input_ids"]
        eos = self.tok.eos_token_id
        docs = []
        for ids in encoded:
            array = np.array([*ids, eos] if eos is not None else ids, dtype=np.int32)
            docs.append((array, np.ones(len(array), dtype=np.uint8)))
        return docs

    def chat_documents(self, texts: list[str], spans: list[list[tuple[int, int]] | None]) -> list[tuple]:
        """Rendered conversations -> (ids, mask); spans None: every token in the loss."""
        if self._byte_lengths is False:
            self._byte_lengths = token_byte_lengths(self.spec.backend_json)
        return chat_documents(self.backend, texts, spans, self._byte_lengths)

    def spans(self, messages: list[dict[str, Any]], tools: list | None, where: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns (ChatRenderer.spans)."""
        return self.chat.spans(messages, tools, where)

    def render(self, messages: list[dict[str, Any]], tools: list | None, generation_prompt: bool, where: str) -> str:
        return self.chat.render(messages, tools, generation_prompt, where)

    def for_training(self, messages: list[dict[str, Any]], tools: list | None, where: str,
                     train_on_inputs: bool) -> tuple[str, list[tuple[int, int]] | None]:
        """The conversation as trained on: its text and the assistant turns' spans (the loss mask), or None for the
        spans when every token trains (--train-on-inputs)."""
        if train_on_inputs:
            return self.render(messages, tools, False, where), None
        return self.spans(messages, tools, where)


def load_tokenizer(directory: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise DataError(f"megatrain prepare needs transformers: {install_hint('hf')}") from exc
    tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    if not tok.is_fast:
        raise DataError(f"the tokenizer in {directory} has no fast (tokenizer.json) version; prepare needs "
                        "token offsets to place the loss mask")
    return tok


def resolve_tokenizer(source: str, revision: str | None) -> str:
    """--tokenizer as a local directory (a hub name fetched, a GGUF file converted once)."""
    from megatrain_ray.system.model_sources import resolve_model_dir  # lazy: a worker process never needs it

    return resolve_model_dir(source, "--tokenizer", Path.cwd(), revision, DataError)


def tokenizer_hash(directory: str) -> str:
    """The manifest's tokenizer_hash: of the files that decide tokens and template."""
    digest = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        path = Path(directory) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------- one chunk of records


@dataclass(slots=True)
class Job:
    """What every chunk shares (sent once to each worker)."""

    fmt: str
    cols: Columns
    seq_len: int
    train_on_inputs: bool
    vision: VisionJob | None = None
    """A vision-language model's chat records: images through its processor (vision_docs.py); None: text only."""


# A chunk's results, in its records' order: ("doc", ids, mask, truncated[, images' bytes]) | ("refused", message) |
# ("dropped", reason, truncated) |
# ("skipped", reason, message) | ("pair", chosen ids, chosen mask, rejected ids, rejected mask, truncated) |
# ("prompt", ids, prompt JSON, columns JSON, column names).
Result = tuple


def process_chunk(tok: Tokenizer, job: Job, chunk: list[tuple[Item, int]]) -> list[Result]:
    """Parse, render and tokenize a chunk of (item, record number) pairs; one batched tokenizer call."""
    if job.fmt == "preference":
        return preference_chunk(tok, job, chunk)
    if job.fmt == "prompts":
        return prompts_chunk(tok, chunk)
    if job.vision is not None:
        return vision_chunk(tok, job, chunk)
    results: list[Result | None] = [None] * len(chunk)
    texts, spans, slots = [], [], []
    for k, (item, number) in enumerate(chunk):
        try:
            where, record = parse_item(item, number)
            if job.fmt == "text":
                text = record_text(record, job.cols, where)
                if not text.strip():
                    results[k] = ("dropped", "empty text", False)
                    continue
                texts.append(text)
                spans.append(None)
            else:
                messages, tools = to_messages(record, job.fmt, job.cols, where)
                text, turn_spans = tok.for_training(messages, tools, where, job.train_on_inputs)
                texts.append(text)
                spans.append(turn_spans)
            slots.append(k)
        except BadRecord as exc:
            results[k] = ("skipped", exc.reason, str(exc))
    if texts and job.fmt == "text":
        docs = tok.texts(texts)
    elif texts:
        docs = tok.chat_documents(texts, spans)
    else:
        docs = []
    for k, (ids, mask) in zip(slots, docs):
        truncated = bool(job.seq_len and len(ids) > job.seq_len)
        if truncated:
            ids, mask = ids[:job.seq_len], mask[:job.seq_len]
        if not mask[1:].any():  # the first token is never a target: it has no context
            results[k] = ("dropped", "no loss tokens (after truncation)" if job.seq_len else "no loss tokens",
                          truncated)
        else:
            results[k] = ("doc", ids, mask, truncated)
    return results  # type: ignore[return-value]
