"""Mixture-of-experts layers: the router, the experts and their tensors, as stateless functions.

The second half of a MoE decoder layer (Qwen3-MoE, Mixtral, gpt-oss), following each family's Hugging Face
modeling file operation by operation:
- Qwen3-MoE: softmax over the router's logits (float32), top-k, renormalised when norm_topk_prob, cast
  back to the model's dtype; experts are SwiGLU MLPs.
- Mixtral: the same with renormalisation always on and the routing weights kept in float32.
- Qwen3-Next and Qwen3.5-MoE: Qwen3-MoE's router (Qwen3.5-MoE: always renormalised) and experts, plus a shared
  SwiGLU expert every token passes through, scaled by sigmoid(shared_expert_gate(x)).
- DeepSeek-V3: sigmoid scores with a bias-corrected, group-limited top-k (model/sigmoid_router.py), SwiGLU experts,
  and shared experts (mlp.shared_experts, one SwiGLU MLP of n_shared_experts x the expert width, no gate) every token
  passes through.
- gpt-oss: the router has a bias; top-k over the logits, softmax over those k; experts have biases, their
  gate and up columns interleaved, and a clamped SwiGLU: (clamp(up) + 1) * g * sigmoid(alpha * g) with
  g = min(gate, limit).

The experts stay fused per layer as transformers 5 keeps them (`mlp.experts.gate_up_proj` [E, ...] and
`mlp.experts.down_proj`), so each is one tensor of the stage's flat buffer and takes one AdamW update. An
expert that received no token in a step gets a zero gradient and a normal AdamW step (its moments decay,
weight decay applies), exactly as transformers 5's fused parameters do under torch.optim.AdamW. Its zero
gradient is not copied to the host (idle_expert_spans; the update dispatcher zeroes the host span).

Expert compute: the token-expert pairs are sorted by expert (a stable sort, so each expert sees its tokens
in order), each expert multiplies its rows, the outputs are weighted and summed per token (gathers by the sort's
permutation and its inverse, forward and backward, so no index_add_ adds rows one by one with atomics). On CUDA in
bfloat16 with sm90 the expert products go through torch._grouped_mm (one kernel per product for all
experts); elsewhere a loop over the experts that received tokens. An expert tensor bound packed (a rollout's decode
step over an NF4 base: quant/nf4_triton.NF4Experts, anything with products(rows, ends, transposed)) computes its
own products from the sorted rows and the cumulative ends, reading only the experts that have rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping

import torch
import torch.nn.functional as F

from megatrain_ray.config.generic_shape import expert_fractions
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.model.sigmoid_router import sigmoid_route

RouterKind = Literal["softmax_topk", "topk_softmax", "sigmoid_group"]


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """The static facts of a MoE layer's MLP half (derived from ModelConfig)."""

    num_experts: int
    top_k: int
    router: RouterKind
    """softmax_topk: softmax over all logits, then top-k (Qwen3-MoE, Mixtral); topk_softmax: top-k over the
    logits, softmax over those (gpt-oss); sigmoid_group: DeepSeek-V3's (model/sigmoid_router.py)."""
    norm_topk_prob: bool
    float32_weights: bool = False
    """Mixtral: the routing weights stay float32 (the expert outputs are multiplied by them, then cast)."""
    swiglu_limit: float = 0.0
    """gpt-oss's clamped SwiGLU (0: the plain one)."""
    swiglu_alpha: float = 0.0
    shared_expert: bool = False
    """Qwen3-Next, Qwen3.5-MoE: a shared expert (mlp.shared_expert.*) gated by sigmoid(mlp.shared_expert_gate(x))."""
    shared_experts: bool = False
    """DeepSeek-V3: shared experts (mlp.shared_experts.*), added without a gate."""
    n_group: int = 1
    """sigmoid_group: the expert groups, and those a token chooses from (topk_group); the factor on the weights."""
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "MoeSpec":
        router = cfg.sigmoid_router
        if router is not None:  # the weights stay float32 (float64), as transformers multiplies the outputs by them
            return cls(cfg.num_experts, cfg.num_experts_per_tok, "sigmoid_group", cfg.norm_topk_prob,
                       float32_weights=True, shared_experts=True, n_group=router.n_group,
                       topk_group=router.topk_group, routed_scaling_factor=router.routed_scaling_factor)
        if cfg.family == "gpt_oss":
            return cls(cfg.num_experts, cfg.num_experts_per_tok, "topk_softmax", False,
                       swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha)
        return cls(cfg.num_experts, cfg.num_experts_per_tok, "softmax_topk",
                   cfg.norm_topk_prob or cfg.family in ("mixtral", "qwen3_5_moe"),
                   float32_weights=cfg.family == "mixtral", shared_expert=cfg.shared_expert_intermediate_size > 0)

    @property
    def gpt_oss(self) -> bool:
        return self.swiglu_limit > 0


