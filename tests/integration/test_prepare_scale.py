"""`megatrain prepare` at scale: the vectorized loss mask against the per-token definition, the parallel path
byte for byte against one process, shards written as they fill and read back as a stream, bad records skipped
and counted (or failing), tool and function-calling turns, --train-on-inputs; what its log says (each split's
records with a warning for a tiny eval split, the rate without the tokenizer's one-time GGUF conversion)."""

from __future__ import annotations

import json
import logging
import random
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

transformers = pytest.importorskip("transformers")

from megatrain_ray.data.batches import Documents
from megatrain_ray.data.prepare import PrepareOptions, Tokenizer, pipeline, prepare, shards
from megatrain_ray.exceptions import DataError
from tests.conftest import REPO

EXAMPLE = Path(REPO) / "examples" / "finetune_qwen2"
sys.path.insert(0, str(EXAMPLE))
from make_tiny_qwen2 import make_tiny_qwen2

ALPACA = EXAMPLE / "alpaca_tiny.json"
WORDS = "the capital of Peru is Lima add two numbers 2 + 3 = 5 spell backwards olleh é 東 \n  ,.!?".split(" ")
# A ChatML template that renders tools, assistant tool calls and tool results (as Qwen2.5's does, simplified).
TOOL_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}{{ '<|im_start|>assistant\\n' }}"
    "{% for call in message.tool_calls %}{{ '<tool_call>' + (call.function | tojson) + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen2(tmp_path_factory.mktemp("model") / "tiny-qwen2")


@pytest.fixture(scope="module")
def tool_model_dir(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny-qwen2-tools"
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(out)
    return out


def reference_document(tok, messages: list[dict], tools=None) -> tuple[list[int], list[int]]:
    """The per-token definition (a1aef2b's loop): a token is in the loss iff its start offset falls in an
    assistant span, the span of turn i running from the render before it (with the generation prompt) to the
    render through it; tokens from transformers' own call."""
    def render(msgs, generation_prompt):
        return tok.apply_chat_template(msgs, tools=tools, tokenize=False,
                                       add_generation_prompt=generation_prompt) if msgs else ""
    full = render(messages, False)
    spans = [(len(render(messages[:i], True)), len(render(messages[:i + 1], False)))
             for i, m in enumerate(messages) if m["role"] == "assistant"]
    encoded = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), [int(any(a <= s < b for a, b in spans)) for s, _ in encoded["offset_mapping"]]


def random_conversation(rng: random.Random) -> list[dict]:
    def text() -> str:
        return "".join(rng.choice(WORDS) + rng.choice(["", " ", "\n", "  "]) for _ in range(rng.randint(0, 12)))
    messages = [{"role": "system", "content": text()}] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, 4)):
        messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
    return messages


def documents(directory: Path, split: str = "train") -> list[tuple[list[int], list[int]]]:
    manifest = json.loads((directory / "manifest.json").read_text())
    rows = [r for f in manifest["splits"][split]["files"] for r in pq.read_table(directory / f).to_pylist()]
    return [(r["input_ids"], r["loss_mask"]) for r in rows]


def test_vectorized_mask_equals_the_per_token_definition(model_dir):
    tok = Tokenizer(str(model_dir))
    rng = random.Random(0)
    conversations = [random_conversation(rng) for _ in range(300)]
    rendered = [tok.spans(m, None, "test") for m in conversations]
    ours = tok.chat_documents([full for full, _ in rendered], [spans for _, spans in rendered])
    for messages, (ids, mask) in zip(conversations, ours):
        ref_ids, ref_mask = reference_document(tok.tok, messages)
        assert ids.tolist() == ref_ids and mask.tolist() == ref_mask


def test_parallel_shards_equal_one_process_byte_for_byte(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "CHUNK_RECORDS", 4)  # 50 records: 13 chunks over 2 workers
    monkeypatch.setattr(shards, "SHARD_TOKENS", 600)  # several shards a split
    outs = {}
    for workers in (1, 2):
        outs[workers] = tmp_path / f"w{workers}"
        prepare(PrepareOptions(str(model_dir), "alpaca", [str(ALPACA)], str(outs[workers]), seed=3,
                               eval_fraction=0.2, workers=workers))
    names = sorted(p.name for p in outs[1].iterdir())
    assert names == sorted(p.name for p in outs[2].iterdir()) and len(names) > 3
    assert all((outs[1] / n).read_bytes() == (outs[2] / n).read_bytes() for n in names)
    manifest = json.loads((outs[1] / "manifest.json").read_text())
    assert manifest["splits"]["eval"]["documents"] == 10 and len(manifest["splits"]["train"]["files"]) > 1


