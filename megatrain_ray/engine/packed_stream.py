"""How a packed stage arrives on the device (finetune.lora.base_quantization=nf4; store/nf4_base.py).

A dense stage is one H2D copy into its weight slot (engine/weights.py). A packed decoder layer is an H2D copy of
its NF4 bytes (from the pinned `nf4` segment, asynchronous) into one device staging buffer, then dequantize_stage
from there into the slot's compute-dtype buffer, both on the H2D stream: the slot's `ready` event, recorded
after them, orders the layer's compute after its dequantization, and the next layer's copy into the staging
buffer after this one's dequantization (the same stream). The templates then bind the dense buffer as for any
stage. The dequantization's temporaries are bounded by nf4_stage's chunking (dequantize_workspace_bytes).

GPU-resident packed layers (engine.gpu_resident with an NF4 base): their packed bytes are copied to the device once,
at the start, and kept there; each use dequantizes them into the slot as above, without the copy.
"""

from __future__ import annotations

from typing import Any

import torch

from megatrain_ray.model.layout import ModelLayout, StageLayout
from megatrain_ray.quant.nf4_stage import NF4StageFormat, dequantize_stage
from megatrain_ray.store.nf4_base import NF4_KIND, stage_format
from megatrain_ray.store.segments import HostStore


class PackedArrival:
    def __init__(self, layout: ModelLayout, store: HostStore, compute_dtype: torch.dtype, device: torch.device,
                 resident_layers: int = 0, decode: Any = None):
        """The packed stages are those with an `nf4` segment in `store`; the first `resident_layers` layers
        (RunSpec.resident_layers) keep their packed bytes on the device; `decode`: the block decoding
        (quant/nf4_stage.decode_blocks through torch.compile with engine.compile; None: eager)."""
        self.store = store
        self.decode = decode
        self.formats: dict[int, NF4StageFormat] = {
            s.index: stage_format(s, compute_dtype) for s in layout.stages if store.has(NF4_KIND, s.index)}
        self.on_device = {s.index: store.get(NF4_KIND, s.index).to(device)
                          for s in layout.resident_stages(resident_layers) if s.index in self.formats}
        largest = max((f.nbytes for i, f in self.formats.items() if i not in self.on_device), default=0)
        self.staging = torch.empty(largest, dtype=torch.uint8, device=device)

    @classmethod
    def of(cls, layout: ModelLayout, store: HostStore, compute_dtype: torch.dtype, device: torch.device,
           resident_layers: int = 0, decode: Any = None) -> PackedArrival | None:
        """The arrival of the store's packed stages, or None when it holds none (every dense run)."""
        if not any(store.has(NF4_KIND, s.index) for s in layout.stages):
            return None
        return cls(layout, store, compute_dtype, device, resident_layers, decode)

    @property
    def resident_bytes(self) -> int:
        return sum(t.numel() for t in self.on_device.values())

    def packs(self, stage: StageLayout) -> bool:
        return stage.index in self.formats

    def load(self, stage: StageLayout, dense: torch.Tensor) -> int:
        """Issue, on the current (H2D) stream, the copy of the stage's packed bytes (none for a resident one) and
        their dequantization into `dense` (the slot's compute buffer, stage.numel elements); returns the bytes
        copied."""
        fmt = self.formats[stage.index]
        if stage.index in self.on_device:
            dequantize_stage(self.on_device[stage.index], fmt, out=dense, decode=self.decode)
            return 0
        staged = self.staging[:fmt.nbytes]
        staged.copy_(self.store.get(NF4_KIND, stage.index), non_blocking=True)
        dequantize_stage(staged, fmt, out=dense, decode=self.decode)
        return fmt.nbytes
