"""A prepared split's images: each document's processor output (prepare/vision_docs.py), kept as bytes.

The shards' `images` column (safetensors bytes of a document's image tensors, null for a document without images)
is streamed row group by row group into an unlinked temporary file under TMPDIR, memory-mapped, so memory holds
only the per-document offsets, as for the tokens (data/batches.py Documents). A batch's images are its documents'
tensors concatenated along their first dimension in row order (images, or Qwen-VL's patches and grid rows): the
ImageInputs the engine hands to the model's get_image_features; no image is decoded when training.
"""

from __future__ import annotations

import tempfile

import numpy as np
import torch

from megatrain_ray.config.hf_vision import vision_config_of_dir
from megatrain_ray.exceptions import DataError, excerpt
from megatrain_ray.messages import ImageInputs

IMAGES_COLUMN = "images"  # prepare/shards.py IMAGES_COLUMN
PIXELS = "pixel_values"


def check_images_fit(store: ImageStore | None, model_path: str, packing: bool, where: str) -> None:
    """Images are for a vision-language model, one document a row: refused otherwise, before anything starts."""
    if store is None or not store.documents_with_images:
        return
    if vision_config_of_dir(model_path) is None:
        raise DataError(f"{where} holds images ({store.documents_with_images} documents with them) but "
                        f"model.path={model_path!r} is not a vision-language model the vision path takes: set "
                        "model.path to the model whose processor prepared the data")
    if packing:
        raise DataError(f"{where} holds images: set data.packing=false (samples with images are one document a "
                        "row)")


class ImageStore:
    """The images of one split's documents (None where a shard has no images column: a text dataset)."""

    def __init__(self, shards: list, where: str, rows_per_batch: int = 256):
        self.where = where
        starts, lengths = [], []
        total = 0
        self._file = tempfile.TemporaryFile()
        for shard in shards:
            if IMAGES_COLUMN not in shard.schema_arrow.names:
                raise DataError(f"{where}: some shards have an {IMAGES_COLUMN!r} column and others not; prepare "
                                "the data again")
            for batch in shard.iter_batches(batch_size=rows_per_batch, columns=[IMAGES_COLUMN]):
                for blob in batch.column(0).to_pylist():
                    starts.append(total)
                    lengths.append(-1 if blob is None else len(blob))
                    if blob:
                        self._file.write(blob)
                        total += len(blob)
        self.starts, self.lengths = np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64)
        self._file.flush()
        self._bytes = np.memmap(self._file, dtype=np.uint8, mode="r", shape=(total,)) if total else None
        self.documents_with_images = int((self.lengths >= 0).sum())

    @staticmethod
    def of(shards: list, where: str) -> ImageStore | None:
        """The split's images, or None for a split whose shards have no images column."""
        if not any(IMAGES_COLUMN in shard.schema_arrow.names for shard in shards):
            return None
        return ImageStore(shards, where)

    def tensors(self, doc: int) -> dict[str, torch.Tensor] | None:
        from safetensors.numpy import load  # lazy: only vision-language data needs it

        n = int(self.lengths[doc])
        if n < 0:
            return None
        start = int(self.starts[doc])
        try:
            arrays = load(bytes(self._bytes[start:start + n])) if n else {}
        except Exception as exc:  # safetensors raises its own error type for damaged bytes
            raise DataError(f"{self.where}: the images of document {doc} are not readable "
                            f"({excerpt(str(exc), 100)}); prepare the data again") from None
        if PIXELS not in arrays:
            raise DataError(f"{self.where}: the images of document {doc} have no {PIXELS!r}; prepare the data again")
        return {k: torch.from_numpy(np.array(v)) for k, v in arrays.items()}

    def batch_images(self, docs: list[int]) -> ImageInputs | None:
        """The ImageInputs of documents `docs` (in row order); None when none of them has an image."""
        parts = [t for t in (self.tensors(d) for d in docs) if t is not None]
        if not parts:
            return None
        keys = list(parts[0])
        for p in parts[1:]:
            if list(p) != keys:
                raise DataError(f"{self.where}: documents' images hold different tensors ({keys} against "
                                f"{list(p)}); prepare the data again with one processor")
        joined = {k: torch.cat([p[k] for p in parts], dim=0) for k in keys}
        pixels = joined.pop(PIXELS)
        return ImageInputs(pixels, joined)
