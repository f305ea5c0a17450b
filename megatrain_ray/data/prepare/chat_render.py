"""Chat records -> (input_ids, loss_mask) documents without transformers' per-call work or its import.

A `TokenizerSpec` is everything a chat document depends on: the Rust tokenizer (its JSON), the chat
template (without and with tools) and the special tokens the template sees. Taken from transformers'
AutoTokenizer (`spec_from_tokenizer`) it is exact by construction; read from the model directory's
files (`spec_from_files`) it costs milliseconds and needs neither transformers' model classes nor torch,
so a worker process starts in a fraction of a second. The pipeline starts its workers with the second
and compares it with the first while they run (pipeline.py), so a directory whose files transformers
reads differently is never used as read.

`ChatRenderer` renders as `apply_chat_template(..., tokenize=False)` does (transformers'
tokenization_utils_base.apply_chat_template and chat_template_utils.render_jinja_template, step for
step, in transformers' own compiled jinja environment), once per conversation for the work shared by
its prefixes: the messages are converted once and each prefix render is a slice of them (every step
of the conversion is message by message). A template of the ChatML family that chat_assembled.py
recognises from its syntax tree (SmolLM2's, plain ChatML) is rendered without Jinja, as the
concatenation of one piece per message, which is exactly the string Jinja renders; transformers'
module is then never imported. `chat_documents` tokenizes a chunk in one batched call and places the
loss mask for the whole chunk with numpy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from megatrain_ray.data.prepare.chat_assembled import assembled_template
from megatrain_ray.data.prepare.records import BadRecord
from megatrain_ray.exceptions import DataError

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names its special_tokens_map holds, so the template sees.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    backend_json: str
    """The Rust tokenizer (tokenizers.Tokenizer.to_str()), truncation and padding off."""
    template: str | None
    """get_chat_template() for a conversation without tools; None: it has none."""
    tool_template: str | None
    """get_chat_template() for a conversation with tools (a "tool_use" named template, if any)."""
    has_template: bool
    special_tokens: tuple[tuple[str, str], ...]
    """special_tokens_map's items, which every render passes to the template."""


def spec_from_tokenizer(tok: Any) -> TokenizerSpec:
    """What transformers' own tokenizer `tok` renders and tokenizes with."""
    backend = tok.backend_tokenizer
    if backend.truncation is not None:  # transformers switches both off for a call without them
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()

    def template(tools: list | None) -> str | None:
        try:
            return tok.get_chat_template(None, tools)
        except ValueError:  # no template (or several and no default): every chat render fails
            return None
    return TokenizerSpec(backend.to_str(), template(None), template([]), bool(tok.chat_template),
                         tuple(tok.special_tokens_map.items()))


def spec_from_files(directory: str) -> TokenizerSpec | None:
    """The spec as the directory's files spell it (tokenizer.json, chat_template.jinja, tokenizer_config.json),
    or None where they do not say it plainly (no tokenizer.json, no template or several named ones)."""
    from tokenizers import Tokenizer as Backend

    root = Path(directory)
    try:
        config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
        backend = Backend.from_file(str(root / "tokenizer.json"))
    except Exception:  # whatever it is (missing, not JSON, not a tokenizer), transformers' own reading decides
        return None
    jinja = root / "chat_template.jinja"
    template = jinja.read_text(encoding="utf-8") if jinja.is_file() else config.get("chat_template")
    if not isinstance(template, str) or not template or (root / "additional_chat_templates").exists():
        return None
    specials = []
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if value is not None:
            specials.append((name, str(value)))
    backend.no_truncation()
    backend.no_padding()
    return TokenizerSpec(backend.to_str(), template, template, True, tuple(specials))


def load_backend(spec: TokenizerSpec) -> Any:
    from tokenizers import Tokenizer as Backend

    return Backend.from_str(spec.backend_json)


