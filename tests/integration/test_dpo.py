"""DPO end to end on a tiny Llama: `megatrain prepare --format preference` against TRL's own preprocessing,
the reference log-probabilities against a plain transformers forward, and 10 DPO steps through the Trainer
(local, and through Ray with 2 GPU workers and 2 optimizer workers) against a reference loop: the transformers
model from the same directory, the same batches, TRL 1.16's loss (DPOTrainer._compute_loss) on its
log-probabilities, torch.optim.AdamW and clip_grad_norm_.

Tolerances (tests/numerics.py, docs/testing.md):
- float64 (engine and reference; the reference's RoPE tables, RMSNorms and log-softmax in float64 too): every
  loss, metric, log-probability and final weight within 1e-10 relative (measured at most 1.3e-14): the same math,
  summed in another order. Data parallel (two GPU workers through Ray) is proved this way against the reference
  loop on the whole batch, so against the one-rank run.
- float32 against an independent reference: the reference computed in float32 and in float64 from the same
  start; the engine's float32 result within 4x that float32-against-float64 difference (floor 16 float32 ulps;
  a metric over the steps as one vector). MKL's float32 GEMMs round by CPU, so no fixed bound holds everywhere
  (two GPU workers against one: a reward 1.9e-6 apart on an AVX-512 Xeon failed the 1e-6 fitted elsewhere).
  Measured on that Xeon, 10 steps: the reference loop's float32 weights 3.0e-6 from its float64 ones at worst,
  the engine's 1.8e-6 from its float32 ones (0.6x); losses: noise 2.5e-6, ours 2.1e-6 (0.8x); rewards over the
  steps: noise 6.6e-7 to 2.0e-6, ours 0.6x to 1.1x. DPO's beta off by 1e-3 puts the losses 4.3e-4 away (110x
  the bound) and the float64 run 3.9e-4.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow.parquet as pq
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")

from megatrain_ray.config.load import load_config
from megatrain_ray.data.prepare import PrepareOptions, prepare
from megatrain_ray.driver.reference import reference_key, reference_path
from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.exceptions import ConfigError, DataError
from tests.conftest import REPO
from tests.integration.test_lora_parity import float64_transformers  # noqa: F401 - a fixture
from tests.numerics import (
    FLOOR,
    Reference,
    assert_exact,
    assert_run_within_noise,
    assert_within_noise,
    bound,
    reference_in_both,
    relative_error,
    run_noise,
)
from tests.reference_dpo import hf_token_logps, trl_loss

sys.path.insert(0, str(Path(REPO) / "examples" / "finetune_qwen2"))
from make_tiny_qwen2 import alpaca_texts, build_tokenizer

QUESTIONS = [("add 2 and 3", "5", "six"), ("the capital of Peru", "Lima", "Peru is a capital"),
             ("spell olleh backwards", "hello", "olleh"), ("add two numbers", "2 + 3 = 5", "2 + 3 = 7"),
             ("the capital of Peru is", "Lima.", "Lima, Peru, the capital"), ("add 1 and 1", "2", "11")]
STEPS = 10
LN2 = 0.6931471805599453


def make_tiny_llama(out: Path) -> Path:
    tok = build_tokenizer(alpaca_texts())
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


def layout(name: str, prompt: str, chosen: str, rejected: str) -> dict:
    """One preference example in one of the accepted layouts."""
    user, good, bad = ({"role": "user", "content": prompt}, {"role": "assistant", "content": chosen},
                       {"role": "assistant", "content": rejected})
    return {
        "trl": {"prompt": [user], "chosen": [good], "rejected": [bad]},
        "trl_implicit": {"chosen": [user, good], "rejected": [user, bad]},
        "sharegpt": {"conversations": [{"from": "human", "value": prompt}], "chosen": {"from": "gpt", "value": chosen},
                     "rejected": {"from": "gpt", "value": rejected}},
        "sharegpt_openai": {"messages": [user], "chosen": good, "rejected": bad},
        "alpaca": {"instruction": prompt, "input": "", "chosen": chosen, "rejected": rejected},
        "trl_text": {"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected},
        "trl_text_implicit": {"chosen": f"{prompt} {chosen}", "rejected": f"{prompt} {rejected}"},
    }[name]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def prepared_pairs(directory: Path) -> list[tuple]:
    manifest = json.loads((directory / "manifest.json").read_text())
    rows = [r for f in manifest["splits"]["train"]["files"] for r in pq.read_table(directory / f).to_pylist()]
    assert [r["pair_role"] for r in rows] == [0, 1] * (len(rows) // 2)
    return [(tuple(c["input_ids"]), tuple(c["loss_mask"]), tuple(r["input_ids"]), tuple(r["loss_mask"]))
            for c, r in zip(rows[0::2], rows[1::2])]


def trl_pairs(model_dir: Path, records: list[dict], max_length: int | None = None) -> list[tuple]:
    """TRL's own preprocessing (DPOTrainer._prepare_dataset, unbound: it drops a pair whose prompt fills
    max_length) and its collator's truncation (keep_start): each pair's sequences and completion masks."""
    from datasets import Dataset
    from trl import DPOTrainer

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start")
    out = DPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenizer=tok), Dataset.from_list(records), tok, args,
                                      "train")
    cut = slice(None, max_length)
    return [(tuple(e["prompt_ids"] + e["chosen_ids"])[cut],
             ((0,) * len(e["prompt_ids"]) + (1,) * len(e["chosen_ids"]))[cut],
             tuple(e["prompt_ids"] + e["rejected_ids"])[cut],
             ((0,) * len(e["prompt_ids"]) + (1,) * len(e["rejected_ids"]))[cut]) for e in out]


def run_prepare(model_dir: Path, inputs: list[Path], out: Path, **options) -> dict:
    return prepare(PrepareOptions(tokenizer_dir=str(model_dir), format="preference", inputs=[str(p) for p in inputs],
                                  output_dir=str(out), workers=1, **options))


@pytest.mark.parametrize("name", ["trl", "trl_implicit", "sharegpt", "sharegpt_openai", "alpaca", "trl_text",
                                  "trl_text_implicit"])
def test_every_layout_gives_trls_tokens(tmp_path, model_dir, name):
    """TRL's layouts against TRL's preprocessing of the same records; LLaMA-Factory's against TRL's of the same
    conversations (the implicit layouts are their own reference: a text prompt ends where the texts differ)."""
    expected = trl_pairs(model_dir, [layout(name if name.startswith("trl") else "trl", *q) for q in QUESTIONS])
    if name == "trl_implicit":
        assert expected == trl_pairs(model_dir, [layout("trl", *q) for q in QUESTIONS])
    path = write_jsonl(tmp_path / f"{name}.jsonl", [layout(name, *q) for q in QUESTIONS])
    manifest = run_prepare(model_dir, [path], tmp_path / "out")
    assert manifest["preference_pairs"] and manifest["documents"] == 2 * len(QUESTIONS)
    assert sorted(prepared_pairs(tmp_path / "out")) == sorted(expected)


def test_a_llama_factory_registry_entry_marked_ranking_is_preference_data(tmp_path, model_dir):
    write_jsonl(tmp_path / "pairs.jsonl", [layout("sharegpt", *q) for q in QUESTIONS])
    (tmp_path / "dataset_info.json").write_text(json.dumps(
        {"prefs": {"file_name": "pairs.jsonl", "ranking": True, "formatting": "sharegpt"}}))
    manifest = prepare(PrepareOptions(tokenizer_dir=str(model_dir), format=None, inputs=[], workers=1,
                                      output_dir=str(tmp_path / "out"), registry=str(tmp_path / "dataset_info.json"),
                                      dataset="prefs"))
    assert manifest["format"] == "preference"
    assert sorted(prepared_pairs(tmp_path / "out")) == sorted(trl_pairs(model_dir, [layout("trl", *q)
                                                                                    for q in QUESTIONS]))


def test_worker_processes_write_the_same_shards(tmp_path, model_dir, monkeypatch):
    from megatrain_ray.data.prepare import pipeline

    monkeypatch.setattr(pipeline, "CHUNK_RECORDS", 4)  # 24 records: 6 chunks over 2 worker processes
    path = write_jsonl(tmp_path / "pairs.jsonl", [layout(n, *q) for n in ("trl", "sharegpt", "alpaca", "trl_text")
                                                  for q in QUESTIONS])
    for workers in (1, 2):
        prepare(PrepareOptions(tokenizer_dir=str(model_dir), format="preference", inputs=[str(path)],
                               output_dir=str(tmp_path / f"w{workers}"), workers=workers, eval_fraction=0.25))
    for name in ("train-00000.parquet", "eval-00000.parquet"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name


def test_a_bad_record_gives_one_error_naming_it_and_the_field(tmp_path, model_dir):
    records = [layout("trl", *QUESTIONS[0]), {"prompt": "add", "chosen": " 5"}]
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(DataError, match=r"bad\.jsonl record 1: a preference record needs the field 'rejected'"):
        run_prepare(model_dir, [path], tmp_path / "out", on_bad_record="fail")
    manifest = run_prepare(model_dir, [path], tmp_path / "skipped")
    assert manifest["skipped"] == {"missing 'rejected'": 1} and manifest["documents"] == 2


def test_seq_len_keeps_the_start_and_drops_a_pair_whose_prompt_fills_it(tmp_path, model_dir):
    """--seq-len as TRL's max_length with keep_start truncation."""
    records = [layout("trl", *q) for q in QUESTIONS]
    records[0]["prompt"][0]["content"] = "add 2 and 3 " * 6  # a prompt longer than the limit
    limit = 24  # the other prompts are 20-22 tokens, so some completions are cut
    expected = trl_pairs(model_dir, records, max_length=limit)
    manifest = run_prepare(model_dir, [write_jsonl(tmp_path / "pairs.jsonl", records)], tmp_path / "out", seq_len=limit)
    assert sorted(prepared_pairs(tmp_path / "out")) == sorted(expected)
    assert len(expected) < len(records) and manifest["truncated"] >= 1
    assert sum(manifest["dropped"].values()) == len(records) - len(expected)


