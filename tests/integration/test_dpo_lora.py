"""DPO with LoRA adapters (finetune.objective=dpo, finetune.method=lora): 10 steps against transformers + peft
with TRL's loss.

The reference is peft's LoRA model on the same tiny Llama, with megatrain's initial adapters, the same
batches (pairs, and the reference log-probabilities megatrain computed before the first step: the base, as B
starts at zero; tests/integration/test_dpo.py checks them against a plain transformers forward), TRL 1.16's
loss on its log-probabilities, torch.optim.AdamW over the adapters and clip_grad_norm_ over them.
Tolerances: float32 at lr 1e-3, per-step loss within 1e-5 relative (as the issue asks of DPO), each final
adapter within 5e-5 relative: measured 1.7e-5 at worst (a down_proj B, which starts at zero, so its 10-step
value is small against the float32 rounding of the per-pair weights that DPO multiplies every token's gradient
by, which AdamW then amplifies); every adapter must move by more than 100x the loss tolerance.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("trl")

from megatrain_ray.driver.trainer import Trainer
from tests.integration.test_dpo import STEPS, dpo_config, model_dir, pairs_dir  # noqa: F401 - fixtures
from tests.reference_dpo import hf_token_logps, trl_loss

REL = 1e-5
ADAPTER_REL = 5e-5
LORA = {"method": "lora", "objective": "dpo", "dpo": {"beta": 0.5}, "lora": {"r": 4, "lora_alpha": 8}}


def peft_reference(cfg, base_dir, adapters: dict[str, torch.Tensor], batches: list):
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    lora = cfg.finetune.lora
    model = peft.get_peft_model(model, peft.LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=0.0,
                                                       target_modules="all-linear", bias="none",
                                                       task_type="CAUSAL_LM"))
    loaded = peft.set_peft_model_state_dict(model, adapters)
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if "lora_" in k]
    o, dpo = cfg.optimizer, cfg.finetune.dpo
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                            foreach=False)
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        per_token = hf_token_logps(model, batch.input_ids, batch.labels)
        completion = torch.cat([torch.zeros_like(batch.labels[:, :1]), (batch.labels != -100).long()], 1)
        loss, _ = trl_loss(per_token, completion, batch.preference.reference_logps.float(), dpo.beta,
                           dpo.label_smoothing, dpo.loss_type)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses, peft.get_peft_model_state_dict(model)


def test_dpo_with_lora_matches_peft_and_trls_loss(tmp_path, model_dir, pairs_dir):  # noqa: F811
    cfg = dpo_config(tmp_path, model_dir, pairs_dir, finetune=LORA)
    with Trainer(cfg) as trainer:
        initial = trainer.adapters()
        batches = [trainer.data.batch(s) for s in range(STEPS)]
        records = trainer.train()
        final = trainer.adapters()
    losses, ref_final = peft_reference(cfg, model_dir, initial, batches)
    assert records[0]["loss"] == pytest.approx(0.6931471805599453, rel=1e-6), "the policy starts as the reference"
    for step, (ours, ref) in enumerate(zip(records, losses)):
        assert abs(ours["loss"] - ref) <= REL * abs(ref), f"step {step}: loss {ours['loss']} vs peft + TRL {ref}"
    assert records[-1]["loss"] < records[0]["loss"], "the DPO loss should fall"
    assert set(final) == set(ref_final)
    for name, value in final.items():
        err = float((value - ref_final[name]).norm() / ref_final[name].norm())
        assert err <= ADAPTER_REL, f"{name}: relative error {err:.2e}"
        assert float((value - initial[name]).norm() / value.norm()) > 100 * REL, f"{name} barely moved"