def moe_mlp_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """The tensors of a MoE layer's MLP half (besides its norm), by Hugging Face's in-memory names."""
    e, h, f = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
    if cfg.family == "gpt_oss":  # gate_up [E, hidden, 2f] with gate and up columns interleaved
        return [("mlp.router.weight", (e, h), "normal"), ("mlp.router.bias", (e,), "normal"),
                ("mlp.experts.gate_up_proj", (e, h, 2 * f), "normal"),
                ("mlp.experts.gate_up_proj_bias", (e, 2 * f), "zeros"),
                ("mlp.experts.down_proj", (e, f, h), "normal"), ("mlp.experts.down_proj_bias", (e, h), "zeros")]
    tensors = [("mlp.gate.weight", (e, h), "normal"), ("mlp.experts.gate_up_proj", (e, 2 * f, h), "normal"),
               ("mlp.experts.down_proj", (e, h, f), "normal")]
    if cfg.sigmoid_router is not None:  # DeepSeek-V3: the routing bias (never trained) and the ungated shared experts
        s = cfg.shared_expert_intermediate_size
        return [*tensors, ("mlp.gate.e_score_correction_bias", (e,), "zeros"),
                ("mlp.shared_experts.gate_proj.weight", (s, h), "normal"),
                ("mlp.shared_experts.up_proj.weight", (s, h), "normal"),
                ("mlp.shared_experts.down_proj.weight", (h, s), "normal")]
    if cfg.shared_expert_intermediate_size:
        s = cfg.shared_expert_intermediate_size
        tensors += [("mlp.shared_expert.gate_proj.weight", (s, h), "normal"),
                    ("mlp.shared_expert.up_proj.weight", (s, h), "normal"),
                    ("mlp.shared_expert.down_proj.weight", (h, s), "normal"),
                    ("mlp.shared_expert_gate.weight", (1, h), "normal")]
    return tensors


def active_fraction(cfg: ModelConfig, name: str) -> float:
    """The share of tensor `name` (a layer's, by its name in the stage) that one token uses: top-k of the
    experts for the fused expert tensors, all of any other tensor. A generic model's expert tensors are found in
    its transformers model (config/generic_shape.expert_fractions)."""
    if cfg.template == "generic" and cfg.path:
        return expert_fractions(str(Path(cfg.path).resolve())).get(name, 1.0)
    return cfg.num_experts_per_tok / cfg.num_experts if cfg.is_moe and name.startswith("mlp.experts.") else 1.0


def moe_pair_width(cfg: ModelConfig) -> int:
    """Elements per token of a MoE layer's token-expert pairs at one width each: each token is routed k times,
    each pair has a row of the expert's width (its intermediates) and one of the hidden size (its gathered input
    and its output); 0 for a dense model. The memory plan counts its tensors in these (planning/gpu_memory)."""
    if not cfg.is_moe:
        return 0
    return cfg.num_experts_per_tok * (cfg.expert_intermediate_size + cfg.hidden_size)


def idle_expert_spans(stage_slots, counts: list[int]) -> list[tuple[int, int]]:
    """[start, end) element spans of a layer's flat buffer that hold the fused expert tensors of the experts
    with no token (counts[e] == 0), adjacent ones merged: their gradient is zero, so the engine copies no
    byte of it to the host (the host span is zeroed there instead)."""
    spans: list[tuple[int, int]] = []
    for slot in stage_slots:
        if not slot.name.startswith("mlp.experts."):
            continue
        per_expert = slot.numel // len(counts)
        for e, n in enumerate(counts):
            if n == 0:
                a = slot.offset + e * per_expert
                if spans and spans[-1][1] == a:
                    spans[-1] = (spans[-1][0], a + per_expert)
                else:
                    spans.append((a, a + per_expert))
    return spans


def expert_numel(stage_slots) -> int:
    """Elements of a layer's fused expert tensors (0 for a dense layer)."""
    return sum(s.numel for s in stage_slots if s.name.startswith("mlp.experts."))


# ----------------------------------------------------------------------------- router


