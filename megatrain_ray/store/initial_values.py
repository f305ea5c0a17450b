"""A stage's first values in the host store: random initialisation as Hugging Face draws it (per-tensor seeds, so
the values do not depend on sharding or stage order), or a Hugging Face checkpoint's tensors. The moments are fresh
zero-filled segments (store/segments.create_segment): nothing to write for them."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch

from megatrain_ray.model.hf_io import HFDirectory, finite_or_refuse
from megatrain_ray.model.layout import StageLayout
from megatrain_ray.store.segments import HostStore


def tensor_seed(seed: int, name: str) -> int:
    """A per-tensor seed: initial weights do not depend on sharding or stage order."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_stage(store: HostStore, stage: StageLayout, seed: int, std: float) -> None:
    """Random initialisation as in Hugging Face: normal(0, std) matrices, ones for norms, zero biases.

    The moments are fresh segments, zero-filled and allocated whole by create_segment: nothing to write. The lean
    state's bf16 master (optimizer.state=lean) gets the same rounded values, and its compensation what the rounding
    dropped (write_compensated).
    """
    master = store.get("master", stage.index)
    if store.has("master_comp", stage.index):
        comp = store.get("master_comp", stage.index)
        for slot in stage.slots:
            start = slot.offset
            for piece in init_slot_pieces(stage, slot, seed, std, torch.float32):
                write_compensated(master[start:start + piece.numel()], comp[start:start + piece.numel()], piece)
                start += piece.numel()
        return
    init_master(master, stage, seed, std)
    if store.has("stream", stage.index):
        store.get("stream", stage.index).copy_(master)


def write_compensated(master: torch.Tensor, comp: torch.Tensor, values: torch.Tensor) -> None:
    """A bf16 master and its bf16 compensation from wider values: master their nearest bf16, comp the rest (exact in
    float32) rounded to bf16, so that master + comp holds about 16 bits of each value. With comp zero instead, the
    first updates smaller than half a bf16 ulp would be lost, where a float32 master's streamed copy crosses a
    rounding boundary for every weight its update carries past one (on SmolLM2's first steps: a loss 0.3 higher)."""
    master.copy_(values)
    comp.copy_(values.float() - master.float())


def init_master(master: torch.Tensor, stage: StageLayout, seed: int, std: float) -> None:
    """init_stage's weights into one flat buffer (also the GPU-resident tier's, engine/resident.py): per tensor
    seeds, so the values do not depend on where the stage lives; the values of init_slot_pieces."""
    for slot in stage.slots:
        start = slot.offset
        for piece in init_slot_pieces(stage, slot, seed, std, master.dtype):
            master[start:start + piece.numel()].copy_(piece)
            start += piece.numel()


INIT_PIECE = 1 << 24
"""Values per piece of init_slot_pieces (64 MB of float32 draws): a multiple of 16, the run torch's normal_
fills at once, so the pieces of a tensor are the values one call for the whole would draw."""


def init_slot_pieces(stage: StageLayout, slot: Any, seed: int, std: float, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The random initial values of one slot, flat, in consecutive pieces of INIT_PIECE values from one generator
    (per tensor: tensor_seed), each drawn in float32 and converted to `dtype` (normal_piece). init_master writes
    them; a frozen NF4 base quantizes them as they come (store/nf4_base.py): a 120B MoE's expert tensor (2 G
    values) never exists whole."""
    if slot.init != "normal":
        yield torch.full((slot.numel,), 1.0 if slot.init == "ones" else 0.0, dtype=dtype)
        return
    gen = torch.Generator().manual_seed(tensor_seed(seed, stage.hf_name(slot)))
    start = 0
    while start < slot.numel:
        stop = slot.numel if slot.numel - start < 2 * INIT_PIECE else start + INIT_PIECE  # no short last piece
        yield normal_piece(stop - start, std, gen, dtype)
        start = stop


def normal_piece(numel: int, std: float, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """numel normal values drawn in float32 from `gen` and converted to `dtype` (rounded for a reduced float): the
    same values for every dtype's run on every torch version. A reduced float's own normal_ draws other values on
    torch 2.11 than on 2.13, and several times slower than float32 on the H200 box's torch 2.11 (a one-off timing,
    not a results file)."""
    values = torch.empty(numel, dtype=torch.float32).normal_(0.0, std, generator=gen)
    return values if dtype == torch.float32 else values.to(dtype)


def load_hf_master(master: torch.Tensor, stage: StageLayout, source: HFDirectory) -> None:
    """load_hf_stage's weights into one flat buffer (also the GPU-resident tier's)."""
    for slot in stage.slots:
        tensor = source[stage.hf_name(slot)]
        finite_or_refuse(tensor, stage.hf_name(slot), source.dir)
        master[slot.offset:slot.offset + slot.numel].copy_(tensor.reshape(-1))


def load_hf_stage(store: HostStore, stage: StageLayout, source: HFDirectory) -> None:
    """Copy one stage's tensors from the checkpoint into its master weights and refresh its streaming copy
    (the moments are fresh zero-filled segments). Extra RAM: one tensor at a time."""
    master = store.get("master", stage.index)
    if store.has("master_comp", stage.index):  # the lean state: its compensation holds what bf16 dropped
        comp = store.get("master_comp", stage.index)
        for slot in stage.slots:
            tensor = source[stage.hf_name(slot)]
            finite_or_refuse(tensor, stage.hf_name(slot), source.dir)
            span = slice(slot.offset, slot.offset + slot.numel)
            write_compensated(master[span], comp[span], tensor.reshape(-1))
        return
    load_hf_master(master, stage, source)
    if store.has("stream", stage.index):
        store.get("stream", stage.index).copy_(master)
