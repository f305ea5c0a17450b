"""LoRA on Qwen3-Next's MoE layers where peft 0.21.2 puts it on transformers 5.23's Qwen3NextForCausalLM, against
transformers + peft.

peft's all-linear on Qwen3-Next (config/lora_targets.py): a full-attention layer's q/k/v/o_proj, a linear-attention
layer's in_proj_qkvz, in_proj_ba, out_proj, and on every MoE layer the router (`mlp.gate`: target parameter
gate.weight), the fused experts (peft's conversion of gate_proj + up_proj and down_proj: `mlp.experts.base_layer` on
gate_up_proj at rank 2r, `mlp.experts` on down_proj) and the shared expert's gate `mlp.shared_expert_gate`
(nn.Linear). The shared expert's own gate_proj, up_proj, down_proj get none (peft maps those names onto the routed
experts), nor does the dense layer's MLP (mlp_only_layers). Named targets map alike.

The tiny model: tests/reference_hybrid's qwen3_next (hidden 72, GQA 4/2, head_dim 24, key and value heads of widths
12 and 10, 5 experts of width 24, shared expert 20, layer 1 dense, tied head) with top-3 routing. The float64 runs:
tests/integration/test_lora_hybrid_parity.lora_run (136 tokens a step, 12 steps, lr 1e-2, torch AdamW with clipping
on peft's model over tests/reference_hybrid.float64_hybrid), bound 1e-10 (EXACT) on every loss and final adapter.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.exceptions import ConfigError  # noqa: E402
from megatrain_ray.model.lora import initial_adapters, peft_adapter_config, peft_name  # noqa: E402
from tests.conftest import tiny_raw  # noqa: E402
from tests.integration.test_lora_hybrid_parity import lora_run  # noqa: E402
from tests.numerics import EXACT, assert_exact, relative_error  # noqa: E402
from tests.reference_hybrid import hf_hybrid_model  # noqa: E402

TOP3 = dict(num_experts_per_tok=3)
EAGER = dict(experts_implementation="eager")  # transformers' grouped_mm takes no float64
MOE_LAYERS, DENSE_LAYER = (0, 2), 1
NAMED = [["gate_proj", "up_proj"], ["gate"], ["shared_expert_gate"], ["down_proj"],
         ["gate", "down_proj", "in_proj_ba", "q_proj"], ["up_proj", "gate_proj", "shared_expert_gate", "o_proj"]]


def base_and_config(tmp_path, targets, overrides=TOP3, **lora):
    """The tiny Hugging Face model (its config's `overrides`) saved, and megatrain's LoRA config on it."""
    model = hf_hybrid_model("qwen3_next", **overrides)
    model.save_pretrained(tmp_path / "base")
    raw = tiny_raw(finetune={"method": "lora", "lora": {"r": 4, "lora_alpha": 8, "target_modules": targets, **lora}})
    raw["model"] = {"path": str(tmp_path / "base")}
    return model, load_config(raw=raw)


@pytest.mark.parametrize("targets,overrides", [*((t, TOP3) for t in ["all-linear", *NAMED]),
                                               ("all-linear", dict(num_experts=0))],  # dense: no MLP adapter
                         ids=lambda t: t if isinstance(t, str) else "+".join(t) if isinstance(t, list) else
                         "dense" if t.get("num_experts") == 0 else "")
def test_qwen3_next_adapters_and_adapter_config_are_peft_s(tmp_path, targets, overrides):
    """The adapters' keys and shapes are those of peft's model on the transformers model, and the adapter_config's
    target_modules, target_parameters, rank_pattern and alpha_pattern those of peft's LoraConfig after its
    conversion (gate_up_proj at rank 2r, alpha 2 lora_alpha; a dense model's target_parameters, which match
    nothing there, left out)."""
    model, cfg = base_and_config(tmp_path, targets, overrides)
    theirs = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                        task_type="CAUSAL_LM"))
    keys = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(theirs).items()}
    ours = {peft_name(i, n): tuple(t.shape) for i in range(cfg.model.num_layers)
            for n, t in initial_adapters(cfg.model, cfg.finetune.lora, 0, i).items()}
    assert ours == keys, set(ours) ^ set(keys)
    assert not [k for k in ours if f".layers.{DENSE_LAYER}.mlp." in k or ".mlp.shared_expert." in k]
    mine, config = peft_adapter_config(cfg.model, cfg.finetune.lora, "base"), theirs.peft_config["default"]
    assert sorted(mine["target_modules"]) == sorted(config.target_modules)
    if not cfg.model.is_moe:
        assert mine["target_parameters"] is None and not mine["rank_pattern"] and not mine["alpha_pattern"]
        return
    assert sorted(mine["target_parameters"] or []) == sorted(config.target_parameters or [])
    assert (mine["rank_pattern"], mine["alpha_pattern"]) == (config.rank_pattern, config.alpha_pattern)


def test_qwen3_next_half_of_the_fused_pair_is_refused_as_peft_refuses_it(tmp_path):
    with pytest.raises(ValueError, match="fused"):
        peft.get_peft_model(hf_hybrid_model("qwen3_next"), peft.LoraConfig(r=4, target_modules=["up_proj"]))
    with pytest.raises(ConfigError, match=r"finetune\.lora\.target_modules.*both or neither"):
        base_and_config(tmp_path, ["up_proj", "q_proj"])


@pytest.mark.parametrize("targets,setting", [("all-linear", "lora_dropout"), (["gate"], "lora_dropout"),
                                             (["down_proj"], "lora_dropout"), (["gate_proj", "up_proj"], "use_rslora"),
                                             ("all-linear", "use_rslora")])
def test_qwen3_next_router_and_expert_adapters_refuse_dropout_and_rslora(tmp_path, targets, setting):
    """peft's ParamWrapper refuses lora_dropout (checked on the model); use_rslora is not built with them."""
    value = {"lora_dropout": 0.1, "use_rslora": True}[setting]
    if setting == "lora_dropout":
        with pytest.raises(ValueError, match="ParamWrapper does not work with lora_dropout"):
            peft.get_peft_model(hf_hybrid_model("qwen3_next"), peft.LoraConfig(r=4, target_modules=targets,
                                                                                lora_dropout=value))
    with pytest.raises(ConfigError, match=rf"finetune\.lora\.{setting}"):
        base_and_config(tmp_path, targets, **{setting: value})


def test_qwen3_next_linear_targets_keep_dropout_and_rslora(tmp_path):
    """The shared expert's gate is an nn.Linear: dropout and rsLoRA as on any projection."""
    _, cfg = base_and_config(tmp_path, ["shared_expert_gate", "in_proj_qkvz"], lora_dropout=0.1, use_rslora=True)
    assert cfg.finetune.lora.targets("qwen3_next") == ("in_proj_qkvz", "shared_expert_gate")


@pytest.mark.parametrize("targets,aux", [("all-linear", True),
                                         (["gate", "down_proj", "shared_expert_gate", "in_proj_ba", "v_proj"], False)])
def test_qwen3_next_moe_lora_matches_peft_in_float64(tmp_path, targets, aux):
    """Every loss and final adapter within 1e-10 of peft's, every adapter moved by more than 1e-4 relative; the
    export's adapter_config and tensors load into peft with no missing or unexpected key (measured with pytest -s:
    printed)."""
    ours, theirs, final, state, initial, base = lora_run(tmp_path, "qwen3_next", targets, aux, **TOP3)
    worst_loss = max(assert_exact(f"loss at step {step}", a, b, EXACT) for step, (a, b) in enumerate(zip(ours, theirs)))
    assert len(ours) == len(theirs) >= 12
    assert set(final) == set(state), set(final) ^ set(state)
    worst = 0.0
    for key, value in final.items():
        worst = max(worst, assert_exact(key, value, state[key], EXACT))
        assert relative_error(value, initial[key]) > 1e-4, f"{key} barely moved"
    modules = {key.split(".layers.")[1].rsplit(".lora_", 1)[0] for key in final}
    for layer in MOE_LAYERS:  # the router, the experts and the shared expert's gate in both cases
        assert {f"{layer}.{m}" for m in ("mlp.gate", "mlp.experts", "mlp.shared_expert_gate")} <= modules, modules
    if targets == "all-linear":
        assert {f"{layer}.mlp.experts.base_layer" for layer in MOE_LAYERS} <= modules
        assert {"0.linear_attn.in_proj_qkvz", "2.self_attn.q_proj"} <= modules
    assert not [m for m in modules if m.startswith(f"{DENSE_LAYER}.mlp.") or ".mlp.shared_expert." in m]
    print(f"qwen3_next {targets}: worst loss error {worst_loss:.2e}, worst adapter error {worst:.2e}, "
          f"{len(final)} adapter tensors")
    export = tmp_path / "export" / "adapter"
    saved = json.loads((export / "adapter_config.json").read_text())
    reference = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM")).peft_config["default"]
    for field in ("target_modules", "target_parameters"):
        assert sorted(saved[field] or []) == sorted(getattr(reference, field) or []), field
    fresh = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base, **EAGER),
                                peft.PeftConfig.from_pretrained(export))
    weights = peft.utils.load_peft_weights(str(export))
    result = peft.set_peft_model_state_dict(fresh, weights)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k], result
    assert set(weights) == set(peft.get_peft_model_state_dict(fresh)) == set(final)
    for key, value in weights.items():  # exported in float32
        assert torch.equal(value, final[key].float()), key
    # the merged export (router and experts folded in, rounded once to float32) computes peft's model on the adapter
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        adapted = fresh.to(torch.float64).eval()(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "export" / "merged", dtype=torch.float64, **EAGER).eval()(ids).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64, **EAGER).eval()(ids).logits
    err, moved = relative_error(merged, adapted), relative_error(plain, adapted)
    print(f"merged export: {err:.2e} from peft's model on the adapter (the adapters move the logits by {moved:.2e})")
    assert err < 1e-6 and moved > 1e3 * err