# ----------------------------------------------------------------------------- training


def dpo_config(tmp_path: Path, model_dir: Path, prepared: Path, **sections):
    raw = {"model": {"path": str(model_dir)},
           "data": {"path": str(prepared), "seq_len": 40, "batch_size": 4, "seed": 1},
           "optimizer": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0,
                         "workers": 2, "chunk_elems": 1024},
           "schedule": {"kind": "constant", "warmup_steps": 0},
           "precision": {"master_dtype": "float32", "compute_dtype": "float32"},
           "engine": {"device": "cpu", "poison_buffers": True, "loss_chunk_tokens": 24},
           "runtime": {"mode": "local", "dashboard": False},
           "train": {"steps": STEPS, "log_every": 100, "output_dir": str(tmp_path / "run")},
           "checkpoint": {"at_end": False},
           "finetune": {"objective": "dpo", "dpo": {"beta": 0.5}}}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return load_config(raw=raw)


@pytest.fixture
def pairs_dir(tmp_path, model_dir) -> Path:
    """Every layout at once: 6 questions x 5 layouts = 30 pairs (12 steps of 2 pairs each make 10 steps a bit
    less than an epoch)."""
    records = [layout(name, *q) for name in ("trl", "trl_implicit", "sharegpt", "alpaca", "trl_text") for q in QUESTIONS]
    run_prepare(model_dir, [write_jsonl(tmp_path / "pairs.jsonl", records)], tmp_path / "prepared")
    return tmp_path / "prepared"


