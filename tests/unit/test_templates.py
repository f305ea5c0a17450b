"""Logits of each template family against transformers, from the same random weights (float32).

Checked twice: the templates over all-resident flat buffers, and the full layer stream of the
engine (host store -> streamed weights -> templates), which must give the same numbers.

Tolerances (tests/numerics.py): transformers' logits are computed twice, by the model in float32 and by a
float64 copy of it; ours (float32) must be within 4x the noise that measures (norm of the difference over the
norm of the logits), never tighter than 16 float32 ulps (1.9e-6). The same for the losses of the packed-row
tests. MKL's float32 GEMMs sum in a CPU-dependent order, so no fixed bound holds on every CPU. Measured on an
AVX-512 Xeon: logits' noise 2.4e-7 to 7.8e-7 (Gemma 3), ours (templates and stream) 0 (Gemma 2) to 6.6e-7 from
transformers' float32 logits, bound 1.9e-6 (the floor) to 3.1e-6; losses' noise and errors below 1e-7. Logits
scaled by 1 + 1e-3 land 300x or more past the bound.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.hf import hf_config_from_model, model_config_from_hf  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from megatrain_ray.exceptions import ConfigError  # noqa: E402
from megatrain_ray.model.layout import build_layout  # noqa: E402
from megatrain_ray.model.templates import model_logits  # noqa: E402
from tests.conftest import one_thread, streamed_logits, tiny_config  # noqa: E402
from tests.numerics import assert_within_noise, bound, relative_error  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)

PHI3 = dict(hidden_size=80, intermediate_size=72, original_max_position_embeddings=16, pad_token_id=None,
            eos_token_id=2)

# pad_token_id None as for PHI3 (whose default, 32000, is outside these vocabularies); Gemma's configs default it
# to 0. The padding row's training (no gradient from the lookup) is tested apart: tests/integration/test_padding_row.py.
GEMMA = dict(hidden_size=80, intermediate_size=72, head_dim=24, query_pre_attn_scalar=20, sliding_window=5,
             pad_token_id=None)

FAMILIES = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3.1-rope-scaling": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "qwen2.5-yarn": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 16}}),
    "llama-yarn-mscale": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
        "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.7, "mscale_all_dim": 1.0}}),
    "mistral-sliding-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 7}),
    "qwen2-bias-tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3-qknorm-headdim": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "num_key_value_heads": 1}),
    # Phi-3: fused qkv_proj and gate_up_proj, hidden 80 (head_dim 20), GQA 4/2. LongRoPE over an original
    # context of 16 tokens: the 33-token inputs below take the long factors, test_phi3_short_and_long_rope
    # the short ones too.
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", {**PHI3, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.15 * i for i in range(10)],
        "long_factor": [1.0 + 2.5 * i for i in range(10)]}}),
    # Without scaling: half of each head rotated, a sliding window of 7, one key/value head.
    "phi3-partial-sliding": ("Phi3Config", "Phi3ForCausalLM", {**PHI3, "num_key_value_heads": 1, "sliding_window": 7,
                                                               "rope_parameters": {"rope_type": "default",
                                                                                   "rope_theta": 10000.0,
                                                                                   "partial_rotary_factor": 0.5}}),
    # Both: LongRoPE over the rotated half (5 factors each), window 9.
    "phi3-longrope-partial": ("Phi3Config", "Phi3ForCausalLM", {**PHI3, "sliding_window": 9, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0], "long_factor": [1.0, 3.0, 7.0, 15.0, 31.0]}}),
    # Gemma 3: (1 + w) norms around attention and MLP, q/k norms, GeLU-tanh, embeddings times sqrt(80), tied head;
    # hidden 80 with head_dim 24 set apart from it, GQA 4/2, query_pre_attn_scalar 20 (not head_dim), local and
    # global layers (window 5 in the local ones, shorter than the inputs), local RoPE base 300, the global one
    # 5000 with linear scaling.
    "gemma3-local-global": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**GEMMA, "num_hidden_layers": 4, "layer_types": [
        "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"], "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 300.0}}}),
    # The pattern as Gemma 3's hub configs give it (every 2nd layer global), one key/value head, an untied head
    # and both soft-caps, small enough to bite: transformers' Gemma 3 applies the final one and ignores the
    # attention one, and so must megatrain.
    "gemma3-pattern-softcap": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        **GEMMA, "num_hidden_layers": 4, "sliding_window_pattern": 2, "num_key_value_heads": 1,
        "tie_word_embeddings": False, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    # Gemma 2: attention logit soft-capping (explicit attention), final logit soft-capping, every 2nd layer global.
    # Caps this small bite the tiny model's scores (about 0.04) and logits (about 0.7).
    "gemma2-softcap": ("Gemma2Config", "Gemma2ForCausalLM", {**GEMMA, "attn_logit_softcapping": 0.05,
                                                             "final_logit_softcapping": 1.0}),
}


def hf_model(name: str, **overrides):
    config_cls, model_cls, extra = FAMILIES[name]
    config = getattr(transformers, config_cls)(**{**BASE, **extra, **overrides}, attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    # Non-trivial norms and biases, so a template that skipped one would differ.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def float64_twin(model):
    """A float64 copy of a Hugging Face model: its results against the float32 model's measure float32's noise."""
    return copy.deepcopy(model).to(torch.float64).eval()


def assert_template_logits_match(name: str, model) -> float:
    """The stateless templates' logits on 2 x 33 tokens against transformers', within the measured noise."""
    ids = torch.randint(0, model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), one_thread():
        expected32, expected64 = model(ids).logits, float64_twin(model)(ids).logits
        ours = template_logits(model, ids)
    return assert_within_noise(f"{name}: template logits", ours, expected32, expected64)


@pytest.mark.float32_parity
@pytest.mark.parametrize("name", list(FAMILIES))
def test_templates_match_transformers(name):
    assert_template_logits_match(name, hf_model(name))


def template_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the stateless templates on `model`'s weights (every stage's padding NaN)."""
    cfg = model_config_from_hf(model.config.to_dict())
    layout = build_layout(cfg)
    buffers = [torch.full((s.numel,), float("nan")) for s in layout.stages]
    for stage, buf in zip(layout.stages, buffers):
        for slot in stage.slots:  # padding stays NaN: a template reading it would fail
            buf[slot.offset:slot.offset + slot.numel] = model.state_dict()[stage.hf_name(slot)].reshape(-1)
    with torch.no_grad():
        return model_logits(cfg, list(layout.stages), buffers, ids)


