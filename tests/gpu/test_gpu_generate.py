"""`megatrain generate` and `megatrain chat` on CUDA (marker `gpu`; skipped without CUDA): the forward-only session
(driver/session.py) on the GPU, with the rollout's weights resident (engine.rollout_weights auto: the decode step a
CUDA graph) and streamed, against transformers' greedy `generate` of each prompt alone on the CPU, token for token.
Both compute in float64 (--set; the H200 runs float64 natively), where greedy choices are exact, as in
tests/integration/test_generate.py, whose tiny Llama, prompts and reference this module reuses. The CPU tests run
the same commands with --device cpu; tests/gpu/test_gpu_rollout.py checks the rollout engine itself on CUDA through
a Trainer. Run on the GPU machine:

    python -m pytest tests/gpu/test_gpu_generate.py -m gpu -s
"""

from __future__ import annotations

import io
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.__main__ import main  # noqa: E402
from tests.integration.test_generate import (FLOAT64, NEW, PROMPTS, greedy, prompt_ids, read_jsonl,  # noqa: E402,F401
                                             tiny_llama, tok, write_jsonl)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("weights", ["auto", "streamed"])
def test_generate_on_cuda_equals_transformers_greedy_token_for_token(tmp_path, tiny_llama, tok, weights):
    prompts, out = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS), tmp_path / "out.jsonl"
    assert main(["generate", str(tiny_llama), "--prompts", str(prompts), "--out", str(out), "--batch-size", "2",
                 "--max-new-tokens", str(NEW), "--device", "cuda", *FLOAT64,
                 "--set", f"engine.rollout_weights={weights}"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64).eval()
    for line, record in zip(read_jsonl(out), PROMPTS, strict=True):
        assert line["completion_ids"] == greedy(model, prompt_ids(tok, record)), (weights, line["id"])


def test_chat_on_cuda_replies_with_transformers_greedy_continuation(tiny_llama, tok, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n/exit\n"))
    capsys.readouterr()
    assert main(["chat", str(tiny_llama), "--max-new-tokens", "6", "--temperature", "0", "--device", "cuda",
                 *FLOAT64]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64).eval()
    ids = prompt_ids(tok, {"messages": [{"role": "user", "content": "Hello there"}]})
    assert capsys.readouterr().out == tok.decode(greedy(model, ids, new=6), skip_special_tokens=True) + "\n"
