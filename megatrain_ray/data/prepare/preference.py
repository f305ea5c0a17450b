"""Preference records (`--format preference`) -> pairs of documents (chosen, rejected) for DPO.

Accepted layouts, detected per record:
  TRL standard            {"prompt": str, "chosen": str, "rejected": str}
  TRL conversational      {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
  TRL implicit prompt     {"chosen": str | [messages], "rejected": ...}: the prompt is their common prefix
  LLaMA-Factory sharegpt  {"conversations": [{"from", "value"}...], "chosen": {"from", "value"}, "rejected": {...}}
                          (`system`, `tools` as in its sft layout; role/content turns too)
  LLaMA-Factory alpaca    {"instruction": str, "input": str, "chosen": str, "rejected": str} (`system`, `history`)

Tokenized as TRL's DPOTrainer does (trl/trainer/dpo_trainer.py, _prepare_dataset and the collator):
conversations through the chat template (the prompt with the generation prompt, prompt + completion
without), standard text through the tokenizer with its special tokens and an EOS appended to each
completion that lacks one; the completion starts where the tokenized prompt and prompt + completion
diverge; the loss mask holds the completion tokens only. --seq-len N keeps the first N tokens of each
sequence, and drops a pair whose prompt alone fills N tokens (TRL's keep_start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from megatrain_ray.data.prepare.records import (
    MESSAGE_ROLES,
    SHAREGPT_ROLES,
    BadRecord,
    Columns,
    _field,
    parse_item,
    to_messages,
)

Completion = str | list[dict[str, Any]]


@dataclass(slots=True)
class PreferenceRecord:
    prompt: Completion
    chosen: Completion
    rejected: Completion
    tools: list | None
    conversational: bool


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def _common_prefix(a: Any, b: Any) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _implicit_prompt_length(chosen: Any, rejected: Any) -> int:
    """The prompt's length in TRL's extract_prompt: up to the first difference, less a space just before it
    (so the completions start with it); where one is a prefix of the other, TRL stops one short of the end."""
    n = 0
    for n in range(min(len(chosen), len(rejected))):
        if chosen[n] != rejected[n]:
            if n > 0 and chosen[n - 1] == " ":
                n -= 1
            break
    return n


def _turn(value: Any, where: str, name: str, role_tag: str, content_tag: str, roles: dict[str, str]) -> dict:
    """A LLaMA-Factory chosen/rejected turn ({role_tag: speaker, content_tag: text}) as an assistant message."""
    if not isinstance(value, dict):
        raise BadRecord(f"bad {name!r}", f"{where}: {name!r} must be one turn, a JSON object with {role_tag!r} and "
                        f"{content_tag!r}, got {type(value).__name__}")
    speaker, content = value.get(role_tag), value.get(content_tag)
    if roles.get(speaker) != "assistant" or content is None:
        raise BadRecord(f"bad {name!r}", f"{where}: {name!r} must be an assistant turn with its text in "
                        f"{content_tag!r}; got {role_tag} {speaker!r}")
    return {"role": "assistant", "content": str(content)}


def to_preference(record: Any, cols: Columns, where: str) -> PreferenceRecord:
    """One record in any accepted layout (module docstring); BadRecord names the record and what is missing."""
    if not isinstance(record, dict):
        raise BadRecord("not a JSON object", f"{where}: expected a JSON object, got {type(record).__name__}")
    for name in ("chosen", "rejected"):
        if record.get(name) in (None, "", []):
            raise BadRecord(f"missing {name!r}", f"{where}: a preference record needs the field {name!r}, which is "
                            f"missing or empty (fields present: {', '.join(sorted(record)) or 'none'})")
    chosen, rejected = record["chosen"], record["rejected"]
    conversation = cols.messages or "conversations"
    if conversation in record or (isinstance(chosen, dict) and "messages" in record):
        # LLaMA-Factory's sharegpt layout (or its OpenAI spelling): the prompt turns read as its sft layout reads
        # them, through to_messages, which wants an assistant turn: a placeholder one is added, then dropped.
        fmt, turns = ("sharegpt", conversation) if conversation in record else ("messages", "messages")
        role_tag = cols.role_tag or ("from" if fmt == "sharegpt" else "role")
        content_tag = cols.content_tag or ("value" if fmt == "sharegpt" else "content")
        roles = cols.roles or (SHAREGPT_ROLES if fmt == "sharegpt" else MESSAGE_ROLES)
        assistant = next(speaker for speaker, role in roles.items() if role == "assistant")
        if not isinstance(record[turns], list):
            raise BadRecord("turns not a list", f"{where}: {turns!r} must be a list of turns, got "
                            f"{type(record[turns]).__name__}")
        placeholder = {role_tag: assistant, content_tag: ""}
        messages, tools = to_messages({**record, turns: [*record[turns], placeholder]}, fmt, cols, where)
        return PreferenceRecord(messages[:-1], [_turn(chosen, where, "chosen", role_tag, content_tag, roles)],
                                [_turn(rejected, where, "rejected", role_tag, content_tag, roles)], tools, True)
    if cols.prompt in record and "prompt" not in record:  # LLaMA-Factory alpaca
        messages, _ = to_messages({**record, cols.response: "-"}, "alpaca", cols, where)
        for name, value in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, str):
                raise BadRecord(f"bad {name!r}", f"{where}: the alpaca preference layout needs {name!r} as a string, "
                                f"got {type(value).__name__}")
        return PreferenceRecord(messages[:-1], [{"role": "assistant", "content": chosen}],
                                [{"role": "assistant", "content": rejected}], None, True)
    tools = record.get("tools") if isinstance(record.get("tools"), list) and record.get("tools") else None
    prompt = record.get("prompt")
    if prompt is None:  # TRL's implicit prompt: the common prefix (of turns, or of characters)
        if type(chosen) is not type(rejected):
            raise BadRecord("mixed layouts", f"{where}: 'chosen' and 'rejected' must both be strings or both be "
                            "message lists")
        n = _implicit_prompt_length(chosen, rejected)
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    conversational = _is_messages(prompt) or _is_messages(chosen)
    for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if conversational and not (_is_messages(value) or (name == "prompt" and value == [])):
            raise BadRecord("mixed layouts", f"{where}: {name!r} must be a list of messages like the other fields "
                            f"(TRL's conversational layout), got {type(value).__name__}")
        if not conversational and not isinstance(value, str):
            raise BadRecord("mixed layouts", f"{where}: {name!r} must be a string like the other fields (TRL's "
                            f"standard layout), got {type(value).__name__}")
    if conversational:
        for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            for k, message in enumerate(value):
                _field(message, "role", f"{where}, {name} message {k}", "preference")
    if not (chosen or rejected):
        raise BadRecord("no completions", f"{where}: 'chosen' and 'rejected' are identical, nothing to prefer")
    return PreferenceRecord(prompt, chosen, rejected, tools, conversational)


def pair_documents(tok: Any, pref: PreferenceRecord, seq_len: int, where: str) -> tuple:
    """A chunk result for one record: ("pair", chosen_ids, chosen_mask, rejected_ids, rejected_mask, truncated),
    or ("dropped", reason, truncated)."""
    if pref.conversational:
        def ids(messages: list, generation_prompt: bool) -> list[int]:
            try:
                out = tok.apply_chat_template(messages, tools=pref.tools, tokenize=True, return_dict=True,
                                              add_generation_prompt=generation_prompt)
            except Exception as exc:  # the template's own raise_exception, or a field it cannot read
                raise BadRecord("chat template error", f"{where}: the chat template cannot render the "
                                f"conversation: {type(exc).__name__}: {str(exc)[:200]}") from None
            return list(out["input_ids"])
        prompt = ids(pref.prompt, True) if pref.prompt else []
        full = [ids(pref.prompt + pref.chosen, False), ids(pref.prompt + pref.rejected, False)]
    else:
        eos = tok.eos_token or ""
        prompt = list(tok(text=pref.prompt)["input_ids"])
        full = [list(tok(text=pref.prompt + (c if c.endswith(eos) else c + eos))["input_ids"])
                for c in (pref.chosen, pref.rejected)]
    prompt_len = min(_common_prefix(prompt, full[0]), _common_prefix(prompt, full[1]))
    truncated = bool(seq_len) and max(len(f) for f in full) > seq_len
    if seq_len and prompt_len >= seq_len:
        return ("dropped", "prompt fills --seq-len", truncated)
    out: list[np.ndarray] = []
    for sequence in full:
        mask = np.zeros(len(sequence), dtype=np.uint8)
        mask[prompt_len:] = 1
        array = np.array(sequence, dtype=np.int32)
        if seq_len:
            array, mask = array[:seq_len], mask[:seq_len]
        if not mask[1:].any():  # the first token is never a target
            return ("dropped", "no completion tokens", truncated)
        out += [array, mask]
    return ("pair", *out, truncated)


def preference_chunk(tok: Any, job: Any, chunk: list) -> list[tuple]:
    """tokenize.process_chunk for --format preference: one result per record, in order."""
    results = []
    for item, number in chunk:
        try:
            where, record = parse_item(item, number)
            results.append(pair_documents(tok.tok, to_preference(record, job.cols, where), job.seq_len, where))
        except BadRecord as exc:
            results.append(("skipped", exc.reason, str(exc)))
    return results
