"""The generic path's mixtures of experts (model/generic_moe.py) and untrained tensors against transformers.

Tiny random models with the load-balancing loss on (output_router_logits, coefficient 0.02; DBRX's
moe_loss_weight, JetMoE's aux_loss_coef), saved by save_pretrained (so in transformers' checkpoint format: one
tensor per expert for Qwen2-MoE, OLMoE, Ernie 4.5-MoE, Phimoe and DeepSeek-V3, GraniteMoE's renamed tensors)
and run from model.path, in float64 on both sides:
- Qwen2-MoE: a shared expert with its sigmoid gate, a dense first layer (mlp_only_layers), 5 experts, top-3.
- OLMoE: q/k norms, 5 experts, top-3. GraniteMoE: top-k then softmax, its multipliers, 5 experts, top-3.
- Phimoe: sparsemixer's top-2 (the family allows 2 only), LayerNorms; see PHIMOE below.
- Ernie 4.5-MoE: two shared experts, a dense first layer, a frozen routing bias (requires_grad=False), top-3.
- JetMoE: experts in the attention too (two routers per layer, both in the loss). DBRX: its own names
  (`transformer.blocks`, fused experts `ffn.experts.mlp.w1`), normalised top-3.
- DeepSeek-V3: MLA attention, grouped routing with a correction bias (a persistent buffer), a shared expert, a
  dense first layer; transformers computes no load-balancing loss for it.
- DeepSeek-V3.2: V3's layers and the sparse-attention indexer, each query attending to its top 5 of up to 16 keys
  (the logits move by 0.16 from attending to all); the indexer runs under torch.no_grad in transformers, so AdamW
  never moves it there: the generic path keeps it frozen (NO_GRADIENT), and the export holds it as the source.
- GLM-4.5 MoE (Glm4MoeForCausalLM): DeepSeek-V3's routing (2 groups of 3 experts, routed_scaling_factor 2.5) beside
  GQA attention with qkv bias, q/k norms and half-rotary RoPE; no load-balancing loss in transformers either.
- Llama 4 text (Llama4ForCausalLM): chunked local attention (chunks of 8 in rows of 16) with RoPE and L2 q/k norms,
  a NoPE full-attention layer with attention temperature tuning (floor_scale 4, so it acts within 16 tokens), a
  dense first layer, a MoE layer with a shared expert and sigmoid top-3 scores; no load-balancing loss.
- Gemma 4 text (Gemma4ForCausalLM): a sliding layer (head width 6, 2 KV heads) and a full layer of other widths
  (10, 1 KV head, keys as values: attention_k_eq_v), a dense MLP beside 5 experts with their own router norm and
  per-expert scale, a per-layer scalar (a persistent buffer), the final logit soft-cap (3.0, so it bends).
- Apertus (dense): its xIELU activation keeps two persistent buffers per layer.
Odd widths: hidden 36 or 40 (never a multiple of 64), GQA where the family has it, 5 experts.

Checked, float64 within 1e-10 (tests/numerics.EXACT) where nothing rounds differently:
- logits of the source weights, through the layer stream, against the transformers model's (the same modules:
  no widened reference is needed, their float32 RoPE tables and norms run on both sides).
- FLOAT64_STEPS training steps (lr 1e-2) against train_hf with the aux loss: every loss and every final tensor.
  transformers computes the load-balancing loss in float32 (softmax sums, f * P) and its gradient through that
  float32 arithmetic; the engine pools the same float32 sums in the same order and forms the gradient in the
  order of transformers' backward (engine/router_aux.py), so this holds to 1e-10 too. Measured: losses within
  4.6e-16, tensors within 9.5e-15. One exception, JetMoE's losses (JETMOE_LOSS_BOUND): transformers records
  three router outputs per layer (its attention's router twice: the attention module and the gating inside
  it, both hooked) and sums their float32 probabilities one by one, the engine per layer first, so the float32
  aux loss differs in its last bits (measured 8.5e-10 of the loss; its gradient, from the exact counts, does
  not: tensors within 2.6e-13). Measured faults: the load-balancing loss left out moves the step-0 loss by 1.3e-2;
  its gradient left out moves the step-1 loss by 1.3e-5 to 9.7e-4; that gradient scaled by 1 + 1e-3, by 1.6e-9
  to 3.5e-6 (JetMoE: 1.9e-8 at step 2), every one past its bound.
- the export loaded by transformers: no missing or unexpected keys (buffers and frozen parameters included), each
  trained tensor the run's rounded to float32, bit for bit.
And in float32, with transformers' default experts implementation (grouped_mm), the logits within the float32
noise of transformers' own. What is checked on load (refusals, skipped tensors): test_generic_loading.py.
PHIMOE: in training transformers' Phimoe samples its experts (Gumbel noise in sparsemixer); the generic path runs
every layer as in evaluation (deterministic top-2), so the reference trains with sparsemixer's evaluation routing.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.messages import IGNORE_INDEX, Batch
from tests.integration.test_generic_template import VOCAB, generic_config, save
from tests.numerics import EXACT, assert_exact, relative_error
from tests.reference_hf import train_hf

FLOAT64_STEPS = 20
AUX_COEF = 0.02
JETMOE_LOSS_BOUND = 1e-8
GENERIC = {"template": "generic"}
"""DeepSeek-V3 and GLM-4.5 MoE have native templates (model.template auto picks them): these tests run the generic
path by name."""
FAMILIES = ["qwen2_moe", "olmoe", "granitemoe", "phimoe", "ernie4_5_moe", "jetmoe", "dbrx", "deepseek_v3",
            "deepseek_v32", "glm4_moe", "llama4", "gemma4", "apertus"]
UNTRAINED = {"ernie4_5_moe", "deepseek_v3", "deepseek_v32", "glm4_moe", "gemma4", "apertus"}
NO_GRADIENT = {"deepseek_v32": ".self_attn.indexer."}
"""Parameters transformers' forward never differentiates (DeepSeek-V3.2's indexer runs under torch.no_grad): AdamW
never moves them there, and the generic path keeps them frozen."""
"""The families whose state_dict holds tensors the model does not train (frozen parameters, persistent buffers)."""


def hf_moe_generic_model(name: str):
    """A tiny random model of `name` (seeded), its router loss on where it has one."""
    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "num_hidden_layers": 2, "max_position_embeddings": 64, "bos_token_id": 0,
              "eos_token_id": 2, "pad_token_id": 1}
    aux = {"output_router_logits": True, "router_aux_loss_coef": AUX_COEF}
    if name == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(hidden_size=36, intermediate_size=44, moe_intermediate_size=20,
                                             shared_expert_intermediate_size=28, num_experts=5, num_experts_per_tok=3,
                                             num_attention_heads=6, num_key_value_heads=2, mlp_only_layers=[0],
                                             **aux, **common)
    elif name == "olmoe":
        config = transformers.OlmoeConfig(hidden_size=36, intermediate_size=20, num_experts=5, num_experts_per_tok=3,
                                          num_attention_heads=6, num_key_value_heads=2, **aux, **common)
    elif name == "granitemoe":
        config = transformers.GraniteMoeConfig(hidden_size=40, intermediate_size=24, num_local_experts=5,
                                               num_experts_per_tok=3, num_attention_heads=4, num_key_value_heads=2,
                                               embedding_multiplier=3.0, residual_multiplier=0.7,
                                               attention_multiplier=0.2, logits_scaling=4.0, **aux, **common)
    elif name == "phimoe":
        config = transformers.PhimoeConfig(hidden_size=36, intermediate_size=24, num_local_experts=5,
                                           num_experts_per_tok=2, num_attention_heads=6, num_key_value_heads=2,
                                           **aux, **common)
    elif name == "ernie4_5_moe":
        config = transformers.Ernie4_5_MoeConfig(hidden_size=36, intermediate_size=44, moe_intermediate_size=20,
                                                 moe_num_experts=5, moe_k=3, moe_num_shared_experts=2,
                                                 moe_layer_start_index=1, num_attention_heads=6,
                                                 num_key_value_heads=2, **aux, **common)
    elif name == "jetmoe":
        config = transformers.JetMoeConfig(hidden_size=36, intermediate_size=20, num_local_experts=5,
                                           num_experts_per_tok=3, num_key_value_heads=2, kv_channels=6,
                                           output_router_logits=True, aux_loss_coef=AUX_COEF, **common)
    elif name == "dbrx":
        config = transformers.DbrxConfig(d_model=36, n_heads=6, n_layers=2, max_seq_len=64, vocab_size=VOCAB,
                                         attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                                         output_router_logits=True,
                                         ffn_config={"ffn_hidden_size": 20, "moe_num_experts": 5, "moe_top_k": 3,
                                                     "moe_loss_weight": AUX_COEF}, pad_token_id=1)
    elif name == "deepseek_v3":  # no load-balancing loss in transformers (its routing bias is a buffer)
        config = transformers.DeepseekV3Config(hidden_size=36, intermediate_size=44, moe_intermediate_size=20,
                                               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=6,
                                               n_shared_experts=1, num_experts_per_tok=3, n_group=2, topk_group=1,
                                               first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **common)
    elif name == "deepseek_v32":  # V3's layers plus the sparse-attention indexer: each query attends to its top 5
        config = transformers.DeepseekV32Config(hidden_size=36, intermediate_size=44, moe_intermediate_size=20,
                                                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=6,
                                                n_shared_experts=1, num_experts_per_tok=3, n_group=2, topk_group=1,
                                                first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                                                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=5,
                                                index_n_heads=2, index_head_dim=12, **common)
    elif name == "glm4_moe":  # GLM-4.5: DeepSeek-V3's router (sigmoid, correction bias, groups) beside GQA attention
        config = transformers.Glm4MoeConfig(hidden_size=36, intermediate_size=44, moe_intermediate_size=20,
                                            num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                            partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                                            n_routed_experts=6, n_shared_experts=1, num_experts_per_tok=3, n_group=2,
                                            topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                            **common)
    elif name == "llama4":  # text model: chunked local attention with RoPE and L2 q/k norms, a NoPE full layer
        config = transformers.Llama4TextConfig(hidden_size=36, intermediate_size=20, intermediate_size_mlp=44,
                                               num_attention_heads=6, num_key_value_heads=2, head_dim=6,
                                               num_local_experts=5, num_experts_per_tok=3, moe_layers=[1],
                                               no_rope_layers=[1, 0], attention_chunk_size=8, floor_scale=4,
                                               **common)
    elif name == "gemma4":  # text model: sliding and full layers of other head widths, K = V in the full layer, MoE
        config = transformers.Gemma4TextConfig(hidden_size=36, intermediate_size=44, num_attention_heads=6,
                                               num_key_value_heads=2, head_dim=6, global_head_dim=10,
                                               num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                                               layer_types=["sliding_attention", "full_attention"],
                                               hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=5,
                                               top_k_experts=3, moe_intermediate_size=20,
                                               final_logit_softcapping=3.0, **common)
    elif name == "apertus":
        config = transformers.ApertusConfig(hidden_size=36, intermediate_size=44, num_attention_heads=6,
                                            num_key_value_heads=2, **common)
    else:
        raise KeyError(name)
    # transformers' default grouped_mm experts have no float64 kernel (the engine, in float64, runs them eager too)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager").eval()
    with torch.no_grad():  # norms and biases away from their initial ones and zeros, so a mix-up shows
        for n, p in model.named_parameters():
            if p.dim() == 1 and p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    return model


def aux_coef(model) -> float | None:
    """The coefficient transformers' causal LM adds the load-balancing loss with (None: no router loss)."""
    if not getattr(model.config, "output_router_logits", False):
        return None
    return getattr(model, "router_aux_loss_coef", None) or model.aux_loss_coef


