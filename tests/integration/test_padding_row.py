"""The padding token's embedding row trains as in transformers, in the native families (dense, MoE and hybrid).

transformers builds each native family's embedding as nn.Embedding(vocab, hidden, padding_idx=pad_token_id): the
lookup gives the pad token's row no gradient, so under AdamW (weight decay on the embedding, as megatrain's layout
decays every matrix) the row only decays, by (1 - lr * weight_decay) a step; with a tied LM head the head's gradient
still reaches it. megatrain reads pad_token_id from config.json (the family's default where it has none) and does the
same (model/templates.embed_backward; docs/model-families.md).

Each case: a tiny random model of tests/unit/test_templates.py or test_moe.py with pad_token_id PAD, its PAD row set
to random values (transformers' init zeros it, on which decay shows nothing; a checkpoint may hold any values), trained
STEPS steps on a token stream whose every 5th token is PAD (so in every row's inputs and targets), lr 5e-3, weight
decay 0.1, clipping on, in float64 by megatrain and by the transformers model itself (tests/reference_hf.train_hf,
float64 throughout). Every step's loss and every final tensor within 1e-10 (EXACT: the same math up to summation
order), the PAD row alone too; untied, the PAD row is its initial values times the product of (1 - lr_t * 0.1), tied,
the head's gradient moved it beyond that. lr 5e-3, not 1e-2: at 1e-2 the tied Qwen3-MoE's layer-0 projections part
by 1.1e-11 (5.7e-15 at 5e-3), too near the bound. Measured (pytest -s prints them): losses within 4.2e-16, weights
within 8.6e-14 (Gemma 3; the others 4.4e-15 to 5.8e-15), the PAD row within 6.2e-15 of transformers' and, untied,
within 1.7e-16 of its decay alone. With the row trained as any other (megatrain before, every family) the loss of
step 1 already parts by 1.8e-5 (Llama), 5.9e-4 (Gemma 3), 2.7e-5 (Mixtral), 3.1e-4 (Qwen3-MoE), 3.05e-4 (Qwen3.5).
The hybrids (Qwen3.5 dense untied, Qwen3-Next MoE tied; their linear-attention layers on rows of 24 tokens, one short
chunk): losses within 2.1e-16, weights within 2.1e-14, the PAD row within 2.4e-16 of transformers' and, Qwen3.5's,
within 1.7e-16 of its decay alone. LoRA's trained
embedding (modules_to_save) against peft: losses within 2.1e-16, trained tensors within 9.8e-16; untrained row, the
loss of step 4 parts by 7.4e-4.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.hf import FAMILIES, HF_MODEL_TYPES, hf_config_from_model, model_config_from_hf  # noqa: E402
from megatrain_ray.driver.checkpointing import state_config  # noqa: E402
from megatrain_ray.exceptions import CheckpointError, ConfigError  # noqa: E402
from tests.conftest import learnable_tokens, tiny_config  # noqa: E402
from tests.integration.test_lora_parity import float64_transformers  # noqa: E402, F401 (a fixture)
from tests.integration.test_phi3_parity import assert_float64_run, run_engine  # noqa: E402
from tests.numerics import assert_exact, relative_error  # noqa: E402
from tests.reference_hf import train_hf  # noqa: E402
from tests.reference_llama import reference_lr  # noqa: E402
from tests.reference_hybrid import float64_hybrid, hf_hybrid_model  # noqa: E402
from tests.unit.test_moe import hf_moe_model  # noqa: E402
from tests.unit.test_templates import hf_model  # noqa: E402

PAD, STEPS, EMBED = 7, 10, "model.embed_tokens.weight"
# name -> (builder, tied head): dense Llama and Gemma 3 (embeddings scaled by sqrt(hidden)), MoE Mixtral and Qwen3-MoE.
# The hybrids of linear and full attention: Qwen3.5 dense, Qwen3-Next (MoE, tied; its reference's float32 RoPE tables
# and norms widened to float64 as in tests/integration/test_hybrid_parity.py).
CASES = {"llama-gqa": (hf_model, False), "gemma3-local-global": (hf_model, True),
         "mixtral-sliding": (hf_moe_model, False), "qwen3-moe-sparse-step": (hf_moe_model, True),
         "qwen3_5": (hf_hybrid_model, False), "qwen3_next": (hf_hybrid_model, True)}


def padded_model(name: str):
    build, tied = CASES[name]
    model = build(name, pad_token_id=PAD)
    embedding = model.get_input_embeddings()
    assert embedding.padding_idx == PAD and model.config.tie_word_embeddings == tied
    with torch.no_grad():
        embedding.weight[PAD] = 0.02 * torch.randn(embedding.weight.shape[1],
                                                   generator=torch.Generator().manual_seed(5))
    return model


def padded_tokens(path, vocab: int) -> str:
    """learnable_tokens with every 5th token PAD."""
    learnable_tokens(path, vocab)
    tokens = np.load(path)
    tokens[::5] = PAD
    np.save(path, tokens)
    return str(path)


@pytest.mark.parametrize("name", list(CASES))
def test_padding_row_matches_transformers(tmp_path, name):
    model = padded_model(name)
    tied = CASES[name][1]
    tokens = padded_tokens(tmp_path / "padded.npy", model.config.vocab_size)
    cfg, ours, initial, batches, final = run_engine(
        tmp_path, model, 24, "float64", data={"path": tokens}, train={"steps": STEPS},
        optimizer={"lr": 5e-3, "weight_decay": 0.1, "grad_clip": 1.0, "workers": 2})
    assert cfg.model.pad_token_id == PAD and cfg.model.tie_word_embeddings == tied
    assert all((b[:, :-1] == PAD).any(dim=1).all() for b in batches), "PAD in every row's inputs"
    hybrid = CASES[name][0] is hf_hybrid_model  # float64_hybrid widens its float32 steps itself
    ref, ref_state = train_hf(float64_hybrid(model) if hybrid else model, cfg, initial, batches, torch.float64,
                              exact=not hybrid)
    assert_float64_run(ours, ref, final, ref_state, initial)
    row_err = assert_exact("the PAD row", final[EMBED][PAD], ref_state[EMBED][PAD])
    o, s = cfg.optimizer, cfg.schedule
    decay = math.prod(1 - o.weight_decay * reference_lr(step, o.lr, STEPS, s.warmup_steps, s.kind, s.min_lr_ratio)
                      for step in range(STEPS))
    decayed_only = relative_error(final[EMBED][PAD], initial[EMBED][PAD] * decay)
    print(f"{name}: PAD row {row_err:.2e} from transformers', {decayed_only:.2e} from weight decay alone")
    if tied:  # the head's gradient reaches the shared row
        assert decayed_only > 1e-3, "tied: the LM head's gradient should have moved the PAD row"
    else:  # no gradient from the lookup: AdamW's moments stay zero, only the decay moves it
        assert decayed_only <= 1e-12, "untied: the PAD row should only decay"


def test_lora_trained_embedding_keeps_the_padding_row_as_peft(tmp_path, float64_transformers):  # noqa: F811
    """LoRA with modules_to_save [embed_tokens, lm_head] on an untied Llama with pad_token_id PAD: peft trains a copy
    of the embedding module, its padding_idx included. Float64 against peft (tests/integration/test_lora_parity.py's
    reference, RoPE and norms in float64), lr 1e-2, STEPS steps: losses and every trained tensor within 1e-10, the
    PAD row of the trained embedding decayed only."""
    from megatrain_ray.driver.trainer import Trainer
    from tests.integration.test_lora_parity import lora_config, peft_model, train_peft

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=PAD)
    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[PAD] = 0.02 * torch.randn(48, generator=torch.Generator().manual_seed(5))
    model.save_pretrained(tmp_path / "base")
    lora = {"r": 4, "lora_alpha": 8, "modules_to_save": ["embed_tokens", "lm_head"]}
    cfg = lora_config(tmp_path, tmp_path / "base", steps=STEPS, finetune={"method": "lora", "lora": lora},
                      precision={"master_dtype": "float64", "compute_dtype": "float64"}, optimizer={"lr": 1e-2})
    assert cfg.model.pad_token_id == PAD
    with Trainer(cfg) as trainer:
        initial = trainer.adapters()
        batches = [trainer.data.tokens_of(s) for s in range(cfg.train.steps)]
        ours = [trainer.step(s)["loss"] for s in range(cfg.train.steps)]
        final = trainer.adapters()
    assert sum(int((b[:, :-1] == PAD).sum()) for b in batches) >= 5, "PAD in the inputs"
    ref_losses, ref_final = train_peft(peft_model(tmp_path / "base", cfg, initial, torch.float64), cfg, batches)
    print(f"LoRA: losses within {max(relative_error(a, b) for a, b in zip(ours, ref_losses)):.2e}, trained tensors "
          f"within {max(relative_error(v, ref_final[k]) for k, v in final.items()):.2e} of peft's")
    for step, (a, b) in enumerate(zip(ours, ref_losses)):
        assert_exact(f"loss at step {step}", a, b)
    assert set(final) == set(ref_final)
    for name, value in final.items():
        assert_exact(name, value, ref_final[name])
        assert relative_error(value, initial[name]) > 1e-3, f"{name} barely moved"
    embed = next(k for k in final if k.endswith("embed_tokens.weight"))
    o, s = cfg.optimizer, cfg.schedule
    decay = math.prod(1 - o.weight_decay * reference_lr(step, o.lr, STEPS, s.warmup_steps, s.kind, s.min_lr_ratio)
                      for step in range(STEPS))
    assert_exact("the PAD row, decayed only", final[embed][PAD], initial[embed][PAD] * decay, 1e-12)


def test_pad_token_id_is_read_as_transformers_reads_it(tmp_path):
    """config.json's pad_token_id: absent, the family's default (each native family's transformers config class);
    null, none; negative, counted from the end as nn.Embedding's padding_idx; outside the vocabulary, refused as
    nn.Embedding refuses it. Written back on export, not part of a checkpoint's state config."""
    for arch, family in FAMILIES.items():
        defaults = transformers.AutoConfig.for_model(HF_MODEL_TYPES[family])
        hf = {**{k: v for k, v in defaults.to_dict().items() if k != "pad_token_id"}, "architectures": [arch]}
        if family == "glm4_moe":  # its defaults (hidden 4096, 96 heads) name no head_dim, which megatrain refuses to
            hf["head_dim"] = 128  # guess (transformers floors it to 42): GLM-4.5's own
        cfg = model_config_from_hf(hf)
        assert cfg.pad_token_id == defaults.pad_token_id, family
        assert model_config_from_hf(hf_config_from_model(cfg)).pad_token_id == cfg.pad_token_id
    vocab = cfg.vocab_size
    assert model_config_from_hf({**hf, "pad_token_id": None}).pad_token_id is None
    assert model_config_from_hf({**hf, "pad_token_id": -1}).pad_token_id == \
        torch.nn.Embedding(vocab, 2, padding_idx=-1).padding_idx == vocab - 1
    for bad in (vocab, -vocab - 1, True, 1.0):
        with pytest.raises(CheckpointError, match="pad_token_id"):
            model_config_from_hf({**hf, "pad_token_id": bad})
    with pytest.raises(ConfigError, match="model.pad_token_id"):
        tiny_config(tmp_path, model={"pad_token_id": 96})  # tiny_raw's vocabulary: 96
    assert "pad_token_id" not in state_config(tiny_config(tmp_path, model={"pad_token_id": 3}))["model"]
