"""The rollout engine with the hybrid families' linear-attention layers (Qwen3.5, Qwen3-Next, Qwen3.5-MoE: the
recurrent cache of model/recurrent_decode.py beside the gated attention layers' KV cache), against transformers' own
generation, whose decode steps run its recurrent delta rule and convolution update.

Greedy, as tests/integration/test_rollout.py holds the other families: prompts of 70, 5 and 33 tokens (left padded by
the engine to 70, so the prefill's chunked rule crosses a chunk boundary with padding before most rows' first token),
12 new tokens each, in float64; every row gives the tokens transformers' `generate` gives that prompt alone, up to a
near tie, and each greedy token's log-probability equals transformers' float64 one over the prompt and completion
within 2 float32 roundings (the rollout stores them in float32). The reference: tests/reference_hybrid.float64_hybrid
(transformers' own delta rules and convolutions with their float32 casts made float64).

Fault injection (by hand, reverted): the padding's inputs left unmasked in the prefill failed 3 of the 4 greedy
tests; the decode step's state left undecayed, and the convolution's kept inputs shifted by one token, all 4.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.hf import model_config_from_hf  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from megatrain_ray.engine.rollout.interface import SamplingSettings  # noqa: E402
from megatrain_ray.model.layer_spec import LayerSpec  # noqa: E402
from megatrain_ray.model.recurrent_decode import RecurrentCache  # noqa: E402
from tests.integration.test_grpo_prompts import tokenizer_dir  # noqa: E402, F401  (a fixture)
from tests.integration.test_grpo_train import grpo_config, prompts_dir  # noqa: E402, F401  (a fixture)
from tests.integration.test_rollout import (  # noqa: E402
    NEW,
    assert_greedy_row,
    assert_sampled_logps_within_noise,
    generated,
    prompts_for,
)
from tests.integration.test_rollout_deepseek import assert_logps  # noqa: E402
from tests.reference_hybrid import float64_hybrid, hf_hybrid_model  # noqa: E402

LENGTHS = (70, 5, 33)


@pytest.mark.parametrize("name, weights, lengths", [
    ("qwen3_5", "streamed", LENGTHS), ("qwen3_5", "resident", LENGTHS), ("qwen3_next", "streamed", LENGTHS),
    ("qwen3_5_moe", "resident", LENGTHS),
    ("qwen3_next", "resident", (2, 1, 3)), ("qwen3_5_moe", "streamed", (1, 2)),  # prompts shorter than the kernel
])
def test_greedy_rows_equal_transformers_generate(tmp_path, name, weights, lengths):
    model = float64_hybrid(hf_hybrid_model(name))
    prompts = prompts_for(model.config.vocab_size, lengths)
    result = generated(tmp_path, model, prompts, SamplingSettings(max_new_tokens=NEW, temperature=0), "float64",
                       weights)
    assert result.tokens.shape == (len(prompts), NEW) and result.lengths.tolist() == [NEW] * len(prompts)
    for row, prompt in enumerate(prompts):
        assert_greedy_row(result.tokens[row], model, prompt, f"{name}: row {row} (prompt of {len(prompt)})")
    print(f"{name}: log-probabilities within {assert_logps(result, model, prompts):.2e}")


def test_the_cache_holds_a_fixed_state_per_linear_layer(tmp_path):
    """The linear layers' cache does not grow with the tokens: the convolution's K - 1 inputs and the state, per
    row; the full-attention layer's keys and values per token."""
    model = hf_hybrid_model("qwen3_5")
    cfg = model_config_from_hf(model.config.to_dict())
    spec = LayerSpec.from_config(cfg, 0)
    la = cfg.linear_attention
    expected = la.conv_width * (la.conv_kernel_dim - 1) * 8 + la.num_value_heads * la.key_head_dim * \
        la.value_head_dim * 8
    assert RecurrentCache.bytes_per_row(spec, torch.float64) == expected
    assert RecurrentCache.empty(3, spec, torch.float64, torch.device("cpu")).nbytes == 3 * expected
    assert RecurrentCache.bytes_per_row(spec, torch.bfloat16) == la.conv_width * (la.conv_kernel_dim - 1) * 2 + \
        la.num_value_heads * la.key_head_dim * la.value_head_dim * 4  # the state in float32