@contextlib.contextmanager
def evaluation_routing(name: str):
    """Phimoe's sparsemixer as in evaluation while the reference trains (see PHIMOE in the module docstring)."""
    if name != "phimoe":
        yield
        return
    module = transformers.models.phimoe.modeling_phimoe
    sample = module.sparsemixer
    module.sparsemixer = lambda scores, jitter_eps, training, top_k=2: sample(scores, jitter_eps, False, top_k)
    try:
        yield
    finally:
        module.sparsemixer = sample


class _CorrectlyRoundedLinear:
    """torch.nn.functional with its linear computed in float64 and rounded once to the input's dtype."""

    def __getattr__(self, name: str):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def linear(x, weight, bias=None):
        wide = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
        return wide.to(x.dtype)


@contextlib.contextmanager
def correctly_rounded_float32_routers(name: str):
    """Ernie 4.5-MoE's and DeepSeek-V3's routers cast to float32 inside a float64 model and multiply there
    (F.linear), and MKL's float32 GEMM rounds by the shape it is given: the generic path and the reference route
    the same tokens in other batch shapes, which moved the float64 losses by 1e-10 to 3e-10 on an AMD EPYC (Zen 4)
    while they agreed within 1e-10 on a Xeon. Within the block both sides' router products are computed in float64
    and rounded once to float32: the same float32 logits whatever the shape, so the comparison is of our math
    alone. The routers' float32 softmax, sigmoid and top-k stay as transformers has them."""
    if name not in ("ernie4_5_moe", "deepseek_v3", "deepseek_v32", "glm4_moe"):
        yield
        return
    module = getattr(transformers.models, name).__dict__[f"modeling_{name}"]
    functional = module.F
    module.F = _CorrectlyRoundedLinear()
    try:
        yield
    finally:
        module.F = functional


