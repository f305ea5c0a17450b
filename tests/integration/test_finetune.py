"""Fine-tuning data: `megatrain prepare`, SFT loss masks, packing, evaluation, and one clear error per bad input.

References are independent of the engine: transformers' logits with the cross-entropy written out
by hand over the documents read straight from the parquet files.

Tolerances (tests/numerics.py): float64 runs against the reference in float64 (its RoPE tables, RMSNorms and
attention too) within 1e-10; float32 runs within 4x the reference's own float32 noise (its float32 loss against
its float64 loss, floor 16 float32 ulps): MKL's float32 GEMMs round by CPU, so the fixed 1e-5 of before held on
one machine only by chance.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.load import load_config
from megatrain_ray.data.batches import DocumentBatches
from megatrain_ray.data.prepare import PrepareOptions, prepare
from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.exceptions import ConfigError, DataError
from tests.conftest import REPO, tiny_raw
from tests.integration.test_lora_parity import float64_transformers  # noqa: F401 - a fixture
from tests.numerics import assert_exact, assert_within_noise

EXAMPLE = Path(REPO) / "examples" / "finetune_qwen2"
sys.path.insert(0, str(EXAMPLE))
from make_tiny_qwen2 import make_tiny_qwen2

ALPACA = EXAMPLE / "alpaca_tiny.json"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen2(tmp_path_factory.mktemp("model") / "tiny-qwen2")


@pytest.fixture(scope="module")
def prepared(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "alpaca"
    prepare(PrepareOptions(str(model_dir), "alpaca", [str(ALPACA)], str(out), seed=1, eval_fraction=0.1))
    return out


def documents(directory: Path, split: str = "train") -> list[tuple[list[int], list[int]]]:
    manifest = json.loads((directory / "manifest.json").read_text())
    rows = [r for f in manifest["splits"][split]["files"] for r in pq.read_table(directory / f).to_pylist()]
    return [(r["input_ids"], r["loss_mask"]) for r in rows]


def finetune_config(tmp_path: Path, model_dir: Path, **sections):
    raw = tiny_raw(**sections)
    raw["model"] = {"path": str(model_dir)}
    raw["train"]["output_dir"] = str(tmp_path / f"run{len(list(tmp_path.glob('run*')))}")
    return load_config(raw=raw)


DTYPES = [pytest.param("float32", marks=pytest.mark.float32_parity), "float64"]


def hf_model(model_dir: Path, dtype: torch.dtype):
    """The transformers model in `dtype`; eager attention's softmax is float32 whatever the model's dtype, so a
    float64 model takes SDPA (float64 throughout, with the float64_transformers fixture's RoPE and norms)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="sdpa" if dtype == torch.float64 else "eager").eval()


def assert_hand_loss(what: str, ours: float, model_dir: Path, docs: list, dtype: str) -> None:
    """float64: ours within 1e-10 of hand_loss in float64. float32: within 4x hand_loss's float32 noise (float32
    against float64; measured on an AVX-512 Xeon: 2e-8 to 1e-7, ours within the floor of 16 ulps)."""
    expected64 = hand_loss(hf_model(model_dir, torch.float64), docs)
    if dtype == "float64":
        assert_exact(what, ours, expected64)
    else:
        assert_within_noise(what, ours, hand_loss(hf_model(model_dir, torch.float32), docs), expected64)


def hand_loss(model, docs: list[tuple[list[int], list[int]]]) -> float:
    """Mean over every loss-masked token of every document of -log p(token | its document's prefix)."""
    total, count = 0.0, 0
    for ids, mask in docs:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        for i in range(1, len(ids)):
            if mask[i]:
                total -= float(logp[i - 1, ids[i]])
                count += 1
    return total / count


# ----------------------------------------------------------------------------- prepare


def test_prepare_masks_exactly_the_assistant_reply(model_dir, prepared):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["documents"] == 50 and manifest["splits"]["eval"]["documents"] == 5
    replies = {r["output"] for r in json.loads(ALPACA.read_text())}
    for ids, mask in documents(prepared) + documents(prepared, "eval"):
        text = tok.decode(ids)
        target = tok.decode([t for t, m in zip(ids, mask) if m])
        assert text.startswith("<|im_start|>user\n") and target.endswith("<|im_end|>\n")
        assert target.removesuffix("<|im_end|>\n") in replies
        assert text.endswith("<|im_start|>assistant\n" + target)  # the prompt is never in the loss


def test_prepare_is_deterministic_per_seed(model_dir, prepared, tmp_path):
    again = tmp_path / "again"
    prepare(PrepareOptions(str(model_dir), "alpaca", [str(ALPACA)], str(again), seed=1, eval_fraction=0.1))
    assert documents(again) == documents(prepared)
    other = tmp_path / "other"
    prepare(PrepareOptions(str(model_dir), "alpaca", [str(ALPACA)], str(other), seed=2, eval_fraction=0.1))
    assert documents(other) != documents(prepared)
    assert sorted(documents(other) + documents(other, "eval")) == sorted(documents(prepared) +
                                                                         documents(prepared, "eval"))


def test_chat_formats_and_registry_give_the_same_tokens(model_dir, tmp_path):
    record = {"instruction": "Add the two numbers.", "input": "2 + 3", "output": "5"}
    user = "Add the two numbers.\n2 + 3"
    files = {
        "alpaca": [record],
        "sharegpt": [{"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": "5"}]}],
        "messages": [{"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "5"}]}],
    }
    results = {}
    for fmt, records in files.items():
        path = tmp_path / f"{fmt}.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in records))
        prepare(PrepareOptions(str(model_dir), fmt, [str(path)], str(tmp_path / fmt)))
        results[fmt] = documents(tmp_path / fmt)
    # A LLaMA-Factory registry entry with renamed columns reads the same record.
    (tmp_path / "renamed.json").write_text(json.dumps([{"q": record["instruction"], "x": "2 + 3", "a": "5"}]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"sums": {
        "file_name": "renamed.json", "columns": {"prompt": "q", "query": "x", "response": "a"}}}))
    prepare(PrepareOptions(str(model_dir), None, [], str(tmp_path / "registry"),
                           registry=str(tmp_path / "dataset_info.json"), dataset="sums"))
    results["registry"] = documents(tmp_path / "registry")
    assert all(r == results["alpaca"] for r in results.values())


