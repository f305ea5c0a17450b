"""Training parity of the hybrid families (Qwen3.5 text, Qwen3-Next, Qwen3.5-MoE text) against transformers' models
themselves, and their round trip through a Hugging Face directory.

The tiny models of tests/reference_hybrid.py are trained for 20 steps by megatrain (the layer stream, float64, two
optimizer workers) and by the transformers model with torch.optim.AdamW (matrices and the convolution's 3-d weight
decayed, vectors not, as megatrain's layout does), clip_grad_norm_ and the same warmup + cosine schedule
(tests/reference_hf.train_hf), on the same row of 136 tokens a step: three chunks of the delta rule, the last 8 tokens
(the third is the first to read a state decayed across a chunk boundary). lr 3e-3.

Bounds (tests/numerics.py), each step's loss and each final tensor: 1e-10 (EXACT), the reference float64 throughout
(tests/reference_hybrid.float64_hybrid: the delta rule, the norms, the RoPE tables and the attention's softmax in
float64, where transformers keeps them float32 in a float64 model). The MoE families run with the load-balancing loss
on (output_router_logits, coef 0.02): its routers' probabilities are summed in float32 on both sides, as transformers
sums them, and with these models' two MoE layers both sides add the same two float32 sums in the same order, so EXACT
holds (tests/integration/test_moe_parity.py's models, with more layers and chunked MLPs, part there and keep 1e-5).
Measured (pytest -s): Qwen3.5 losses within 4.2e-16, weights 4.1e-13; Qwen3-Next 4.1e-16 and 1.2e-14; Qwen3.5-MoE
3.8e-16 and 2.5e-12. The round trip's logits (float32, forward
only): within 4x the noise of transformers' float32 logits against its float64 twin, floor 16 float32 ulps (1.9e-6);
measured 1.1e-7 to 1.8e-7 against noises of about 2e-7, the bound the floor.

Fault injection (by hand, reverted): the attention's output gate as sigmoid(-gate) fails every test here, from the
first step's loss (3.2e-5 to 1.7e-4 relative) and the round trips' logits (5.1e-2 to 6.5e-2); the chunk state left
undecayed between chunks fails the training tests from the first step's loss (1.5e-8 to 9.7e-7; at 80 tokens, two
chunks, it went unseen: hence 136).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.hf import model_config_from_hf  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from tests.conftest import learnable_tokens, one_thread, tiny_config, tiny_raw, train_from_hf_weights  # noqa: E402
from tests.integration.test_phi3_parity import assert_float64_run  # noqa: E402
from tests.numerics import EXACT, assert_within_noise  # noqa: E402
from tests.reference_hf import train_export_and_reload, train_hf  # noqa: E402
from tests.reference_hybrid import float64_hybrid, hf_hybrid_model  # noqa: E402

SEQ_LEN = 136
AUX_COEF = 0.02
LR = 3e-3  # at 1e-3 the linear layers' dt_bias (about 1) moves by less than the 1e-3 that proves it trained


def run_both(tmp_path, model, aux: bool, engine: dict | None = None):
    """20 float64 steps through megatrain (`engine`: settings of the engine section) and through `model` (float64
    throughout); returns (our losses, its losses, our final weights, its, the initial weights)."""
    mcfg = model_config_from_hf(model.config.to_dict())
    cfg = tiny_config(tmp_path, model=dataclasses.asdict(mcfg), data={"seq_len": SEQ_LEN, "batch_size": 1},
                      precision={"master_dtype": "float64", "compute_dtype": "float64"},
                      optimizer={"workers": 2, "lr": LR}, engine=engine or {})
    initial, batches, records, final = train_from_hf_weights(cfg, model)
    assert all(("aux_loss" in r) == aux for r in records)
    tied = {"lm_head.weight"} if mcfg.tie_word_embeddings else set()
    assert set(initial) == set(model.state_dict()) - tied
    ref_losses, ref_state = train_hf(float64_hybrid(model), cfg, initial, batches, torch.float64, aux=aux)
    return [r["loss"] for r in records], ref_losses, final, ref_state, initial


def test_qwen3_5_float64_training_matches_transformers(tmp_path):
    """Qwen3.5: dense, its four projections apart; the layer inputs through host memory and the MLP in chunks of 100
    tokens (136 a step: the linear mixer recomputed once, the MLP in two chunks)."""
    assert_float64_run(*run_both(tmp_path, hf_hybrid_model("qwen3_5"), aux=False,
                                 engine={"activation_offload": True, "mlp_chunk_tokens": 100}), limit=EXACT)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_hybrid_moe_with_load_balancing_loss_matches_transformers(tmp_path, name):
    """Qwen3-Next: the fused projections, MoE layers with a shared expert around a dense one, tied; Qwen3.5-MoE: its
    four projections, its router always renormalised. Both with the load-balancing loss."""
    model = hf_hybrid_model(name, output_router_logits=True, router_aux_loss_coef=AUX_COEF)
    assert_float64_run(*run_both(tmp_path, model, aux=True), limit=EXACT)


@pytest.mark.float32_parity
@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_hybrid_hf_round_trip(tmp_path, name):
    """A directory as save_pretrained writes it (the experts one tensor each), with a multi-token-prediction
    tensor beside it (mtp.*, which transformers does not load and megatrain does not read) -> import -> one step ->
    export -> transformers loads it with no missing, unexpected or mismatched key, its logits megatrain's."""
    from safetensors.torch import load_file, save_file

    from megatrain_ray.config.load import load_config

    model = hf_hybrid_model(name)
    source = tmp_path / "source"
    model.save_pretrained(source)
    weights = load_file(str(source / "model.safetensors"))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in weights
    save_file({**weights, "mtp.fc.weight": torch.zeros(4, 4)}, str(source / "model.safetensors"),
              metadata={"format": "pt"})
    raw = tiny_raw(data={"seq_len": SEQ_LEN}, train={"steps": 1, "output_dir": str(tmp_path / "run")},
                   optimizer={"lr": 1e-2}, schedule={"warmup_steps": 0})
    raw["model"] = {"path": str(source)}
    raw["data"]["path"] = learnable_tokens(tmp_path / "tokens.npy", model.config.vocab_size)
    ids = torch.randint(0, model.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(4))
    ours, loaded = train_export_and_reload(load_config(raw=raw), model, ids, tmp_path / "hf")
    with torch.no_grad(), one_thread():
        theirs = loaded.eval()(ids).logits
        theirs64 = float64_hybrid(loaded)(ids).logits
    err = assert_within_noise("round-trip logits", ours, theirs, theirs64)
    print(f"{name}: round-trip logits relative error {err:.2e}")


