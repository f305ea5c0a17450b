"""GRPO prompt data: `megatrain prepare --format prompts` against the tokenizer's own encoding (text prompts, BOS
included) and its own apply_chat_template(add_generation_prompt=True) (chat prompts), the other columns kept as
JSON for the reward functions, and data/prompts.PromptBatches: a step's prompts a pure function of (data.seed,
step), max_prompt_length keeping a prompt's last tokens, the held-out split, and one clear error per bad record or
misfit setting. The tokenizer is a tiny byte-level BPE built here (a BOS added to text, a ChatML template reading
bos_token), so nothing is downloaded."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.load import load_config
from megatrain_ray.data.preference import make_evaluation_batches, make_training_batches
from megatrain_ray.data.prepare import PrepareOptions, prepare
from megatrain_ray.data.prompts import PromptBatches, PromptRows
from megatrain_ray.exceptions import ConfigError, DataError
from tests.conftest import REPO, tiny_raw

sys.path.insert(0, str(Path(REPO) / "examples" / "finetune_qwen2"))
from make_tiny_qwen2 import CHAT_TEMPLATE, alpaca_texts, build_tokenizer  # noqa: E402

BOS = "<|endoftext|>"
TEXT_RECORDS = [{"prompt": f"add {a} and {b}", "answer": str(a + b), "level": a % 3, "tags": ["math", str(a)],
                 "meta": {"source": "tiny", "n": a}} for a, b in ((2, 3), (1, 1), (4, 5), (7, 2), (3, 3), (6, 1))]
TEXT_RECORDS[1].pop("meta")  # a record without a column: null there, as `datasets` fills it
TEXT_RECORDS[2]["completion"] = "9"  # left out, as TRL leaves it out of the reward functions' arguments
CHAT_RECORDS = [{"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": q}],
                 "solution": s} for q, s in (("the capital of Peru", "Lima"), ("spell olleh backwards", "hello"))] + \
               [{"prompt": [{"role": "user", "content": "add two numbers"}], "solution": "5"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """ChatML like Qwen2's, plus a BOS the tokenizer adds to text and the template writes (as Llama's do)."""
    from tokenizers import processors

    backend = build_tokenizer(alpaca_texts()).backend_tokenizer
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                           special_tokens=[(BOS, bos_id)])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token="<|im_end|>",
                                               pad_token=BOS, chat_template="{{ bos_token }}" + CHAT_TEMPLATE)
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_prepare(tokenizer_dir: Path, path: Path, out: Path, **options) -> dict:
    return prepare(PrepareOptions(tokenizer_dir=str(tokenizer_dir), format="prompts", inputs=[str(path)],
                                  output_dir=str(out), workers=1, **options))


def grpo_config(prepared: Path, data: dict | None = None, train: dict | None = None, **grpo) -> object:
    raw = tiny_raw(model={"vocab_size": 512, "max_position_embeddings": 256}, train={"steps": 20, **(train or {})},
                   data={"path": str(prepared), "seq_len": 64, "batch_size": 8, "seed": 3, **(data or {})})
    raw["finetune"] = {"objective": "grpo", "grpo": {"reward_funcs": ["tests.reference_grpo:first_reward"],
                                                     "num_generations": 4, "max_completion_length": 16, **grpo}}
    return load_config(raw=raw)


@pytest.fixture(scope="module")
def text_prompts(tmp_path_factory, tokenizer_dir) -> Path:
    tmp = tmp_path_factory.mktemp("text")
    run_prepare(tokenizer_dir, write_jsonl(tmp / "prompts.jsonl", TEXT_RECORDS), tmp / "prepared")
    return tmp / "prepared"


def test_text_prompts_are_the_tokenizers_encoding_with_every_other_column(text_prompts, tok):
    manifest = json.loads((text_prompts / "manifest.json").read_text())
    assert manifest["prompts"] is True and manifest["format"] == "prompts"
    assert manifest["prompt_columns"] == ["answer", "level", "tags", "meta"]
    rows = pq.read_table(text_prompts / manifest["splits"]["train"]["files"][0]).to_pylist()
    assert sorted(r["record"] for r in rows) == list(range(len(TEXT_RECORDS)))
    for row in rows:
        record = TEXT_RECORDS[row["record"]]
        assert row["input_ids"] == tok(record["prompt"])["input_ids"]  # transformers' own call, as TRL's
        assert row["input_ids"][0] == tok.bos_token_id and row["input_ids"][-1] != tok.eos_token_id
        assert set(row["loss_mask"]) == {0}
        assert json.loads(row["prompt"]) == record["prompt"]
        assert json.loads(row["columns"]) == {k: v for k, v in record.items() if k not in ("prompt", "completion")}
    everything = PromptBatches(grpo_config(text_prompts), str(text_prompts), evaluation=True).eval_prompts(100)
    assert isinstance(everything, PromptRows) and everything.indices == [r["record"] for r in rows]
    for k, number in enumerate(everything.indices):
        record = TEXT_RECORDS[number]
        assert everything.ids[k] == tok(record["prompt"])["input_ids"]
        assert everything.prompts[k] == record["prompt"]
        assert {name: values[k] for name, values in everything.columns.items()} == \
            {name: record.get(name) for name in ("answer", "level", "tags", "meta")}


def test_chat_prompts_are_apply_chat_template_with_the_generation_prompt(tmp_path, tokenizer_dir, tok):
    manifest = run_prepare(tokenizer_dir, write_jsonl(tmp_path / "chat.jsonl", CHAT_RECORDS), tmp_path / "out")
    assert manifest["prompt_columns"] == ["solution"]
    rows = PromptBatches(grpo_config(tmp_path / "out"), str(tmp_path / "out"), evaluation=True).eval_prompts(10)
    generation_prompt = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for ids, prompt, solution, number in zip(rows.ids, rows.prompts, rows.columns["solution"], rows.indices):
        record = CHAT_RECORDS[number]
        expected = tok.apply_chat_template(record["prompt"], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
        assert ids == list(expected) and ids[-len(generation_prompt):] == generation_prompt
        assert ids.count(tok.bos_token_id) == 1  # the template's BOS, no second one from the tokenizer
        assert prompt == record["prompt"] and solution == record["solution"]


def test_step_prompts_are_a_pure_function_of_seed_and_step(text_prompts):
    cfg = grpo_config(text_prompts)  # 6 prompts, 8 completions of 4 per prompt: 2 prompts a step, 3 steps an epoch
    first, second = PromptBatches(cfg, str(text_prompts)), PromptBatches(cfg, str(text_prompts))
    assert first.prompts_per_step == 2 and len(first) == 6
    steps = [first.step_prompts(s) for s in range(9)]
    assert [second.step_prompts(s) for s in reversed(range(9))] == steps[::-1]  # any order of calls, same rows
    epochs = [sum((steps[s].indices for s in range(3 * e, 3 * e + 3)), []) for e in range(3)]
    assert all(sorted(epoch) == list(range(6)) for epoch in epochs)  # every prompt once an epoch
    assert len({tuple(epoch) for epoch in epochs}) > 1  # each epoch its own permutation
    assert [first.epoch_of(s) for s in (0, 3, 4)] == [0.0, 1.0, 4 / 3]
    other_seed = PromptBatches(grpo_config(text_prompts, data={"seed": 4}), str(text_prompts))
    assert [other_seed.step_prompts(s).indices for s in range(3)] != [steps[s].indices for s in range(3)]
    in_order = PromptBatches(grpo_config(text_prompts, data={"shuffle": False}), str(text_prompts))
    assert sum((in_order.step_prompts(s).indices for s in range(3)), []) == in_order.eval_prompts(6).indices


def test_max_prompt_length_keeps_the_last_tokens_and_seq_len_must_hold_prompt_and_completion(text_prompts, tok):
    whole = PromptBatches(grpo_config(text_prompts), str(text_prompts)).step_prompts(0)
    cut = PromptBatches(grpo_config(text_prompts, max_prompt_length=3), str(text_prompts)).step_prompts(0)
    assert cut.indices == whole.indices and cut.prompts == whole.prompts  # the reward functions see it whole
    assert cut.ids == [ids[-3:] for ids in whole.ids] and all(len(ids) > 3 for ids in whole.ids)
    with pytest.raises(ConfigError, match=r"data\.seq_len.*max_prompt_length=60 \+ max_completion_length=16"):
        grpo_config(text_prompts, max_prompt_length=60)
    longest = max(len(tok(r["prompt"])["input_ids"]) for r in TEXT_RECORDS)
    with pytest.raises(DataError, match=rf"data\.seq_len=20 cannot hold the longest prompt .*\({longest} tokens.*"
                                        rf"max_completion_length=16: raise data\.seq_len to {longest + 16}"):
        PromptBatches(grpo_config(text_prompts, data={"seq_len": 20}), str(text_prompts))


def test_held_out_prompts_and_the_wrong_data_are_refused_clearly(tmp_path, tokenizer_dir, text_prompts):
    path = write_jsonl(tmp_path / "prompts.jsonl", TEXT_RECORDS * 4)
    run_prepare(tokenizer_dir, path, tmp_path / "split", eval_fraction=0.25)
    cfg = grpo_config(tmp_path / "split", train={"eval_every": 2})
    assert isinstance(make_training_batches(cfg), PromptBatches)
    held_out = make_evaluation_batches(cfg)
    assert isinstance(held_out, PromptBatches) and len(held_out) == 6 and held_out.docs.where.endswith("(eval)")
    assert held_out.eval_prompts(4) == held_out.eval_prompts(4) and len(held_out.eval_prompts(99).ids) == 6
    with pytest.raises(DataError, match=r"holds 6 prompts, fewer than data\.batch_size / .* = 8"):
        PromptBatches(grpo_config(text_prompts, data={"batch_size": 32}), str(text_prompts))
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": f"{r['prompt']} = {r['answer']}"} for r in TEXT_RECORDS])
    prepare(PrepareOptions(tokenizer_dir=str(tokenizer_dir), format="text", inputs=[str(texts)], workers=1,
                           output_dir=str(tmp_path / "documents")))
    with pytest.raises(DataError, match=r"holds documents, not prompts: prepare it with `megatrain prepare --format "
                                        r"prompts`"):
        make_training_batches(grpo_config(tmp_path / "documents"))
    with pytest.raises(DataError, match=r"holds GRPO prompts .*finetune\.objective=grpo"):
        make_training_batches(load_config(raw=tiny_raw(model={"vocab_size": 512}, data={"path": str(text_prompts)})))
    with pytest.raises(DataError, match=r"--seq-len does not apply to --format prompts.*max_prompt_length"):
        run_prepare(tokenizer_dir, path, tmp_path / "cut", seq_len=8)


BAD_RECORDS = [
    ({"answer": "5"}, r"record 1: the prompts format needs the field 'prompt'"),
    ({"prompt": "  "}, r"record 1: 'prompt' is empty"),
    ({"prompt": []}, r"record 1: 'prompt' is an empty list of messages"),
    ({"prompt": 7}, r"record 1: 'prompt' must be a string or a list of chat messages .*got int"),
    ({"prompt": [{"content": "hi"}]}, r"record 1: 'prompt' message 0 needs 'role'"),
    ({"prompt": [{"role": "user", "content": 3}]}, r"record 1: 'prompt' message 0 needs 'content' as a string"),
    ({"prompt": "add", "completions": ["x"]}, r"record 1: the column 'completions' would be passed .* rename it"),
    ([1, 2], r"record 1: expected a JSON object, got list"),
]


@pytest.mark.parametrize("record,message", BAD_RECORDS)
def test_a_bad_record_is_one_error_naming_the_file_record_and_field(tmp_path, tokenizer_dir, record, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [TEXT_RECORDS[0], record, TEXT_RECORDS[3]])
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}\s{message}"):
        run_prepare(tokenizer_dir, path, tmp_path / "out", on_bad_record="fail")
    manifest = run_prepare(tokenizer_dir, path, tmp_path / "skipped")
    assert sum(manifest["skipped"].values()) == 1 and manifest["splits"]["train"]["documents"] == 2


def test_a_column_without_a_json_form_is_refused_naming_it(tmp_path, tokenizer_dir):
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["add 2 and 3", "add 1 and 1"], "answer": ["5", "2"],
                             "blob": pa.array([b"\x00", b"\x01"], type=pa.binary())}), path)
    with pytest.raises(DataError, match=rf"{path} record 0: the column 'blob' is not JSON-serialisable"):
        run_prepare(tokenizer_dir, path, tmp_path / "out", on_bad_record="fail")


def test_worker_processes_write_the_same_shards(tmp_path, tokenizer_dir):
    """Results come back from the workers in input order: the shards are byte for byte one process's."""
    path = write_jsonl(tmp_path / "mixed.jsonl", (TEXT_RECORDS + CHAT_RECORDS) * 40)  # 360 records: 2 chunks
    for workers in (1, 2):
        prepare(PrepareOptions(tokenizer_dir=str(tokenizer_dir), format="prompts", inputs=[str(path)],
                               output_dir=str(tmp_path / f"out{workers}"), workers=workers, eval_fraction=0.1))
    manifests = [json.loads((tmp_path / f"out{w}" / "manifest.json").read_text()) for w in (1, 2)]
    assert manifests[0] == manifests[1]
    for split in manifests[0]["splits"].values():
        for name in split["files"]:
            assert (tmp_path / "out1" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes()
