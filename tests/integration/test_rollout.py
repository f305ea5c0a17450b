"""The rollout engine (engine/rollout/) against transformers' own generation.

Greedy: a batch of prompts of different lengths (left-padded by the engine, 12 new tokens each, so the sequences
outgrow the 7-token sliding windows) gives every row exactly the tokens transformers' `generate` gives that prompt
alone, for dense, sliding-window, soft-capped, local/global-RoPE, partial-rotary, MoE and attention-sink families,
in float64 (transformers' float64 model; greedy choices are discrete, so exact up to a near tie of its two best
logits, within 1e-6, where a rounding may choose either). Transformers is the reference row by row: its own
left-padded float64 eager generation emits pad tokens for the padded rows.

Sampled: the rollout's log-probability of each sampled token, log_softmax(logits / T)[token], in float32 against
transformers' forward over the prompt and completion, within 4x the float32-against-float64 noise of transformers'
own values (tests/numerics.py). Stop tokens end a row (the stop token kept, padding after), and the same seed gives
the same completions.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.hf import model_config_from_hf  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from megatrain_ray.engine.rollout.interface import SamplingSettings  # noqa: E402
from tests.conftest import one_thread, tiny_config  # noqa: E402
from tests.numerics import assert_within_noise  # noqa: E402
from tests.unit.test_moe import hf_moe_model  # noqa: E402
from tests.unit.test_templates import float64_twin, hf_model  # noqa: E402

NEW = 12
TIE = 1e-6
"""Transformers' top-two logit gap under which greedy rows may part (float64 logits of order 1)."""
DENSE = ["llama-gqa", "mistral-sliding-window", "gemma2-softcap", "gemma3-local-global", "phi3-partial-sliding"]
MOE = ["qwen3-moe-dense-layer", "gpt-oss"]


def build(name: str):
    return hf_moe_model(name) if name in MOE else hf_model(name)