def float64_logits(trainer, ids: torch.Tensor) -> torch.Tensor:
    """The logits of the layer stream in its compute dtype (Trainer.logits returns float32)."""
    engine = trainer.gpu.instance.engine  # runtime.mode=local: the worker object itself
    trainer.flush()
    with torch.no_grad():
        return engine._forward_only(Batch(ids, torch.full_like(ids, IGNORE_INDEX)),
                                    lambda x, head_w, embed_w: engine.generic.head_logits(x, head_w, embed_w).cpu())


@pytest.fixture(scope="module", params=FAMILIES)
def float64_run(request, tmp_path_factory):
    """One family's float64 run: the source model, its initial logits both ways, FLOAT64_STEPS steps both ways,
    and the export loaded back."""
    name = request.param
    tmp_path = tmp_path_factory.mktemp(name)
    model = hf_moe_generic_model(name)
    cfg = generic_config(tmp_path, save(model, tmp_path / "hf"), data={"seq_len": 16}, model=GENERIC,
                         precision={"master_dtype": "float64", "compute_dtype": "float64"},
                         optimizer={"lr": 1e-2}, train={"steps": FLOAT64_STEPS}, schedule={"warmup_steps": 1})
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with correctly_rounded_float32_routers(name), Trainer(cfg) as trainer:
        logits = float64_logits(trainer, ids)
        initial = trainer.master_weights()
        batches = [trainer.data.tokens_of(s) for s in range(cfg.train.steps)]
        records = [trainer.step(s) for s in range(cfg.train.steps)]
        final = trainer.master_weights()
        out = trainer.export(tmp_path / "export", dtype="float32")
    coef = aux_coef(model)
    reference = copy.deepcopy(model)
    # train_hf adds config.router_aux_loss_coef * aux_loss (DBRX and JetMoE name the coefficient otherwise)
    if coef is not None:
        reference.config.router_aux_loss_coef = coef
    # the untrained tensors (buffers, frozen parameters) as the source holds them, the trained ones as ours began
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    start = {k: v for k, v in model.state_dict().items() if k not in tied} | initial
    with evaluation_routing(name), correctly_rounded_float32_routers(name):
        ref_losses, ref_state = train_hf(reference, cfg, start, batches, torch.float64, aux=coef is not None)
        with torch.no_grad():
            ref_logits = copy.deepcopy(model).double()(ids).logits
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    return {"name": name, "model": model, "logits": logits, "ref_logits": ref_logits, "initial": initial,
            "final": final, "records": records, "ref_losses": ref_losses, "ref_state": ref_state, "loaded": loaded,
            "info": info, "coef": coef}


