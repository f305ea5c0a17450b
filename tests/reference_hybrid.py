"""transformers' Qwen3.5 text, Qwen3-Next and Qwen3.5-MoE text models as the references of the hybrid families'
tests: tiny random models with odd shapes, and the same models computing in float64 throughout.

transformers computes several steps in float32 whatever the model's dtype: the RoPE tables, the (1 + w) RMSNorms
(x.float()), the gated RMSNorm of the linear attention's output, its log-decay (A_log.float(), a.float()), the whole
chunked gated delta rule (torch_chunk_gated_delta_rule casts q, k, v, beta and g to float32) and the eager attention's
softmax. megatrain computes all of them in its compute dtype (float64 in the exact tests), so float64_hybrid makes the
reference do the same: the norms and tables written out as transformers writes them without the casts; the delta rule
(chunked, and the recurrent one its generation's decode steps run) and the GatedDeltaNet forward are transformers' own
source with its float32 casts turned into float64 ones (the number
of casts replaced is checked, so a transformers that changes them fails here, not silently); SDPA for the attention.
Left in float32 on both sides, as in tests/reference_hf.py: a MoE router's softmax and the load-balancing loss's sums.
"""

from __future__ import annotations

import copy
import inspect
import textwrap
import types

import torch

from tests.numerics import assert_within_noise
from tests.reference_hf import default_inv_freq64

transformers = __import__("transformers")

BASE = dict(vocab_size=128, hidden_size=72, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
            max_position_embeddings=256, rms_norm_eps=1e-6, pad_token_id=None, linear_conv_kernel_dim=4,
            linear_key_head_dim=12, linear_value_head_dim=10, linear_num_key_heads=2, linear_num_value_heads=4)
"""hidden 72 (no multiple of 64), GQA 4/2 in the attention layers and 2 key heads for 4 value heads in the linear
ones, head_dim 24 with a quarter rotated (6 dimensions), key and value heads of different widths (12 and 10)."""

HYBRIDS = {
    # dense: linear, full, linear
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        num_hidden_layers=3, intermediate_size=56, layer_types=["linear_attention", "full_attention",
                                                                "linear_attention"])),
    # Qwen3-Next's fused in_proj_qkvz / in_proj_ba; top-2 of 5 experts renormalised, a shared expert, layer 1 dense
    # (mlp_only_layers); tied head
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_hidden_layers=3, intermediate_size=40, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=20, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=True,
        layer_types=["linear_attention", "linear_attention", "full_attention"])),
    # every layer sparse, top-2 of 4 (always renormalised), a shared expert; full first
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=16, layer_types=["full_attention", "linear_attention"])),
}


def hf_hybrid_model(name: str, **overrides):
    """The tiny transformers model `name`, float32, its norms, biases and per-head parameters moved off their
    initial values (so that a template that skipped one would differ)."""
    config_cls, model_cls, extra = HYBRIDS[name]
    kwargs = {**BASE, **extra, **overrides}
    config = getattr(transformers, config_cls)(**kwargs, attn_implementation="eager", experts_implementation="eager") \
        if "num_experts" in kwargs else getattr(transformers, config_cls)(**kwargs, attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _recompiled(fn, replacements: dict[str, str], minimum: dict[str, int], namespace: dict):
    """`fn`'s own source (decorators dropped) with `replacements` made, compiled in `namespace`; each replaced string
    must occur at least `minimum` times."""
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("def "))
    source = "\n".join(lines[start:])
    for old, new in replacements.items():
        assert source.count(old) >= minimum[old], (fn.__qualname__, old, source.count(old))
        source = source.replace(old, new)
    scope: dict = {}
    exec(compile(source, f"<float64 {fn.__qualname__}>", "exec"), namespace, scope)
    return next(iter(scope.values()))


def _rope_forward(self, x, position_ids):
    """The RoPE tables in float64 for float64 inputs: Qwen3.5's text positions repeat one row for its three
    multimodal grids, which makes its interleaved sections the plain tables."""
    if x.dtype != torch.float64:
        return type(self).forward(self, x, position_ids)
    if position_ids.ndim == 3:
        assert all(torch.equal(position_ids[0], p) for p in position_ids), "text positions: the grids are equal"
        position_ids = position_ids[0]
    params = self.config.rope_parameters
    inv_freq = default_inv_freq64(params["rope_theta"], self.inv_freq)
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
    theirs = type(self).forward(self, x.float(), position_ids[None].expand(3, -1, -1)
                                if type(self).__name__.startswith("Qwen3_5") else position_ids)
    # The same tables: ours rounded to float32 within the noise of transformers' float32 ones against ours
    assert_within_noise("RoPE cos table", cos.float(), theirs[0], cos)
    return cos, sin


def _norm_forward(self, x):
    """transformers' (1 + w) RMSNorm without its cast to float32."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _gated_norm_forward(self, x, gate):
    """transformers' gated RMSNorm without its casts to float32."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x * torch.nn.functional.silu(gate)


def float64_hybrid(model):
    """A float64 copy of `model` computing in float64 throughout (the module docstring), and SDPA attention."""
    model = copy.deepcopy(model).to(torch.float64).eval()
    model.set_attn_implementation("sdpa")
    deltanets = 0
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("TextRotaryEmbedding") or name == "Qwen3NextRotaryEmbedding":
            module.forward = types.MethodType(_rope_forward, module)
        elif name.endswith("RMSNormGated"):
            module.forward = types.MethodType(_gated_norm_forward, module)
        elif name.endswith("RMSNorm"):
            module.forward = types.MethodType(_norm_forward, module)
        elif name.endswith("GatedDeltaNet"):
            namespace = inspect.unwrap(type(module).forward).__globals__  # the module its forward was written in
            rules = {name: _recompiled(namespace[name], {"torch.float32": "torch.float64"}, {"torch.float32": 1},
                                       namespace)
                     for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")}
            forward = _recompiled(type(module).forward, {".float()": ".double()"}, {".float()": 2},
                                  {**namespace, **rules})
            module.forward = types.MethodType(forward, module)
            deltanets += 1
    assert deltanets, "no GatedDeltaNet module"
    return model
