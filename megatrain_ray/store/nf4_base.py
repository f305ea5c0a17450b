"""A frozen base in NF4 on the host (finetune.lora.base_quantization=nf4, QLoRA's 4-bit base).

Each decoder layer's host segment is kind `nf4`: one uint8 buffer in quant/nf4_stage.NF4StageFormat (blocksize
64, double quantization; the vectors in the compute dtype), filled once at the start from the stage's dense
weights (random initialisation or the Hugging Face checkpoint, in the master dtype of the run, that is
precision.stream_dtype) and never written again. The embedding and the LM head keep their dense `master`, as
QLoRA keeps them unquantized; in a mixture-of-experts layer the fused expert tensors are quantized too (blockwise,
each as one matrix) and the router's weight and the experts' biases kept (quant/nf4_stage.quantized_slot). The
weight stream (engine/packed_stream.py) copies the packed bytes to the device
and dequantizes them there; export and tests read the base through DequantizedBase, the values the layers
compute with.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.dtypes import TORCH_DTYPES
from megatrain_ray.model.hf_io import HFDirectory, finite_or_refuse
from megatrain_ray.model.layout import ModelLayout, StageLayout, TensorSlot
from megatrain_ray.quant.nf4 import dequantize_nf4, quantize_nf4
from megatrain_ray.quant.nf4_stage import NF4StageFormat, dequantize_stage, pack_stage_pieces, quantized_slot
from megatrain_ray.store.initial_values import init_master, init_slot_pieces, load_hf_master
from megatrain_ray.store.segments import HostStore, SegmentSpec
from megatrain_ray.store.tensor_maps import DerivedTensors

NF4_KIND = "nf4"
"""The segment kind of a packed decoder layer."""
NF4_BLOCKSIZE = 64
"""QLoRA's (bitsandbytes' default) block size; with double quantization."""


def packs_stage(run: RunSpec, stage: StageLayout) -> bool:
    """Whether the run holds this stage packed in NF4: the decoder layers of an nf4 frozen base."""
    return run.frozen_base and run.base_quantization == "nf4" and stage.kind == "layer"


def stage_format(stage: StageLayout, compute_dtype: torch.dtype | str) -> NF4StageFormat:
    """The packed format of a decoder layer (the host's bytes, the device's staging copy, the planner's figure).
    Layers of the same shapes share one format object: dequantize_stage caches its index tensors per format and
    device, which a format per layer would rebuild (and copy to the GPU) for every layer of every step."""
    dtype = TORCH_DTYPES[compute_dtype] if isinstance(compute_dtype, str) else compute_dtype
    return _shared_format(stage.slots, stage.numel, stage.decay_numel, dtype, stage)


_FORMATS: dict[tuple, NF4StageFormat] = {}


def _shared_format(slots: tuple, numel: int, decay_numel: int, dtype: torch.dtype,
                   stage: StageLayout) -> NF4StageFormat:
    key = (slots, numel, decay_numel, dtype)
    found = _FORMATS.get(key)
    if found is None:  # the first layer of these shapes stands for all (the format reads their slots only)
        found = _FORMATS.setdefault(key, NF4StageFormat.for_stage(stage, dtype, NF4_BLOCKSIZE, double_quant=True))
    return found


def fill_base_stage(store: HostStore, stage: StageLayout, run: RunSpec, source: HFDirectory | None, seed: int,
                    std: float) -> None:
    """A frozen-base stage from the Hugging Face `source` (or, when None, randomly initialised from `seed` and
    `std` as initial_values.init_master does), in the master dtype of the run. A packed stage quantizes each tensor into
    its segment as its values come (a checkpoint's tensor by tensor, random ones in pieces of
    initial_values.INIT_PIECE values): one filling thread holds one tensor (or piece) and its block maxima, never the
    stage's dense weights (6.4 GB for a gpt-oss-120b layer in bf16, times the threads)."""
    if not store.has(NF4_KIND, stage.index):
        master = store.get("master", stage.index)
        if source is not None:
            load_hf_master(master, stage, source)
        else:
            init_master(master, stage, seed, std)
        return
    dtype = TORCH_DTYPES[run.master_dtype]

    def pieces(slot: TensorSlot) -> Iterator[torch.Tensor]:
        if source is None:
            yield from init_slot_pieces(stage, slot, seed, std, dtype)
            return
        name = stage.hf_name(slot)
        tensor = source[name]
        finite_or_refuse(tensor, name, source.dir)
        yield tensor.reshape(-1).to(dtype)

    pack_stage_pieces(stage_format(stage, run.compute_dtype), pieces, out=store.get(NF4_KIND, stage.index))


def fill_threads(stages: int, cores: int, thread_bytes: int = 0, available: int = 0) -> tuple[int, int]:
    """(threads that fill stages at once, torch threads each): a thread per stage up to the cores, and, when each
    holds `thread_bytes` of temporaries, no more than `available` RAM (with a quarter to spare) holds; each runs
    torch single-threaded. A filling thread makes many small torch calls (quantization chunks sized for a core's
    cache), too small for an OpenMP team: packing a layer took 200 ns a value with two torch threads on a busy
    2-core VM, 8.5 with one."""
    threads = max(1, min(stages, cores))
    if thread_bytes and available:
        threads = max(1, min(threads, int(0.75 * available) // thread_bytes))
    return threads, 1


PROCESS_FILL_VALUES = 1 << 31
"""Values to pack above which fill_processes spawns processes: below it, the processes' start (a torch import
each, about 2 s) outweighs what the threads lose to the GIL."""


def fill_processes(threads: int, values: int) -> int:
    """Processes to pack the stages in, instead of threads (0: threads). A filling thread makes about ten torch
    calls per 64K values (quant/nf4.py's chunks, sized for a core's cache), each holding the GIL for its dispatch,
    so threads contend for it as they grow in number (not measured against processes on 16 free cores); a process
    per stage has a GIL of its own. On the H200 box,
    16 processes packed 16 of Llama-3.1-70B's layers at 12.6 times one thread's rate (45.4 ns a value each
    against 35.9: benchmarks/results/nf4-startup-llama3-70b-cpu-*.json). On two cores threads lose little."""
    return threads if threads > 2 and values >= PROCESS_FILL_VALUES else 0


def fill_base_stage_in_process(specs: list[SegmentSpec], stage: StageLayout, run: RunSpec, model_path: str,
                               seed: int, std: float) -> None:
    """fill_base_stage in a process of its own (fill_processes): it maps the stage's segments from their `specs`
    (the shard created them), and reads the checkpoint at `model_path` ("": random initialisation)."""
    torch.set_num_threads(1)
    source = HFDirectory(model_path) if model_path else None
    fill_base_stage(HostStore(specs), stage, run, source, seed, std)


def checkpoint_fill_bytes(layout: ModelLayout, run: RunSpec) -> int:
    """RAM a thread holds while it quantizes a checkpoint's decoder layer: its largest quantized tensor as read
    (up to 4 bytes a value: float32 checkpoints; gpt-oss's MXFP4 experts are dequantized to bf16 beside their
    packed bytes), its copy in the master dtype and its block maxima. gpt-oss-120b's gate_up_proj: 2.1 G values,
    14.9 GB: on a 128 GB box, with the 58 GB store allocated, three threads at a time."""
    largest = max((slot.numel for stage in layout.layers for slot in stage.slots if quantized_slot(slot)), default=0)
    return largest * (4 + TORCH_DTYPES[run.master_dtype].itemsize + 1)


class DequantizedBase(Mapping[str, torch.Tensor]):
    """The base's tensors by Hugging Face name, in layout order, as the device computes with them: the dense
    stages as views of their `master`, the packed ones dequantized (in the compute dtype, one stage kept at a
    time: export reads the tensors in order)."""

    def __init__(self, store: HostStore, layout: ModelLayout, compute_dtype: torch.dtype | str):
        self.store, self.layout = store, layout
        self.compute_dtype = TORCH_DTYPES[compute_dtype] if isinstance(compute_dtype, str) else compute_dtype
        self.names = [stage.hf_name(slot) for stage in layout.stages
                      if store.has("master", stage.index) or store.has(NF4_KIND, stage.index) for slot in stage.slots]
        self._cached: tuple[int, torch.Tensor] | None = None

    def _flat(self, stage: StageLayout) -> torch.Tensor:
        if self.store.has("master", stage.index):
            return self.store.get("master", stage.index)
        if self._cached is None or self._cached[0] != stage.index:
            fmt = stage_format(stage, self.compute_dtype)
            self._cached = (stage.index, dequantize_stage(self.store.get(NF4_KIND, stage.index), fmt))
        return self._cached[1]

    def __getitem__(self, name: str) -> torch.Tensor:
        stage, slot = self.layout.stage_of(name)
        if not (self.store.has("master", stage.index) or self.store.has(NF4_KIND, stage.index)):
            raise KeyError(name)
        return self._flat(stage)[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class RequantizedBase(DerivedTensors):
    """A dense base (the Hugging Face directory a LoRA checkpoint records) as an NF4 run computed with it: each
    decoder-layer matrix in the master dtype, quantized and dequantized into the compute dtype (pack_stage quantizes
    each matrix alone, as quantize_nf4 does: the same values as DequantizedBase), the layers' vectors in the
    compute dtype, the embedding and LM head in the master dtype. What `megatrain export` of such a checkpoint
    merges the adapters onto."""

    def __init__(self, base: Mapping[str, torch.Tensor], layout: ModelLayout, master_dtype: str, compute_dtype: str):
        super().__init__(base)
        self.layout = layout
        self.master_dtype, self.compute_dtype = TORCH_DTYPES[master_dtype], TORCH_DTYPES[compute_dtype]

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.base[name].to(self.master_dtype)
        stage, slot = self.layout.stage_of(name)
        if stage.kind != "layer":
            return tensor
        if not quantized_slot(slot):  # vectors, a MoE router, the experts' biases
            return tensor.to(self.compute_dtype)
        return dequantize_nf4(quantize_nf4(tensor, NF4_BLOCKSIZE, double_quant=True), self.compute_dtype)