def test_generic_moe_logits_match_transformers_to_1e10(float64_run):
    run = float64_run
    err = relative_error(run["logits"], run["ref_logits"])
    print(f"{run['name']} float64 logits: {err:.2e}")
    assert run["logits"].dtype == torch.float64
    assert_exact(f"{run['name']} logits", run["logits"], run["ref_logits"])


def test_generic_moe_float64_training_with_the_aux_loss_matches_transformers(float64_run):
    run = float64_run
    name, ours, final, initial = run["name"], [r["loss"] for r in run["records"]], run["final"], run["initial"]
    trainable = {n for n, p in run["model"].named_parameters()
                 if p.requires_grad and not (name in NO_GRADIENT and NO_GRADIENT[name] in n)}
    assert set(final) == trainable  # Hugging Face's names; frozen parameters and buffers are no stage's
    loss_limit = JETMOE_LOSS_BOUND if name == "jetmoe" else EXACT
    print(f"{name} float64 ({'aux ' + str(run['coef']) if run['coef'] else 'no aux loss'}): losses within "
          f"{max(relative_error(a, b) for a, b in zip(ours, run['ref_losses'])):.2e} (bound {loss_limit:.0e}), "
          f"tensors within {max(relative_error(v, run['ref_state'][k]) for k, v in final.items()):.2e}")
    assert all(("aux_loss" in r) == (run["coef"] is not None) for r in run["records"])
    for step, (a, b) in enumerate(zip(ours, run["ref_losses"])):
        assert_exact(f"loss at step {step}", a, b, loss_limit)
    for key, value in final.items():
        assert value.dtype == torch.float64
        assert_exact(key, value, run["ref_state"][key])
        assert relative_error(value, initial[key]) > 1e-3, f"{key} barely moved"
    assert ours[-1] < ours[0] - 0.05