def test_shards_fill_in_bounded_memory_and_training_reads_them_as_a_stream(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "SHARD_TOKENS", 300)
    one = tmp_path / "one"
    prepare(PrepareOptions(str(model_dir), "alpaca", [str(ALPACA)], str(one), seed=1, workers=1))
    monkeypatch.setattr(shards, "SHARD_TOKENS", 1 << 22)
    big = tmp_path / "big"
    prepare(PrepareOptions(str(model_dir), "alpaca", [str(ALPACA)], str(big), seed=1, workers=1))
    small_files = json.loads((one / "manifest.json").read_text())["splits"]["train"]["files"]
    assert len(small_files) > 3 and sorted(documents(one)) == sorted(documents(big))
    docs = Documents(str(one), "train", "data.path")
    assert isinstance(docs.tokens, np.memmap) and len(docs) == 50
    stored = documents(one)
    for d in range(len(docs)):
        start, end = docs.starts[d], docs.starts[d + 1]
        assert (docs.tokens[start:end].tolist(), docs.mask[start:end].tolist()) == stored[d]
    read_in_small_batches = Documents.__new__(Documents)
    read_in_small_batches.where = "x"
    read_in_small_batches._stream([pq.ParquetFile(one / f) for f in small_files], rows_per_batch=3)
    assert np.array_equal(read_in_small_batches.tokens, docs.tokens) and np.array_equal(read_in_small_batches.starts,
                                                                                        docs.starts)


