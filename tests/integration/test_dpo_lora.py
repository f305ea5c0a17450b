"""DPO with LoRA adapters (finetune.objective=dpo, finetune.method=lora): 10 steps against transformers + peft
with TRL's loss.

The reference is peft's LoRA model on the same tiny Llama, with megatrain's initial adapters, the same
batches (pairs, and the reference log-probabilities megatrain computed before the first step: the base, as B
starts at zero; tests/integration/test_dpo.py checks them against a plain transformers forward), TRL 1.16's
loss on its log-probabilities, torch.optim.AdamW over the adapters and clip_grad_norm_ over them.

Tolerances (tests/numerics.py):
- float64 (engine, adapters and peft, the reference's RoPE tables, norms and attention too): losses and adapters
  within 1e-10 (measured at most 1.0e-14).
- float32: peft's run made in float32 (plain and twice with perturbed gradients: the noise ensemble) and in
  float64 from the same adapters; each step's loss and each final adapter within 4x that float32-against-float64
  difference on the machine running the test (MKL's float32
  GEMMs round by CPU; the fixed 1e-5 and 5e-5 of before were fitted on one). Measured on an AVX-512 Xeon: the
  adapters' noise 3.7e-5 (a down_proj B, which starts at zero, so its 10-step value is small against the
  float32 rounding of the per-pair weights that DPO multiplies every token's gradient by, which AdamW then
  amplifies), ours 4.3e-5 from peft's float32 adapters (1.2x, bound 1.5e-4); the losses' noise 2.4e-6, ours
  0.6x that. On a 2-core AMD EPYC (Zen 2, AVX2 only) the plain float32 run alone gave a noise of 3.6e-6 and ours
  lay 1.44e-5 from it (4.02x: failed), 1.09e-5 from float64; the ensemble measures the noise as the spread of
  float32 runs. Every adapter must move by more than 100x its bound. DPO's beta off by 1e-3: the losses 22x the
  float32 bound, 3e-5 from peft in float64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("trl")

from megatrain_ray.driver.trainer import Trainer
from tests.integration.test_dpo import LN2, STEPS, dpo_config, model_dir, pairs_dir  # noqa: F401 - fixtures
from tests.integration.test_lora_parity import float64_transformers  # noqa: F401 - a fixture
from tests.numerics import (
    SAMPLES32,
    Reference,
    assert_exact,
    assert_run_exact,
    assert_run_within_noise,
    bound,
    perturbed_gradients,
    relative_error,
    run_noise,
)
from tests.reference_dpo import hf_token_logps, trl_loss

LORA = {"method": "lora", "objective": "dpo", "dpo": {"beta": 0.5}, "lora": {"r": 4, "lora_alpha": 8}}


def peft_reference(cfg, base_dir, adapters: dict[str, torch.Tensor], batches: list, dtype: torch.dtype):
    """peft's model in `dtype` (eager attention's softmax is float32 whatever the model's dtype: float64 takes
    SDPA), TRL's loss on the batches' reference log-probabilities, AdamW and clip_grad_norm_ over the adapters."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=dtype, attn_implementation="sdpa" if dtype == torch.float64 else "eager")
    lora = cfg.finetune.lora
    model = peft.get_peft_model(model, peft.LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=0.0,
                                                       target_modules="all-linear", bias="none",
                                                       task_type="CAUSAL_LM"))
    loaded = peft.set_peft_model_state_dict(model, adapters)
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if "lora_" in k]
    o, dpo = cfg.optimizer, cfg.finetune.dpo
    params = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in params} == {dtype}
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                            foreach=False)
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        per_token = hf_token_logps(model, batch.input_ids, batch.labels)
        completion = torch.cat([torch.zeros_like(batch.labels[:, :1]), (batch.labels != -100).long()], 1)
        loss, _ = trl_loss(per_token, completion, batch.preference.reference_logps.to(dtype), dpo.beta,
                           dpo.label_smoothing, dpo.loss_type)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses, peft.get_peft_model_state_dict(model)


def train(tmp_path, base, pairs, dtype: str) -> tuple[Any, dict, list, list[float], dict]:
    """(config, initial adapters, batches, losses, final adapters) of a DPO LoRA run in `dtype`."""
    cfg = dpo_config(tmp_path, base, pairs, finetune=LORA, precision={"master_dtype": dtype,
                                                                               "compute_dtype": dtype})
    with Trainer(cfg) as trainer:
        initial = trainer.adapters()
        batches = [trainer.data.batch(s) for s in range(STEPS)]
        losses = [r["loss"] for r in trainer.train()]
        final = trainer.adapters()
    assert losses[-1] < losses[0], "the DPO loss should fall"
    return cfg, initial, batches, losses, final


@pytest.fixture(scope="module")
def float64_cache() -> dict:
    """The float64 run and peft's float64 run from its adapters on its batches, made once for the module by the
    first test that asks (float64_runs): the float64 test's comparison and the float32 test's float64 twin."""
    return {}


def float64_runs(cache: dict, tmp_path, base, pairs) -> dict:
    """Needs the float64_transformers fixture active."""
    if not cache:
        cfg, initial, batches, losses, final = train(tmp_path / "float64", base, pairs, "float64")
        cache.update(initial=initial, batches=batches, losses=losses, final=final,
                     peft=peft_reference(cfg, base, initial, batches, torch.float64))
    return cache


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.float32_parity), "float64"])
def test_dpo_with_lora_matches_peft_and_trls_loss(tmp_path, model_dir, pairs_dir, float64_transformers,  # noqa: F811
                                                   float64_cache, dtype):
    """float64: within 1e-10 of peft in float64. float32: within 4x the float32 noise of peft's run, its float32 run
    (the float32 reference log-probabilities) against its float64 one (the float64 test's, from the same adapters
    on the float64 reference log-probabilities: their rounding is part of float32's noise)."""
    twin = float64_runs(float64_cache, tmp_path, model_dir, pairs_dir)
    ref_losses64, ref_final64 = twin["peft"]
    if dtype == "float64":
        losses, initial, final = twin["losses"], twin["initial"], twin["final"]
        assert_exact("loss at step 0 (the policy is the reference: ln 2)", losses[0], LN2)
        assert_run_exact(losses, final, ref_losses64, ref_final64, initial, moved=1e-3)
        return
    cfg, initial, batches, losses, final = train(tmp_path, model_dir, pairs_dir, "float32")
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(batches, twin["batches"]))
    assert all(torch.equal(v, twin["initial"][k].float()) for k, v in initial.items()), "adapters drawn in float32"
    samples = []  # the noise ensemble (tests/numerics.py, SAMPLES32): one plain float32 run may sit low by chance
    for seed in range(1, SAMPLES32):
        with perturbed_gradients(seed):
            samples.append(peft_reference(cfg, model_dir, initial, batches, torch.float32))
    ref = Reference(*peft_reference(cfg, model_dir, initial, batches, torch.float32), ref_losses64, ref_final64,
                    samples)
    assert set(final) == set(ref.state32)
    assert_run_within_noise(losses, final, ref, initial)
    # The policy starts as the reference (B = 0): ln 2 up to the losses' float32 noise.
    assert relative_error(losses[0], LN2) <= bound(run_noise(dict(enumerate(ref.losses32)),
                                                             dict(enumerate(ref.losses64)))), losses[0]
