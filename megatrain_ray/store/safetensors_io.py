"""Safetensors files streamed between disk and the host store: written with their CRC-32 in one pass over
the bytes, read back straight into segment views with every size, dtype, shape and the checksum checked.

A checkpoint's stage files are plain safetensors (any reader opens them); nothing is ever pickled.
Disk-tier tensors (store/disk_tier.DiskTensor) go through a bounce buffer a chunk at a time.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.store.disk_tier import DiskTensor, byte_view

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16",
                       torch.uint8: "U8"}  # U8: the lean state's 8-bit moments (optimizer.lean_moments=int8)
_CHUNK = 64 << 20


def _header(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        entries[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


def _chunks(t: torch.Tensor | DiskTensor, write: bool) -> Iterator[memoryview]:
    """A tensor's bytes, _CHUNK at a time: views of its memory, or a bounce buffer for a disk-tier file,
    read from the file before each chunk is handed out (`write` False) or written to it once the caller
    has filled the chunk, when the next one is asked for (`write` True)."""
    if not isinstance(t, DiskTensor):
        view = byte_view(t)
        for begin in range(0, len(view), _CHUNK):
            yield view[begin:begin + _CHUNK]
        return
    bounce = memoryview(bytearray(min(_CHUNK, t.nbytes)))
    for begin in range(0, t.nbytes, _CHUNK):
        chunk = bounce[:min(_CHUNK, t.nbytes - begin)]
        if not write:
            t.read_bytes(begin, chunk)
        yield chunk
        if write:
            t.write_bytes(begin, chunk)


def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> dict:
    """Stream the tensors to `path` (fsynced); returns {path, bytes, crc32} of the whole file."""
    header = _header(tensors, metadata)
    crc = zlib.crc32(header)
    size = len(header)
    with open(path, "wb") as f:
        f.write(header)
        for _, t in tensors:
            for chunk in _chunks(t, write=False):
                crc = zlib.crc32(chunk, crc)
                f.write(chunk)
                size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return {"path": path.name, "bytes": size, "crc32": crc}


def read_safetensors_into(path: Path, targets: dict[str, torch.Tensor], expect: dict) -> None:
    """Read a file written by write_safetensors straight into `targets` (views into segments), checking
    its size, every tensor's dtype and shape, and the CRC-32 of the whole file."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete") from None
    if size != expect["bytes"]:
        raise CheckpointError(f"checkpoint file {path} has {size} bytes, the manifest says {expect['bytes']}: "
                              "it is truncated or was changed")
    with open(path, "rb") as f:
        raw_len = f.read(8)
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > size:
            raise CheckpointError(f"checkpoint file {path}: corrupt safetensors header")
        header_bytes = f.read(header_len)
        crc = zlib.crc32(header_bytes, zlib.crc32(raw_len))
        try:
            header = json.loads(header_bytes)
        except ValueError:
            raise CheckpointError(f"checkpoint file {path}: corrupt safetensors header") from None
        entries = sorted(((v["data_offsets"][0], k, v) for k, v in header.items() if k != "__metadata__"))
        missing = set(targets) - {k for _, k, _ in entries}
        if missing:
            raise CheckpointError(f"checkpoint file {path} lacks tensor {sorted(missing)[0]!r}: it was written for "
                                  "another model shape")
        for _, name, entry in entries:
            target = targets.get(name)
            if target is None or entry["dtype"] != _SAFETENSORS_DTYPES.get(target.dtype) \
                    or list(target.shape) != entry["shape"]:
                raise CheckpointError(f"checkpoint file {path}: tensor {name!r} is {entry['dtype']} "
                                      f"{entry['shape']}, this run expects "
                                      f"{_SAFETENSORS_DTYPES.get(target.dtype) if target is not None else 'none'} "
                                      f"{list(target.shape) if target is not None else ''}: the checkpoint belongs "
                                      "to another model or precision")
            for chunk in _chunks(target, write=True):
                if f.readinto(chunk) != len(chunk):
                    raise CheckpointError(f"checkpoint file {path} ends early")
                crc = zlib.crc32(chunk, crc)
    if crc != expect["crc32"]:
        raise CheckpointError(f"checkpoint file {path}: CRC-32 mismatch (the file is corrupt); use an older "
                              "checkpoint or start afresh")