def reference_loop(cfg, model_dir: Path, batches: list, dtype: torch.dtype = torch.float32
                   ) -> tuple[list[float], list[dict], dict]:
    """The plain transformers model from the same directory in `dtype`, TRL's loss on its log-probabilities (the
    batches' reference log-probabilities, megatrain's, in `dtype`), AdamW (decay on matrices only, as megatrain)
    and clip_grad_norm_. Returns the losses, TRL's metrics of each step and the final state."""
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=dtype)
    model.train()
    o, dpo = cfg.optimizer, cfg.finetune.dpo
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
    losses, metrics = [], []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        per_token = hf_token_logps(model, batch.input_ids, batch.labels)
        completion = torch.cat([torch.zeros_like(batch.labels[:, :1]), (batch.labels != -100).long()], 1)
        loss, logged = trl_loss(per_token, completion, batch.preference.reference_logps.to(dtype), dpo.beta,
                                dpo.label_smoothing, dpo.loss_type)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        losses.append(loss.item())
        metrics.append(logged)
    return losses, metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}


class DpoRun(NamedTuple):
    cfg: Any
    records: list[dict]
    initial: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    batches: list


def train_dpo(tmp_path, model_dir, pairs_dir, **sections) -> DpoRun:
    cfg = dpo_config(tmp_path, model_dir, pairs_dir, **sections)
    with Trainer(cfg) as trainer:
        initial = trainer.master_weights()
        batches = [trainer.data.batch(s) for s in range(cfg.train.steps)]
        records = trainer.train()
        final = trainer.master_weights()
    return DpoRun(cfg, records, initial, final, batches)