class ChatRenderer:
    """apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=...) from a spec."""

    def __init__(self, spec: TokenizerSpec):
        self.spec = spec
        self._steps: tuple | None = None
        self.template_kwargs: dict[str, Any] = {}

    def _transformers_steps(self) -> tuple:
        """transformers' private steps of apply_chat_template, imported on the first Jinja render: only this module
        of transformers (no torch, no model classes); used as they are, so the render is transformers' own
        (pyproject pins the version). A template chat_assembled.py renders never needs them."""
        if self._steps is None:
            try:
                from transformers.utils.chat_template_utils import (
                    _alias_reasoning_fields,
                    _compile_jinja_template,
                    _plain_template_data,
                )
            except ImportError as exc:
                raise DataError(f"megatrain prepare needs transformers' chat-template steps ({exc}); install the "
                                "version pyproject.toml pins: pip install -e '.[hf]'") from None
            self.template_kwargs = _plain_template_data(dict(self.spec.special_tokens))
            self._steps = (_alias_reasoning_fields, _compile_jinja_template, _plain_template_data)
        return self._steps

    def _assembled(self, messages: list[dict[str, Any]], tools: list | None) -> list[str] | None:
        """Each message's piece of the render where the template is one chat_assembled.py renders exactly
        (conversations without tools only); None: Jinja renders it."""
        if tools is not None:
            return None
        assembled = assembled_template(self.spec.template)
        return assembled.pieces(messages) if assembled is not None else None

    def _prepared(self, messages: list[dict[str, Any]], tools: list | None) -> tuple[Any, list, dict[str, Any]]:
        """(compiled template, converted messages, the template's variables but messages and add_generation_prompt):
        the work every prefix render shares."""
        template = self.spec.tool_template if tools is not None else self.spec.template
        if template is None:
            raise ValueError("the tokenizer has no chat template for this conversation")
        if tools is not None and not all(isinstance(tool, dict) for tool in tools):
            raise ValueError("Tools should either be a JSON schema, or a callable function with type hints "
                             "and a docstring suitable for auto-conversion to a schema.")
        alias, compile_template, plain = self._transformers_steps()
        chat = plain([{k: v for k, v in m.items() if v is not None} for m in messages])
        for message in chat:
            if not isinstance(message, dict):
                raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        compiled = compile_template(template)
        # What Template.render(**variables) puts in a new context: its globals, overridden by the variables.
        variables = {**compiled.globals, **self.template_kwargs,
                     "tools": plain(list(tools) if tools is not None else None), "documents": None}
        return compiled, alias(chat), variables

    def render(self, messages: list[dict[str, Any]], tools: list | None, generation_prompt: bool, where: str) -> str:
        if not messages:
            return ""
        pieces = self._assembled(messages, tools)
        if pieces is not None:
            return "".join(pieces) + (assembled_template(self.spec.template).prompt if generation_prompt else "")
        self._transformers_steps()  # its DataError is not the record's
        with _bad_template(where):
            template, chat, variables = self._prepared(messages, tools)
            return self._render(template, chat, variables, generation_prompt)

    @staticmethod
    def _render(template: Any, chat: list, variables: dict[str, Any], generation_prompt: bool) -> str:
        """Template.render(messages=chat, add_generation_prompt=..., **variables), without copying the variables
        into a new dict with the template's globals on every render of a conversation's prefixes."""
        if not chat:
            return ""
        context = template.new_context({**variables, "messages": chat, "add_generation_prompt": generation_prompt},
                                       shared=True)
        try:
            return template.environment.concat(template.root_render_func(context))
        except Exception:
            template.environment.handle_exception()  # raises it, its traceback pointing into the template
            raise

    def spans(self, messages: list[dict[str, Any]], tools: list | None, where: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns: turn i spans from the end
        of the conversation before it (with the generation prompt) to the end of the conversation through it."""
        pieces = self._assembled(messages, tools)
        if pieces is not None:
            return self._assembled_spans(messages, pieces, where)
        self._transformers_steps()
        with _bad_template(where):
            template, chat, variables = self._prepared(messages, tools)
            full = self._render(template, chat, variables, False)
            spans = []
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                before = self._render(template, chat[:i], variables, True)
                through = full if i == len(messages) - 1 else self._render(template, chat[:i + 1], variables, False)
                if not (through.startswith(before) and full.startswith(through)):
                    raise BadRecord("template not a prefix", f"{where}: the chat template does not render a "
                                    "conversation as a prefix of its continuation, so the assistant turns cannot be "
                                    "located")
                spans.append((len(before), len(through)))
        return full, spans

    def _assembled_spans(self, messages: list[dict[str, Any]], pieces: list[str],
                         where: str) -> tuple[str, list[tuple[int, int]]]:
        """spans() from the messages' pieces, with the same renders in lengths: the render of messages[:k] is the
        first k pieces joined ("" for none), with the generation prompt after it when asked (never after none:
        an empty conversation renders as ""). So turn i's `before` is a prefix of its `through` iff piece i starts
        with the prompt (or i is 0), and `through` is always a prefix of the whole."""
        prompt = assembled_template(self.spec.template).prompt
        spans = []
        end = 0
        for i, (message, piece) in enumerate(zip(messages, pieces)):
            start, end = end, end + len(piece)
            if message["role"] != "assistant":
                continue
            if i and not piece.startswith(prompt):
                raise BadRecord("template not a prefix", f"{where}: the chat template does not render a "
                                "conversation as a prefix of its continuation, so the assistant turns cannot be "
                                "located")
            spans.append((start + len(prompt) if i else 0, end))
        return "".join(pieces), spans


class _bad_template:
    """Any error of a render (the template's own raise_exception, a field it cannot read) -> BadRecord."""

    def __init__(self, where: str):
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, BadRecord) or not isinstance(exc, Exception):
            return False
        raise BadRecord("chat template error", f"{self.where}: the chat template cannot render the conversation: "
                        f"{type(exc).__name__}: {str(exc)[:200]}") from None


def _byte_level_alphabet() -> frozenset[str]:
    """The 256 characters a byte-level tokenizer spells bytes with (GPT-2's bytes_to_unicode): one byte each."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return frozenset(chr(c) for c in [*kept, *(256 + k for k in range(len(moved)))])


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def token_byte_lengths(backend_json: str) -> np.ndarray | None:
    """Each token id's length in bytes of the text, where the tokenizer provably cuts a text into tokens whose bytes
    are the text's, in order, with offsets that say so: no normalizer; a pre-tokenizer of splits that remove
    nothing (Split) then ByteLevel without a prefix space; a BPE model over the byte-level alphabet (no byte
    fallback, dropout, prefix or suffix; with an unknown token, every one of the 256 characters a token, so it is
    never used; without one, a character not in the vocabulary is left out, which chat_documents sees: the tokens
    spell fewer bytes than the text, and it reads the offsets instead); added tokens that
    absorb no whitespace (no lstrip, rstrip); a post-processor that leaves offsets as they are (TemplateProcessing,
    which adds nothing without special tokens, or ByteLevel without trim_offsets). Then a token's start offset is
    the character holding the first of its bytes, which the cumulated lengths give (chat_documents). -1: an id that
    no such text produces; None: a tokenizer otherwise (its offsets are read from the tokenizer)."""
    try:
        config = json.loads(backend_json)
        model = config["model"]
        vocab = model["vocab"]
        added = config.get("added_tokens") or []
        if config.get("normalizer") is not None or not _splits_then_byte_level(config.get("pre_tokenizer")) \
                or not _offsets_kept(config.get("post_processor")):
            return None
        if (model.get("type") != "BPE" or model.get("byte_fallback") or model.get("dropout")
                or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix")
                or not isinstance(vocab, dict)
                or (model.get("unk_token") is not None and not all(c in vocab for c in BYTE_LEVEL_ALPHABET))):
            return None
        if any(token.get("lstrip") or token.get("rstrip") for token in added):
            return None
        lengths = np.full(max([*vocab.values(), *(token["id"] for token in added)], default=-1) + 1, -1, np.int64)
        for token, i in vocab.items():
            if all(c in BYTE_LEVEL_ALPHABET for c in token):
                lengths[i] = len(token)
        for token in added:
            lengths[token["id"]] = len(token["content"].encode("utf-8"))
        return lengths
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _splits_then_byte_level(pre: Any) -> bool:
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    if not steps or not all(isinstance(step, dict) for step in steps):
        return False
    last = steps[-1]
    return (last.get("type") == "ByteLevel" and last.get("add_prefix_space") is False
            and all(step.get("type") == "Split" and step.get("behavior") != "Removed" for step in steps[:-1]))


def _offsets_kept(post: Any) -> bool:
    if post is None:
        return True
    steps = post.get("processors") if isinstance(post, dict) and post.get("type") == "Sequence" else [post]
    return isinstance(steps, list) and all(
        isinstance(step, dict) and (step.get("type") == "TemplateProcessing"
                                    or (step.get("type") == "ByteLevel" and step.get("trim_offsets") is False))
        for step in steps)


def chat_documents(backend: Any, texts: list[str], spans: list[list[tuple[int, int]] | None],
                   byte_lengths: np.ndarray | None = None) -> list[tuple]:
    """Rendered conversations -> (ids int32, mask uint8) each; spans None: every token in the loss. A token is in
    the loss iff its start offset falls in one of its conversation's spans [a, b): with every position of the
    chunk counted from its conversation's base, the spans with a <= start less those with b <= start (binary
    searches over the sorted starts and ends; a <= b) are the spans holding it. Memory: the chunk's tokens.

    byte_lengths (token_byte_lengths): the tokenizer's offsets follow from the tokens' lengths, so the chunk is
    tokenized without offsets (a quarter less time) and each start is placed in bytes: a token starting in the
    character at c starts at a byte in [B(c), B(c + 1)), and spans end on characters, so its start is in [a, b)
    iff its first byte is in [B(a), B(b)). Where a conversation's token bytes do not add up to its text's (never,
    for such a tokenizer), the chunk is tokenized again with offsets."""
    masked = [d for d, s in enumerate(spans) if s is not None]
    if not masked or byte_lengths is not None:
        encodings = getattr(backend, "encode_batch_fast", backend.encode_batch)(texts, add_special_tokens=False)
    else:
        encodings = backend.encode_batch(texts, add_special_tokens=False)
    lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
    bounds = np.zeros(len(encodings) + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    ids = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=np.int32, count=int(bounds[-1]))
    mask = np.ones(len(ids), dtype=np.uint8)
    if masked:
        tokens = np.concatenate([np.arange(bounds[d], bounds[d + 1]) for d in masked])
        located = None
        if byte_lengths is not None:
            located = _byte_starts(texts, spans, masked, ids[tokens], lengths[masked], byte_lengths)
            if located is None:
                encodings = backend.encode_batch(texts, add_special_tokens=False)  # the same ids, with offsets
        if located is None:
            located = _char_starts(texts, spans, masked, encodings, lengths[masked])
        token_starts, span_starts, span_ends = located
        holding = (np.searchsorted(span_starts, token_starts, side="right")
                   - np.searchsorted(span_ends, token_starts, side="right"))
        mask[tokens] = holding > 0
    return [(ids[bounds[d]:bounds[d + 1]], mask[bounds[d]:bounds[d + 1]]) for d in range(len(texts))]


def _char_starts(texts: list[str], spans: list, masked: list[int], encodings: list,
                 counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token starts, sorted span starts, sorted span ends) in characters, the tokens' from their offsets."""
    # Conversation d's positions from base[d], one spare each: a span's end never reaches the next conversation.
    base = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter((len(t) + 1 for t in texts), dtype=np.int64, count=len(texts)), out=base[1:])
    span_starts = np.sort(np.array([base[d] + a for d in masked for a, _ in spans[d]], dtype=np.int64))
    span_ends = np.sort(np.array([base[d] + b for d in masked for _, b in spans[d]], dtype=np.int64))
    token_starts = np.fromiter((s for d in masked for s, _ in encodings[d].offsets), dtype=np.int64,
                               count=int(counts.sum()))
    token_starts += np.repeat(base[masked], counts)
    return token_starts, span_starts, span_ends


