"""The checkpoint file of tensors trained on the device by torch.optim.AdamW (LoRA's adapters, engine/adapters.py;
a vision-language model's tower and projector, engine/vision_tier.py): the tensors by name, their moments as
`optimizer.exp_avg.<name>` / `optimizer.exp_avg_sq.<name>`, AdamW's step count in the metadata and the manifest
entry (store/safetensors_io.py's format: size and CRC-32 checked on read)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.store.safetensors_io import read_safetensors_into, write_safetensors

MOMENTS = ("exp_avg", "exp_avg_sq")


def adam_step(named: Mapping[str, torch.Tensor], optimizer: Any) -> int:
    """AdamW's step count: the first tensor's with a state (0 before the first step)."""
    for t in named.values():
        state = optimizer.state.get(t)
        if state:
            return int(state["step"])
    return 0


def save_adam_state(path: Path, named: Mapping[str, torch.Tensor], optimizer: Any, metadata: dict[str, str]) -> dict:
    """Write `named` and their moments (zeros before the first step) to `path`; the manifest entry, with
    `adam_step`."""
    tensors = [(n, t.detach().cpu()) for n, t in named.items()]
    for kind in MOMENTS:
        for n, t in named.items():
            state = optimizer.state.get(t)
            tensors.append((f"optimizer.{kind}.{n}", (state[kind] if state else torch.zeros_like(t)).detach().cpu()))
    step = adam_step(named, optimizer)
    entry = write_safetensors(path, tensors, {**metadata, "adam_step": str(step)})
    entry["adam_step"] = step
    return entry


def load_adam_state(directory: Path, entry: dict, named: Mapping[str, torch.Tensor], optimizer: Any) -> None:
    """Restore `named`, their moments (on each tensor's device) and AdamW's step count from the file of `entry` in
    the checkpoint `directory`."""
    targets: dict[str, torch.Tensor] = {}
    staged: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
    for n, t in named.items():
        flats = {kind: torch.empty(t.shape, dtype=t.dtype) for kind in ("param", *MOMENTS)}
        targets[n] = flats["param"]
        targets.update({f"optimizer.{kind}.{n}": flats[kind] for kind in MOMENTS})
        staged.append((t, flats))
    path = directory / entry["path"]
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory} has no {Path(entry['path']).name}")
    read_safetensors_into(path, targets, entry)
    step = int(entry.get("adam_step", 0))
    optimizer.state.clear()
    with torch.no_grad():
        for t, flats in staged:
            t.copy_(flats["param"])
            if step:  # torch's AdamW keeps its step count as a CPU tensor, its moments on the tensor's device
                optimizer.state[t] = {"step": torch.tensor(float(step)),
                                      **{kind: flats[kind].to(t.device) for kind in MOMENTS}}