def test_generic_moe_export_loads_in_transformers_with_every_key(float64_run):
    run = float64_run
    assert not run["info"]["missing_keys"] and not run["info"]["unexpected_keys"], run["info"]
    state = run["loaded"].state_dict()
    for key, value in run["final"].items():
        assert torch.equal(state[key], value.float()), key
    trained = {n for n, p in run["model"].named_parameters(remove_duplicate=False)
               if p.requires_grad and not (run["name"] in NO_GRADIENT and NO_GRADIENT[run["name"]] in n)}
    untrained = {k: v for k, v in run["model"].state_dict().items() if k not in trained}
    for key, value in untrained.items():  # buffers and frozen parameters, exported as the source holds them
        assert torch.equal(state[key].float(), value.float()), key
    assert bool(untrained) == (run["name"] in UNTRAINED), sorted(untrained)


RAY_STEPS = 10


@pytest.mark.ray
@pytest.mark.parametrize("name", ["llama4", "gemma4"])
def test_generic_moe_through_ray_with_two_optimizer_workers(tmp_path, ray_session, name):
    """The Ray path (host shards, the GPU worker and 2 optimizer workers as actors) with Llama 4's chunked attention
    and shared expert, and Gemma 4's layers of two widths, its experts beside the MLP and its soft-cap: RAY_STEPS
    float64 steps against transformers' within 1e-10, losses and every tensor. Not DeepSeek-V3 or GLM-4.5: their
    routers multiply in float32, and correctly_rounded_float32_routers patches this process, not the GPU worker's
    actor (measured through Ray unpatched: DeepSeek-V3's losses within 3.3e-9, its tensors within 1.3e-6)."""
    model = hf_moe_generic_model(name)
    cfg = generic_config(tmp_path, save(model, tmp_path / "hf"), data={"seq_len": 16}, model=GENERIC,
                         precision={"master_dtype": "float64", "compute_dtype": "float64"},
                         optimizer={"lr": 1e-2, "workers": 2}, train={"steps": RAY_STEPS},
                         schedule={"warmup_steps": 1}, runtime={"mode": "ray"})
    with Trainer(cfg) as trainer:
        initial = trainer.master_weights()
        batches = [trainer.data.tokens_of(s) for s in range(cfg.train.steps)]
        ours = [trainer.step(s)["loss"] for s in range(cfg.train.steps)]
        final = trainer.master_weights()
    start = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or
             not model.config.tie_word_embeddings} | initial
    ref_losses, ref_state = train_hf(copy.deepcopy(model), cfg, start, batches, torch.float64)
    print(f"{name} through Ray, 2 optimizer workers: losses within "
          f"{max(relative_error(a, b) for a, b in zip(ours, ref_losses)):.2e}, tensors within "
          f"{max(relative_error(v, ref_state[k]) for k, v in final.items()):.2e}")
    for step, (a, b) in enumerate(zip(ours, ref_losses)):
        assert_exact(f"loss at step {step}", a, b)
    for key, value in final.items():
        assert_exact(key, value, ref_state[key])


@pytest.mark.float32_parity
@pytest.mark.parametrize("name", ["qwen2_moe", "granitemoe", "glm4_moe", "gemma4"])
def test_generic_moe_float32_logits_with_grouped_mm_experts(tmp_path, name):
    """In float32 the experts run as transformers runs them by default (grouped_mm): logits within the float32
    noise of transformers' own (tests/numerics.py; measured bit for bit for all four, noises 1.5e-7 to 6.7e-7).
    Llama 4's experts have one implementation only (batched products: no experts setting)."""
    from tests.numerics import assert_within_noise

    model = hf_moe_generic_model(name)
    model.set_experts_implementation("grouped_mm")
    cfg = generic_config(tmp_path, save(model, tmp_path / "hf"), data={"seq_len": 16}, model=GENERIC)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with Trainer(cfg) as trainer:
        ours = trainer.logits(ids)
    with torch.no_grad():
        theirs = model(ids).logits
        theirs64 = copy.deepcopy(model).double()
        theirs64.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
        theirs64 = theirs64(ids).logits
    err = assert_within_noise(f"{name} float32 logits", ours, theirs, theirs64)
    print(f"{name} float32 logits: {err:.2e}, noise {relative_error(theirs, theirs64):.2e}")