FLOAT64 = {"master_dtype": "float64", "compute_dtype": "float64"}
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins")
LOGPS = ("logps/chosen", "logps/rejected")


def metric_series(records: list[dict], key: str) -> torch.Tensor:
    """One metric over the steps, as one vector (norm of the difference over the norm: a reward, a difference of
    two log-probabilities of about -30, is small at some steps, where float32 leaves it few significant digits);
    the rewards from step 1 on: at step 0 the policy is the reference, the rewards rounding noise about 0."""
    return torch.tensor([r[key] for s, r in enumerate(records) if s or key not in REWARDS], dtype=torch.float64)


def assert_accuracies_and_start(run: DpoRun, ref_metrics: list[dict]) -> None:
    for step, (ours, theirs) in enumerate(zip(run.records, ref_metrics)):
        if step:  # the share of pairs ranked right: a count, equal unless a margin is within rounding of 0
            assert ours["rewards/accuracies"] == theirs["rewards/accuracies"], step
    assert run.records[-1]["loss"] < run.records[0]["loss"] - 0.05, "the DPO loss should fall"


def assert_dpo_exact(run: DpoRun, losses: list[float], metrics: list[dict], state: dict) -> None:
    """A float64 run against the float64 reference loop: losses, TRL's metrics and final weights within 1e-10;
    the policy starts as the reference (ln 2)."""
    assert len(run.records) == len(losses)
    assert_exact("loss at step 0 (the policy is the reference: ln 2)", run.records[0]["loss"], LN2)
    for step, (ours, ref) in enumerate(zip(run.records, losses)):
        assert_exact(f"loss at step {step}", ours["loss"], ref)
    for key in REWARDS + LOGPS:
        assert_exact(f"{key} over the steps", metric_series(run.records, key), metric_series(metrics, key))
    for name, value in run.final.items():
        assert_exact(name, value, state[name])
        assert relative_error(value, run.initial[name]) > 1e-3, f"{name} barely moved"
    assert_accuracies_and_start(run, metrics)


def assert_dpo_within_noise(run: DpoRun, ref: Reference, metrics32: list[dict], metrics64: list[dict]) -> None:
    """A float32 run against the reference loop in float32, within 4x the float32 loop's distance from the
    float64 loop: every step's loss, each of TRL's metrics over the steps, every final weight (each of which must
    have moved by more than 100x its bound)."""
    assert_run_within_noise([r["loss"] for r in run.records], run.final, ref, run.initial)
    for key in REWARDS + LOGPS:
        assert_within_noise(f"{key} over the steps", metric_series(run.records, key), metric_series(metrics32, key),
                            metric_series(metrics64, key))
    # The policy starts as the reference: the same forward on the same shapes, so ln 2 up to the loss's noise.
    assert relative_error(run.records[0]["loss"], LN2) <= bound(run_noise(
        dict(enumerate(ref.losses32)), dict(enumerate(ref.losses64)))), run.records[0]["loss"]
    assert_accuracies_and_start(run, metrics32)