def test_system_field_and_alpaca_history_become_turns(model_dir, tmp_path):
    alpaca = {"system": "Be brief.", "instruction": "And 4 + 4?", "output": "8", "history": [["2 + 3?", "5"]]}
    messages = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"},
                             {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4 + 4?"},
                             {"role": "assistant", "content": "8"}]}
    for name, record, fmt in (("a", alpaca, "alpaca"), ("m", messages, "messages")):
        (tmp_path / f"{name}.json").write_text(json.dumps([record]))
        prepare(PrepareOptions(str(model_dir), fmt, [str(tmp_path / f"{name}.json")], str(tmp_path / name)))
    assert documents(tmp_path / "a") == documents(tmp_path / "m")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    (ids, mask), = documents(tmp_path / "a")
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "5<|im_end|>\n8<|im_end|>\n"
    assert tok.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_text_documents_are_all_loss_and_end_with_eos(model_dir, tmp_path):
    (tmp_path / "a.txt").write_text("The capital of Peru is Lima.")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "Spell the word backwards."}) + "\n" +
                                      json.dumps({"text": "  "}) + "\n")
    manifest = prepare(PrepareOptions(str(model_dir), "text", [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")],
                                      str(tmp_path / "out"), seq_len=5))
    eos = transformers.AutoTokenizer.from_pretrained(model_dir).eos_token_id
    assert manifest["dropped"] == {"empty text": 1} and manifest["documents"] == 2
    docs = documents(tmp_path / "out")
    assert all(all(m == 1 for m in mask) and len(ids) <= 5 for ids, mask in docs)
    assert manifest["truncated"] == sum(ids[-1] != eos for ids, _ in docs) >= 1


@pytest.mark.parametrize("content, match", [
    ([{"instruction": "Say hi."}], "the alpaca format needs the field 'output'"),
    ([], "holds no records"),
])
def test_bad_records_give_one_clear_error(model_dir, tmp_path, content, match):
    (tmp_path / "bad.json").write_text(json.dumps(content))
    with pytest.raises(DataError, match=match):
        prepare(PrepareOptions(str(model_dir), "alpaca", [str(tmp_path / "bad.json")], str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- batches and loss


def test_batches_are_a_function_of_the_step_and_cover_each_epoch(model_dir, prepared, tmp_path):
    cfg = finetune_config(tmp_path, model_dir, data={"path": str(prepared), "seq_len": 64, "batch_size": 2,
                                                     "packing": True})
    data, again = DocumentBatches(cfg.data, cfg.model, str(prepared)), DocumentBatches(cfg.data, cfg.model,
                                                                                        str(prepared))
    rows = len(data._plan(0))
    steps = (rows + 2 * len(data._plan(1))) // 2  # into the third epoch
    for step in range(steps):
        a, b = data.batch(step), again.batch(step)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels) and a.segments == b.segments
    first_epoch = sorted(d for row in data._plan(0) for d in row)
    assert first_epoch == list(range(45)) and data._plan(0) != data._plan(1)


@pytest.mark.parametrize("packing", [False, True], ids=["one-per-row", "packed"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sft_loss_is_the_hand_computed_loss_of_the_documents(model_dir, prepared, tmp_path, packing, dtype,
                                                             float64_transformers):  # noqa: F811
    """Loss only on the assistant tokens, mean over the batch's loss tokens; packed documents see only
    themselves (positions restart, attention stops at the boundary)."""
    cfg = finetune_config(tmp_path, model_dir, data={"path": str(prepared), "seq_len": 96, "batch_size": 2,
                                                     "packing": packing},
                          precision={"master_dtype": dtype, "compute_dtype": dtype})
    docs = documents(prepared)
    with Trainer(cfg) as trainer:
        rows = [trainer.data._row(k) for k in range(2)]
        loss = trainer.step(0)["loss"]
    assert max(len(r) for r in rows) > 1 if packing else all(len(r) == 1 for r in rows)
    assert_hand_loss("SFT loss", loss, model_dir, [docs[d] for row in rows for d in row], dtype)


def test_packed_and_unpacked_batches_give_the_same_update(model_dir, prepared, tmp_path):
    """The same documents packed into one row or one per row: same loss, same gradient norm, same
    weights after the step (float64, so the comparison is tight)."""
    exact = {"master_dtype": "float64", "compute_dtype": "float64"}
    results = {}
    for packing in (False, True):
        cfg = finetune_config(tmp_path, model_dir, precision=exact, data={
            "path": str(prepared), "seq_len": 96, "batch_size": 3, "packing": packing})
        data = DocumentBatches(cfg.data, cfg.model, str(prepared))
        batch = data.rows_batch([[0, 1, 2]] if packing else [[0], [1], [2]])
        with Trainer(cfg) as trainer:
            result = trainer.gpu.train_step(batch, 1e-3, 1, batch.loss_tokens).result()
            results[packing] = (result, trainer.master_weights())
    (plain, w_plain), (packed, w_packed) = results[False], results[True]
    assert packed.valid_tokens == plain.valid_tokens
    assert packed.loss == pytest.approx(plain.loss, abs=1e-12)
    assert packed.grad_norm == pytest.approx(plain.grad_norm, rel=1e-10)
    assert max((w_packed[k] - w_plain[k]).abs().max().item() for k in w_plain) < 1e-12


@pytest.mark.parametrize("dtype", DTYPES)
def test_eval_loss_is_the_hand_computed_loss_of_the_eval_split(model_dir, prepared, tmp_path, dtype,
                                                               float64_transformers):  # noqa: F811
    cfg = finetune_config(tmp_path, model_dir, data={"path": str(prepared), "seq_len": 96, "batch_size": 2},
                          train={"steps": 1, "eval_every": 1, "eval_batches": 8}, schedule={"warmup_steps": 0},
                          precision={"master_dtype": dtype, "compute_dtype": dtype})
    with Trainer(cfg) as trainer:
        before = trainer.evaluate()
        record = trainer.step(0)
    assert_hand_loss("eval_loss", before, model_dir, documents(prepared, "eval"), dtype)
    assert "eval_loss" in record and record["eval_loss"] != before  # after the update
    lines = (Path(cfg.train.output_dir) / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["eval_loss"] == record["eval_loss"]


# ----------------------------------------------------------------------------- errors before allocation


def write_text_docs(model_dir: Path, tmp_path: Path, words: int) -> Path:
    (tmp_path / "long.txt").write_text(" ".join(["apple"] * words))
    out = tmp_path / f"long{words}"
    prepare(PrepareOptions(str(model_dir), "text", [str(tmp_path / "long.txt")], str(out)))
    return out


def test_token_ids_beyond_the_vocabulary(prepared, tmp_path):
    raw = tiny_raw(data={"path": str(prepared), "seq_len": 64, "batch_size": 2})  # vocab 96 < the tokenizer's 384
    raw["train"]["output_dir"] = str(tmp_path / "run")
    with pytest.raises(DataError, match=r"token id \d+ outside model.vocab_size=96"):
        Trainer(load_config(raw=raw))


def test_documents_longer_than_the_model_or_the_rows(model_dir, tmp_path):
    longer_than_model = write_text_docs(model_dir, tmp_path, 100)  # > max_position_embeddings=256
    with pytest.raises(DataError, match="more than the model's max_position_embeddings=256; prepare it again"):
        Trainer(finetune_config(tmp_path, model_dir, data={"path": str(longer_than_model), "seq_len": 64,
                                                            "batch_size": 1}))
    longer_than_rows = write_text_docs(model_dir, tmp_path, 30)
    with pytest.raises(DataError, match=r"more than data.seq_len \+ 1 = 65"):
        Trainer(finetune_config(tmp_path, model_dir, data={"path": str(longer_than_rows), "seq_len": 64,
                                                            "batch_size": 1}))


def test_packing_and_eval_need_prepared_documents(model_dir, tmp_path):
    tokens = tmp_path / "t.npy"
    np.save(tokens, np.arange(1000, dtype=np.int32) % 300)
    with pytest.raises(ConfigError, match="data.packing needs documents"):
        Trainer(finetune_config(tmp_path, model_dir, data={"path": str(tokens), "packing": True}))
    with pytest.raises(ConfigError, match="train.eval_every needs evaluation documents"):
        Trainer(finetune_config(tmp_path, model_dir, data={"path": str(tokens)}, train={"eval_every": 5}))


@pytest.mark.ray
def test_through_ray_two_host_shards_load_in_parallel_and_train_like_local(model_dir, prepared, tmp_path,
                                                                          ray_session):
    """Ray actors: each of two HostShards loads its own stages; packed batches and eval cross actor
    boundaries; the run equals the in-process one. float64, so up to summation order within 1e-10 (measured
    bit-identical); each export is its run's masters rounded to float32 (the base's dtype), bit for bit."""
    runs = {}
    for mode in ("local", "ray"):
        cfg = finetune_config(tmp_path, model_dir, runtime={"mode": mode}, host={"num_shards": 2},
                              data={"path": str(prepared), "seq_len": 96, "batch_size": 2, "packing": True},
                              train={"steps": 3, "eval_every": 3, "export_dir": str(tmp_path / f"export-{mode}")},
                              schedule={"warmup_steps": 0}, precision={"master_dtype": "float64",
                                                                       "compute_dtype": "float64"})
        with Trainer(cfg) as trainer:
            history = trainer.train()
            masters = trainer.master_weights()
        exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"export-{mode}").state_dict()
        assert set(masters) <= set(exported)
        assert all(torch.equal(exported[k], v.float()) for k, v in masters.items())
        runs[mode] = ([(r["loss"], r.get("eval_loss")) for r in history], masters)
    assert runs["ray"][0][-1][1] is not None
    for step, ((loss_l, eval_l), (loss_r, eval_r)) in enumerate(zip(runs["local"][0], runs["ray"][0])):
        assert_exact(f"loss at step {step}", loss_r, loss_l)
        assert (eval_l is None) == (eval_r is None)
        if eval_l is not None:
            assert_exact(f"eval_loss at step {step}", eval_r, eval_l)
    for name, value in runs["local"][1].items():
        assert_exact(name, runs["ray"][1][name], value)


@pytest.mark.parametrize("window", [0, 3], ids=["causal", "sliding-window"])
def test_document_attention_equals_attention_on_each_document_alone(window):
    """The bucketed, padded attention of packed rows against SDPA on each document by itself (values and
    gradients), with GQA, documents of many lengths, and a sliding window shorter than some of them."""
    import torch.nn.functional as F

    from megatrain_ray.model.attention import attention, document_buckets
    from megatrain_ray.model.layer_spec import LayerSpec

    spec = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=8, eps=1e-6, qk_norm=False, attention_bias=False,
                     sliding_window=window)
    segments = ((1, 5, 9, 1), (16,), (3, 3, 10))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, 16, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    ours = attention(q, k, v, spec, document_buckets(segments, torch.device("cpu")))
    rows = []
    for b, lengths in enumerate(segments):
        parts, start = [], 0
        for n in lengths:
            i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
            mask = (j <= i) & ((i - j < window) if window else True)
            sl = slice(start, start + n)
            parts.append(F.scaled_dot_product_attention(q[b:b + 1, :, sl], k[b:b + 1, :, sl].repeat_interleave(2, 1),
                                                        v[b:b + 1, :, sl].repeat_interleave(2, 1), attn_mask=mask,
                                                        scale=8 ** -0.5))
            start += n
        rows.append(torch.cat(parts, dim=2))
    expected = torch.cat(rows)
    assert (ours - expected).abs().max().item() < 1e-12
    grad = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    ours_grads = torch.autograd.grad(ours, (q, k, v), grad)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    assert all((a - b).abs().max().item() < 1e-12 for a, b in zip(ours_grads, expected_grads))


def test_a_document_without_a_target_is_refused(model_dir, tmp_path):
    import pyarrow as pa

    out = tmp_path / "handmade"
    out.mkdir()
    pq.write_table(pa.table({"input_ids": pa.array([[5, 6, 7], [8]], type=pa.list_(pa.int32())),
                             "loss_mask": pa.array([[1, 1, 1], [1]], type=pa.list_(pa.uint8()))}), out / "t.parquet")
    (out / "manifest.json").write_text(json.dumps({"splits": {"train": {"files": ["t.parquet"]}}}))
    with pytest.raises(DataError, match="document 1 has fewer than 2 tokens"):
        Trainer(finetune_config(tmp_path, model_dir, data={"path": str(out), "seq_len": 16, "batch_size": 1}))
