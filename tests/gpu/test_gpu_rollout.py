"""The rollout engine on CUDA (marker `gpu`; skipped without CUDA): the decode pass captured as a CUDA graph over the
resident rollout weights, and the streamed pass, against transformers' greedy `generate` of each prompt alone on
the CPU, token for token. Both compute in float64 (the H200 runs float64 natively), where greedy choices are exact up
to a near tie of transformers' two best logits (tests/integration/test_rollout.py's rule). The CPU tests run the
graph's pass eagerly; only here is the graph itself captured and replayed, and the masked attention over the cache
(model/attention.py cached_attention, the KV heads' query heads folded into the query length) run by CUDA's kernels.
Run on the GPU machine:

    python -m pytest tests/gpu/test_gpu_rollout.py -m gpu -s
"""

from __future__ import annotations

import dataclasses

import pytest

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.hf import model_config_from_hf  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from megatrain_ray.engine.rollout.interface import SamplingSettings  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402
from tests.integration.test_rollout import MOE, NEW, assert_greedy_row, build, prompts_for  # noqa: E402
from tests.unit.test_templates import float64_twin  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("weights", ["resident", "streamed"])
@pytest.mark.parametrize("name", ["llama-gqa", "mistral-sliding-window", "gemma2-softcap", "gpt-oss"])
def test_greedy_rows_on_cuda_equal_transformers_generate(tmp_path, name, weights):
    model = float64_twin(build(name))
    prompts = prompts_for(model.config.vocab_size)
    result = greedy_on_cuda(tmp_path, model, prompts, weights)
    print(f"{name} {weights}: cuda_graph {result.stats['cuda_graph']:.0f}, "
          f"{result.stats['tokens_per_s']:.0f} tok/s")
    assert result.stats["weights_resident"] == (weights == "resident")
    # A graph replays resident weights of dense layers only (MoE routing changes its shapes): gpt-oss decodes eagerly.
    assert result.stats["cuda_graph"] == (weights == "resident" and name not in MOE)
    assert result.tokens.shape == (len(prompts), NEW)
    for row, prompt in enumerate(prompts):
        assert_greedy_row(result.tokens[row], model, prompt, f"{name} on cuda ({weights}): row {row}")


@pytest.mark.parametrize("weights", ["resident", "streamed"])
def test_a_hybrids_greedy_rows_on_cuda_equal_transformers_generate(tmp_path, weights):
    """Qwen3.5's linear-attention layers with their recurrent states (model/recurrent_decode.py), resident: the
    decode step captured as a CUDA graph, the states saved and restored around its warm-up runs (a graph that
    replayed from states the warm-up had advanced would part from transformers at the first token)."""
    from tests.integration.test_rollout_hybrid import LENGTHS
    from tests.reference_hybrid import float64_hybrid, hf_hybrid_model

    model = float64_hybrid(hf_hybrid_model("qwen3_5"))
    prompts = prompts_for(model.config.vocab_size, LENGTHS)
    result = greedy_on_cuda(tmp_path, model, prompts, weights)
    print(f"qwen3_5 {weights}: cuda_graph {result.stats['cuda_graph']:.0f}")
    assert result.stats["cuda_graph"] == (weights == "resident")
    for row, prompt in enumerate(prompts):
        assert_greedy_row(result.tokens[row], model, prompt, f"qwen3_5 on cuda ({weights}): row {row}")


def greedy_on_cuda(tmp_path, model, prompts, weights: str):
    """Greedy generation of NEW tokens for each prompt on CUDA in float64, `model`'s weights loaded, every stage
    streamed for training (engine.rollout_weights: `weights`)."""
    cfg = tiny_config(tmp_path, model=dataclasses.asdict(model_config_from_hf(model.config.to_dict())),
                      precision={"master_dtype": "float64", "compute_dtype": "float64"},
                      engine={"device": "cuda", "poison_buffers": True, "rollout_weights": weights,
                              "gpu_resident": "none"})
    with Trainer(cfg) as trainer:
        trainer.load_weights({k: v for k, v in model.state_dict().items() if k in trainer.master_weights()})
        return trainer.gpu.generate(prompts, SamplingSettings(max_new_tokens=NEW, temperature=0)).result()