def test_the_cuda_graph_pass_with_its_index_on_the_device_decodes_the_same(tmp_path, monkeypatch):
    """The decode pass a CUDA graph captures (the cache index a 0-d tensor; the recurrent states updated in place),
    run eagerly on the CPU in place of the graph, after the graph's warm-up steps under the same kept_as_found
    (engine/rollout/graphs.py): the same greedy rows as transformers, so `kept` covers every state a step changes in
    place (measured by hand: restoring the delta-rule states only, a row parts from transformers at its 3rd token)."""
    import megatrain_ray.engine.rollout.passes as passes
    from megatrain_ray.engine.rollout.graphs import WARMUP, kept_as_found

    def index_on_device(decode, applies, rows, first_index, device, kept=()):
        token, index = torch.zeros(rows, dtype=torch.int64, device=device), torch.tensor(first_index, device=device)
        with kept_as_found(kept):  # as DecodeGraph's warm-up
            for _ in range(WARMUP):
                decode(token, index)
        return lambda token, index: decode(token, torch.tensor(index, device=device))

    monkeypatch.setattr(passes, "graph_or_eager", index_on_device)
    model = float64_hybrid(hf_hybrid_model("qwen3_5"))
    prompts = prompts_for(model.config.vocab_size, LENGTHS)
    result = generated(tmp_path, model, prompts, SamplingSettings(max_new_tokens=NEW, temperature=0), "float64",
                       "resident")
    for row, prompt in enumerate(prompts):
        assert_greedy_row(result.tokens[row], model, prompt, f"qwen3_5: row {row}")


@pytest.mark.float32_parity
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_sampled_logps_match_transformers_within_float32_noise(tmp_path, name):
    """Sampled (temperature 0.7, top-k, top-p) in float32: each token's rollout log-probability against
    transformers' float32 model over the prompt and completion, within the noise of that model against its float64
    twin (tests/numerics.assert_within_noise)."""
    model = hf_hybrid_model(name)
    prompts = prompts_for(model.config.vocab_size, LENGTHS)
    sampling = SamplingSettings(max_new_tokens=NEW, temperature=0.7, top_k=50, top_p=0.95, seed=5)
    result = generated(tmp_path, model, prompts, sampling, "float32")
    assert_sampled_logps_within_noise(name, result, prompts, sampling, model, float64_hybrid(model))


LORA = {"method": "lora", "lora": {"r": 4, "lora_alpha": 8, "target_modules": [
    "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"]}}
"""Qwen3-Next's attention and linear-attention projections (its shared expert takes no adapter here)."""


@pytest.mark.parametrize("name, finetune", [("qwen3_5", {}), ("qwen3_5_moe", {}), ("qwen3_next", LORA)],
                         ids=["qwen3_5-full", "qwen3_5_moe-full", "qwen3_next-lora"])
def test_grpo_trains_a_hybrid_with_resident_and_streamed_rollout_weights(tmp_path, prompts_dir, name, finetune):
    """Three GRPO steps of a tiny hybrid on the prepared prompts (tests/integration/test_grpo_train.py's task),
    rolling out from the resident copy and from the streamed stages: the same completions, rewards and losses at each
    step; the rollout's log-probabilities are the trainer's recomputed ones up to float32 rounding (the chunked rule
    over the whole sequence against the prefill and one recurrence step a token); the weights (LoRA: the adapters)
    move."""
    hf = hf_hybrid_model(name, vocab_size=512, max_position_embeddings=256)
    model = dataclasses.asdict(model_config_from_hf(hf.config.to_dict()))
    runs = {}
    for weights in ("streamed", "resident"):
        cfg = grpo_config(tmp_path / weights, prompts_dir, rollout_weights=weights, model=model,
                          sections={"finetune": finetune} if finetune else None)
        with Trainer(cfg) as trainer:
            state = trainer.adapters if finetune else trainer.master_weights
            before = state()
            runs[weights] = trainer.train()
            after = state()
        assert any(not torch.equal(before[k], after[k]) for k in before)
    for key in ("loss", "reward", "rollout_tokens", "completions/mean_length"):
        assert [r[key] for r in runs["resident"]] == [r[key] for r in runs["streamed"]], key
    gaps = [r["sampling/sampling_logp_difference/max"] for run in runs.values() for r in run]
    assert all(math.isfinite(r["loss"]) for run in runs.values() for r in run)
    assert max(gaps) < 2e-5, gaps  # the bound of test_grpo_train's dense model
    print(f"{name}: rollout/trainer log-prob gap at most {max(gaps):.2e}")
