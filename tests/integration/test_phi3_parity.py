"""Training parity of the Phi-3 template against transformers' Phi3ForCausalLM itself.

The same tiny random Phi-3 (hidden 80, GQA 4/2, half of each head rotated, LongRoPE over an original
context of 16 tokens, sliding window 9; tests/unit/test_templates.py's "phi3-longrope-partial") is
trained for 20 steps by megatrain and by the Hugging Face model with torch.optim.AdamW (matrices decayed,
norms not, as megatrain's layout does), clip_grad_norm_ and the same warmup + cosine schedule, on the
same batches. Rows of 24 tokens take LongRoPE's long factors, rows of 12 its short ones.

Tolerance 1e-5 relative, per-step loss and each final tensor (norm of the difference over the norm), lr
1e-3. Measured over 20 steps, the weights (losses within 2e-7 everywhere):
- float64 (both sides): 3e-7 to 1.4e-6. Not float64's 1e-10: transformers computes its RoPE tables in
  float32 even for a float64 model (megatrain in float64), and AdamW amplifies that difference.
- float32: 1.5e-6 to 6.3e-6 with clipping; without clipping on 12-token rows 1.2e-5, where the float32
  Hugging Face run itself is 5.9e-6 away from its float64 run: float32 noise, so the runs without
  clipping are compared in float64 only.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.hf import model_config_from_hf  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402
from tests.integration.test_training_parity import assert_close_run  # noqa: E402
from tests.reference_hf import train_hf  # noqa: E402
from tests.unit.test_templates import hf_model  # noqa: E402

NAME = "phi3-longrope-partial"


def run_both(tmp_path, model, seq_len: int, dtype: str, **sections):
    """The same steps through megatrain (tiny_config with `model`'s shape and weights) and through `model` itself
    with train_hf; returns (our losses, its losses, our final weights, its, the initial weights)."""
    mcfg = model_config_from_hf(model.config.to_dict())
    precision = {"master_dtype": dtype, "compute_dtype": dtype}
    cfg = tiny_config(tmp_path, model=dataclasses.asdict(mcfg), data={"seq_len": seq_len}, precision=precision,
                      **sections)
    with Trainer(cfg) as trainer:
        trainer.load_weights({k: v for k, v in model.state_dict().items() if k in trainer.master_weights()})
        initial = trainer.master_weights()
        batches = [trainer.data.tokens_of(s) for s in range(cfg.train.steps)]
        ours = [trainer.step(s)["loss"] for s in range(cfg.train.steps)]
        final = trainer.master_weights()
    tied = {"lm_head.weight"} if mcfg.tie_word_embeddings else set()
    assert set(initial) == set(model.state_dict()) - tied  # HF's names (Phi-3's fused ones); a tied head is the embedding
    ref_losses, ref_state = train_hf(model, cfg, initial, batches, getattr(torch, dtype))
    return ours, ref_losses, final, ref_state, initial


def report(ours, ref, final, ref_state) -> tuple[float, float]:
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(ours, ref))
    weight_rel = max(((v - ref_state[k].to(v.dtype)).norm() / ref_state[k].norm()).item() for k, v in final.items())
    print(f"max relative loss difference {loss_rel:.2e}, max relative weight difference {weight_rel:.2e}")
    return loss_rel, weight_rel


@pytest.mark.parametrize("seq_len", [24, 12], ids=["long-rope", "short-rope"])
@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clip", "noclip"])
def test_phi3_float64_matches_transformers(tmp_path, seq_len, clip):
    ours, ref, final, ref_state, initial = run_both(tmp_path, hf_model(NAME), seq_len, "float64",
                                                    optimizer={"workers": 2, "grad_clip": clip})
    report(ours, ref, final, ref_state)
    assert_close_run(ours, ref, final, ref_state, initial, rel=1e-5)


@pytest.mark.parametrize("seq_len", [24, 12], ids=["long-rope", "short-rope"])
def test_phi3_float32_matches_transformers(tmp_path, seq_len):
    ours, ref, final, ref_state, initial = run_both(tmp_path, hf_model(NAME), seq_len, "float32", optimizer={"workers": 2})
    report(ours, ref, final, ref_state)
    assert_close_run(ours, ref, final, ref_state, initial, rel=1e-5)


@pytest.mark.ray
def test_phi3_ray_float32_matches_transformers(tmp_path, ray_session):
    """The Ray path: host shards, GPU worker and 2 optimizer workers as actors."""
    ours, ref, final, ref_state, initial = run_both(tmp_path, hf_model(NAME), 24, "float32", optimizer={"workers": 2},
                                                    runtime={"mode": "ray"})
    report(ours, ref, final, ref_state)
    assert_close_run(ours, ref, final, ref_state, initial, rel=1e-5)