def test_bad_records_are_skipped_and_counted_or_fail_with_one_line(model_dir, tmp_path):
    good = {"messages": [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5"}]}
    lines = [json.dumps(good), "{not json", json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
             json.dumps({"messages": [{"role": "user", "content": "hi"}]}), json.dumps([1, 2]), json.dumps(good)]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"messages": "\xff"}\n')
    manifest = prepare(PrepareOptions(str(model_dir), "messages", [str(path)], str(tmp_path / "out")))
    assert manifest["documents"] == 2 and manifest["records"] == 7
    assert manifest["skipped"] == {"not valid JSON": 1, "unknown role": 1, "no assistant turn": 1,
                                   "not a JSON object": 1, "not UTF-8": 1}
    with pytest.raises(DataError, match=rf"{path}:2 is not valid JSON") as info:
        prepare(PrepareOptions(str(model_dir), "messages", [str(path)], str(tmp_path / "fail"), on_bad_record="fail"))
    assert "\n" not in str(info.value) and not (tmp_path / "fail").exists()
    (tmp_path / "tool.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}) + "\n")
    with pytest.raises(DataError, match=r"tool.jsonl record 1, turn 0: unknown role 'robot'"):
        prepare(PrepareOptions(str(model_dir), "messages", [str(tmp_path / "tool.jsonl")], str(tmp_path / "f2"),
                               on_bad_record="fail"))


def test_tool_and_function_calling_turns_render_and_only_the_assistant_learns(tool_model_dir, tmp_path):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    record = {"tools": tools, "messages": [
        {"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "RESULT 5", "tool_call_id": "1"}, {"role": "assistant", "content": "It is 5."}]}
    sharegpt = {"tools": tools, "conversations": [
        {"from": "human", "value": "2 + 3?"}, {"from": "function_call", "value": "", "tool_calls": [call]},
        {"from": "observation", "value": "RESULT 5", "tool_call_id": "1"}, {"from": "gpt", "value": "It is 5."}]}
    for name, rec, fmt in (("m", record, "messages"), ("s", sharegpt, "sharegpt")):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(rec) + "\n")
        prepare(PrepareOptions(str(tool_model_dir), fmt, [str(tmp_path / f"{name}.jsonl")], str(tmp_path / name)))
    tok = transformers.AutoTokenizer.from_pretrained(tool_model_dir)
    (ids, mask), = documents(tmp_path / "m")
    assert documents(tmp_path / "s") == [(ids, mask)]
    assert (ids, mask) == reference_document(tok, record["messages"], tools)
    text, target = tok.decode(ids), tok.decode([t for t, m in zip(ids, mask) if m])
    assert "Tools: " in text and "<|im_start|>tool\nRESULT 5" in text
    assert target == '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>\n' \
                     "It is 5.<|im_end|>\n"


def test_train_on_inputs_puts_every_token_in_the_loss(model_dir, tmp_path):
    prepare(PrepareOptions(str(model_dir), "alpaca", [str(ALPACA)], str(tmp_path / "all"), seed=1,
                           train_on_inputs=True))
    prepare(PrepareOptions(str(model_dir), "alpaca", [str(ALPACA)], str(tmp_path / "assistant"), seed=1))
    every, assistant = documents(tmp_path / "all"), documents(tmp_path / "assistant")
    assert [ids for ids, _ in every] == [ids for ids, _ in assistant]
    assert all(all(mask) for _, mask in every) and not any(all(mask) for _, mask in assistant)
    assert json.loads((tmp_path / "all" / "manifest.json").read_text())["train_on_inputs"] is True


class Captured(logging.Handler):
    """The pipeline's log records at INFO and above, however the megatrain_ray logger tree is configured."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def __enter__(self) -> list[logging.LogRecord]:
        self.level_before = pipeline.log.level
        pipeline.log.setLevel(logging.INFO)
        pipeline.log.addHandler(self)
        return self.records

    def __exit__(self, *exc) -> None:
        pipeline.log.removeHandler(self)
        pipeline.log.setLevel(self.level_before)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_tiny_eval_split_is_warned_about_with_the_records_each_split_got(model_dir, tmp_path):
    for fraction, held in ((0.1, 5), (0.004, 1)):  # 50 records; 0.2 of a record rounded to none before
        with Captured() as records:
            manifest = prepare(PrepareOptions(str(model_dir), "alpaca", [str(ALPACA)], str(tmp_path / str(fraction)),
                                              seed=1, eval_fraction=fraction, workers=1))
        assert manifest["splits"]["eval"]["documents"] == held
        warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        expected = (f"prepare: --eval-fraction {fraction:g} of 50 records: the eval split got {held} record(s) "
                    f"({held / 50:.1%}), the train split {50 - held}; an eval_loss over fewer than 20 records (always "
                    "the same ones) measures little: give more records or a larger --eval-fraction")
        assert warnings == [expected], warnings


def test_the_records_rate_leaves_out_the_tokenizers_gguf_conversion(model_dir, tmp_path, monkeypatch):
    """A GGUF --tokenizer is converted once (minutes for a large model): the rate counts the records' own time,
    and the conversion's time is a line of its own."""
    offset = [0.0]
    real = pipeline.time.perf_counter

    class Clock:
        @staticmethod
        def perf_counter() -> float:
            return real() + offset[0]

    def converting(source: str, revision: str | None) -> str:
        offset[0] += 100.0  # the conversion takes 100 s
        return str(model_dir)

    monkeypatch.setattr(pipeline, "time", Clock)
    monkeypatch.setattr(pipeline, "resolve_tokenizer", converting)
    with Captured() as records:
        prepare(PrepareOptions(str(tmp_path / "model.gguf"), "alpaca", [str(ALPACA)], str(tmp_path / "out"), workers=1))
    lines = [r.getMessage() for r in records]
    gguf = re.escape(str(tmp_path / "model.gguf"))
    assert any(re.fullmatch(rf"prepare: --tokenizer {gguf} ready in 100\.0 s \(a \.gguf file: its one-time "
                            r"conversion, or the hash that finds it in the cache\), not counted in the records' rate",
                            line) for line in lines), lines
    done = next(line for line in lines if "records/s)" in line)
    seconds, rate = map(float, re.search(r"\(([0-9.]+) s, ([0-9]+) records/s\)$", done).groups())
    assert seconds < 50 and rate >= 1, done  # with the conversion counted: over 100 s, 0 records/s
