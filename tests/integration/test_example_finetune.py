"""examples/finetune_qwen2 as a user types it: make the model, prepare, train (with eval and export),
re-export in bf16 with `megatrain export`, then `megatrain generate` on the export, against transformers' greedy
generate of the same directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open

from tests.conftest import REPO
from tests.integration.test_cli import megatrain, side_by_side

EXAMPLE = f"{REPO}/examples/finetune_qwen2"


def test_finetune_example_end_to_end(tmp_path):
    model, data, run, sft, sft_bf16 = (tmp_path / n for n in ("tiny-qwen2", "alpaca", "run", "sft", "sft-bf16"))
    made = subprocess.run([sys.executable, f"{EXAMPLE}/make_tiny_qwen2.py", str(model)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert made.returncode == 0, made.stderr
    proc = megatrain("prepare", "--tokenizer", str(model), "--format", "alpaca", "--input",
                     f"{EXAMPLE}/alpaca_tiny.json", "--output", str(data), "--eval-fraction", "0.1")
    assert proc.returncode == 0, proc.stderr
    assert "50 records -> train: 45 documents" in proc.stderr
    proc = megatrain("train", f"{EXAMPLE}/config.yaml", "--local", "--set", f"model.path={model}",
                     "--set", f"data.path={data}", "--set", f"train.output_dir={run}", "--set", f"train.export_dir={sft}",
                     "--set", "train.steps=12", "--set", "train.eval_every=6")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "eval_loss" in r] == [5, 11]
    assert lines[-1]["loss"] < lines[0]["loss"]
    proc = megatrain("export", str(run), str(sft_bf16), "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        assert (sft_bf16 / name).is_file(), name
    with safe_open(str(sft / "model.safetensors"), "pt") as f32, \
            safe_open(str(sft_bf16 / "model.safetensors"), "pt") as bf16:
        for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.bias"):
            assert torch.equal(bf16.get_tensor(name), f32.get_tensor(name).to(torch.bfloat16))
    # The README's last command, in float64 (greedy choices exact), against transformers' greedy generate of the
    # same export loaded as a serving tool would (upcast to float64), each prompt alone.
    answers = tmp_path / "answers.jsonl"
    proc = megatrain("generate", str(sft_bf16), "--prompts", f"{EXAMPLE}/prompts.jsonl", "--max-new-tokens", "6",
                     "--out", str(answers), "--set", "precision.master_dtype=float64",
                     "--set", "precision.compute_dtype=float64")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    prompts = [json.loads(line) for line in open(f"{EXAMPLE}/prompts.jsonl")]
    assert len(rows) == len(prompts) == 3
    tok = transformers.AutoTokenizer.from_pretrained(sft_bf16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(sft_bf16, dtype=torch.float64).eval()
    stops = hf.generation_config.eos_token_id
    for row, prompt in zip(rows, prompts):
        ids = tok.apply_chat_template(prompt["messages"], tokenize=True, return_dict=True,
                                      add_generation_prompt=True)["input_ids"]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=6, do_sample=False, eos_token_id=stops, pad_token_id=tok.pad_token_id)
        assert row["completion_ids"] == out[0, len(ids):].tolist(), (prompt, row)
        assert row["completion"] == tok.decode(row["completion_ids"], skip_special_tokens=True)


def test_cli_errors_are_one_line_without_traceback(tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"instruction": "Say hi."}) + "\n")
    prepared, exported = side_by_side(
        lambda: megatrain("prepare", "--tokenizer", str(tmp_path / "no-model"), "--format", "alpaca", "--input",
                          str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "out")),
        lambda: megatrain("export", str(tmp_path), str(tmp_path / "exported")))
    assert prepared.returncode == 2 and "--tokenizer" in prepared.stderr and "Traceback" not in prepared.stderr
    assert exported.returncode == 2 and "neither a model directory" in exported.stderr
    assert "Traceback" not in exported.stderr
