"""The layer inputs kept from the forward for the recompute in the backward.

Kept on the device, they cost one [tokens, hidden] tensor per layer: GPU memory grows with depth
and batch. Offloaded, each input is copied device->host on the D2H stream as soon as the forward
has produced it (pinned host buffers, reused step after step), and copied back on the H2D stream
one layer ahead of the backward that needs it. The device then holds at most two of them. The
last layer's input stays on the device: the backward starts with it.

Ordering, by events only: a D2H starts after compute produced the tensor; the tensor's memory is
not reused before the D2H read it (`record_stream`); the H2D of layer i waits for its D2H; the next
step's D2H into buffer i waits until the H2D out of it is done. On the CPU copies are synchronous
and the same code runs (that is how CI checks it).
"""

from __future__ import annotations

from typing import Any

import torch

from megatrain_ray.engine.streams import DeviceStreams


class ActivationStash:
    def __init__(self, streams: DeviceStreams, offload: bool, num_layers: int, on_copy: Any):
        """`on_copy(kind, stream, start_event, nbytes)` is told of each copy (timeline and byte counts)."""
        self.streams = streams
        self.offload = offload
        self.last = num_layers - 1
        self.on_copy = on_copy
        self.kept: dict[int, torch.Tensor] = {}
        self.host: dict[int, torch.Tensor] = {}
        self.stored: dict[int, Any] = {}
        """Event: the D2H into host[i] is complete."""
        self.read: dict[int, Any] = {}
        """Event: the H2D out of host[i] is complete (the buffer may be overwritten)."""
        self.back: dict[int, tuple[torch.Tensor, Any]] = {}

    def _host_buffer(self, index: int, like: torch.Tensor) -> torch.Tensor:
        buf = self.host.get(index)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.streams.is_cuda)
            self.host[index] = buf
            self.read.pop(index, None)
        return buf

    def put(self, index: int, x: torch.Tensor) -> None:
        """Keep layer `index`'s input (called in the forward, right after x was produced on compute)."""
        if not self.offload or index == self.last:
            self.kept[index] = x
            return
        s = self.streams
        host = self._host_buffer(index, x)
        produced = s.record(s.compute)
        with s.on(s.d2h):
            s.wait(s.d2h, produced)
            s.wait(s.d2h, self.read.get(index))
            start = s.record(s.d2h, timing=True)
            host.copy_(x, non_blocking=True)
            if s.is_cuda:
                x.record_stream(s.d2h)  # the allocator must not hand x's memory out before this copy read it
            self.stored[index] = s.record(s.d2h)
        self.on_copy("d2h", s.d2h, start, x.numel() * x.element_size())

    def prefetch(self, index: int, device: torch.device) -> None:
        """Start bringing layer `index`'s input back (called one layer ahead in the backward)."""
        if not self.offload or index < 0 or index in self.back or index in self.kept:
            return
        s = self.streams
        host = self.host[index]
        with s.on(s.h2d):
            s.wait(s.h2d, self.stored[index])
            start = s.record(s.h2d, timing=True)
            x = torch.empty(host.shape, dtype=host.dtype, device=device)
            x.copy_(host, non_blocking=True)
            ready = s.record(s.h2d)
        self.read[index] = ready
        self.back[index] = (x, ready)
        self.on_copy("h2d", s.h2d, start, x.numel() * x.element_size())

    def release(self) -> None:
        """Drop every buffer (pinned host and device) and the copy callback (the engine's bound method)."""
        self.kept.clear()
        self.host.clear()
        self.back.clear()
        self.stored.clear()
        self.read.clear()
        self.on_copy = None

    def take(self, index: int, device: torch.device) -> torch.Tensor:
        """Layer `index`'s input on the device, ready for compute; the stash lets go of it."""
        if index in self.kept:
            return self.kept.pop(index)
        self.prefetch(index, device)
        x, ready = self.back.pop(index)
        s = self.streams
        s.wait(s.compute, ready)
        if s.is_cuda:
            x.record_stream(s.compute)  # allocated on the H2D stream, used and freed on compute
        return x
