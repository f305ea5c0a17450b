"""How a packed stage arrives on the device (finetune.lora.base_quantization=nf4; store/nf4_base.py).

A dense stage is one H2D copy into its weight slot (engine/weights.py). A packed decoder layer is an H2D copy of
its NF4 bytes (from the pinned `nf4` segment, asynchronous) into one device staging buffer, then dequantize_stage
from there into the slot's compute-dtype buffer, both on the H2D stream: the slot's `ready` event, recorded
after them, orders the layer's compute after its dequantization, and the next layer's copy into the staging
buffer after this one's dequantization (the same stream). The templates then bind the dense buffer as for any
stage. The dequantization's temporaries are bounded by nf4_stage's chunking (dequantize_workspace_bytes).

GPU-resident packed layers (engine.gpu_resident with an NF4 base): their packed bytes are copied to the device once,
at the start, and kept there; each use dequantizes them into the slot as above, without the copy.

With engine.nf4_kernels=triton (or auto, on a CUDA device with triton where the kernels pass their start-up
probe, quant/nf4_triton_probe.py) the block decoding is quant/nf4_triton's
one-pass kernel, writing the slot in place (bit for bit the values of the torch decoding; by its reads and writes
about 2.5 bytes of device memory traffic a value against the compiled torch decoding's 6.5, an estimate not yet
measured). A rollout's decode step over GPU-resident packed MoE layers (`load(..., keep_experts=True)`)
dequantizes all but the fused expert tensors, which the layer then reads in NF4 where they
lie (`expert_views`: only the experts some row is routed to, quant/nf4_triton.NF4Experts.products); dequantizing a
gpt-oss-120b layer's 3.2 B expert values for a batch of 32 tokens was most of a decode step's time.
"""

from __future__ import annotations

from typing import Any

import torch

from megatrain_ray.exceptions import ConfigError
from megatrain_ray.model.layout import ModelLayout, StageLayout
from megatrain_ray.observe.log import get_logger
from megatrain_ray.quant.nf4_stage import (
    EXPERT_MATRICES,
    TRITON_DTYPES,
    NF4StageFormat,
    dequantize_stage,
    experts_readable_in_nf4,
)
from megatrain_ray.quant.nf4_triton import NF4Experts, dequantize_blocks_into, triton_available
from megatrain_ray.quant.nf4_triton_probe import kernels_failure
from megatrain_ray.store.nf4_base import NF4_KIND, stage_format
from megatrain_ray.store.segments import HostStore

log = get_logger(__name__)


