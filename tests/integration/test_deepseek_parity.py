"""Training parity of the native DeepSeek-V3 and GLM-4.5 MoE templates against transformers' DeepseekV3ForCausalLM and
Glm4MoeForCausalLM themselves, DeepSeek-V3's padding row, and both round trips through a Hugging Face directory.

The tiny models of tests/reference_deepseek.py are trained by megatrain (the layer stream, float64, two optimizer
workers) and by the transformers model with torch.optim.AdamW (matrices and the fused experts decayed, vectors not,
as megatrain's layout does), clip_grad_norm_ and the same warmup + cosine schedule (tests/reference_hf.train_hf), on
the same row of 40 tokens a step, lr 3e-3. transformers computes no load-balancing loss for DeepSeek-V3 (its causal
LM returns none, nor GLM-4.5 MoE's; DeepSeek's sequence-wise loss and its bias update are not in it), so neither
run has one. The
routing bias (mlp.gate.e_score_correction_bias) is a buffer in transformers, outside its optimizer: megatrain's must
stay as loaded, equal to transformers' after the run, while every other tensor moves.

Bounds (tests/numerics.py), each step's loss and each final tensor: 1e-10 (EXACT), the reference float64 throughout
(tests/reference_deepseek.float64_deepseek: the norms, the RoPE tables and the router in float64 where transformers
keeps them float32). Measured (pytest -s): DeepSeek-V3 losses within 3.9e-15, weights 5.8e-14; with one q_proj, the
layer inputs through host memory and the MLP in 2 chunks 4.1e-16 and 3.2e-15; GLM-4.5 MoE 3.8e-16 and 2.6e-14. The
round trip's logits (float32, forward only): within 4x the noise of transformers' float32 logits against its float64
twin, floor 16 float32 ulps (1.9e-6); measured 1.4e-7 (DeepSeek-V3) and 8.9e-8 (GLM-4.5 MoE).

The padding row: pad_token_id PAD in every row's inputs, its row set to random values; transformers' nn.Embedding
(padding_idx) gives it no gradient, so under AdamW it only decays; megatrain's the same (tests/integration/
test_padding_row.py's check, for this family): losses within 2.0e-16, the row equal to transformers', 1.7e-16 from
its decay alone.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.hf import model_config_from_hf  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from megatrain_ray.model.sigmoid_router import BIAS  # noqa: E402
from tests.conftest import learnable_tokens, one_thread, tiny_config, tiny_raw, train_from_hf_weights  # noqa: E402
from tests.integration.test_padding_row import padded_tokens  # noqa: E402
from tests.integration.test_phi3_parity import assert_float64_run  # noqa: E402
from tests.numerics import EXACT, assert_exact, assert_within_noise, relative_error  # noqa: E402
from tests.reference_deepseek import float64_deepseek, hf_deepseek_model  # noqa: E402
from tests.reference_hf import train_hf  # noqa: E402
from tests.reference_llama import reference_lr  # noqa: E402

SEQ_LEN = 40
LR = 3e-3
PAD, EMBED = 7, "model.embed_tokens.weight"


def run_both(tmp_path, model, steps: int = 20, data: dict | None = None, optimizer: dict | None = None,
             engine: dict | None = None):
    """`steps` float64 steps through megatrain and through `model` (float64 throughout); returns (cfg, our losses,
    its losses, our final weights, its, the initial weights)."""
    mcfg = model_config_from_hf(model.config.to_dict())
    cfg = tiny_config(tmp_path, model=dataclasses.asdict(mcfg), data={"seq_len": SEQ_LEN, "batch_size": 1,
                                                                       **(data or {})},
                      precision={"master_dtype": "float64", "compute_dtype": "float64"}, train={"steps": steps},
                      optimizer={"workers": 2, "lr": LR, **(optimizer or {})}, engine=engine or {})
    assert cfg.model.family == mcfg.family
    initial, batches, records, final = train_from_hf_weights(cfg, model)
    assert not any("aux_loss" in r for r in records)
    assert set(initial) == set(model.state_dict())
    ref_losses, ref_state = train_hf(float64_deepseek(model), cfg, initial, batches, torch.float64)
    return cfg, [r["loss"] for r in records], ref_losses, final, ref_state, initial


def assert_bias_kept(final, ref_state, initial) -> dict:
    """The routing biases as loaded, as transformers' (a buffer); returns the other tensors of `final`."""
    biases = [k for k in final if k.endswith(BIAS)]
    assert biases
    for name in biases:
        assert torch.equal(final[name], initial[name]) and torch.equal(final[name], ref_state[name]), name
        assert final[name].abs().max() > 0  # drawn: a zero bias would hide one left out of the choice
    return {k: v for k, v in final.items() if k not in biases}


