"""A decode step as one CUDA graph: every layer and the head, captured once per generation and replayed for each
token. Eager, a decode step of a 7B model is about a thousand small kernels, each launched from Python; the GPU then
waits on the CPU (measured on an H200: 25 ms a step where reading the weights takes 4). Replayed, the step costs the
GPU's time alone. The graph reads its inputs from fixed buffers (the token of each row, the cache index as a device
tensor) and writes the logits into a fixed buffer; the KV cache and the weights are the same tensors every replay.

It applies where a decode pass has fixed shapes and no host synchronisation: on a GPU, with the rollout's resident
weights or, for LoRA, every base layer GPU-resident (engine/rollout/weights.ResidentBaseView; the streamed path copies
through the training slots and events), dense layers (a mixture of experts sorts
its tokens by expert into data-dependent shapes) and RoPE tables that do not switch with the length (LongRoPE)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from megatrain_ray.observe.log import get_logger

log = get_logger(__name__)
WARMUP = 2
"""Eager runs on a side stream before the capture (cuBLAS and the attention kernels pick their work space)."""


@contextmanager
def kept_as_found(kept: tuple[torch.Tensor, ...]) -> Iterator[None]:
    """Put `kept` back as it was on entry, however the block ends: state that a warm-up step changes in place (the
    linear-attention layers' recurrent states). The copy waits in host memory, not beside the cache on the GPU."""
    saved = [t.to("cpu", copy=True) for t in kept]
    try:
        yield
    finally:
        for tensor, value in zip(kept, saved):
            tensor.copy_(value)


class DecodeGraph:
    """`decode(token [rows], index 0-d tensor) -> logits [rows, vocab]` captured; call with the token and the Python
    index of the cache slot it goes to. `first_index`: where the first replay writes (the warm-up and capture write
    there too, and the first replay overwrites it before anything reads it). `kept`: state a step updates in place
    rather than writes at the index (the linear-attention layers' recurrent states): kept_as_found around the warm-up
    runs and the capture (which runs nothing), so the first replay starts from the prefill's, and so does the eager
    decoding where the capture fails."""

    def __init__(self, decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], rows: int, first_index: int,
                 device: torch.device, kept: tuple[torch.Tensor, ...] = ()):
        self.token = torch.zeros(rows, dtype=torch.int64, device=device)
        self.index = torch.full((), first_index, dtype=torch.int64, device=device)
        with kept_as_found(kept):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            try:
                with torch.cuda.stream(side):
                    for _ in range(WARMUP):
                        decode(self.token, self.index)
            finally:  # a warm-up that raised may leave steps queued on the side stream: none may outlive the restore
                torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = decode(self.token, self.index)

    def __call__(self, token: torch.Tensor, index: int) -> torch.Tensor:
        self.token.copy_(token)
        self.index.fill_(index)
        self.graph.replay()
        return self.logits


def graph_or_eager(decode: Callable[[torch.Tensor, torch.Tensor | int], torch.Tensor], applies: bool, rows: int,
                   first_index: int, device: torch.device,
                   kept: tuple[torch.Tensor, ...] = ()) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """A DecodeGraph of `decode` where it applies and captures, else `decode` itself, eager (a capture that fails is
    logged once and the generation goes on eagerly)."""
    if applies:
        try:
            return DecodeGraph(decode, rows, first_index, device, kept)
        except Exception as exc:  # noqa: BLE001 (any capture failure: the eager path computes the same)
            log.warning("the rollout's decode step could not be captured as a CUDA graph (%s: %s); decoding eagerly",
                        type(exc).__name__, exc)
    return decode