def test_multimodal_qwen3_5_checkpoint_trains_its_text_model(tmp_path):
    """A directory as the hub's Qwen3.5 checkpoints are (Qwen3_5ForConditionalGeneration: config.json's text_config,
    the language model under model.language_model., a vision tower under model.visual.) imports as its text model,
    the vision tower unread: the logits those of transformers' text class loaded from the same directory, and the
    export after a step a Qwen3_5ForCausalLM directory that transformers loads with no missing or unexpected key, its
    logits megatrain's; both within the float32 noise as the round trip above (measured 0, both sides through SDPA in
    the same order; 3.8e-8 under MKL_CBWR=COMPATIBLE)."""
    from megatrain_ray.config.load import load_config
    from tests.reference_hybrid import BASE, HYBRIDS

    text = {**BASE, **HYBRIDS["qwen3_5"][2]}
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=BASE["hidden_size"],
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text,
                                                                                    vision_config=vision)).eval()
    source = tmp_path / "source"
    model.save_pretrained(source)
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    assert type(reference).__name__ == "Qwen3_5ForCausalLM"
    raw = tiny_raw(data={"seq_len": 24}, train={"steps": 1, "output_dir": str(tmp_path / "run")},
                   schedule={"warmup_steps": 0})
    raw["model"] = {"path": str(source)}
    raw["data"]["path"] = learnable_tokens(tmp_path / "tokens.npy", text["vocab_size"])
    ids = torch.randint(0, text["vocab_size"], (2, 70), generator=torch.Generator().manual_seed(5))
    with Trainer(load_config(raw=raw)) as trainer:
        assert trainer.cfg.model.family == "qwen3_5"
        before = trainer.logits(ids)
        trainer.train()
        after = trainer.logits(ids)
        trainer.export(tmp_path / "hf")
    with torch.no_grad(), one_thread():
        errors = [assert_within_noise("imported logits", before, reference(ids).logits,
                                      float64_hybrid(reference)(ids).logits)]
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(loaded).__name__ == "Qwen3_5ForCausalLM"
    with torch.no_grad(), one_thread():
        errors.append(assert_within_noise("exported logits", after, loaded.eval()(ids).logits,
                                          float64_hybrid(loaded)(ids).logits))
    assert (after - before).abs().max() > 1e-3  # the step moved them
    print(f"multimodal Qwen3.5: imported and exported logits within {max(errors):.1e} of transformers'")