class PackedArrival:
    def __init__(self, layout: ModelLayout, store: HostStore, compute_dtype: torch.dtype, device: torch.device,
                 resident_layers: int = 0, decode: Any = None, kernels: str = "torch"):
        """The packed stages are those with an `nf4` segment in `store`; the first `resident_layers` layers
        (RunSpec.resident_layers) keep their packed bytes on the device; `decode`: the block decoding
        (quant/nf4_stage.decode_blocks through torch.compile with engine.compile; None: eager)."""
        self.store = store
        self.decode = decode
        self.formats: dict[int, NF4StageFormat] = {
            s.index: stage_format(s, compute_dtype) for s in layout.stages if store.has(NF4_KIND, s.index)}
        # engine.nf4_kernels resolved first: a refusal comes before the resident layers' bytes are copied
        self.decode_into = dequantize_blocks_into if uses_triton(kernels, device, compute_dtype) else None
        if self.formats:  # which decoder runs is no longer only the user's choice (auto): say it once
            log.info("NF4 base: %d packed stages decoded by %s (engine.nf4_kernels=%s)", len(self.formats),
                     "the Triton kernels" if self.decode_into is not None else
                     "torch (compiled)" if decode is not None else "torch", kernels)
        self.on_device = {s.index: store.get(NF4_KIND, s.index).to(device)
                          for s in layout.resident_stages(resident_layers) if s.index in self.formats}
        largest = max((f.nbytes for i, f in self.formats.items() if i not in self.on_device), default=0)
        self.staging = torch.empty(largest, dtype=torch.uint8, device=device)
        self._expert_views: dict[int, dict[str, NF4Experts]] = {}

    @classmethod
    def of(cls, layout: ModelLayout, store: HostStore, compute_dtype: torch.dtype, device: torch.device,
           resident_layers: int = 0, decode: Any = None, kernels: str = "torch") -> PackedArrival | None:
        """The arrival of the store's packed stages, or None when it holds none (every dense run); `kernels`:
        engine.nf4_kernels."""
        if not any(store.has(NF4_KIND, s.index) for s in layout.stages):
            return None
        return cls(layout, store, compute_dtype, device, resident_layers, decode, kernels)

    @property
    def resident_bytes(self) -> int:
        return sum(t.numel() for t in self.on_device.values())

    def packs(self, stage: StageLayout) -> bool:
        return stage.index in self.formats

    def keeps_experts(self, stage: StageLayout) -> bool:
        """The stage's fused expert tensors can be read in NF4 where they lie: its packed bytes stay on the device
        (a streamed stage's staging buffer is overwritten by the next layer's copy while this one computes), the
        Triton kernels run here, and its experts are quantized."""
        if self.decode_into is None or stage.index not in self.on_device:
            return False
        fmt = self.formats[stage.index]
        return experts_readable_in_nf4(fmt.stage.slots, fmt.blocksize)

    def expert_views(self, stage: StageLayout) -> dict[str, NF4Experts]:
        """The stage's fused expert tensors as NF4Experts over its device-resident packed bytes (keeps_experts)."""
        views = self._expert_views.get(stage.index)
        if views is None:
            fmt, packed = self.formats[stage.index], self.on_device[stage.index]
            views = self._expert_views[stage.index] = {
                m.slot.name: stage_experts(packed, fmt, i)
                for i, m in enumerate(fmt.matrices) if m.slot.name in EXPERT_MATRICES}
        return views

    def load(self, stage: StageLayout, dense: torch.Tensor, keep_experts: bool = False) -> int:
        """Issue, on the current (H2D) stream, the copy of the stage's packed bytes (none for a resident one) and
        their dequantization into `dense` (the slot's compute buffer, stage.numel elements), all but the fused
        expert tensors with `keep_experts` (keeps_experts; the layer binds expert_views instead); returns the bytes
        copied."""
        fmt = self.formats[stage.index]
        skip = EXPERT_MATRICES if keep_experts else frozenset()
        if stage.index in self.on_device:
            dequantize_stage(self.on_device[stage.index], fmt, out=dense, decode=self.decode,
                             decode_into=self.decode_into, skip=skip)
            return 0
        assert not keep_experts, "only device-resident packed stages keep their experts in NF4"
        staged = self.staging[:fmt.nbytes]
        staged.copy_(self.store.get(NF4_KIND, stage.index), non_blocking=True)
        dequantize_stage(staged, fmt, out=dense, decode=self.decode, decode_into=self.decode_into)
        return fmt.nbytes


def uses_triton(kernels: str, device: torch.device, compute_dtype: torch.dtype) -> bool:
    """engine.nf4_kernels resolved: triton where it runs and passes its probe (auto; quant/nf4_triton_probe.py),
    or because it was asked for (an error if it cannot run or fails the probe); never for float64 (the tests'
    exact runs), which the kernels do not take."""
    if kernels == "torch" or compute_dtype not in TRITON_DTYPES:
        return False
    if not triton_available(device):
        if kernels == "triton":
            missing = " without triton" if device.type == "cuda" else ""
            raise ConfigError(f"engine.nf4_kernels=triton needs triton and a CUDA device; this worker runs on "
                              f"{device}{missing}: set engine.nf4_kernels to auto or torch")
        return False
    failure = kernels_failure(device, compute_dtype)
    if failure is None:
        return True
    if kernels == "triton":
        raise ConfigError(f"engine.nf4_kernels=triton: the NF4 Triton kernels fail on {device} ({failure}); set "
                          "engine.nf4_kernels to torch, or auto, which then decodes in torch")
    log.warning("NF4 Triton kernels unusable on %s (%s): the NF4 base is decoded in torch (engine.nf4_kernels=auto)",
                device, failure)
    return False


def stage_experts(packed: torch.Tensor, fmt: NF4StageFormat, i: int) -> NF4Experts:
    """Matrix i of a packed stage (a fused [E, A, B] expert tensor) as NF4Experts: views of its codes, block maxima,
    scales and offset in the stage's sections (quant/nf4_stage.py), no copy."""
    return NF4Experts(*fmt.matrix_parts(packed, i), fmt.matrices[i].slot.shape, fmt.blocksize, fmt.compute_dtype)
