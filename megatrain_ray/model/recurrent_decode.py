"""The linear-attention (Gated DeltaNet) layers of Qwen3.5 and Qwen3-Next with the rollout's cache (model/decode.py):
instead of keys and values per token, each row keeps a fixed-size state a layer, as transformers' generation does:

- the convolution's last K - 1 inputs ([q k v] before the convolution, in the compute dtype), so a decode step
  convolves its token with them;
- the delta rule's state S [H_v, d_k, d_v] (float32, float64 when computing in it).

Prefill runs the training's chunked rule (model/delta_rule.py) over the whole left-padded prompt and keeps its final
state; the padding's normed inputs are zeroed first (as transformers' apply_mask_to_padding_states), so their keys
are 0 and write nothing, and its decay is set to 0, so the state a real token meets is the zero state of its row's
start, as in training. Each
decode step is one recurrence step (gated_delta_step), both states updated in place: a CUDA graph replays it on the
same buffers (engine/rollout/graphs.py saves and restores them around its warm-up runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from megatrain_ray.model.delta_rule import chunk_gated_delta_rule, gated_delta_step
from megatrain_ray.model.linear_attention import P, causal_conv, mixer_output, projections, split_heads, write_gates
from megatrain_ray.model.norms import norm_dtype, rms_norm


@dataclass(slots=True)
class RecurrentCache:
    """One linear-attention layer's state of every row: the convolution's last inputs [rows, channels, K - 1] and
    the delta rule's state [rows, H_v, d_k, d_v]."""

    conv: torch.Tensor
    state: torch.Tensor

    @staticmethod
    def shapes(spec: Any, rows: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The convolution's kept inputs' shape and the state's."""
        la = spec.linear
        return (rows, la.conv_channels, la.conv_kernel - 1), (rows, la.num_value_heads, la.key_head_dim,
                                                              la.value_head_dim)

    @classmethod
    def empty(cls, rows: int, spec: Any, dtype: torch.dtype, device: torch.device) -> RecurrentCache:
        conv, state = cls.shapes(spec, rows)
        return cls(torch.zeros(conv, dtype=dtype, device=device),
                   torch.zeros(state, dtype=norm_dtype(dtype), device=device))

    @classmethod
    def bytes_per_row(cls, spec: Any, dtype: torch.dtype) -> int:
        """The two states of one row (whatever the number of tokens): the inputs in `dtype`, the state in float32
        (float64 when computing in it)."""
        conv, state = (math.prod(shape) for shape in cls.shapes(spec, 1))
        size = torch.tensor([], dtype=dtype).element_size()
        return conv * size + state * torch.tensor([], dtype=norm_dtype(dtype)).element_size()

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.state.numel() * self.state.element_size()

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What a decode step changes in place (a CUDA graph's warm-up must leave it as it found it)."""
        return self.conv, self.state


def cached_linear_mixer(h: torch.Tensor, w: Mapping[str, torch.Tensor], spec: Any, cache: RecurrentCache,
                        real: torch.Tensor | None, proj) -> torch.Tensor:
    """The token mixer's output [rows, T, hidden] of the normed input h: a prefill from the zero state (T tokens,
    `real` [rows, T] marking the rows' real tokens, False on the left padding), or one decode step (T = 1, `real`
    None) from the cached state, updating `cache`."""
    la = spec.linear
    conv_weight = w[f"{P}conv1d.weight"]  # [channels, 1, K]
    if real is not None:
        h = h * real.unsqueeze(-1).to(h.dtype)
    mixed, z, b, a = projections(h, w, la, proj)
    if real is not None:  # prefill: the causal convolution from zeros, its last K - 1 inputs kept
        inputs, width = mixed.transpose(1, 2), la.conv_kernel - 1
        padded = F.pad(inputs, (max(width - inputs.shape[-1], 0), 0))
        cache.conv.copy_(padded[..., padded.shape[-1] - width:])
        convolved = causal_conv(mixed, conv_weight)
    else:
        window = torch.cat((cache.conv, mixed.transpose(1, 2)), dim=-1)  # [rows, channels, K]
        cache.conv.copy_(window[..., 1:])
        convolved = F.silu(F.conv1d(window, conv_weight, groups=window.shape[1])).transpose(1, 2)
    q, k, v = split_heads(convolved, la)
    beta, g = write_gates(b, a, w, h.dtype)
    if real is not None:
        # the padding writes nothing (its keys are 0); without its decay too, the chunk's running decay is the
        # row's own, as in an unpadded prompt (a float32 decay summed over the padding costs precision)
        g = g.masked_fill(~real.unsqueeze(-1), 0.0)
        out, state = chunk_gated_delta_rule(q, k, v, g, beta, final_state=True)
        cache.state.copy_(state)
    else:
        out = gated_delta_step(q, k, v, g, beta, cache.state)
    return mixer_output(out, z, w, la, proj)


def cached_linear_block(x: torch.Tensor, w: Mapping[str, torch.Tensor], spec: Any, cache: RecurrentCache,
                        real: torch.Tensor | None, proj) -> torch.Tensor:
    """x plus the linear-attention mixer of norm(x): the first half of a hybrid's linear layer with its cache."""
    h = rms_norm(x, w["input_layernorm.weight"], spec.eps, spec.plus_one)
    return x + cached_linear_mixer(h, w, spec, cache, real, proj)
