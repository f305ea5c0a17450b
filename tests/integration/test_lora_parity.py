"""LoRA training parity (finetune.method=lora): the streaming engine against transformers + peft.

Same base (a tiny random Hugging Face model saved to tmp_path and loaded by both), same initial adapters
(megatrain draws them, peft gets them through set_peft_model_state_dict), same batches and schedule; the
reference trains peft's model with torch.optim.AdamW over its trainable parameters and clip_grad_norm_.
target_modules all-linear (every projection of every layer), float32, 20 steps.

Tolerances (tests/numerics.py): peft's run is made twice, in float32 and in float64 from the same adapters; each
step's loss and each final adapter (norm of the difference over norm of the tensor) must be within 4x the noise
that measures, the float32 peft run against the float64 one, on the machine running the test. The engine sums in
another order (per-layer recompute, chunked loss, its own norm of the global gradient) and AdamW amplifies it;
MKL's float32 GEMMs round by CPU (the Qwen2 o_proj B: 1.9e-5 from peft's float32 run on an AVX-512 Xeon, 4.8e-6
on an AMD EPYC; peft's own float32 run is 1.7e-5 from its float64 run on the Xeon), so no fixed bound holds
everywhere. lr 1e-3: at lr 1e-2 the float32 noise grows past what a comparison can use. On a random base the
loss barely moves in 20 steps at that rate; what proves the comparison is that every adapter moved: B starts at
zero, and each final tensor must differ from its initial value by more than 100x the bound.

"2 workers" through Ray: a LoRA run has no CPU optimizer workers (the adapters' AdamW runs on the device), so
the Ray runs spread the base over two host shards (host.num_shards=2), and a data-parallel run has two GPU
workers (parallel.gpus=2) whose summed gradients must give peft's single-process run.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from megatrain_ray.config.load import load_config
from megatrain_ray.driver.trainer import Trainer
from tests.conftest import learnable_tokens, one_thread, tiny_raw
from tests.numerics import (
    FACTOR,
    Reference,
    assert_run_exact,
    assert_run_within_noise,
    reference_in_both,
    relative_error,
)
from tests.reference_cache import ReferenceRuns, code_of
from tests.reference_llama import reference_lr


def make_base(directory: Path, family: str) -> Path:
    """A tiny random model with odd sizes (head_dim 12, intermediate 80), saved as Hugging Face does."""
    common = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    gemma = dict(head_dim=12, tie_word_embeddings=True, pad_token_id=0, sliding_window=8, query_pre_attn_scalar=12)
    torch.manual_seed(11)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    elif family == "phi3":  # fused qkv_proj and gate_up_proj: one adapter each, as peft puts them
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, tie_word_embeddings=False,
                                                                     pad_token_id=0))
    else:  # gemma2: GeLU MLP, four norms, soft-capping, sliding layers
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common, **gemma))
    model.save_pretrained(directory)
    return directory


def lora_config(tmp_path: Path, base: Path, steps: int = 20, **sections):
    defaults = {"finetune": {"method": "lora", "lora": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}},
                "train": {"steps": steps}, "schedule": {"warmup_steps": min(3, steps)}}
    raw = tiny_raw(**{name: {**defaults.get(name, {}), **sections.get(name, {})} for name in {*defaults, *sections}})
    raw["model"] = {"path": str(base)}
    tmp_path.mkdir(parents=True, exist_ok=True)
    raw["data"]["path"] = learnable_tokens(tmp_path / "tokens.npy", 96)
    raw["train"]["output_dir"] = str(tmp_path / "run")
    return load_config(raw=raw)


def peft_model(base: Path, cfg, adapters: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
    """peft's LoRA model on the base, with megatrain's adapters, in `dtype`; the load must match every key. Eager
    attention's softmax is float32 whatever the model's dtype: a float64 model takes SDPA, float64 throughout, where
    the family has it (Gemma 2's soft-capped scores are eager only)."""
    sdpa = dtype == torch.float64 and transformers.AutoConfig.from_pretrained(base).model_type != "gemma2"
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype,
                                                              attn_implementation="sdpa" if sdpa else "eager")
    lora = cfg.finetune.lora
    model = peft.get_peft_model(model, peft.LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=0.0,
                                                       target_modules=list(lora.targets(cfg.model.family))
                                                       if lora.target_modules != "all-linear" else "all-linear",
                                                       bias="none",
                                                       use_rslora=lora.use_rslora, task_type="CAUSAL_LM",
                                                       modules_to_save=list(lora.modules_to_save) or None))
    result = peft.set_peft_model_state_dict(model, adapters)
    assert not result.unexpected_keys, result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k], result.missing_keys
    return model


