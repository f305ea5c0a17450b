"""A Hugging Face model trained as megatrain is configured: the reference of the families' parity tests."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from tests.conftest import one_thread
from tests.reference_cache import ReferenceRuns
from tests.reference_llama import reference_lr


def _inv_freq_in_float64(params: dict, dim: int, long: bool) -> torch.Tensor:
    """Inverse frequencies of transformers' default, linear and LongRoPE (Phi-3) RoPE, its formulas in float64
    (transformers: float32)."""
    rope_type = params["rope_type"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float64) / dim
    if rope_type == "longrope":
        factors = torch.tensor(params["long_factor"] if long else params["short_factor"], dtype=torch.float64)
        return 1.0 / (factors * params["rope_theta"] ** exponents)
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"]
    assert rope_type == "default", f"no float64 RoPE for rope_type {rope_type}"
    return inv_freq


def _rope_in_float64(module) -> None:
    """`module` (a model's rotary embedding) computes its cos and sin tables in float64 for float64 inputs: the
    same formulas, the same choice of LongRoPE's long or short factors, the same attention scaling; transformers
    itself computes them in float32 whatever the model's dtype. Checked against transformers' own frequencies."""
    eager, config = module.forward, module.config

    def forward(x, position_ids, layer_type=None):
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        tables = eager(x, position_ids, **kwargs)  # updates LongRoPE's inverse frequencies as transformers does
        if x.dtype != torch.float64:
            return tables
        prefix = "" if layer_type is None else f"{layer_type}_"
        params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
        theirs = getattr(module, f"{prefix}inv_freq")
        long = int(position_ids.max()) + 1 > params.get("original_max_position_embeddings", float("inf"))
        inv_freq = _inv_freq_in_float64(params, 2 * theirs.numel(), long).to(x.device)
        torch.testing.assert_close(inv_freq, theirs.to(torch.float64), rtol=1e-5, atol=0)
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = getattr(module, f"{prefix}attention_scaling")
        return emb.cos() * scaling, emb.sin() * scaling

    module.forward = forward


def _rms_norm_in_float64(module) -> None:
    """`module` (an RMSNorm) as transformers writes it, without its cast of the input to float32."""
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    plus_one = type(module).__name__.startswith("Gemma")  # Gemma: x * (1 + weight)

    def forward(x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return normed * ((1.0 + module.weight) if plus_one else module.weight)

    module.forward = forward


def default_inv_freq64(theta: float, theirs: torch.Tensor) -> torch.Tensor:
    """RoPE's default inverse frequencies in float64 for transformers' float32 `theirs` (dim = 2 x its length),
    checked against them: an elementwise float32 pow, no GEMM, so within 0.62 float32 ulps on any CPU (measured,
    theta 1e4 to 1e7); 4 ulps allowed."""
    dim = 2 * theirs.numel()
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float64) / dim))
    torch.testing.assert_close(inv_freq, theirs.to(torch.float64), rtol=4 * torch.finfo(torch.float32).eps, atol=0)
    return inv_freq.to(theirs.device)


def float64_throughout(model) -> None:
    """What transformers computes in float32 even in a float64 model, in float64 as megatrain does in its compute
    dtype: the RoPE tables, the RMSNorms (Llama's style and Gemma's) and the attention's softmax (transformers'
    eager attention: float32; PyTorch's SDPA computes in the inputs' dtype). Left in float32, as megatrain leaves
    them: the softmax of a soft-capped attention (Gemma 2 and 3: no SDPA path), a MoE router's softmax and the
    load-balancing loss's sums. Default, linear and LongRoPE tables only (gpt-oss's YaRN and attention sinks are
    not done: its tests compare it with transformers as it is)."""
    if not getattr(model.config, "attn_logit_softcapping", None):
        model.set_attn_implementation("sdpa")
    rotary = 0
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RotaryEmbedding"):
            _rope_in_float64(module)
            rotary += 1
        elif name.endswith("RMSNorm"):
            _rms_norm_in_float64(module)
    assert rotary, "no rotary embedding module"


def train_hf(model, cfg, state: dict[str, torch.Tensor], batches: list[torch.Tensor],
             dtype: torch.dtype, aux: bool = False, exact: bool = False,
             runs: ReferenceRuns | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The Hugging Face model itself, trained with torch.optim.AdamW and clip_grad_norm_ as megatrain is
    configured (lr schedule, betas, eps, weight decay on matrices only, clipping); with `aux` (a mixture of
    experts), the loss adds router_aux_loss_coef * the aux_loss transformers computes. With `exact`, a float64
    model is float64 throughout (float64_throughout): the float64 twin of a float32 run, whose difference from
    it is then all of float32's rounding. On one thread (tests.conftest.one_thread: a tiny model's ops).
    `runs`: where a module keeps the runs made (by the content of all they read: the model's class, config and
    tensors, the settings, weights and batches), for a module whose models and their classes are not patched."""
    def train() -> tuple[list[float], dict[str, torch.Tensor]]:
        with one_thread():
            return _train_hf(model, cfg, state, batches, dtype, aux, exact)
    if runs is None:
        return train()
    o, s = cfg.optimizer, cfg.schedule
    settings = (o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.grad_clip, s.warmup_steps, s.kind, s.min_lr_ratio)
    return runs.get(train, type(model).__qualname__, model.config.to_json_string(), model.state_dict(), settings,
                    state, batches, dtype, aux, exact)


def _train_hf(model, cfg, state, batches, dtype, aux, exact):
    model = copy.deepcopy(model).to(dtype).train()
    if exact and dtype == torch.float64:
        float64_throughout(model)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()  # the embedding itself (Gemma)
    assert set(missing) <= tied and not unexpected, (missing, unexpected)
    if tied:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    o, s = cfg.optimizer, cfg.schedule
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
    losses = []
    for step, tokens in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = reference_lr(step, o.lr, len(batches), s.warmup_steps, s.kind, s.min_lr_ratio)
        opt.zero_grad(set_to_none=True)
        out = model(tokens[:, :-1], output_router_logits=True) if aux else model(tokens[:, :-1])
        logits = out.logits
        work = torch.promote_types(logits.dtype, torch.float32)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(work), tokens[:, 1:].reshape(-1))
        if aux:
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_export_and_reload(cfg, model, ids: torch.Tensor, out_dir):
    """The HF round trip of a parity test: megatrain imports `model`'s directory (every tensor it holds equal to
    the model's), trains cfg.train.steps (every tensor moves), gives its logits on `ids`, and exports to `out_dir`;
    transformers loads the export with no missing, unexpected or mismatched key, as the same class. Returns (our
    float32 logits, the loaded model)."""
    import transformers

    from megatrain_ray.driver.trainer import Trainer

    with Trainer(cfg) as trainer:
        initial = trainer.master_weights()
        for key, value in model.state_dict().items():
            if key in initial:
                assert torch.equal(initial[key], value), key
        trainer.train()
        moved = trainer.master_weights()
        assert all(not torch.equal(moved[k], initial[k]) for k in moved)
        ours = trainer.logits(ids)
        trainer.export(out_dir)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                                    output_loading_info=True,
                                                                    experts_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(loaded) is type(model)
    return ours, loaded
