"""The rollout engine with DeepSeek-V3's latent attention (model/latent_decode.py: the compressed cache, the absorbed
attention) and with GLM-4.5 MoE, against transformers' own generation.

Greedy, as tests/integration/test_rollout.py holds the other families: a batch of prompts of different lengths (left
padded by the engine), 12 new tokens each, in float64; every row gives exactly the tokens transformers' `generate`
gives that prompt alone, up to a near tie of its two best logits (within 1e-6). The reference is transformers' model
with its float32 steps widened to float64 (tests/reference_deepseek.float64_deepseek), which caches every head's
expanded keys and values, where megatrain caches the latent and attends in its space: the same scores summed in
another order; each greedy token's log-probability equals transformers' within 2 float32 roundings (the rollout
stores them in float32). The tiny models of tests/reference_deepseek.py (a dense first layer, then sigmoid-routed experts).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from megatrain_ray.engine.rollout.interface import SamplingSettings  # noqa: E402
from megatrain_ray.model.latent_decode import LatentCache  # noqa: E402
from tests.integration.test_grpo_prompts import tokenizer_dir  # noqa: E402, F401  (a fixture)
from tests.integration.test_grpo_train import prompts_dir  # noqa: E402, F401  (a fixture)
from tests.integration.test_rollout import NEW, assert_greedy_row, generated, prompts_for  # noqa: E402
from tests.numerics import assert_exact  # noqa: E402
from tests.reference_deepseek import float64_deepseek, hf_deepseek_model  # noqa: E402


@pytest.mark.parametrize("name, weights", [
    ("deepseek_v3", "streamed"),  # the low-rank query, interleaved RoPE
    ("deepseek_v3_q_proj", "resident"),  # one q_proj, RoPE by halves
    ("deepseek_v3_yarn", "streamed"),  # YaRN's tables and the softmax scale's mscale squared
    ("glm4_moe", "streamed"),  # GQA with qkv biases, q/k norms, partial rotary
])
def test_greedy_rows_equal_transformers_generate(tmp_path, name, weights):
    model = float64_deepseek(hf_deepseek_model(name))
    prompts = prompts_for(model.config.vocab_size)
    result = generated(tmp_path, model, prompts, SamplingSettings(max_new_tokens=NEW, temperature=0), "float64",
                       weights)
    assert result.tokens.shape == (len(prompts), NEW) and result.lengths.tolist() == [NEW] * len(prompts)
    if name.startswith("deepseek"):  # the compressed cache: kv_lora_rank + qk_rope_head_dim values a token a layer
        cfg = model.config
        slots = result.stats["kv_cache_bytes"] / (len(prompts) * cfg.num_hidden_layers * 8)
        assert slots % (cfg.kv_lora_rank + cfg.qk_rope_head_dim) == 0
    for row, prompt in enumerate(prompts):
        assert_greedy_row(result.tokens[row], model, prompt, f"{name}: row {row} (prompt of {len(prompt)})")
    print(f"{name}: log-probabilities within {assert_logps(result, model, prompts):.2e}")


def assert_logps(result, model, prompts) -> float:
    """Each greedy token's log-probability (the rollout keeps them in float32) equals transformers' float64 one over
    the prompt and the completion, within 2 float32 roundings: the float64 paths agree far below that."""
    worst = 0.0
    for row, prompt in enumerate(prompts):
        ids = torch.tensor([prompt + result.tokens[row].tolist()])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1]
        theirs = torch.log_softmax(logits, dim=-1).gather(1, result.tokens[row][:, None])[:, 0]
        worst = max(worst, assert_exact(f"row {row}'s log-probabilities", result.logps[row].double(), theirs,
                                        2 * torch.finfo(torch.float32).eps))
    return worst


def test_the_device_index_decode_pass_decodes_the_same(tmp_path, monkeypatch):
    """The decode pass a CUDA graph would capture (the cache index a 0-d tensor, index_copy_ into the compressed
    cache, attention over all of it under the mask), run eagerly on the CPU."""
    import megatrain_ray.engine.rollout.passes as passes

    def index_on_device(decode, applies, rows, first_index, device, kept=()):
        return lambda token, index: decode(token, torch.tensor(index, device=device))

    monkeypatch.setattr(passes, "graph_or_eager", index_on_device)
    model = float64_deepseek(hf_deepseek_model("deepseek_v3"))
    prompts = prompts_for(model.config.vocab_size)
    result = generated(tmp_path, model, prompts, SamplingSettings(max_new_tokens=NEW, temperature=0), "float64",
                       "resident")
    for row, prompt in enumerate(prompts):
        assert_greedy_row(result.tokens[row], model, prompt, f"row {row}")


def test_the_latent_cache_holds_the_compressed_width():
    from megatrain_ray.config.hf import model_config_from_hf
    from megatrain_ray.model.layer_spec import LayerSpec

    spec = LayerSpec.from_config(model_config_from_hf(hf_deepseek_model("deepseek_v3").config.to_dict()))
    cache = LatentCache.empty(2, spec, 64, torch.float32, torch.device("cpu"))
    assert cache.entries.shape == (2, 1, 64, 24 + 8) and cache.nbytes == 2 * 64 * 32 * 4
    assert LatentCache.bytes_per_token(spec, torch.bfloat16) == 32 * 2


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_q_proj", "deepseek_v3_yarn"])
def test_the_absorbed_attention_over_the_compressed_cache_equals_the_training_layer(name):
    """Float64, one MoE layer: a prefill of 5 tokens then 4 decode steps through the compressed cache give the
    training template's output over all 9 tokens (every head's keys and values expanded, model/templates.py) within
    1e-12 (measured by the print), with a LoRA adapter on kv_b_proj merged into the head maps as the template
    computes it apart."""
    from megatrain_ray.config.hf import model_config_from_hf
    from megatrain_ray.model.decode import cache_mask, cached_decoder_layer, layer_cache
    from megatrain_ray.model.layer_spec import LayerSpec
    from megatrain_ray.model.rope import rope_tables
    from megatrain_ray.model.templates import decoder_layer

    model = hf_deepseek_model(name)
    cfg = model_config_from_hf(model.config.to_dict())
    layer = cfg.num_layers - 1
    spec = dataclasses.replace(LayerSpec.from_config(cfg, layer), lora_scaling=2.0)
    prefix = f"model.layers.{layer}."
    w = {k[len(prefix):]: v.double() for k, v in model.state_dict().items() if k.startswith(prefix)}
    g = torch.Generator().manual_seed(3)
    rank, out = cfg.latent_attention.kv_lora_rank, w["self_attn.kv_b_proj.weight"].shape[0]
    w["self_attn.kv_b_proj.lora_A.weight"] = 0.1 * torch.randn(4, rank, generator=g, dtype=torch.float64)
    w["self_attn.kv_b_proj.lora_B.weight"] = 0.1 * torch.randn(out, 4, generator=g, dtype=torch.float64)
    x = torch.randn(2, 9, cfg.hidden_size, generator=g, dtype=torch.float64)
    cos, sin = rope_tables(cfg, 9, x.device, torch.float64)
    full = decoder_layer(x, w, (cos, sin), spec)
    cache = layer_cache(2, spec, 64, torch.float64, x.device)
    assert isinstance(cache, LatentCache)
    valid = torch.ones(2, 64, dtype=torch.bool)
    pieces = []
    for start, count in [(0, 5), (5, 1), (6, 1), (7, 1), (8, 1)]:
        here = torch.arange(start, start + count).expand(2, -1)
        rope = (cos[here].unsqueeze(1), sin[here].unsqueeze(1))
        pieces.append(cached_decoder_layer(x[:, start:start + count], w, rope, spec, cache, start,
                                           cache_mask(valid, start, count, 0)))
    # the layer's own contribution (the residual stream left out, which would hide a wrong attention)
    err = assert_exact(f"{name}: cached layer", torch.cat(pieces, dim=1) - x, full - x, 1e-12)
    print(f"{name}: the compressed cache's layer within {err:.2e} of the training layer")


def test_grpo_steps_train_deepseek_v3(tmp_path, prompts_dir):  # noqa: F811
    """finetune.objective grpo end to end on DeepSeek-V3 (random init, float32): 2 steps of the rollout through the
    compressed cache, a reward that varies within a group (the even tokens) and the policy-gradient head; the losses
    finite, every weight moved but the routing biases, which stay as they were. The head and the step are checked against TRL for the other families
    (tests/integration/test_grpo_step.py); what is DeepSeek-V3's own here is the rollout, checked above."""
    from megatrain_ray.config.hf import model_config_from_hf
    from megatrain_ray.model.sigmoid_router import BIAS
    from megatrain_ray.config.load import load_config
    from tests.conftest import tiny_raw
    from tests.integration.test_grpo_train import HERE

    hf = hf_deepseek_model("deepseek_v3", vocab_size=512, max_position_embeddings=256).config.to_dict()
    raw = tiny_raw(model=dataclasses.asdict(model_config_from_hf(hf)), train={"steps": 2},
                   data={"path": str(prompts_dir), "seq_len": 40, "batch_size": 8, "seed": 3},
                   optimizer={"lr": 1e-2}, schedule={"warmup_steps": 1}, finetune={"objective": "grpo", "grpo": {
                       "reward_funcs": [f"{HERE}:even_reward"], "reward_weights": [1.0],
                       "num_generations": 4, "max_completion_length": 12}})
    raw["train"]["output_dir"] = str(tmp_path / "run")
    cfg = load_config(raw=raw)
    with Trainer(cfg) as trainer:
        before = trainer.master_weights()
        history = trainer.train()
        after = trainer.master_weights()
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward"]) for r in history)
    assert all(1 <= r["completions/mean_length"] <= 12 for r in history)
    for key, value in before.items():
        assert torch.equal(value, after[key]) == key.endswith(BIAS), key