def reference_pair(run: DpoRun, model_dir: Path) -> tuple[Reference, list[dict], list[dict]]:
    """The reference loop on the run's batches in float32 and float64, and TRL's metrics of each."""
    metrics = {}

    def loop(dtype):
        losses, metrics[dtype], state = reference_loop(run.cfg, model_dir, run.batches, dtype)
        return losses, state

    ref = reference_in_both(loop)
    return ref, metrics[torch.float32], metrics[torch.float64]


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.float32_parity), "float64"])
def test_reference_logps_equal_a_plain_transformers_forward(tmp_path, model_dir, pairs_dir, dtype,
                                                            float64_transformers):  # noqa: F811
    """float64: within 1e-10 of transformers' forward in float64 (measured 9e-17). float32: within 4x the distance
    of transformers' float32 forward from its float64 one, floor 16 ulps (measured: noise 1.2e-8, ours 5.4e-8 from
    transformers' float32 sums: the floor, 1.9e-6, holds it); then the reuse of the file (float32 only)."""
    cfg = dpo_config(tmp_path, model_dir, pairs_dir, train={"steps": 1},
                     precision={"master_dtype": dtype, "compute_dtype": dtype})
    with Trainer(cfg) as trainer:
        ours = trainer.data.reference
        rows = list(trainer.data.reference_batches())
        path = reference_path(trainer.data, reference_key(cfg, trainer.run_spec.compute_dtype, str(pairs_dir)))
        assert path.is_file()
    expected = {}
    for ref_dtype in (torch.float32, torch.float64) if dtype == "float32" else (torch.float64,):
        model = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=ref_dtype)
        with torch.no_grad():
            expected[ref_dtype] = torch.zeros_like(ours)
            for documents, batch in rows:
                expected[ref_dtype][documents] = hf_token_logps(model, batch.input_ids, batch.labels).double().sum(1)
    if dtype == "float64":
        assert_exact("reference log-probabilities", ours, expected[torch.float64])
        return
    assert_within_noise("reference log-probabilities", ours, expected[torch.float32], expected[torch.float64])
    # A second run (or a resume) reads them back instead of computing them again.
    mtime = path.stat().st_mtime_ns
    cfg2 = dpo_config(tmp_path / "again", model_dir, pairs_dir, train={"steps": 1})
    with Trainer(cfg2) as trainer:
        torch.testing.assert_close(trainer.data.reference, ours, rtol=0, atol=0)
        key = reference_key(cfg2, trainer.run_spec.compute_dtype, str(pairs_dir))
    assert path.stat().st_mtime_ns == mtime
    # Other weights (rewritten model files) or another compute dtype: another key, so the file is not reused.
    weights = model_dir / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))
    assert reference_key(cfg2, "float32", str(pairs_dir)) != key
    assert reference_key(cfg2, "bfloat16", str(pairs_dir)) != reference_key(cfg2, "float32", str(pairs_dir))


@pytest.fixture(scope="module")
def float64_cache() -> dict:
    """The local float64 run and the reference loop's float64 run on its batches, made once for the module by the
    first test that asks (local_float64): the float64 test's comparison, and the float64 twin that measures the
    float32 test's noise."""
    return {}


def local_float64(cache: dict, tmp_path: Path, model_dir: Path, pairs_dir: Path) -> tuple[DpoRun, tuple]:
    """(the local float64 run, the reference loop's (losses, metrics, state) in float64 on its batches, with its
    float64 reference log-probabilities). Needs the float64_transformers fixture active."""
    if "run" not in cache:
        run = train_dpo(tmp_path / "float64", model_dir, pairs_dir, precision=FLOAT64)
        cache["run"], cache["loop"] = run, reference_loop(run.cfg, model_dir, run.batches, torch.float64)
    return cache["run"], cache["loop"]


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.float32_parity), "float64"])
def test_local_ten_steps_match_trl_loss_reference_loop(tmp_path, model_dir, pairs_dir, dtype, float64_cache,
                                                       float64_transformers):  # noqa: F811
    """float64: the run within 1e-10 of the loop in float64. float32: within 4x the loop's float32 noise, its float32
    run (on the float32 reference log-probabilities) against its float64 one (the float64 test's, on the float64
    reference log-probabilities: their rounding is part of float32's noise)."""
    run64, (losses64, metrics64, state64) = local_float64(float64_cache, tmp_path, model_dir, pairs_dir)
    if dtype == "float64":
        assert_dpo_exact(run64, losses64, metrics64, state64)
        return
    run = train_dpo(tmp_path, model_dir, pairs_dir)
    assert all(torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
               for a, b in zip(run.batches, run64.batches)), "the float64 twin trained on other batches"
    losses32, metrics32, state32 = reference_loop(run.cfg, model_dir, run.batches, torch.float32)
    assert_dpo_within_noise(run, Reference(losses32, state32, losses64, state64), metrics32, metrics64)


