"""examples/dpo_smollm2 is the SFT-before-DPO example of docs/fine-tuning.md: its config loads (DPO with LoRA; the
README gives model.path), and its pairs are the SFT example's records (each prompt a facts.jsonl
instruction, chosen its taught answer, rejected another), so `SFT on the chosen answers, then DPO` is what its
two commands do. The runs themselves are in its README (minutes on a CPU: not a test)."""

from __future__ import annotations

import json
from pathlib import Path

from megatrain_ray.config.load import load_config
from tests.conftest import REPO

EXAMPLES = Path(REPO) / "examples"


def test_the_dpo_example_trains_lora_dpo_on_the_sft_examples_chosen_answers():
    cfg = load_config(str(EXAMPLES / "dpo_smollm2" / "config.yaml"))  # model.path is given on the command line
    assert (cfg.finetune.objective, cfg.finetune.method) == ("dpo", "lora") and not cfg.data.packing
    assert cfg.data.batch_size % 2 == 0
    facts = [json.loads(line) for line in (EXAMPLES / "finetune_smollm2" / "facts.jsonl").read_text().splitlines()]
    taught = {r["instruction"]: r["output"] for r in facts}
    pairs = [json.loads(line) for line in (EXAMPLES / "dpo_smollm2" / "pairs.jsonl").read_text().splitlines()]
    assert len(pairs) == len(facts)
    for pair in pairs:
        (prompt,), (chosen,), (rejected,) = pair["prompt"], pair["chosen"], pair["rejected"]
        assert prompt["role"] == "user" and chosen["role"] == rejected["role"] == "assistant"
        assert chosen["content"] == taught[prompt["content"]] != rejected["content"]