def test_the_plan_counts_the_compressed_cache():
    """`megatrain plan` for GRPO on DeepSeek-V3: the rollout's KV cache at kv_lora_rank + qk_rope_head_dim values a
    token a layer (the 16 x 1,536-token rows of tests/unit/test_rollout_plan.py, bfloat16)."""
    from megatrain_ray.config.hf import model_config_from_hf
    from megatrain_ray.config.load import load_config
    from megatrain_ray.planning.machine import Machine
    from megatrain_ray.planning.memory import plan_run
    from megatrain_ray.planning.rollout import rollout_bytes

    hf = hf_deepseek_model("deepseek_v3", max_position_embeddings=4096).config.to_dict()
    cfg = load_config(raw={"model": dataclasses.asdict(model_config_from_hf(hf)),
                           "data": {"path": "synthetic", "seq_len": 1536, "batch_size": 16},
                           "precision": {"compute_dtype": "bfloat16"}, "engine": {"gpu_resident": "none"},
                           "finetune": {"objective": "grpo", "grpo": {
                               "reward_funcs": ["tests.reference_grpo:first_reward"], "num_generations": 2,
                               "max_prompt_length": 512, "max_completion_length": 1024}}})
    sizes = rollout_bytes(cfg, plan_run(cfg, Machine.from_preset("h200-128gb")).run)
    assert sizes["KV cache"] == 16 * 1536 * 3 * (24 + 8) * 2
