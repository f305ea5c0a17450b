"""Writing a split as shards while it fills: memory holds one shard's documents at most.

A shard is written when its documents reach SHARD_TOKENS tokens (or DOCS_PER_SHARD documents); its
rows are shuffled by a permutation seeded with (seed, split, shard number) first, so the order inside
a shard is seeded but never needs more than the shard in memory. Rows go in row groups of
ROW_GROUP_ROWS, the unit training reads them in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SHARD_TOKENS = 1 << 22
DOCS_PER_SHARD = 50_000
ROW_GROUP_ROWS = 4096
SPLIT_IDS = {"train": 0, "eval": 1}
PAIR_ROLE = "pair_role"
"""Preference data: the column saying a row is a pair's chosen (0) or rejected (1) sequence; pairs are adjacent rows."""
PROMPT_COLUMNS = ("prompt", "columns", "record")
"""Prompt data (GRPO): the prompt as given (JSON text: a string, or a list of chat messages), the record's other
columns (JSON text of an object) and its record number in the input (files in order, from 0); `input_ids` holds the
prompt's tokens, `loss_mask` zeros."""
IMAGES_COLUMN = "images"
"""A vision-language model's data: a document's images as its processor returned them (pixel_values, and any
further tensor such as image_grid_thw), safetensors bytes; null for a document without images
(prepare/vision_docs.py writes them, data/image_store.py reads them)."""


def list_array(parts: list[np.ndarray], dtype: np.dtype, kind: pa.DataType) -> pa.Array:
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(values, type=kind))


class SplitWriter:
    """One split's shards, `{split}-{k:05d}.parquet`, and its totals for the manifest."""

    def __init__(self, directory: Path, split: str, seed: int, pairs: bool = False, images: bool = False):
        self.directory, self.split, self.seed, self.pairs = directory, split, seed, pairs
        self.with_images = images
        self.images: list[bytes | None] = []  # IMAGES_COLUMN of each row, vision-language data only
        self.image_count = 0
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.prompts: list[tuple[str, str, int]] = []  # PROMPT_COLUMNS of each row, prompt data only
        self.buffered = 0
        self.files: list[str] = []
        self.documents = self.tokens = self.loss_tokens = self.longest = 0

    def add(self, ids: np.ndarray, mask: np.ndarray, images: bytes | None = None) -> None:
        if self.with_images:
            self.images.append(images)
            self.image_count += images is not None
        self._append(ids, mask)
        if self.buffered >= SHARD_TOKENS or len(self.ids) >= DOCS_PER_SHARD:
            self.flush()

    def add_pair(self, chosen: np.ndarray, chosen_mask: np.ndarray, rejected: np.ndarray,
                 rejected_mask: np.ndarray) -> None:
        """A preference pair: two rows that stay adjacent (chosen first) in the shard, whatever its shuffle."""
        self._append(chosen, chosen_mask)
        self._append(rejected, rejected_mask)
        if self.buffered >= SHARD_TOKENS or len(self.ids) >= DOCS_PER_SHARD:
            self.flush()

    def add_prompt(self, ids: np.ndarray, prompt: str, columns: str, record: int) -> None:
        """A GRPO prompt: its tokens (no loss), the prompt and the other columns as JSON text, its record number."""
        self.prompts.append((prompt, columns, record))
        self.add(ids, np.zeros(len(ids), dtype=np.uint8))

    def _append(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self.ids.append(ids)
        self.masks.append(mask)
        self.buffered += len(ids)
        self.documents += 1
        self.tokens += len(ids)
        self.loss_tokens += int(np.count_nonzero(mask))
        self.longest = max(self.longest, len(ids))

    def flush(self) -> None:
        if not self.ids:
            return
        k = len(self.files)
        rng = np.random.default_rng([self.seed, SPLIT_IDS[self.split], k])
        if self.pairs:  # the pairs are shuffled, each one's two rows stay together
            order = (2 * rng.permutation(len(self.ids) // 2)[:, None] + np.arange(2)).reshape(-1)
        else:
            order = rng.permutation(len(self.ids))
        columns = {"input_ids": list_array([self.ids[i] for i in order], np.int32, pa.int32()),
                   "loss_mask": list_array([self.masks[i] for i in order], np.uint8, pa.uint8())}
        if self.pairs:
            columns[PAIR_ROLE] = pa.array(np.arange(len(order), dtype=np.uint8) % 2, type=pa.uint8())
        if self.prompts:
            for c, (name, kind) in enumerate(zip(PROMPT_COLUMNS, (pa.string(), pa.string(), pa.int64()))):
                columns[name] = pa.array([self.prompts[i][c] for i in order], type=kind)
        if self.with_images:
            columns[IMAGES_COLUMN] = pa.array([self.images[i] for i in order], type=pa.binary())
        table = pa.table(columns)
        name = f"{self.split}-{k:05d}.parquet"
        pq.write_table(table, self.directory / name, row_group_size=ROW_GROUP_ROWS)
        self.files.append(name)
        self.ids, self.masks, self.prompts, self.images, self.buffered = [], [], [], [], 0

    def summary(self) -> dict[str, Any]:
        self.flush()
        out = {"files": self.files, "documents": self.documents, "tokens": self.tokens,
               "loss_tokens": self.loss_tokens, "max_document_tokens": self.longest}
        if self.with_images:
            out["documents_with_images"] = self.image_count
        return out