class RouterRecord:
    """What one MoE layer's router did in a pass, for the load-balancing loss: top-k assignments per
    expert (no gradient) and the sum over tokens of its softmax probabilities (with autograd in the
    recompute). Added to over the chunks of a chunked MLP."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None
        self.prob_sum: torch.Tensor | None = None
        self.rows = 0

    def add(self, counts: torch.Tensor, prob_sum: torch.Tensor, rows: int) -> None:
        self.counts = counts if self.counts is None else self.counts + counts
        self.prob_sum = prob_sum if self.prob_sum is None else self.prob_sum + prob_sum
        self.rows += rows


def route(h: torch.Tensor, w: Mapping[str, torch.Tensor], spec: MoeSpec,
          record: RouterRecord | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, k] and expert indices [T, k] of the rows h [T, hidden]."""
    if spec.router == "sigmoid_group":
        return sigmoid_route(h, w, spec, record)
    if spec.gpt_oss:
        logits = F.linear(h, w["mlp.router.weight"], w["mlp.router.bias"])
        top, index = torch.topk(logits, spec.top_k, dim=-1)
        weights = F.softmax(top, dim=1, dtype=top.dtype)
    else:
        logits = F.linear(h, w["mlp.gate.weight"])
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not spec.float32_weights:
            weights = weights.to(logits.dtype)
    if record is not None:
        # As transformers' load_balancing_loss_func: softmax over every logit in their dtype, summed in float32;
        # its top-k picks the experts the routing picked.
        flat = index.reshape(-1)  # index_add_, not bincount: a fixed shape, which torch.compile can trace
        counts = torch.zeros(spec.num_experts, dtype=torch.float32, device=h.device).index_add_(
            0, flat, torch.ones(flat.shape, dtype=torch.float32, device=h.device))
        record.add(counts, F.softmax(logits, dim=-1).float().sum(0), h.shape[0])
    return weights, index


# ----------------------------------------------------------------------------- experts


def grouped_mm_usable(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """torch._grouped_mm: CUDA, bfloat16, compute capability 9.0 or later, and every stride a multiple of 16
    bytes (its TMA loads; an unaligned stride would be refused), i.e. the widths multiples of 8."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and all(n % 8 == 0 for t in (x, *weights) for n in t.shape[1:]))


def _packed(weight) -> bool:
    """An expert tensor left in a packed format on the device (quant/nf4_triton.NF4Experts, bound for a rollout's
    decode step): it computes its own products from the offsets, reading only the experts that have rows."""
    return not isinstance(weight, torch.Tensor)


def _expert_products(rows: torch.Tensor, weight, counts: list[int], offsets: torch.Tensor,
                     transposed: bool) -> torch.Tensor:
    """Each expert's rows times its matrix: rows [N, in] sorted by expert, weight [E, out, in] (or [E, in,
    out] when `transposed`, gpt-oss) or a packed expert tensor (`_packed`); returns [N, out]."""
    if _packed(weight):
        return weight.products(rows, offsets, transposed)
    if grouped_mm_usable(rows, weight):
        mat = weight if transposed else weight.transpose(-2, -1)
        return torch._grouped_mm(rows, mat, offs=offsets)
    out_width = weight.shape[-1] if transposed else weight.shape[-2]
    out = rows.new_empty(rows.shape[0], out_width)
    # unbind, not weight[e]: its backward stacks the experts' gradients into one tensor (zeros for the experts
    # without rows), where each weight[e] would allocate and add a zero-filled gradient of the whole tensor.
    per_expert = weight.unbind(0)
    start = 0
    for e, n in enumerate(counts):
        if n:
            part = rows[start:start + n]
            out[start:start + n] = part @ per_expert[e] if transposed else F.linear(part, per_expert[e])
        start += n
    return out


def _swiglu(gate_up: torch.Tensor, spec: MoeSpec) -> torch.Tensor:
    if spec.gpt_oss:  # interleaved columns, clamped, (up + 1) * gate * sigmoid(alpha * gate)
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=spec.swiglu_limit)
        up = up.clamp(min=-spec.swiglu_limit, max=spec.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * spec.swiglu_alpha))
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class _Dispatch(torch.autograd.Function):
    """rows = h[token_of]: each token's row once per pair, in the experts' order. Backward without atomics:
    the pairs' gradients put back in token order (a gather by the inverse permutation), summed over the k."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, token_of: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return h.index_select(0, token_of)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        pairs = grad.index_select(0, inverse)
        return pairs.view(-1, ctx.k, pairs.shape[-1]).sum(1), None, None, None


