"""transformers' DeepSeek-V3 and GLM-4.5 MoE as the references of the deepseek_v3 and glm4_moe templates' tests: tiny
random models with odd shapes, and the same models computing in float64 throughout.

transformers computes in float32 whatever the model's dtype: the RoPE tables, the RMSNorms (x.to(float32)) and the
router (its logits from the rows and weight cast to float32, the sigmoid, the top-k weights). megatrain computes them
in its compute dtype (float64 in the exact tests), so float64_deepseek makes the reference do the same: the norms and
tables written out as transformers writes them without the casts (YaRN's inverse frequencies too, checked against
transformers' own), the router transformers' own source with its float32 casts turned into float64 ones (the number
of casts replaced is checked); SDPA for the attention.
"""

from __future__ import annotations

import copy
import math
import types

import torch

from tests.reference_hybrid import _recompiled

transformers = __import__("transformers")

BASE = dict(vocab_size=128, hidden_size=72, intermediate_size=56, moe_intermediate_size=20, num_hidden_layers=3,
            num_attention_heads=3, num_key_value_heads=3, n_shared_experts=2, n_routed_experts=10,
            num_experts_per_tok=3, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=24, q_lora_rank=40,
            qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=14, routed_scaling_factor=1.7, norm_topk_prob=True,
            max_position_embeddings=256, rms_norm_eps=1e-5, pad_token_id=None, num_nextn_predict_layers=0)
"""hidden 72 (no multiple of 64), 3 heads of q.k width 20 (12 unrotated + 8 rotated) and value width 14, a 24-wide
latent, a rank-40 query; 10 experts (no power of two) in 2 groups of 5 of which a token takes 1, top-3, 2 shared
experts, one dense first layer then 2 MoE layers; rms_norm_eps 1e-5 (the latent norms keep their 1e-6)."""

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.7}
"""YaRN with DeepSeek's mscale and mscale_all_dim unequal (so the cos/sin factor is not 1) and the softmax scale's
mscale(4, 0.7) ** 2. Its ramp over the 4 rotated frequencies runs from dimension 1 to 3 (truncated): the values
(i - 1) / 2 are exact in float32, so transformers' float32 ramp is the float64 one."""

DEEPSEEKS = {
    # the low-rank query, interleaved RoPE (DeepSeek's checkpoints)
    "deepseek_v3": dict(rope_interleave=True),
    # one q_proj (q_lora_rank null), RoPE by halves, no renormalisation of the top-k, 3 dense layers of 4 ... one
    "deepseek_v3_q_proj": dict(q_lora_rank=None, rope_interleave=False, norm_topk_prob=False, num_hidden_layers=2),
    # YaRN with mscale; every expert group open to a token (topk_group = n_group)
    "deepseek_v3_yarn": dict(rope_parameters=YARN, topk_group=2, first_k_dense_replace=0, num_hidden_layers=2,
                             max_position_embeddings=16384),
}


GLM_BASE = dict(vocab_size=128, hidden_size=72, intermediate_size=56, moe_intermediate_size=20, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=20, n_shared_experts=2, n_routed_experts=10,
                num_experts_per_tok=3, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.7,
                norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-5, pad_token_id=None,
                attention_bias=True, num_nextn_predict_layers=0)
"""GLM-4.5 MoE's: GQA 4/2 with head_dim 20 (Glm4MoeConfig's partial rotary factor 0.5: 10 dimensions rotated), qkv
biases, the same experts, groups and router as BASE."""

GLMS = {
    "glm4_moe": dict(use_qk_norm=True),  # q/k norms (GLM-4.5's); GLM-4.5-Air has none
    "glm4_moe_no_qk_norm": dict(use_qk_norm=False, topk_group=2, norm_topk_prob=False),
}


def hf_deepseek_model(name: str, **overrides):
    """The tiny transformers model `name` (of DEEPSEEKS or GLMS), float32, its norms and biases moved off their initial
    values and its routing bias drawn (so that a template that skipped one would differ)."""
    if name in GLMS:
        config = transformers.Glm4MoeConfig(**{**GLM_BASE, **GLMS[name], **overrides}, attn_implementation="eager",
                                            experts_implementation="eager")
        model_cls = transformers.Glm4MoeForCausalLM
    else:
        config = transformers.DeepseekV3Config(**{**BASE, **DEEPSEEKS[name], **overrides},
                                               attn_implementation="eager", experts_implementation="eager")
        model_cls = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
        for pname, b in model.named_buffers():
            if pname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return model


def _yarn_inv_freq64(params: dict, dim: int) -> torch.Tensor:
    """YaRN's inverse frequencies (transformers' _compute_yarn_parameters) in float64."""
    base, factor = params["rope_theta"], params["factor"]
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float64) / dim)

    def correction(rotations: float) -> float:
        return dim * math.log(params["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (
            2 * math.log(base))
    low = max(math.floor(correction(params.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction(params.get("beta_slow", 1))), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return 1.0 / (factor * pos) * (1 - keep) + 1.0 / pos * keep


def _rope_forward(self, x, position_ids):
    """The RoPE tables in float64 for float64 inputs (default or YaRN), their inverse frequencies checked against
    transformers' float32 ones."""
    if x.dtype != torch.float64:
        return type(self).forward(self, x, position_ids)
    params, dim = self.config.rope_parameters, 2 * self.inv_freq.numel()
    if params["rope_type"] == "yarn":
        inv_freq = _yarn_inv_freq64(params, dim)
    else:
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float64) / dim))
    torch.testing.assert_close(inv_freq, self.inv_freq.to(torch.float64), rtol=4 * torch.finfo(torch.float32).eps,
                               atol=0)
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def _norm_forward(self, x):
    """transformers' RMSNorm without its cast to float32."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def float64_deepseek(model):
    """A float64 copy of `model` computing in float64 throughout (the module docstring), and SDPA attention."""
    model = copy.deepcopy(model).to(torch.float64).eval()
    model.set_attn_implementation("sdpa")
    routers = 0
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RotaryEmbedding"):
            module.forward = types.MethodType(_rope_forward, module)
        elif name.endswith("RMSNorm"):
            module.forward = types.MethodType(_norm_forward, module)
        elif name.endswith("TopkRouter"):
            namespace = type(module).forward.__globals__
            forward = _recompiled(type(module).forward, {"torch.float32": "torch.float64"}, {"torch.float32": 2},
                                  namespace)
            module.forward = types.MethodType(forward, module)
            routers += 1
    assert routers == sum(1 for layer in model.model.layers if hasattr(layer.mlp, "gate"))
    return model