def prompts_for(vocab: int, lengths=(5, 11, 3)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_greedy_row(ours: torch.Tensor, model, prompt: list[int], what: str) -> None:
    """`ours` equals transformers' greedy generate of `prompt` alone, token for token, up to a near tie: where
    transformers' two best logits are within TIE of each other, a rounding may pick either (gpt-oss's reference keeps
    float32 steps in a float64 model, and an MKL code path moves its last bits), and the rows may part there."""
    with torch.no_grad(), one_thread():
        # the mask given: generate would take a prompt token equal to pad_token_id for padding (and restart RoPE)
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                             max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    theirs = out.sequences[0, len(prompt):]
    differ = (ours != theirs).nonzero()
    if len(differ):
        at = int(differ[0])
        best = out.scores[at][0].topk(2).values
        assert best[0] - best[1] < TIE, (f"{what}: token {at} is {int(ours[at])}, transformers' {int(theirs[at])}, "
                                         f"whose two best logits are {float(best[0] - best[1]):.3g} apart")


def generated(tmp_path, model, prompts, sampling: SamplingSettings, dtype: str, weights: str = "auto"):
    mcfg = model_config_from_hf(model.config.to_dict())
    cfg = tiny_config(tmp_path, model=dataclasses.asdict(mcfg), precision={"master_dtype": dtype,
                                                                          "compute_dtype": dtype},
                      engine={"device": "cpu", "poison_buffers": True, "rollout_weights": weights})
    with Trainer(cfg) as trainer:
        trainer.load_weights({k: v for k, v in model.state_dict().items() if k in trainer.master_weights()})
        return trainer.gpu.generate(prompts, sampling).result()


@pytest.mark.parametrize("name,weights", [(name, "streamed") for name in DENSE + MOE] +
                         [("llama-gqa", "resident"), ("gpt-oss", "resident")])
def test_greedy_rows_equal_transformers_generate_of_each_prompt(tmp_path, name, weights):
    """`weights`: engine.rollout_weights, the stages streamed through the training slots for every token, or the
    rollout's resident copy."""
    model = float64_twin(build(name))
    prompts = prompts_for(model.config.vocab_size)
    result = generated(tmp_path, model, prompts, SamplingSettings(max_new_tokens=NEW, temperature=0), "float64",
                       weights)
    assert result.stats["weights_resident"] == (weights == "resident")
    assert result.tokens.shape == (len(prompts), NEW) and result.lengths.tolist() == [NEW] * len(prompts)
    assert not result.stopped.any()
    for row, prompt in enumerate(prompts):
        assert_greedy_row(result.tokens[row], model, prompt, f"{name}: row {row} (prompt of {len(prompt)})")


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-sliding-window", "gemma2-softcap", "gpt-oss"])
def test_the_cuda_graph_pass_with_its_index_on_the_device_decodes_the_same(tmp_path, monkeypatch, name):
    """The decode pass a CUDA graph captures (engine/rollout/graphs.py) takes the cache index as a 0-d tensor, writes
    the KV cache with index_copy_ and attends over the whole cache under the mask: run here eagerly on the CPU in
    place of the graph, its greedy rows equal transformers' generate as the int-index pass does."""
    import megatrain_ray.engine.rollout.passes as passes

    def index_on_device(decode, applies, rows, first_index, device, kept=()):
        return lambda token, index: decode(token, torch.tensor(index, device=device))

    monkeypatch.setattr(passes, "graph_or_eager", index_on_device)
    model = float64_twin(build(name))
    prompts = prompts_for(model.config.vocab_size)
    result = generated(tmp_path, model, prompts, SamplingSettings(max_new_tokens=NEW, temperature=0), "float64",
                       "resident")
    for row, prompt in enumerate(prompts):
        assert_greedy_row(result.tokens[row], model, prompt, f"{name}: row {row}")


def test_a_stop_token_ends_its_row_and_is_kept(tmp_path):
    model = float64_twin(build("llama-gqa"))
    prompts = prompts_for(model.config.vocab_size)
    free = generated(tmp_path / "free", model, prompts, SamplingSettings(max_new_tokens=NEW, temperature=0),
                     "float64")
    stop = free.tokens[1, 3].item()  # row 1 stops at its 4th token (or earlier, where that token came before)
    first = [row.tolist().index(stop) if stop in row.tolist() else None for row in free.tokens]
    result = generated(tmp_path / "stop", model, prompts,
                       SamplingSettings(max_new_tokens=NEW, temperature=0, stop_token_ids=(stop,), pad_token_id=-1),
                       "float64")
    for row, at in enumerate(first):
        length = NEW if at is None else at + 1
        assert result.lengths[row] == length and bool(result.stopped[row]) == (at is not None)
        assert result.tokens[row, :length].tolist() == free.tokens[row, :length].tolist()
        assert (result.tokens[row, length:] == -1).all() and (result.logps[row, length:] == 0).all()
    assert result.tokens.shape[1] == max(result.lengths.tolist())  # no decode step past the last live row


@pytest.mark.float32_parity
@pytest.mark.parametrize("name", ["llama-gqa", "gpt-oss"])
def test_sampled_logps_match_transformers_within_float32_noise(tmp_path, name):
    model = build(name)
    prompts = prompts_for(model.config.vocab_size)
    sampling = SamplingSettings(max_new_tokens=NEW, temperature=0.7, top_k=50, top_p=0.95, seed=5)
    result = generated(tmp_path / "a", model, prompts, sampling, "float32")
    again = generated(tmp_path / "b", model, prompts, sampling, "float32")
    assert torch.equal(result.tokens, again.tokens) and torch.equal(result.logps, again.logps)
    other = generated(tmp_path / "c", model, prompts, dataclasses.replace(sampling, seed=6), "float32")
    assert not torch.equal(result.tokens, other.tokens)
    assert_sampled_logps_within_noise(name, result, prompts, sampling, model, float64_twin(model))


def assert_sampled_logps_within_noise(name: str, result, prompts, sampling: SamplingSettings, model, twin) -> None:
    """Each sampled token's rollout log-probability against transformers' float32 `model` over the prompt and the
    completion (at the sampling temperature), within the noise of that model against its float64 `twin`."""
    ours, ref32, ref64 = [], [], []
    with torch.no_grad(), one_thread():
        for row, prompt in enumerate(prompts):
            completion = result.tokens[row, :int(result.lengths[row])]
            ids = torch.tensor([prompt + completion.tolist()])
            for reference, out in ((model, ref32), (twin, ref64)):
                logits = reference(ids).logits[0, len(prompt) - 1:-1] / sampling.temperature
                out.append(logits.log_softmax(-1).gather(1, completion[:, None]).squeeze(1))
            ours.append(result.logps[row, :len(completion)])
    assert_within_noise(f"{name}: sampled tokens' log-probabilities", torch.cat(ours), torch.cat(ref32),
                        torch.cat(ref64))
