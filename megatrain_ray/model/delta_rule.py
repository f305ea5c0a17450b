"""The gated delta rule in chunks (Gated DeltaNet, Qwen3-Next and Qwen3.5's linear attention), in plain torch.

Per value head, with a state S [d_k, d_v] that starts at zero for every row (training: no cache):
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t
q and k L2-normalised, q scaled by d_k ** -0.5. Token by token that is a loop of T small products; here, as
transformers' torch_chunk_gated_delta_rule (and FLA's kernel) compute it, the sequence is cut into chunks of 64
tokens: inside a chunk the updates fold into a unit lower-triangular system (the UT transform, two triangular
solves) and matrix products, and only the chunk boundaries pass the state on, so the loop runs T / 64 times. The
operations are transformers' in its order (float32 inside, float64 when the engine computes in it), so the results
agree to rounding; autograd differentiates them (the engine's backward recomputes the layer as any other).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain_ray.model.norms import norm_dtype

CHUNK = 64
"""Tokens per chunk, transformers' and FLA's default."""
L2_EPS = 1e-6
"""Inside the L2 norm of q and k: x * rsqrt(sum(x^2) + eps), as transformers' l2norm (FLA's)."""


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def unit_queries_keys(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k L2-normalised along their last dimension, q then scaled by d_k ** -0.5."""
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           chunk: int = CHUNK, final_state: bool = False):
    """The gated delta rule's output [B, T, H_v, d_v] in v's dtype, from q and k [B, T, H_k, d_k], v [B, T, H_v, d_v],
    the log-decay g and the write strength beta [B, T, H_v]; each query/key head serves H_v / H_k consecutive value
    heads. Every row starts from a zero state; T need not be a multiple of `chunk` (zero padding, which neither
    decays nor writes the state, and whose outputs are dropped). With `final_state`, (output, the state after the
    last token [B, H_v, d_k, d_v] in the working dtype): where the rollout's decode steps go on from a prefill."""
    out_dtype = v.dtype
    work = norm_dtype(out_dtype)
    groups = v.shape[2] // k.shape[2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    # [B, H, T, d] in the working dtype
    q, k, v, beta, g = (t.transpose(1, 2).to(work, memory_format=torch.contiguous_format) for t in (q, k, v, beta, g))
    q, k = unit_queries_keys(q, k)
    seq_len = q.shape[2]
    pad = (chunk - seq_len % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    batch, heads, padded, _ = q.shape
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [B, H, N, C, d]
        return t.reshape(batch, heads, padded // chunk, chunk, t.shape[-1])
    q, k, k_beta, v_beta = chunks(q), chunks(k), chunks(k_beta), chunks(v_beta)
    g = g.reshape(batch, heads, padded // chunk, chunk).cumsum(dim=-1)  # log of the decay since the chunk's start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # exp(g_i - g_j) for j <= i, 0 above the diagonal (masked before the exp: no overflow)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strict lower triangle: the UT system's off-diagonal
    intra = (q @ k.transpose(-1, -2)) * decay
    # (I + strict lower part) u = v_beta and w = k_beta exp(g): the chunk's updates folded into its writes
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * g.exp().unsqueeze(-1), upper=False, unitriangular=True)
    q_decayed = q * g.exp().unsqueeze(-1)  # reads the state as it was at the chunk's start
    k_decayed = k * (g[..., -1:] - g).exp().unsqueeze(-1)  # writes decayed to the chunk's end
    chunk_decay = g[..., -1].exp()[..., None, None]
    state = q.new_zeros(batch, heads, q.shape[-1], v.shape[-1])
    outs = []
    # The loop is the sequential part (T / 64 steps, each a few small kernels): w and q read the state in one
    # product, the adds ride on the products (baddbmm). unbind, not [:, :, i]: the backward of N selects would
    # allocate N zero tensors of the whole sequence (O(N^2) bytes written); unbind's stacks the N gradients once.
    reads = torch.cat((w, q_decayed), dim=-2)  # [B, H, N, 2C, d_k]
    for u_i, read_i, intra_i, k_i, decay_i in zip(u.unbind(2), reads.unbind(2), intra.unbind(2),
                                                   k_decayed.transpose(-1, -2).unbind(2), chunk_decay.unbind(2)):
        predicted, inter = (read_i @ state).split(chunk, dim=-2)
        v_new = u_i - predicted  # the part of the writes the state does not predict
        outs.append(torch.baddbmm(inter.flatten(0, 1), intra_i.flatten(0, 1), v_new.flatten(0, 1)))
        state = torch.baddbmm((state * decay_i).flatten(0, 1), k_i.flatten(0, 1),
                              v_new.flatten(0, 1)).view_as(state)
    out = torch.stack(outs, dim=1).reshape(batch, heads, padded, -1)[:, :, :seq_len]
    out = out.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format)
    return (out, state) if final_state else out


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule for every row, its state updated in place (a decode step; in place so a
    CUDA graph replays it on the same buffer): q and k [B, 1, H_k, d_k], v [B, 1, H_v, d_v], g and beta [B, 1, H_v],
    state [B, H_v, d_k, d_v] in the working dtype; returns the output [B, 1, H_v, d_v] in v's dtype. The recurrence
    of the module docstring term by term, as transformers' torch_recurrent_gated_delta_rule."""
    out_dtype, work = v.dtype, state.dtype
    groups = v.shape[2] // k.shape[2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q, k, v = (t[:, 0].to(work) for t in (q, k, v))  # [B, H, d]
    q, k = unit_queries_keys(q, k)
    decayed = state * g[:, 0].to(work).exp()[..., None, None]
    predicted = (decayed * k.unsqueeze(-1)).sum(dim=-2)  # S^T k, [B, H, d_v]
    delta = (v - predicted) * beta[:, 0].to(work).unsqueeze(-1)
    state.copy_(decayed + k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (state * q.unsqueeze(-1)).sum(dim=-2).unsqueeze(1).to(out_dtype)


def delta_rule_flops_per_token(value_heads: int, key_dim: int, value_dim: int, chunk: int = CHUNK) -> float:
    """Forward FLOPs per token of chunk_gated_delta_rule as it runs (its products, the triangular solves at half a
    product each): per value head 2 C d_k for k_beta k^T, 2 C d_k for q k^T, C (d_k + d_v) for the two solves,
    2 C d_v for the intra-chunk product and 6 d_k d_v for the three products with the state (read by w and q,
    written by k); q and k are repeated to the value heads first, so the key heads do not count."""
    c, dk, dv = chunk, key_dim, value_dim
    return value_heads * (4.0 * c * dk + c * (dk + dv) + 2.0 * c * dv + 6.0 * dk * dv)


def delta_rule_saved_elements(value_heads: int, key_dim: int, value_dim: int, chunk: int = CHUNK) -> float:
    """Elements per token (in the working dtype: float32, float64 when computing in it) of the tensors autograd keeps
    for chunk_gated_delta_rule's backward: per value head 5 C (the decay matrix, the two masked products, the UT
    system, the intra-chunk scores), 13 d_k and 3 d_v (q, k and their normed, scaled, beta-weighted and decayed forms,
    the state's reads; v, v_beta and the solve's u), d_k d_v / C (one state per chunk) and 7 per-token scalars. Counted from what
    autograd saves (tests/unit/test_hybrid_templates.py measures it); the plan's estimate of a linear layer's
    backward (planning/gpu_memory.py)."""
    c, dk, dv = chunk, key_dim, value_dim
    return value_heads * (5.0 * c + 13.0 * dk + 3.0 * dv + dk * dv / c + 7.0)


def linear_mixer_saved_bytes(value_heads: int, key_dim: int, value_dim: int, conv_width: int, value_width: int,
                             work_bytes: int, compute_bytes: int) -> float:
    """Bytes per token autograd keeps for a linear-attention token mixer's backward besides its normed input:
    the rule's tensors (delta_rule_saved_elements, working dtype) and at most 4 x (conv_width + value_width)
    elements in the compute dtype for the projections, the convolution, the gates and the output norm (measured on
    the CPU at 3.1 to 3.4 of them: tests/unit/test_hybrid_templates.py)."""
    return delta_rule_saved_elements(value_heads, key_dim, value_dim) * work_bytes + \
        4.0 * (conv_width + value_width) * compute_bytes