def _byte_starts(texts: list[str], spans: list, masked: list[int], token_ids: np.ndarray, counts: np.ndarray,
                 byte_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """_char_starts in bytes from the tokens' byte lengths (chat_documents); None where a conversation's tokens do not
    spell exactly its text's bytes."""
    if len(token_ids) and int(token_ids.max()) >= len(byte_lengths):
        return None
    token_bytes = byte_lengths[token_ids]
    if len(token_bytes) and int(token_bytes.min()) < 0:
        return None
    ends = np.zeros(len(token_bytes) + 1, dtype=np.int64)
    np.cumsum(token_bytes, out=ends[1:])
    first = np.zeros(len(masked) + 1, dtype=np.int64)
    np.cumsum(counts, out=first[1:])
    text_bytes = np.fromiter((len(texts[d].encode("utf-8")) for d in masked), dtype=np.int64, count=len(masked))
    if not np.array_equal(ends[first[1:]] - ends[first[:-1]], text_bytes):
        return None
    # Conversation k's positions from base[k] (its bytes after those before it), one spare each, as _char_starts.
    spare = np.arange(len(masked), dtype=np.int64)
    base = ends[first[:-1]] + spare
    token_starts = ends[:-1] + np.repeat(spare, counts)

    def byte_at(text: str, char: int) -> int:
        return char if text.isascii() else len(text[:char].encode("utf-8"))
    span_starts = np.sort(np.array([base[k] + byte_at(texts[d], a) for k, d in enumerate(masked) for a, _ in spans[d]],
                                   dtype=np.int64))
    span_ends = np.sort(np.array([base[k] + byte_at(texts[d], b) for k, d in enumerate(masked) for _, b in spans[d]],
                                 dtype=np.int64))
    return token_starts, span_starts, span_ends