@pytest.mark.ray
def test_two_gpu_workers_through_ray_give_the_reference_loops_run(tmp_path, ray_session, model_dir, pairs_dir,
                                                                  float64_transformers):  # noqa: F811
    """Data parallel through Ray (2 GPU workers over gloo, 2 optimizer workers): each rank takes whole pairs and
    divides by the pairs of the whole batch, the ranks' gradients are summed, the metrics gathered. float64, so the
    run, metrics included, is the reference loop's on the whole batch within 1e-10 (the one-rank run, local, is
    that loop's too: test_local_ten_steps_match_trl_loss_reference_loop)."""
    run = train_dpo(tmp_path, model_dir, pairs_dir, data={"batch_size": 8}, train={"steps": 5}, runtime={"mode": "ray"},
                    parallel={"gpus": 2, "backend": "gloo"}, precision=FLOAT64)
    assert {r["gpus"] for r in run.records} == {2}
    assert_dpo_exact(run, *reference_loop(run.cfg, model_dir, run.batches, torch.float64))


def test_resume_reuses_the_reference_and_continues_the_same_run(tmp_path, model_dir, pairs_dir):
    with Trainer(dpo_config(tmp_path / "whole", model_dir, pairs_dir, train={"steps": 6})) as trainer:
        whole = [r["loss"] for r in trainer.train()]
    cfg = dpo_config(tmp_path / "parts", model_dir, pairs_dir, train={"steps": 3}, checkpoint={"at_end": True})
    with Trainer(cfg) as trainer:
        first = [r["loss"] for r in trainer.train()]
        path = reference_path(trainer.data, reference_key(cfg, trainer.run_spec.compute_dtype, str(pairs_dir)))
    cfg = dpo_config(tmp_path / "parts", model_dir, pairs_dir, train={"steps": 6})
    with Trainer(cfg, resume="auto") as trainer:
        rest = [r["loss"] for r in trainer.train()]
    assert first + rest == whole
    path.unlink()  # a resume cannot recompute them: its weights are no longer the initial ones
    cfg = dpo_config(tmp_path / "parts", model_dir, pairs_dir, train={"steps": 8})
    with pytest.raises(ConfigError, match="resuming a DPO run needs the reference log-probabilities"):
        with Trainer(cfg, resume="auto"):
            pass


def test_sft_on_preference_pairs_is_refused(tmp_path, model_dir, pairs_dir):
    cfg = dpo_config(tmp_path, model_dir, pairs_dir, finetune={"objective": "sft"})
    with pytest.raises(DataError, match="holds preference pairs .* set finetune.objective=dpo"):
        Trainer(cfg)


