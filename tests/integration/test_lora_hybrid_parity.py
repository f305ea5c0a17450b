"""LoRA on the hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: Gated DeltaNet layers between gated attention
layers) against transformers + peft 0.21.2, in float64.

The adapters sit where peft puts them: a full-attention layer's q/k/v/o_proj (q_proj holds each head's query and its
output gate), a linear-attention layer's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj (Qwen3-Next:
in_proj_qkvz, in_proj_ba, out_proj), Qwen3.5's dense MLP, Qwen3.5-MoE's shared expert and its gate; all-linear on
Qwen3.5 and Qwen3.5-MoE is all of them, as peft's (Qwen3-Next's all-linear, with its router, experts and shared
expert gate: tests/integration/test_lora_qwen3_next.py). The
tiny models of tests/reference_hybrid.py (hidden 72, GQA, key and value heads of different widths), 136 tokens a step
(three chunks of the delta rule), 12 steps, lr 1e-2. The reference is peft's model over tests/reference_hybrid's
float64_hybrid (the delta rule, the norms, the RoPE tables and the softmax in float64, where transformers keeps them
float32 in a float64 model), trained by torch AdamW with clipping (test_lora_parity.train_peft); the MoE families with
the load-balancing loss on. Bound: 1e-10 (EXACT) on every loss and final adapter, every adapter moved by more than
1e-4 relative (measured with pytest -s: printed). An export loads in peft with no missing or unexpected key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from megatrain_ray.exceptions import ConfigError  # noqa: E402
from tests.conftest import learnable_tokens, tiny_raw  # noqa: E402
from tests.integration.test_lora_parity import train_peft  # noqa: E402
from tests.integration.test_qlora import assert_nf4_logits_match_the_dequantized_model  # noqa: E402
from megatrain_ray.quant.nf4 import dequantize_nf4, quantize_nf4  # noqa: E402
from tests.numerics import EXACT, assert_exact, relative_error  # noqa: E402
from tests.reference_hybrid import float64_hybrid, hf_hybrid_model  # noqa: E402

SEQ_LEN = 136
STEPS = 12
AUX_COEF = 0.02
MIXER = {"qwen3_5": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
         "qwen3_5_moe": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
         "qwen3_next": ["in_proj_qkvz", "in_proj_ba", "out_proj"]}


def lora_run(tmp_path: Path, name: str, targets, aux: bool, **overrides):
    """megatrain's float64 LoRA run on the tiny model `name` (its config's `overrides`) and peft's from the same
    adapters on the same batches: (our losses, peft's, our final adapters, peft's, the initial ones, the base
    directory)."""
    extra = dict(output_router_logits=True, router_aux_loss_coef=AUX_COEF) if aux else {}
    model = hf_hybrid_model(name, **extra, **overrides)
    base = tmp_path / "base"
    model.save_pretrained(base)
    raw = tiny_raw(finetune={"method": "lora", "lora": {"r": 4, "lora_alpha": 8, "target_modules": targets}},
                   train={"steps": STEPS, "output_dir": str(tmp_path / "run")}, optimizer={"lr": 1e-2},
                   data={"seq_len": SEQ_LEN, "batch_size": 1},
                   precision={"master_dtype": "float64", "compute_dtype": "float64"})
    raw["model"] = {"path": str(base)}
    raw["data"]["path"] = learnable_tokens(tmp_path / "tokens.npy", model.config.vocab_size)
    cfg = load_config(raw=raw)
    with Trainer(cfg) as trainer:
        initial = trainer.adapters()
        batches = [trainer.data.tokens_of(s) for s in range(STEPS)]
        records = [trainer.step(s) for s in range(STEPS)]
        final = trainer.adapters()
        trainer.export(str(tmp_path / "export"), "float32")
    assert all(("aux_loss" in r) == aux for r in records)
    reference = float64_hybrid(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64,
                                                                                 **({"experts_implementation": "eager"}
                                                                                    if name != "qwen3_5" else {})))
    peft_model = peft.get_peft_model(reference, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                target_modules=targets, task_type="CAUSAL_LM"))
    loaded = peft.set_peft_model_state_dict(peft_model, initial)
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if "lora_" in k], loaded
    losses, state = train_peft(peft_model, cfg, batches, AUX_COEF if aux else 0.0)
    return [r["loss"] for r in records], losses, final, state, initial, base


@pytest.mark.parametrize("name,targets,aux", [
    ("qwen3_5", "all-linear", False),
    ("qwen3_5_moe", ["q_proj", "v_proj", *MIXER["qwen3_5_moe"]], True),
    ("qwen3_5_moe", "all-linear", True),  # the shared expert's three projections and its gate too
    ("qwen3_next", ["k_proj", "o_proj", *MIXER["qwen3_next"]], True),
])
def test_hybrid_lora_matches_peft_in_float64(tmp_path, name, targets, aux):
    ours, theirs, final, state, initial, base = lora_run(tmp_path, name, targets, aux)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert_exact(f"loss at step {step}", a, b, EXACT)
    assert set(final) == set(state), set(final) ^ set(state)
    worst = 0.0
    for key, value in final.items():
        worst = max(worst, assert_exact(key, value, state[key], EXACT))
        assert relative_error(value, initial[key]) > 1e-4, f"{key} barely moved"
    mixer = [k for k in final if ".linear_attn." in k]
    assert mixer and [k for k in final if ".self_attn." in k]  # both kinds of layer adapted
    shared = [k for k in final if ".mlp.shared_expert" in k]
    assert len(shared) == (8 * model_layers(base) if name == "qwen3_5_moe" and targets == "all-linear" else 0)
    print(f"{name}: worst adapter error {worst:.2e}, {len(final)} adapter tensors ({len(mixer)} on the mixers)")
    # the export: peft builds the same adapters from its adapter_config.json and loads every saved tensor
    export = tmp_path / "export" / "adapter"  # beside it "merged": the base with the adapters folded in
    fresh = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base),
                                peft.PeftConfig.from_pretrained(export))
    result = peft.set_peft_model_state_dict(fresh, peft.utils.load_peft_weights(str(export)))
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k], result


@pytest.mark.parametrize("name,targets,match", [
    ("qwen3_next", ["gate_proj"], r"gate_proj and up_proj are fused into qwen3_next's mlp.experts.gate_up_proj"),
    ("qwen3_next", ["shared_expert"], r"'shared_expert' is not a module of a qwen3_next layer peft adapts.*"
                                      r"shared_expert_gate, gate, gate_proj, up_proj, down_proj or all-linear"),
    ("qwen3_5", ["in_proj_qkvz"], r"'in_proj_qkvz' is not a module of a qwen3_5 layer peft adapts"),
    ("qwen3_5_moe", ["gate"], r"'gate' is not a module of a qwen3_5_moe layer peft adapts"),
])
def test_hybrid_lora_targets_that_are_not_built_are_refused(tmp_path, name, targets, match):
    model = hf_hybrid_model(name)
    model.save_pretrained(tmp_path / "base")
    raw = tiny_raw(finetune={"method": "lora", "lora": {"target_modules": targets}})
    raw["model"] = {"path": str(tmp_path / "base")}
    with pytest.raises(ConfigError, match=match):
        load_config(raw=raw)


def model_layers(base: Path) -> int:
    return transformers.AutoConfig.from_pretrained(base).num_hidden_layers


KEPT = ("mlp.gate.weight", "linear_attn.conv1d.weight")
"""What an NF4 base keeps in the compute dtype besides the vectors: the router and the convolution kernel, neither an
nn.Linear (quant/nf4_stage.KEPT_MATRICES)."""


@pytest.mark.float32_parity
@pytest.mark.parametrize("name,targets", [("qwen3_5", "all-linear"), ("qwen3_5_moe", "all-linear"),
                                          ("qwen3_next", "all-linear")])  # its router, experts and expert gate too
def test_hybrid_lora_on_an_nf4_base_equals_peft_on_the_dequantized_model(tmp_path, name, targets):
    """QLoRA on a hybrid: every decoder matrix and fused expert tensor streams in NF4 (the Gated DeltaNet's
    projections, the shared expert and its gate included; Qwen3-Next: adapters on the NF4 experts and on the
    router), the router and the convolution kernel in the compute dtype;
    fp32 logits with random non-zero adapters within 4x the float32 noise of peft on the dequantized model (its float64
    twin), far from peft on the original base (test_qlora.assert_nf4_logits_match_the_dequantized_model)."""
    model = hf_hybrid_model(name)
    base, reference_base = tmp_path / "base", tmp_path / "dequantized"
    model.save_pretrained(base)
    replaced = 0
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if ".layers." in pname and param.dim() >= 2 and not pname.endswith(KEPT):
                param.copy_(dequantize_nf4(quantize_nf4(param, 64, double_quant=True), torch.float32))
                replaced += 1
    model.save_pretrained(reference_base)
    assert replaced >= 3 * 5
    raw = tiny_raw(finetune={"method": "lora", "lora": {"r": 4, "lora_alpha": 8, "target_modules": targets,
                                                        "base_quantization": "nf4"}},
                   train={"steps": 2, "output_dir": str(tmp_path / "run")}, schedule={"warmup_steps": 1})
    raw["model"] = {"path": str(base)}
    raw["data"]["path"] = learnable_tokens(tmp_path / "tokens.npy", model.config.vocab_size)
    cfg = load_config(raw=raw)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    experts = {"experts_implementation": "eager"} if name != "qwen3_5" else {}

    def peft_model_of(model_dir, adapters, dtype):
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager",
                                                               **experts)
        wrapped = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                                                          task_type="CAUSAL_LM"))
        peft.set_peft_model_state_dict(wrapped, {k: v.to(dtype) for k, v in adapters.items()})
        return wrapped.eval()
    err = assert_nf4_logits_match_the_dequantized_model(cfg, base, reference_base, ids, peft_model_of)
    print(f"{name}: NF4-base logits within {err:.2e} of peft on the dequantized model")
