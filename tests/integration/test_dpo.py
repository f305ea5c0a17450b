"""DPO end to end on a tiny Llama: `megatrain prepare --format preference` against TRL's own preprocessing,
the reference log-probabilities against a plain transformers forward, and 10 DPO steps through the Trainer
(local, and Ray with 2 optimizer workers) against a reference loop: the transformers model from the same
directory, the same batches, TRL 1.16's loss (DPOTrainer._compute_loss) on its log-probabilities,
torch.optim.AdamW and clip_grad_norm_.

Tolerances: float32 at lr 1e-3, per-step loss within 1e-5 relative and final weights within 1e-5 relative
(norm of the difference over the norm), as tests/integration/test_training_parity.py argues for the
cross-entropy; the reference log-probabilities within 1e-5 relative (float32 sums of about 10-30 token
log-probabilities, in another order).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

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
from tests.reference_dpo import hf_token_logps, trl_loss

sys.path.insert(0, str(Path(REPO) / "examples" / "finetune_qwen2"))
from make_tiny_qwen2 import alpaca_texts, build_tokenizer

QUESTIONS = [("add 2 and 3", "5", "six"), ("the capital of Peru", "Lima", "Peru is a capital"),
             ("spell olleh backwards", "hello", "olleh"), ("add two numbers", "2 + 3 = 5", "2 + 3 = 7"),
             ("the capital of Peru is", "Lima.", "Lima, Peru, the capital"), ("add 1 and 1", "2", "11")]
STEPS = 10


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


def reference_loop(cfg, model_dir: Path, batches: list) -> tuple[list[float], list[dict], dict]:
    """The plain transformers model from the same directory, TRL's loss on its log-probabilities, AdamW (decay on
    matrices only, as megatrain) and clip_grad_norm_."""
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
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
        loss, logged = trl_loss(per_token, completion, batch.preference.reference_logps.float(), dpo.beta,
                                dpo.label_smoothing, dpo.loss_type)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        losses.append(loss.item())
        metrics.append(logged)
    return losses, metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_dpo(tmp_path, model_dir, pairs_dir, **sections) -> None:
    cfg = dpo_config(tmp_path, model_dir, pairs_dir, **sections)
    with Trainer(cfg) as trainer:
        initial = trainer.master_weights()
        batches = [trainer.data.batch(s) for s in range(STEPS)]
        records = trainer.train()
        final = trainer.master_weights()
    losses, metrics, ref_state = reference_loop(cfg, model_dir, batches)
    for step, (ours, ref, theirs) in enumerate(zip(records, losses, metrics)):
        assert abs(ours["loss"] - ref) <= 1e-5 * abs(ref), f"step {step}: loss {ours['loss']} vs reference {ref}"
        # At step 0 the policy is the reference: the rewards are rounding noise, their comparison a coin toss.
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins") + (("rewards/accuracies",) if step else ()):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (step, key)
    assert records[0]["loss"] == pytest.approx(0.6931471805599453, rel=1e-6), "the policy starts as the reference"
    assert records[-1]["loss"] < records[0]["loss"] - 0.05, "the DPO loss should fall over 10 steps"
    for name, value in final.items():
        err = (value - ref_state[name]).norm() / ref_state[name].norm()
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
        assert (value - initial[name]).norm() / initial[name].norm() > 1e-3, f"{name} barely moved"


def test_reference_logps_equal_a_plain_transformers_forward(tmp_path, model_dir, pairs_dir):
    cfg = dpo_config(tmp_path, model_dir, pairs_dir, train={"steps": 1})
    with Trainer(cfg) as trainer:
        ours = trainer.data.reference
        rows = list(trainer.data.reference_batches())
        path = reference_path(trainer.data, reference_key(cfg, trainer.run_spec.compute_dtype, str(pairs_dir)))
        assert path.is_file()
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        for documents, batch in rows:
            expected = hf_token_logps(model, batch.input_ids, batch.labels).double().sum(1)
            torch.testing.assert_close(ours[documents], expected, rtol=1e-5, atol=0)
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


def test_local_ten_steps_match_trl_loss_reference_loop(tmp_path, model_dir, pairs_dir):
    run_dpo(tmp_path, model_dir, pairs_dir)


@pytest.mark.ray
def test_ray_ten_steps_match_trl_loss_reference_loop(tmp_path, ray_session, model_dir, pairs_dir):
    run_dpo(tmp_path, model_dir, pairs_dir, runtime={"mode": "ray"})


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
    assert lines[0]["loss"] == pytest.approx(0.6931471805599453, rel=1e-6)
    losses = [r["loss"] for r in lines]
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.03, losses
    assert sum(r["rewards/margins"] for r in lines[-10:]) > 0
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected"} <= set(lines[-1])


def test_ten_steps_match_trls_dpotrainer_itself(tmp_path, model_dir):
    """TRL's DPOTrainer (precompute_ref_log_probs, sigmoid loss) on the same model, fed the same pairs in our
    step order (sequential sampler), with AdamW at the same settings (weight decay 0: transformers' Trainer
    decides by parameter name which tensors decay), constant lr and max_grad_norm 1: its logged per-step
    losses within 1e-5 relative of ours (its reference log-probabilities come from its own forward, equal
    to ours within 1e-5 relative, see above)."""
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
        ours = [r["loss"] for r in trainer.train()]
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
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs TRL's DPOTrainer {b}"


def test_evaluation_is_the_dpo_loss_of_the_eval_pairs(tmp_path, model_dir):
    """train.eval_every with DPO: the eval split's pairs get their own reference log-probabilities (a plain
    transformers forward of the initial model), and eval_loss is the mean over those pairs of TRL's loss on the
    trained model's log-probabilities (within 1e-5 relative)."""
    records = [layout(name, *q) for name in ("trl", "sharegpt", "alpaca", "trl_text") for q in QUESTIONS]
    run_prepare(model_dir, [write_jsonl(tmp_path / "pairs.jsonl", records)], tmp_path / "prepared", eval_fraction=0.25)
    cfg = dpo_config(tmp_path, model_dir, tmp_path / "prepared", train={"steps": 4, "eval_every": 4, "eval_batches": 2})
    with Trainer(cfg) as trainer:
        records = trainer.train()
        batches = list(trainer.eval_data)
        final = trainer.master_weights()
    assert len(batches) == 2 and all(b.input_ids.shape[0] == 4 for b in batches)
    initial = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    trained = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    trained.load_state_dict(final)
    total = pairs = 0.0
    with torch.no_grad():
        for batch in batches:
            ref = hf_token_logps(initial, batch.input_ids, batch.labels).double().sum(1)
            torch.testing.assert_close(batch.preference.reference_logps, ref, rtol=1e-5, atol=0)
            per_token = hf_token_logps(trained, batch.input_ids, batch.labels)
            completion = torch.cat([torch.zeros_like(batch.labels[:, :1]), (batch.labels != -100).long()], 1)
            loss, _ = trl_loss(per_token, completion, batch.preference.reference_logps.float(), cfg.finetune.dpo.beta,
                               0.0, "sigmoid")
            total += loss.item() * (batch.input_ids.shape[0] // 2)
            pairs += batch.input_ids.shape[0] // 2
    assert records[-1]["eval_loss"] == pytest.approx(total / pairs, rel=1e-5)
    assert records[-1]["eval_loss"] != pytest.approx(0.6931471805599453, rel=1e-3), "the model moved"


@pytest.mark.ray
def test_two_gpu_workers_give_the_run_of_one(tmp_path, ray_session, model_dir, pairs_dir):
    """Data parallel: each rank takes whole pairs and divides by the pairs of the whole batch, the ranks' gradients
    are summed: the one-rank run up to summation order (1e-6 relative, as tests/integration/test_data_parallel.py),
    metrics included."""
    sections = {"data": {"batch_size": 8}, "runtime": {"mode": "ray"}, "train": {"steps": 5}}
    with Trainer(dpo_config(tmp_path / "one", model_dir, pairs_dir, **sections)) as trainer:
        initial = trainer.master_weights()
        one = trainer.train()
        one_final = trainer.master_weights()
    sections["parallel"] = {"gpus": 2, "backend": "gloo"}
    with Trainer(dpo_config(tmp_path / "two", model_dir, pairs_dir, **sections)) as trainer:
        two = trainer.train()
        two_final = trainer.master_weights()
    for a, b in zip(two, one):
        for key in ("loss", "rewards/chosen", "rewards/margins", "logps/rejected"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
    for name, ref in one_final.items():
        assert ((two_final[name] - ref).norm() / ref.norm()).item() <= 1e-6, name
        assert ((ref - initial[name]).norm() / initial[name].norm()).item() > 1e-4, name


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