def train_peft(model, cfg, batches: list[torch.Tensor], aux_coef: float = 0.0
               ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: torch.optim.AdamW over the peft model's trainable parameters, the run's schedule and
    clipping; `aux_coef` > 0 adds the MoE router's load-balancing loss as transformers computes it. On one thread
    (tests.conftest.one_thread), and made once per distinct input (tests/reference_cache.py: the model's code,
    configs and tensors, the settings and batches), so the model passed in is trained only the first time."""
    o, s = cfg.optimizer, cfg.schedule
    settings = (o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.grad_clip, s.warmup_steps, s.kind, s.min_lr_ratio)

    def train() -> tuple[list[float], dict[str, torch.Tensor]]:
        with one_thread():
            return _train_peft(model, cfg, batches, aux_coef)
    return PEFT_RUNS.get(train, code_of(model), model.config.to_json_string(), repr(model.peft_config),
                         model.state_dict(), settings, batches, aux_coef)


PEFT_RUNS = ReferenceRuns()


def _train_peft(model, cfg, batches: list[torch.Tensor], aux_coef: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    o, s = cfg.optimizer, cfg.schedule
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                            foreach=False)
    losses = []
    for step, tokens in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = reference_lr(step, o.lr, len(batches), s.warmup_steps, s.kind, s.min_lr_ratio)
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=tokens[:, :-1], **({"output_router_logits": True} if aux_coef else {}))
        logits = out.logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(
            logits.dtype, torch.float32)), tokens[:, 1:].reshape(-1))
        if aux_coef:
            loss = loss + aux_coef * out.aux_loss
        loss.backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses, peft.get_peft_model_state_dict(model)


class LoraRun(NamedTuple):
    losses: list[float]
    initial: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    reference: Reference  # peft's run in float32 and float64
    base: Path
    base_after: dict[str, torch.Tensor]


def peft_reference(base: Path, cfg, initial: dict[str, torch.Tensor], batches: list[torch.Tensor]) -> Reference:
    """peft's run from megatrain's initial adapters, in float32 and in float64 (the noise of the float32 run)."""
    return reference_in_both(lambda dtype: train_peft(peft_model(base, cfg, initial, dtype), cfg, batches))


def run_both(tmp_path: Path, family: str, world: int = 1, **sections) -> LoraRun:
    base = make_base(tmp_path / "base", family)
    cfg = lora_config(tmp_path, base, **sections)
    with Trainer(cfg) as trainer:
        assert trainer.cluster.parallel.world == world
        initial = trainer.adapters()
        batches = [trainer.data.tokens_of(s) for s in range(cfg.train.steps)]
        ours = [trainer.step(s)["loss"] for s in range(cfg.train.steps)]
        final = trainer.adapters()
        base_after = trainer.master_weights()
    return LoraRun(ours, initial, final, peft_reference(base, cfg, initial, batches), base, base_after)


def assert_lora_parity(run: LoraRun, factor: float = FACTOR) -> float:
    """The run's losses and adapters against peft's within `factor` x the measured float32 noise; every adapter
    moved."""
    assert set(run.final) == set(run.reference.state32), set(run.final) ^ set(run.reference.state32)
    return assert_run_within_noise(run.losses, run.final, run.reference, run.initial, factor)


def _rope_in_float64(self, x, position_ids=None):
    """Default RoPE's tables as transformers computes them, in float64 throughout (transformers: float32)."""
    assert self.rope_type == "default", self.rope_type
    dim = 2 * self.inv_freq.numel()
    inv_freq = 1.0 / (self.config.rope_parameters["rope_theta"] ** (
        torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float64) / dim))
    emb = (position_ids[..., None].to(torch.float64) * inv_freq.to(x.device)).repeat(1, 1, 2)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def _rms_norm_in_float64(self, x):
    """RMSNorm as transformers writes it, without its cast of the input to float32."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.fixture
def float64_transformers(monkeypatch):
    """transformers computes the RoPE tables and the RMSNorms of Llama and Qwen2 in float32 even in a float64 model
    (megatrain in the compute dtype): for the float64 comparison the reference does them in float64 too, the same
    formulas, so the two sides differ by summation order alone."""
    for module in (transformers.models.llama.modeling_llama, transformers.models.qwen2.modeling_qwen2):
        for suffix, float64_forward in (("RotaryEmbedding", _rope_in_float64), ("RMSNorm", _rms_norm_in_float64)):
            cls = next(v for k, v in vars(module).items() if k.endswith(suffix))
            eager = cls.forward

            def forward(self, x, *args, eager=eager, float64_forward=float64_forward, **kwargs):
                return (float64_forward if x.dtype == torch.float64 else eager)(self, x, *args, **kwargs)
            monkeypatch.setattr(cls, "forward", forward)


def assert_base_untouched(base: Path, base_after: dict[str, torch.Tensor]) -> None:
    reference = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    for name, value in base_after.items():
        assert torch.equal(value, reference[name]), f"the frozen base changed: {name}"


@pytest.mark.float32_parity
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clip", "noclip"])
def test_lora_matches_peft_local(tmp_path, family, clip):
    run = run_both(tmp_path, family, optimizer={"grad_clip": clip})
    assert_lora_parity(run)
    assert_base_untouched(run.base, run.base_after)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lora_float64_matches_peft_to_1e10(tmp_path, float64_transformers, family):
    """The float64 twin of the float32 tests: both sides in float64 (the reference's RoPE and norms too), lr 1e-2,
    clipping on: the same math up to summation order, so losses and adapters within 1e-10 (measured 2e-16 on the
    losses)."""
    float64 = {"master_dtype": "float64", "compute_dtype": "float64"}
    base = make_base(tmp_path / "base", family)
    cfg = lora_config(tmp_path, base, precision=float64, optimizer={"lr": 1e-2})
    with Trainer(cfg) as trainer:
        initial = trainer.adapters()
        batches = [trainer.data.tokens_of(s) for s in range(cfg.train.steps)]
        ours = [trainer.step(s)["loss"] for s in range(cfg.train.steps)]
        final = trainer.adapters()
    ref_losses, ref_final = train_peft(peft_model(base, cfg, initial, torch.float64), cfg, batches)
    assert_run_exact(ours, final, ref_losses, ref_final, initial, moved=1e-2)


@pytest.mark.float32_parity
@pytest.mark.parametrize("family", ["phi3", "gemma2"])
def test_lora_matches_peft_for_fused_projections_and_gemma(tmp_path, family):
    assert_lora_parity(run_both(tmp_path, family))


@pytest.mark.float32_parity
def test_rslora_with_some_projections_matches_peft(tmp_path):
    """use_rslora (scaling lora_alpha / sqrt(r)), r 8, adapters on q_proj, v_proj and down_proj only."""
    lora = {"r": 8, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    run = run_both(tmp_path, "llama", finetune={"method": "lora", "lora": lora})
    assert len(run.final) == 3 * 2 * 3  # 3 layers, 3 projections, A and B
    assert_lora_parity(run)


@pytest.mark.float32_parity
def test_lora_with_a_chunked_mlp_and_offloaded_inputs_matches_peft(tmp_path):
    """The MLP in chunks of 24 tokens (64 a step: three, the last short), its adapters' gradients summed over
    them, and the layer inputs through host memory."""
    assert_lora_parity(run_both(tmp_path, "qwen2", engine={"mlp_chunk_tokens": 24, "activation_offload": True}))


@pytest.mark.float32_parity
def test_lora_with_the_compiled_layer_matches_peft(tmp_path):
    """engine.compile: the decoder layer with its adapters through torch.compile (Inductor on the CPU), 8 steps.
    Inductor fuses the norms, RoPE and the adapters' casts and rounds them in another order, within the same
    measured float32 noise bound as the eager layer."""
    from torch._dynamo.utils import counters

    counters.clear()
    assert_lora_parity(run_both(tmp_path, "qwen2", engine={"compile": True}, train={"steps": 8}))
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"]


def test_lora_in_bf16_tracks_the_float32_peft_reference(tmp_path):
    """bf16 base and layer math (the GPU default), float32 adapters as peft keeps them, against peft in float32:
    bf16 rounds each activation to 3.9e-3 relative; measured: losses within 4.0e-5, adapters within 2.6e-2."""
    run = run_both(tmp_path, "qwen2", precision={"compute_dtype": "bfloat16"})
    # bf16's own rounding (2**-8), not float32's GEMM order: fixed bounds, 10x and 25x below what bf16 moves.
    for step, (a, b) in enumerate(zip(run.losses, run.reference.losses32)):
        assert abs(a - b) <= 1e-3 * abs(b), f"step {step}: loss {a} vs peft {b}"
    for name, value in run.final.items():
        err = relative_error(value, run.reference.state32[name])
        assert err <= 5e-2, f"{name}: relative error {err:.2e} from peft in float32"


@pytest.mark.float32_parity
def test_lora_with_modules_to_save_matches_peft(tmp_path):
    """modules_to_save [embed_tokens, lm_head] (untied Llama): both matrices train in full beside the adapters,
    from the base's values, in the same AdamW and global norm, as peft's ModulesToSaveWrapper copies."""
    lora = {"r": 4, "lora_alpha": 8, "modules_to_save": ["embed_tokens", "lm_head"]}
    run = run_both(tmp_path, "llama", finetune={"method": "lora", "lora": lora})
    assert {"base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"} <= set(run.final)
    assert_lora_parity(run)
    assert_base_untouched(run.base, run.base_after)  # the host's base stays as it was: the trained copies are apart


@pytest.mark.float32_parity
@pytest.mark.parametrize("mlp_chunk", [0, 24], ids=["whole", "mlp-chunks"])
def test_lora_dropout_matches_peft_given_the_same_masks(tmp_path, mlp_chunk):
    """lora_dropout 0.3: the reference is peft with each adapter's nn.Dropout replaced by one that applies the
    masks megatrain draws (model/lora.dropout_mask, from the run seed, the step and the layer; with the MLP in
    chunks of 24 tokens, each chunk's from its own seed): the masks are the only random part, the forward,
    backward and AdamW are peft's. A layer recomputed in the backward with other masks than its forward's would
    give other gradients, and the adapters would drift apart."""
    from megatrain_ray.model.layout import token_chunks
    from megatrain_ray.model.lora import dropout_mask, layer_dropout_seed

    base = make_base(tmp_path / "base", "llama")
    cfg = lora_config(tmp_path, base, finetune={"method": "lora", "lora": {"r": 4, "lora_alpha": 8,
                                                                             "lora_dropout": 0.3}},
                      engine={"mlp_chunk_tokens": mlp_chunk})
    with Trainer(cfg) as trainer:
        initial = trainer.adapters()
        batches = [trainer.data.tokens_of(s) for s in range(cfg.train.steps)]
        ours = [trainer.step(s)["loss"] for s in range(cfg.train.steps)]
        final = trainer.adapters()
    step = [0]

    class SameMasks(torch.nn.Module):
        def __init__(self, layer: int, module: str, p: float):
            super().__init__()
            self.layer, self.module, self.p = layer, module, p

        def forward(self, x):
            seed = layer_dropout_seed(cfg.train.seed, step[0] + 1, self.layer)  # AdamW's step: 1, 2, ...
            if not (mlp_chunk and self.module.startswith("mlp.")):
                return x * dropout_mask(x.shape, seed, self.module, self.p, x.device).to(x.dtype) / (1 - self.p)
            flat = x.reshape(-1, x.shape[-1])  # chunk k > 0 draws from seed * 131 + k
            keep = torch.cat([dropout_mask((part.stop - part.start, flat.shape[1]), seed * 131 + k if k else seed,
                                           self.module, self.p, x.device)
                              for k, part in enumerate(token_chunks(flat.shape[0], mlp_chunk))])
            return x * keep.view_as(x).to(x.dtype) / (1 - self.p)

    def peft_with_our_masks(dtype: torch.dtype) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = peft_model(base, cfg, initial, dtype)
        for name, module in model.named_modules():
            if hasattr(module, "lora_dropout") and "default" in getattr(module, "lora_dropout", {}):
                layer = int(name.split(".layers.")[1].split(".")[0])
                module.lora_dropout["default"] = SameMasks(layer, name.split(f".layers.{layer}.")[1], 0.3)
        o, s = cfg.optimizer, cfg.schedule
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                                foreach=False)
        ref_losses = []
        for step[0], tokens in enumerate(batches):
            for group in opt.param_groups:
                group["lr"] = reference_lr(step[0], o.lr, len(batches), s.warmup_steps, s.kind, s.min_lr_ratio)
            opt.zero_grad(set_to_none=True)
            logits = model(input_ids=tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(
                torch.promote_types(logits.dtype, torch.float32)), tokens[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
            opt.step()
            ref_losses.append(loss.item())
        return ref_losses, peft.get_peft_model_state_dict(model)

    reference = reference_in_both(peft_with_our_masks)
    assert_lora_parity(LoraRun(ours, initial, final, reference, base, {}))
    # The masks mattered: without dropout the same start trains to other losses.
    plain, _ = train_peft(peft_model(base, cfg, initial), cfg, batches)
    assert max(abs(a - b) / b for a, b in zip(ours[1:], plain[1:])) > 1e-4  # measured 8e-4


@pytest.mark.float32_parity
@pytest.mark.ray
def test_two_gpu_workers_train_the_adapters_of_one(tmp_path, ray_session):
    """Data parallel LoRA (parallel.gpus=2, gloo on the CPU): each rank computes its rows, the adapters'
    gradients are summed in one all-reduce and every rank takes the same step; the loss curve and adapters are
    peft's on the whole batch (the sum's order differs from one rank's: the same noise bound holds)."""
    assert_lora_parity(run_both(tmp_path, "qwen2", world=2, runtime={"mode": "ray"}, parallel={"gpus": 2}))


@pytest.mark.float32_parity
@pytest.mark.ray
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lora_matches_peft_through_ray(tmp_path, ray_session, family):
    run = run_both(tmp_path, family, runtime={"mode": "ray"}, host={"num_shards": 2})
    assert_lora_parity(run)
    assert_base_untouched(run.base, run.base_after)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of a run's metrics.jsonl."""
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def exported_adapter_logits(base: Path, adapter_dir: Path, ids: torch.Tensor, **hf_kwargs
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Load megatrain's PEFT export on the Hugging Face base as a user would, checking that peft's own model has
    exactly the saved adapter keys and that PeftModel.from_pretrained warns of no missing or unexpected key;
    returns the logits of `ids` with the adapters and without them (float32)."""
    def hf_base():
        return transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **hf_kwargs)
    fresh = peft.get_peft_model(hf_base(), peft.PeftConfig.from_pretrained(adapter_dir))
    result = peft.set_peft_model_state_dict(fresh, peft.utils.load_peft_weights(str(adapter_dir)))
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k], result
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(hf_base(), adapter_dir).eval()
    assert not [w for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    with torch.no_grad():
        theirs = model(ids).logits
        with model.disable_adapter():
            plain = model(ids).logits
    return theirs, plain