class _Combine(torch.autograd.Function):
    """out[t] = sum of token t's k pair rows of y (in the experts' order): a gather by the inverse permutation
    and a sum over k, where index_add_ would add them one by one with atomics. Backward: each pair row takes
    its token's gradient (a gather)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, token_of: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(token_of)
        pairs = y.index_select(0, inverse)
        return pairs.view(-1, k, pairs.shape[-1]).sum(1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (token_of,) = ctx.saved_tensors
        return grad.index_select(0, token_of), None, None, None


def experts(h: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, w: Mapping[str, torch.Tensor],
            spec: MoeSpec) -> torch.Tensor:
    """The weighted sum of each row's k experts: h [T, hidden], weights and index [T, k].

    The routing weight multiplies the expert's SwiGLU output before the down projection where the weights are
    in the rows' dtype and the expert has no output bias (Qwen3-MoE): the same sum as weighting the output, on
    rows of the expert's width instead of the hidden size. Mixtral (float32 weights) and gpt-oss (output bias)
    weight the output, as transformers does."""
    tokens, k = index.shape
    flat_expert = index.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    token_of = order // k  # pair p = t * k + j belongs to token t
    sorted_expert = flat_expert[order]
    # Cumulative rows per expert from the sorted experts: a fixed-shape result (bincount's shape depends on the
    # data, which torch.compile cannot trace), and no atomics.
    ends = torch.searchsorted(sorted_expert, torch.arange(spec.num_experts, device=h.device), right=True)
    offsets = ends.to(torch.int32)
    gate_up_w, down_w = w["mlp.experts.gate_up_proj"], w["mlp.experts.down_proj"]
    grouped = (_packed(gate_up_w) and _packed(down_w)) or grouped_mm_usable(h, gate_up_w, down_w)
    # The loop needs the counts on the host (a device sync); the grouped products and packed experts take offsets.
    counts = [] if grouped else torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    rows = _Dispatch.apply(h, token_of, inverse, k)
    gate_up = _expert_products(rows, gate_up_w, counts, offsets, spec.gpt_oss)
    if spec.gpt_oss:
        gate_up = gate_up + w["mlp.experts.gate_up_proj_bias"][sorted_expert]
    act = _swiglu(gate_up, spec)
    pair_weights = weights.reshape(-1)[order, None]
    weight_first = not spec.gpt_oss and pair_weights.dtype == act.dtype
    if weight_first:
        act = act * pair_weights
    out = _expert_products(act, down_w, counts, offsets, spec.gpt_oss)
    if spec.gpt_oss:
        out = out + w["mlp.experts.down_proj_bias"][sorted_expert]
    if not weight_first:
        out = (out * pair_weights).to(h.dtype)
    return _Combine.apply(out, token_of, inverse, k)


def moe_mlp(h: torch.Tensor, w: Mapping[str, torch.Tensor], spec: MoeSpec,
            record: RouterRecord | None = None, proj=None) -> torch.Tensor:
    """The MoE MLP of normed rows h [..., hidden] (the layer's residual add is the caller's). `proj`: how the shared
    expert's projections are computed (model/lora.projection: with their LoRA adapters where bound; default the
    plain matrix products)."""
    shape = h.shape
    flat = h.reshape(-1, shape[-1])
    weights, index = route(flat, w, spec, record)
    out = experts(flat, weights, index, w, spec)
    if spec.shared_expert:  # as transformers: the routed sum plus sigmoid(gate(x)) * the shared SwiGLU expert
        proj = proj or (lambda x, module: F.linear(x, w[f"{module}.weight"]))
        gated = F.silu(proj(flat, "mlp.shared_expert.gate_proj")) * proj(flat, "mlp.shared_expert.up_proj")
        shared = proj(gated, "mlp.shared_expert.down_proj")
        out = out + torch.sigmoid(proj(flat, "mlp.shared_expert_gate")) * shared
    if spec.shared_experts:  # DeepSeek-V3: the routed sum plus the shared SwiGLU experts, no gate
        gated = F.silu(F.linear(flat, w["mlp.shared_experts.gate_proj.weight"])) \
            * F.linear(flat, w["mlp.shared_experts.up_proj.weight"])
        out = out + F.linear(gated, w["mlp.shared_experts.down_proj.weight"])
    return out.view(shape)


def load_balancing_loss(records: list[RouterRecord], num_experts: int,
                        coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' load_balancing_loss_func over the MoE layers' records (no attention mask): f_e, the
    top-k assignments to expert e over all layers and rows divided by the rows, and P_e, the mean router
    probability over all layers and rows; the loss is E * sum_e f_e P_e. Returns (loss, coef * d loss / d prob_sum),
    the latter the same [E] vector for every layer's prob_sum (f has no gradient), formed in the order of float32
    operations transformers' backward takes through coef * aux (((coef E) f) / rows), so that it rounds alike."""
    rows = sum(r.rows for r in records)
    f = sum(r.counts for r in records) / rows
    p = sum(r.prob_sum.detach() for r in records) / rows
    coef_grad = torch.full((), coef, dtype=torch.float32, device=f.device) * num_experts * f / rows
    return num_experts * (f * p).sum(), coef_grad
