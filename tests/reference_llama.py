"""An independent plain-PyTorch Llama-family model, the reference for training parity.

Written apart from megatrain_ray.model on purpose: nn.Linear/nn.Embedding modules, explicit
softmax attention with a -inf mask (no SDPA), RoPE through complex multiplication (the same
half-split pairing as Hugging Face checkpoints), a float32 RMSNorm. Parameter names are Hugging
Face's, so a megatrain state dict loads with `load_state_dict`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.reference_cache import ReferenceRuns


class RefRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = torch.promote_types(x.dtype, torch.float32)
        y = x.to(work)
        y = y / torch.sqrt(torch.mean(y * y, dim=-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rope_complex(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [B, H, T, D]; pairs (i, i + D/2) rotate by position * theta^(-2i/D)."""
    d = x.shape[-1]
    work = torch.promote_types(x.dtype, torch.float32)
    freqs = 1.0 / theta ** (torch.arange(0, d // 2, dtype=work, device=x.device) * 2 / d)
    angles = torch.arange(x.shape[2], dtype=work, device=x.device)[:, None] * freqs[None, :]
    rot = torch.polar(torch.ones_like(angles), angles)
    z = torch.complex(x[..., : d // 2].to(work), x[..., d // 2:].to(work)) * rot
    return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)


class RefAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, theta: float, bias: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, head_dim, theta
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope_complex(q, self.theta), rope_complex(k, self.theta)
        group = self.heads // self.kv_heads
        k = k[:, :, None].expand(b, self.kv_heads, group, t, self.head_dim).reshape(b, self.heads, t, self.head_dim)
        v = v[:, :, None].expand(b, self.kv_heads, group, t, self.head_dim).reshape(b, self.heads, t, self.head_dim)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
        out = (probs @ v).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self.o_proj(out)


class RefMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        return self.down_proj(gate * torch.sigmoid(gate) * self.up_proj(x))


class RefBlock(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        head_dim = c["hidden_size"] // c["num_attention_heads"]
        self.input_layernorm = RefRMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = RefAttention(c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], head_dim,
                                      c["rope_theta"], c.get("attention_bias", False))
        self.post_attention_layernorm = RefRMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = RefMLP(c["hidden_size"], c["intermediate_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class RefInner(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(RefBlock(c) for _ in range(c["num_layers"]))
        self.norm = RefRMSNorm(c["hidden_size"], c["rms_norm_eps"])


class RefLlama(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.model = RefInner(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        if c.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        work = torch.promote_types(logits.dtype, torch.float32)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(work), tokens[:, 1:].reshape(-1))


def config_of(m) -> dict:
    """The reference's config dict from a megatrain ModelConfig (only the fields it reads)."""
    return {"vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
            "num_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.num_key_value_heads, "rms_norm_eps": m.rms_norm_eps,
            "rope_theta": m.rope_theta, "tie_word_embeddings": m.tie_word_embeddings,
            "attention_bias": m.attention_bias}


def reference_lr(step: int, peak: float, total: int, warmup: int, kind: str, min_ratio: float) -> float:
    """Warmup then cosine/linear/constant, written out independently of megatrain_ray.optim.adamw."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    if kind == "constant":
        return peak
    frac = (step - warmup) / max(1, total - warmup)
    low = peak * min_ratio
    if kind == "linear":
        return low + (peak - low) * (1 - frac)
    return low + (peak - low) * (math.cos(math.pi * frac) + 1) / 2


def train_reference(c: dict, state: dict[str, torch.Tensor], batches: list[torch.Tensor], *, lr: float,
                    betas: tuple[float, float], eps: float, weight_decay: float, grad_clip: float,
                    warmup: int, kind: str, min_ratio: float, dtype: torch.dtype,
                    device: str = "cpu") -> tuple[list[float], dict]:
    """Train RefLlama with torch.optim.AdamW and clip_grad_norm_ on the given batches."""
    model = RefLlama(c).to(dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model = model.to(device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps, foreach=False)
    losses = []
    for step, tokens in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = reference_lr(step, lr, len(batches), warmup, kind, min_ratio)
        opt.zero_grad(set_to_none=True)
        loss = model.loss(tokens.to(device))
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def train_reference_like(cfg, state: dict[str, torch.Tensor], batches: list[torch.Tensor], dtype: torch.dtype,
                         device: str = "cpu") -> tuple[list[float], dict]:
    """train_reference with the model, optimizer and schedule settings of a megatrain Config; made once per distinct
    input (tests/reference_cache.py: the same reference serves the local and the Ray run, 1 or 3 workers)."""
    o, s = cfg.optimizer, cfg.schedule
    model = config_of(cfg.model)
    settings = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, grad_clip=o.grad_clip,
                    warmup=s.warmup_steps, kind=s.kind, min_ratio=s.min_lr_ratio, dtype=dtype, device=device)
    return _RUNS.get(lambda: train_reference(model, state, batches, **settings), model, settings, state, batches)


_RUNS = ReferenceRuns()