@pytest.mark.parametrize("name, engine", [
    ("deepseek_v3", {}),  # the low-rank query, interleaved RoPE, one dense layer then two MoE layers
    ("deepseek_v3_q_proj", {"activation_offload": True, "mlp_chunk_tokens": 24}),  # one q_proj, MLP in 2 chunks
    ("glm4_moe", {}),  # GQA with qkv biases, q/k norms and half of each head rotated; the same MoE
])
def test_deepseek_float64_training_matches_transformers(tmp_path, name, engine):
    _, ours, ref, final, ref_state, initial = run_both(tmp_path, hf_deepseek_model(name), engine=engine)
    trained = assert_bias_kept(final, ref_state, initial)
    assert_float64_run(ours, ref, trained, ref_state, initial, limit=EXACT)


def test_deepseek_padding_row_matches_transformers(tmp_path):
    """pad_token_id PAD in every row: 10 float64 steps, weight decay 0.1, clipping; the PAD row only decays."""
    model = hf_deepseek_model("deepseek_v3", pad_token_id=PAD)
    assert model.get_input_embeddings().padding_idx == PAD
    with torch.no_grad():
        model.get_input_embeddings().weight[PAD] = 0.02 * torch.randn(72, generator=torch.Generator().manual_seed(5))
    tokens = padded_tokens(tmp_path / "padded.npy", model.config.vocab_size)
    cfg, ours, ref, final, ref_state, initial = run_both(
        tmp_path, model, steps=10, data={"path": tokens},
        optimizer={"lr": 5e-3, "weight_decay": 0.1, "grad_clip": 1.0})
    assert cfg.model.pad_token_id == PAD
    trained = assert_bias_kept(final, ref_state, initial)
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert_exact(f"loss at step {step}", a, b)
    for key, value in trained.items():
        assert_exact(key, value, ref_state[key])
    row_err = assert_exact("the PAD row", final[EMBED][PAD], ref_state[EMBED][PAD])
    o, s = cfg.optimizer, cfg.schedule
    decay = math.prod(1 - o.weight_decay * reference_lr(step, o.lr, 10, s.warmup_steps, s.kind, s.min_lr_ratio)
                      for step in range(10))
    decayed_only = relative_error(final[EMBED][PAD], initial[EMBED][PAD] * decay)
    print(f"deepseek_v3: losses within {max(relative_error(a, b) for a, b in zip(ours, ref)):.2e}, PAD row "
          f"{row_err:.2e} from transformers', {decayed_only:.2e} from weight decay alone")
    assert decayed_only <= 1e-12, "untied: the PAD row should only decay"


@pytest.mark.float32_parity
@pytest.mark.parametrize("name, family, mtp", [("deepseek_v3", "deepseek_v3", "model.layers.61.eh_proj.weight"),
                                               ("glm4_moe_no_qk_norm", "glm4_moe", "model.layers.46.eh_proj.weight")])
def test_deepseek_hf_round_trip(tmp_path, name, family, mtp):
    """A directory as save_pretrained writes it (the experts one tensor each), with a multi-token-prediction tensor
    beside it (model.layers.61.* for DeepSeek-V3, .46.* for GLM-4.5-Air, which transformers skips on load: its
    patterns name those layers; megatrain does not read it) -> import (the native template, as model.template auto picks it) -> one step -> export -> transformers loads it with no missing,
    unexpected or mismatched key, the routing biases as they were, its logits megatrain's."""
    from safetensors.torch import load_file, save_file

    from megatrain_ray.config.load import load_config

    model = hf_deepseek_model(name)
    source = tmp_path / "source"
    model.save_pretrained(source)
    weights = load_file(str(source / "model.safetensors"))
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in weights
    save_file({**weights, mtp: torch.zeros(4, 4)}, str(source / "model.safetensors"),
              metadata={"format": "pt"})
    raw = tiny_raw(data={"seq_len": SEQ_LEN}, train={"steps": 1, "output_dir": str(tmp_path / "run")},
                   optimizer={"lr": 1e-2}, schedule={"warmup_steps": 0})
    raw["model"] = {"path": str(source)}
    raw["data"]["path"] = learnable_tokens(tmp_path / "tokens.npy", model.config.vocab_size)
    cfg = load_config(raw=raw)
    assert (cfg.model.family, cfg.model.template) == (family, "native")
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(4))
    with Trainer(cfg) as trainer:
        initial = trainer.master_weights()
        assert all(torch.equal(initial[k], v) for k, v in model.state_dict().items())
        trainer.train()
        moved = trainer.master_weights()
        ours = trainer.logits(ids)
        trainer.export(tmp_path / "hf")
    for key, value in moved.items():  # every tensor moved but the routing biases
        assert torch.equal(value, initial[key]) == key.endswith(BIAS), key
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                                    output_loading_info=True,
                                                                    experts_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(loaded) is type(model)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, moved[key]), key
    with torch.no_grad(), one_thread():
        theirs = loaded.eval()(ids).logits
        theirs64 = float64_deepseek(loaded)(ids).logits
    err = assert_within_noise("round-trip logits", ours, theirs, theirs64)
    print(f"{name}: round-trip logits relative error {err:.2e}")