def test_example_as_a_user_types_it(tmp_path):
    """examples/dpo_tiny: make the model, prepare, train through the CLI (30 steps: 3 epochs of 10 steps of 4 pairs);
    the loss starts at ln 2 and the last epoch's is lower than the first's (a step's loss, of 4 pairs, is noisy)."""
    import subprocess

    from tests.integration.test_cli import megatrain

    example = Path(REPO) / "examples" / "dpo_tiny"
    model, data, run = tmp_path / "tiny-qwen2", tmp_path / "dpo-tiny", tmp_path / "run"
    made = subprocess.run([sys.executable, f"{REPO}/examples/finetune_qwen2/make_tiny_qwen2.py", str(model)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert made.returncode == 0, made.stderr
    proc = megatrain("prepare", "--tokenizer", str(model), "--format", "preference", "--input",
                     str(example / "pairs.jsonl"), "--output", str(data))
    assert proc.returncode == 0, proc.stderr
    assert "40 records -> train: 80 documents" in proc.stderr
    proc = megatrain("train", str(example / "config.yaml"), "--local", "--set", f"model.path={model}",
                     "--set", f"data.path={data}", "--set", f"train.output_dir={run}")
    assert proc.returncode == 0, proc.stderr
    assert "reward_acc" in proc.stderr
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # The policy starts as the reference: the same forward on the same shapes (8 rows), so ln 2 up to the
    # rounding of a float32 loss (measured: float32's ln 2, 2.7e-9 from it).
    assert lines[0]["loss"] == pytest.approx(LN2, rel=FLOOR)
    losses = [r["loss"] for r in lines]
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.03, losses
    assert sum(r["rewards/margins"] for r in lines[-10:]) > 0
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected"} <= set(lines[-1])


@pytest.mark.float32_parity
def test_ten_steps_match_trls_dpotrainer_itself(tmp_path, model_dir, float64_transformers):  # noqa: F811
    """TRL's DPOTrainer (precompute_ref_log_probs, sigmoid loss) on the same model, fed the same pairs in our
    step order (sequential sampler), with AdamW at the same settings (weight decay 0: transformers' Trainer
    decides by parameter name which tensors decay), constant lr and max_grad_norm 1: its logged per-step
    losses (its reference log-probabilities from its own forward) within 4x the float32 noise of these steps'
    losses, measured by the reference loop (the same model, loss and AdamW on the same batches) in float32
    against float64. Not TRL's own float64 run: its Trainer logs every loss through float32 (its float64 run
    logs ln 2 as 0.69314718246) and lands 1.5e-6 from our float64 run, so it is no float64 reference; the exact
    float64 comparison of the same math is test_local_ten_steps_match_trl_loss_reference_loop's.
    Measured: noise 1.4e-6 (the largest step's), ours 3.5e-6 from TRL's at worst (2.5x; bound 5.6e-6); with
    DPO's beta off by 1e-3, 1.7e-5 at step 1."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    records = [layout("trl", *q) for q in QUESTIONS]
    run_prepare(model_dir, [write_jsonl(tmp_path / "pairs.jsonl", records)], tmp_path / "prepared")
    cfg = dpo_config(tmp_path, model_dir, tmp_path / "prepared", optimizer={"weight_decay": 0.0})
    with Trainer(cfg) as trainer:
        docs = trainer.data.docs
        sequence = lambda d: tuple(int(t) for t in docs.tokens[docs.starts[d]:docs.starts[d + 1]])  # noqa: E731
        by_tokens = {(c, r): k for k, (c, _, r, _) in enumerate(trl_pairs(model_dir, records))}
        order = []
        for step in range(STEPS):
            documents = trainer.data.step_documents(step)
            half = len(documents) // 2
            order += [by_tokens[(sequence(c), sequence(r))] for c, r in zip(documents[:half], documents[half:])]
        initial = trainer.master_weights()
        batches = [trainer.data.batch(s) for s in range(STEPS)]
        ours = [r["loss"] for r in trainer.train()]
        final = trainer.master_weights()
    ref = reference_pair(DpoRun(cfg, [], initial, final, batches), model_dir)[0]
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=cfg.data.batch_size // 2,
                     max_steps=STEPS, learning_rate=cfg.optimizer.lr, lr_scheduler_type="constant", warmup_steps=0,
                     weight_decay=0.0, adam_beta1=cfg.optimizer.beta1, adam_beta2=cfg.optimizer.beta2,
                     adam_epsilon=cfg.optimizer.eps, max_grad_norm=cfg.optimizer.grad_clip, beta=cfg.finetune.dpo.beta,
                     loss_type=["sigmoid"], precompute_ref_log_probs=True, max_length=None, logging_steps=1,
                     train_sampling_strategy="sequential", save_strategy="no", report_to=[], use_cpu=True, seed=0,
                     dataloader_num_workers=0, bf16=False)  # TRL's default is bf16 autocast
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    trl_trainer = DPOTrainer(model=model, args=args, processing_class=tok,
                             train_dataset=Dataset.from_list([records[k] for k in order]))
    trl_trainer.train()
    theirs = [entry["loss"] for entry in trl_trainer.state.log_history if "loss" in entry]
    assert len(theirs) == STEPS
    noise = run_noise(dict(enumerate(ref.losses32)), dict(enumerate(ref.losses64)))
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert relative_error(a, b) <= bound(noise), (
            f"step {step}: loss {a} vs TRL's DPOTrainer {b}: relative error {relative_error(a, b):.2e}, bound "
            f"{bound(noise):.2e} (4x the float32 noise {noise:.2e} of the reference loop's losses)")


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.float32_parity), "float64"])
def test_evaluation_is_the_dpo_loss_of_the_eval_pairs(tmp_path, model_dir, dtype, float64_transformers):  # noqa: F811
    """train.eval_every with DPO: the eval split's pairs get their own reference log-probabilities (a plain
    transformers forward of the initial model), and eval_loss is the mean over those pairs of TRL's loss on the
    trained model's log-probabilities: within 1e-10 in float64; in float32 within 4x the distance of that hand
    computation in float32 from the same in float64 (measured: eval_loss noise 9.1e-7, ours 5.5e-7 from the float32
    hand computation; the reference log-probabilities 4.1e-8, within the floor of 16 ulps)."""
    records = [layout(name, *q) for name in ("trl", "sharegpt", "alpaca", "trl_text") for q in QUESTIONS]
    run_prepare(model_dir, [write_jsonl(tmp_path / "pairs.jsonl", records)], tmp_path / "prepared", eval_fraction=0.25)
    cfg = dpo_config(tmp_path, model_dir, tmp_path / "prepared", train={"steps": 4, "eval_every": 4, "eval_batches": 2},
                     precision={"master_dtype": dtype, "compute_dtype": dtype})
    with Trainer(cfg) as trainer:
        records = trainer.train()
        batches = list(trainer.eval_data)
        final = trainer.master_weights()
    assert len(batches) == 2 and all(b.input_ids.shape[0] == 4 for b in batches)
    ours_ref = torch.cat([b.preference.reference_logps for b in batches])
    refs, losses = {}, {}
    for hand_dtype in (torch.float32, torch.float64) if dtype == "float32" else (torch.float64,):
        initial = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=hand_dtype)
        trained = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=hand_dtype)
        trained.load_state_dict(final)
        total = pairs = 0.0
        refs[hand_dtype] = []
        with torch.no_grad():
            for batch in batches:
                ref = hf_token_logps(initial, batch.input_ids, batch.labels).double().sum(1)
                refs[hand_dtype].append(ref)
                per_token = hf_token_logps(trained, batch.input_ids, batch.labels)
                completion = torch.cat([torch.zeros_like(batch.labels[:, :1]), (batch.labels != -100).long()], 1)
                loss, _ = trl_loss(per_token, completion, ref.to(hand_dtype), cfg.finetune.dpo.beta, 0.0, "sigmoid")
                total += loss.item() * (batch.input_ids.shape[0] // 2)
                pairs += batch.input_ids.shape[0] // 2
        refs[hand_dtype] = torch.cat(refs[hand_dtype])
        losses[hand_dtype] = total / pairs
    if dtype == "float64":
        assert_exact("eval reference log-probabilities", ours_ref, refs[torch.float64])
        assert_exact("eval_loss", records[-1]["eval_loss"], losses[torch.float64])
    else:
        assert_within_noise("eval reference log-probabilities", ours_ref, refs[torch.float32], refs[torch.float64])
        assert_within_noise("eval_loss", records[-1]["eval_loss"], losses[torch.float32], losses[torch.float64])
    assert records[-1]["eval_loss"] != pytest.approx(LN2, rel=1e-3), "the model moved"


def test_bf16_compute_tracks_float32(tmp_path, model_dir, pairs_dir):
    """bf16 weights and math (the GPU default) on the CPU, with their own bf16 reference log-probabilities (another
    key, another file): the loss curve within 2 % of the float32 run's (as the cross-entropy's bf16 test)."""
    losses = {}
    for dtype in ("float32", "bfloat16"):
        cfg = dpo_config(tmp_path / dtype, model_dir, pairs_dir, precision={"compute_dtype": dtype})
        with Trainer(cfg) as trainer:
            losses[dtype] = [r["loss"] for r in trainer.train()]
    assert len(list((pairs_dir / "reference").glob("train-*.safetensors"))) == 2
    for step, (a, b) in enumerate(zip(losses["bfloat16"], losses["float32"])):
        assert abs(a - b) <= 0.02 * abs(b), f"step {step}: bf16 loss {a} vs float32 {b}"