@pytest.mark.float32_parity
@pytest.mark.parametrize("name", ["qwen2-bias-tied", "qwen3-qknorm-headdim", "mistral-sliding-window",
                                  "phi3-longrope", "phi3-partial-sliding", "phi3-longrope-partial",
                                  "gemma3-local-global", "gemma3-pattern-softcap", "gemma2-softcap"])
def test_streamed_engine_logits_match_transformers(tmp_path, name):
    assert_within_noise(f"{name}: streamed logits", *streamed_logits(tmp_path, hf_model(name)))


@pytest.mark.float32_parity
@pytest.mark.parametrize("name", ["phi3-longrope", "phi3-longrope-partial"])
def test_phi3_short_and_long_rope(tmp_path, name):
    """LongRoPE as transformers: up to original_max_position_embeddings (16) tokens the short factors, past
    it the long ones for every position; through the templates and through the streamed engine. The two
    sets differ enough that taking the wrong one moves the logits far past the bound (measured: 3.5e-3 and
    9.4e-3 relative, the bound 1.9e-6)."""
    model = hf_model(name)
    mcfg = model_config_from_hf(model.config.to_dict())
    assert mcfg.rope_scaling is not None and mcfg.rope_scaling.rope_type == "longrope"
    assert mcfg.rope_scaling.original_max_position_embeddings == 16
    cfg = tiny_config(tmp_path, model=dataclasses.asdict(mcfg))
    lengths = (5, 16, 17, 40)
    inputs = [torch.randint(0, mcfg.vocab_size, (2, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    twin = float64_twin(model)
    with torch.no_grad(), one_thread():
        expected = [model(ids).logits for ids in inputs]
        expected64 = [twin(ids).logits for ids in inputs]
        templates = [template_logits(model, ids) for ids in inputs]
        short = model(inputs[2][:, :16]).logits
    with Trainer(cfg) as trainer:
        trainer.load_weights({k: v for k, v in model.state_dict().items() if k in trainer.master_weights()})
        streamed = [trainer.logits(ids) for ids in inputs]
    limit = 0.0
    for n, theirs, theirs64, template, ours in zip(lengths, expected, expected64, templates, streamed):
        assert_within_noise(f"template logits of {n} tokens", template, theirs, theirs64)
        assert_within_noise(f"streamed logits of {n} tokens", ours, theirs, theirs64)
        limit = max(limit, bound(relative_error(theirs, theirs64)))
    # The first 16 positions of a 17-token input differ from the 16-token input: the long factors took over.
    assert relative_error(expected[2][:, :16], short) > 100 * limit


def test_config_mapping_reads_families():
    q2 = model_config_from_hf(hf_model("qwen2-bias-tied").config.to_dict())
    assert q2.family == "qwen2" and q2.attention_bias and q2.tie_word_embeddings and not q2.qk_norm
    q3 = model_config_from_hf(hf_model("qwen3-qknorm-headdim").config.to_dict())
    assert q3.qk_norm and q3.resolved_head_dim == 32 and not q3.attention_bias
    llama = model_config_from_hf(hf_model("llama3.1-rope-scaling").config.to_dict())
    assert llama.rope_scaling is not None and llama.rope_scaling.original_max_position_embeddings == 16
    assert llama.rope_theta == 500000.0
    yarn = model_config_from_hf(hf_model("qwen2.5-yarn").config.to_dict()).rope_scaling
    assert yarn is not None and yarn.rope_type == "yarn" and yarn.factor == 4.0
    assert yarn.resolved_attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert model_config_from_hf(hf_model("mistral-sliding-window").config.to_dict()).sliding_window == 7
    phi3 = model_config_from_hf(hf_model("phi3-longrope-partial").config.to_dict())
    assert phi3.family == "phi3" and phi3.sliding_window == 9 and phi3.rotary_dim == 10 and not phi3.attention_bias
    long = phi3.rope_scaling
    assert long is not None and long.rope_type == "longrope" and long.long_factor == [1.0, 3.0, 7.0, 15.0, 31.0]
    assert long.factor == 8.0  # max_position_embeddings 128 over the original 16, as transformers derives it
    rotary = hf_model("phi3-longrope-partial").model.rotary_emb
    assert long.resolved_attention_factor == pytest.approx(rotary.attention_scaling)
    assert long.resolved_attention_factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(16)))
    g3 = model_config_from_hf(hf_model("gemma3-local-global").config.to_dict())
    assert g3.family == "gemma3" and g3.is_gemma and g3.qk_norm and g3.tie_word_embeddings and not g3.attention_bias
    assert (g3.rope_theta, g3.rope_local_base_freq, g3.sliding_window, g3.query_pre_attn_scalar) == (5000, 300, 5, 20)
    assert g3.rope_scaling is not None and (g3.rope_scaling.rope_type, g3.rope_scaling.factor) == ("linear", 4.0)
    assert [g3.layer_slides(i) for i in range(4)] == [True, False, True, True]
    softcap = model_config_from_hf(hf_model("gemma3-pattern-softcap").config.to_dict())
    assert softcap.final_logit_softcapping == 3.0 and not softcap.tie_word_embeddings
    assert softcap.attn_logit_softcapping == 0.0  # transformers' Gemma 3 never applies it
    assert [softcap.layer_slides(i) for i in range(4)] == [True, False, True, False]
    g2 = model_config_from_hf(hf_model("gemma2-softcap").config.to_dict())
    assert g2.family == "gemma2" and not g2.qk_norm and g2.rope_local_base_freq == 0
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (0.05, 1.0)
    assert [g2.layer_slides(i) for i in range(3)] == [True, False, True]


@pytest.mark.float32_parity
@pytest.mark.parametrize("name", ["gemma3-local-global", "gemma2-softcap"])
def test_gemma_packed_documents_equal_each_document_alone(tmp_path, name):
    """Packed rows (RoPE positions restart, attention stops at each document): the loss of a row of
    documents (19, 6, 7) and a row (32) equals transformers' on each document alone, through the local
    and global layers (Gemma 3: both RoPE tables gathered by position; Gemma 2: soft-capped attention in
    the document buckets); a document longer than the window (5) exercises it inside the buckets."""
    from megatrain_ray.messages import Batch

    model = hf_model(name)
    mcfg = model_config_from_hf(model.config.to_dict())
    cfg = tiny_config(tmp_path, model=dataclasses.asdict(mcfg), data={"seq_len": 32})
    gen = torch.Generator().manual_seed(6)
    rows = ((19, 6, 7), (32,))
    docs = [[torch.randint(0, mcfg.vocab_size, (n + 1,), generator=gen) for n in lengths] for lengths in rows]
    ids = torch.stack([torch.cat([d[:-1] for d in row]) for row in docs])
    labels = torch.stack([torch.cat([d[1:] for d in row]) for row in docs])
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
    with torch.no_grad(), one_thread():  # transformers' loss in float32 and in float64 (the noise)
        total32, total64 = (sum(F.cross_entropy(m(d[None, :-1]).logits[0], d[1:], reduction="sum").item()
                                for row in docs for d in row) for m in (model, float64_twin(model)))
    with Trainer(cfg) as trainer:
        trainer.load_weights({k: v for k, v in model.state_dict().items() if k in trainer.master_weights()})
        ours, count = trainer.gpu.eval_loss(Batch(ids, labels, positions, rows)).result()
    assert count == 64
    assert_within_noise("loss of the packed rows", ours, total32 / 64, total64 / 64)


def test_gemma3_config_json_in_transformers_4_spelling():
    """Gemma 3 27B's text_config as google/gemma-3-27b-it ships it, with Gemma3TextConfig's defaults of that
    time written out (transformers 4: rope_theta, rope_local_base_freq and rope_scaling at the top, the
    layer pattern as sliding_window_pattern) reads as transformers 5 reads it, and has the layout's
    27,009,346,304 parameters (configs/shapes/gemma3-27b.yaml)."""
    hf = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 128, "hidden_size": 5376,
          "intermediate_size": 21504, "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
          "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
          "sliding_window": 1024, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
          "sliding_window_pattern": 6, "vocab_size": 262208, "max_position_embeddings": 131072,
          "rms_norm_eps": 1e-6, "final_logit_softcapping": None, "attn_logit_softcapping": None,
          "hidden_activation": "gelu_pytorch_tanh"}
    cfg = model_config_from_hf(hf)
    theirs = model_config_from_hf(transformers.Gemma3TextConfig(**hf).to_dict())
    assert theirs.layer_types and not cfg.layer_types and cfg.sliding_window_pattern == 6
    assert dataclasses.replace(cfg, layer_types=theirs.layer_types, sliding_window_pattern=0) == theirs
    assert [cfg.layer_slides(i) for i in range(62)] == [t == "sliding_attention" for t in theirs.layer_types]
    assert cfg.tie_word_embeddings and cfg.rope_local_base_freq == 10_000.0 and cfg.attention_scale == 168 ** -0.5
    assert build_layout(cfg).num_params == 27_009_346_304
    with pytest.raises(ConfigError, match="hidden_activation"):
        model_config_from_hf({**hf, "hidden_activation": "gelu"})
    with pytest.raises(ConfigError, match="sliding layers"):
        model_config_from_hf({**hf, "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}})


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_config_round_trip(name):
    cfg = model_config_from_hf(hf_model(name).config.to_dict())
    hf = transformers.AutoConfig.for_model(**hf_config_from_model(cfg))
    assert model_config_from_hf(hf.to_dict()) == cfg


@pytest.mark.float32_parity
def test_phi3_packed_rows_take_the_rope_factors_of_their_longest_document(tmp_path):
    """Packed rows (positions restart per document): LongRoPE's factor set follows the longest position
    in the batch, as transformers given the same position ids, not the row length. Rows of 32 tokens:
    documents (20, 12) reach position 19 (long factors), documents (10, 12, 10) position 11 (short).
    The reference is transformers on the packed row with its position ids and a block-diagonal causal
    mask, in float32 and float64 (the noise); the loss counts the 12-token document only, and q, k are
    scaled up so that attention (and with it the factor set) moves the loss well past the bound (measured:
    4.5e-4 relative, 240x the bound of 1.9e-6)."""
    from megatrain_ray.messages import IGNORE_INDEX, Batch

    model = hf_model("phi3-longrope")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight.mul_(8.0)
    mcfg = model_config_from_hf(model.config.to_dict())
    cfg = tiny_config(tmp_path, model=dataclasses.asdict(mcfg), data={"seq_len": 32})
    gen = torch.Generator().manual_seed(5)
    losses = {}
    twin = float64_twin(model)
    with Trainer(cfg) as trainer:
        trainer.load_weights({k: v for k, v in model.state_dict().items() if k in trainer.master_weights()})
        for lengths in ((20, 12), (10, 12, 10)):
            docs = [torch.randint(0, mcfg.vocab_size, (n + 1,), generator=gen) for n in lengths]
            ids = torch.cat([d[:-1] for d in docs])[None]
            counted = [torch.full((n,), k == lengths.index(12)) for k, n in enumerate(lengths)]
            labels = torch.where(torch.cat(counted), torch.cat([d[1:] for d in docs]), IGNORE_INDEX)[None]
            positions = torch.cat([torch.arange(n) for n in lengths])[None]
            ours, _ = trainer.gpu.eval_loss(Batch(ids, labels, positions, (lengths,))).result()
            doc = torch.cat([torch.full((n,), k) for k, n in enumerate(lengths)])
            allowed = (doc[:, None] == doc[None, :]) & torch.ones(32, 32, dtype=torch.bool).tril()
            twelve = docs[lengths.index(12)][1:]
            refs = []  # (packed, alone) in float32, then in float64
            for m in (model, twin):
                mask = torch.zeros(1, 1, 32, 32, dtype=m.dtype).masked_fill(~allowed, float("-inf"))
                with torch.no_grad(), one_thread():
                    packed = m(ids, attention_mask=mask, position_ids=positions).logits[0]
                    alone = m(docs[lengths.index(12)][None, :-1]).logits[0]  # 12 tokens: the short factors
                refs.append((F.cross_entropy(packed, labels[0]).item(), F.cross_entropy(alone, twelve).item()))
            losses[lengths] = (ours, *refs)
    for lengths, (ours, (packed32, alone32), (packed64, alone64)) in losses.items():
        assert_within_noise(f"{lengths}: loss against the packed row", ours, packed32, packed64)
        if max(lengths) <= 16:  # short factors: each document alone gives the same loss
            assert_within_noise(f"{lengths}: loss against the document alone", ours, alone32, alone64)
    ours, (_, alone32), (_, alone64) = losses[(20, 12)]
    assert relative_error(ours, alone32) > 100 * bound(relative_error(alone32, alone64))


def test_phi3_config_json_in_transformers_4_spelling():
    """A config.json as Phi-3-mini-128k-instruct ships it (transformers 4: rope_scaling of type "su" or
    "longrope", the factor lists only; rope_theta and original_max_position_embeddings at the top;
    the factor values here are made up) reads as transformers reads it, and its shape has 3.82 B parameters."""
    factors = {"short_factor": [1.0 + 0.01 * i for i in range(48)], "long_factor": [1.0 + 0.5 * i for i in range(48)]}
    read = {}
    for kind in ("longrope", "su"):
        hf = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
              "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": {"type": kind, **factors},
              "sliding_window": 262144, "tie_word_embeddings": False, "attention_bias": False,
              "hidden_act": "silu", "pad_token_id": 32000, "eos_token_id": 32000, "bos_token_id": 1}
        cfg = read[kind] = model_config_from_hf(hf)
        if kind == "longrope":  # transformers 5.23's Phi3Config(...) fails on "su" (no original length)
            assert cfg == model_config_from_hf(transformers.Phi3Config(**hf).to_dict())
        long = cfg.rope_scaling
        assert long is not None and long.rope_type == "longrope" and long.factor == 32.0
        assert long.original_max_position_embeddings == 4096 and long.long_factor == factors["long_factor"]
        assert long.resolved_attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
        assert cfg.sliding_window == 262144 and cfg.rotary_dim == 96
        assert build_layout(cfg).num_params == 3_821_079_552
    assert read["su"] == read["longrope"]
