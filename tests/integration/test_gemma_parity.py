"""Training parity of the Gemma templates against transformers' Gemma3ForCausalLM and Gemma2ForCausalLM.

The tiny random Gemmas of tests/unit/test_templates.py (hidden 80, head_dim 24, query_pre_attn_scalar 20,
a sliding window of 5 in the local layers): "gemma3-local-global" (GQA 4/2, tied head, local RoPE base
300 and a global base of 5000 with linear scaling; layers local, global, local, local),
"gemma3-pattern-softcap" (one key/value head, untied head, the final logit soft-cap, every 2nd layer
global) and "gemma2-softcap" (attention and final logit soft-caps, every 2nd layer global). Each is
trained for 20 steps by megatrain and by the Hugging Face model itself with torch.optim.AdamW (matrices
decayed, norms not, as megatrain's layout does), clip_grad_norm_ and the same warmup + cosine schedule,
on the same rows of 24 tokens (longer than the window), as tests/integration/test_phi3_parity.py does.

Tolerance 1e-5 relative, per-step loss and each final tensor (norm of the difference over the norm), lr 1e-3.
Measured over 20 steps (max over the tensors; losses within 2.2e-7 everywhere):
- float32, transformers as it is: 2.2e-6 to 2.9e-6 for Gemma 3 (3.4e-6 without clipping), 4.5e-7 for Gemma 2.
- float64: 1.5e-7 to 1.1e-6 for Gemma 3 (transformers' RoPE tables are float32 even in a float64 model),
  5.9e-8 to 7.4e-8 for Gemma 2. Here the reference's Gemma RMSNorm computes in the model's dtype:
  transformers' casts its input with x.float(), which for a float64 model rounds every norm to float32
  (megatrain computes norms in float64 when it computes in float64); left as it is, AdamW amplifies that
  rounding to 1.4e-5 in one Gemma 3 tensor. In float32 the replacement is the same operations.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.integration.test_phi3_parity import report  # noqa: E402
from tests.integration.test_phi3_parity import run_both as run_phi3_style  # noqa: E402
from tests.integration.test_training_parity import assert_close_run  # noqa: E402
from tests.unit.test_templates import hf_model  # noqa: E402

NAMES = ["gemma3-local-global", "gemma3-pattern-softcap", "gemma2-softcap"]


def _norm_in_model_dtype(self, x: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm as transformers writes it, with x.float() replaced by the model's working dtype."""
    work = torch.promote_types(x.dtype, torch.float32)
    return (self._norm(x.to(work)) * (1.0 + self.weight.to(work))).type_as(x)


@pytest.fixture
def float64_gemma_norms(monkeypatch):
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.gemma3 import modeling_gemma3

    monkeypatch.setattr(modeling_gemma3.Gemma3RMSNorm, "forward", _norm_in_model_dtype)
    monkeypatch.setattr(modeling_gemma2.Gemma2RMSNorm, "forward", _norm_in_model_dtype)


def run_both(tmp_path, name: str, dtype: str, **sections):
    model = hf_model(name)
    assert 24 > model.config.sliding_window  # the window is shorter than the sequence
    return run_phi3_style(tmp_path, model, 24, dtype, **sections)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clip", "noclip"])
def test_gemma_float64_matches_transformers(tmp_path, float64_gemma_norms, name, clip):
    ours, ref, final, ref_state, initial = run_both(tmp_path, name, "float64",
                                                    optimizer={"workers": 2, "grad_clip": clip})
    report(ours, ref, final, ref_state)
    assert_close_run(ours, ref, final, ref_state, initial, rel=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_gemma_float32_matches_transformers(tmp_path, name):
    ours, ref, final, ref_state, initial = run_both(tmp_path, name, "float32", optimizer={"workers": 2})
    report(ours, ref, final, ref_state)
    assert_close_run(ours, ref, final, ref_state, initial, rel=1e-5)


def test_gemma3_float32_without_clipping_matches_transformers(tmp_path):
    ours, ref, final, ref_state, initial = run_both(tmp_path, "gemma3-local-global", "float32",
                                                    optimizer={"workers": 2, "grad_clip": 0.0})
    report(ours, ref, final, ref_state)
    assert_close_run(ours, ref, final, ref_state, initial, rel=1e-5)


@pytest.mark.ray
@pytest.mark.parametrize("name", ["gemma3-local-global", "gemma2-softcap"])
def test_gemma_ray_float32_matches_transformers(tmp_path, ray_session, name):
    """The Ray path: host shards, GPU worker and 2 optimizer workers as actors."""
    ours, ref, final, ref_state, initial = run_both(tmp_path, name, "float32",
                                                    optimizer={"workers": 2}, runtime={"mode": "ray"})
    report(ours, ref, final, ref_state)
    assert_close_run(ours, ref, final, ref_state, initial, rel=1e-5)
