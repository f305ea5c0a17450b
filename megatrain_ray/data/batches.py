"""Training batches: a token stream (token file, byte-level text, synthetic) or prepared documents.

Token streams (`TokenBatches`, data/token_batches.py) are cut into non-overlapping windows of seq_len + 1 tokens (the
inputs and their shifted labels). Sample k of the run is window perm_e[k mod n] of epoch
e = k // n, where perm_e is a permutation seeded by (data.seed, e).

Prepared documents (`DocumentBatches`, a directory written by `megatrain prepare`) become rows:
one document per row (padded), or with data.packing several whole documents per row, each
with its own RoPE positions and attention span. Epoch e's rows come from perm_e the same way.
Either way the batch of a step is a pure function of (data.seed, step): resuming needs only
the step. Prepared shards are never read whole: they are streamed row group by row group, checked,
into memory-mapped files (under TMPDIR), so the process holds only the documents' offsets.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from megatrain_ray.config.loop_sections import DataConfig
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.data.image_store import ImageStore, check_images_fit
from megatrain_ray.data.token_batches import TokenBatches
from megatrain_ray.exceptions import ConfigError, DataError, excerpt
from megatrain_ray.messages import IGNORE_INDEX, Batch
from megatrain_ray.system.files import contained, read_json_object

# ----------------------------------------------------------------------------- prepared documents

# The columns a prepared shard holds: lists of integers (token ids; 0/1 loss mask).
SHARD_COLUMNS = ("input_ids", "loss_mask")


def _open_shard(path: Path, where: str):
    """One parquet shard of a prepared directory, opened (not read), its columns and their types checked."""
    import pyarrow as pa  # lazy: start-up time
    import pyarrow.parquet as pq

    if not path.is_file():
        raise DataError(f"{where}: shard {path.name} is missing; copy the whole prepared directory or prepare "
                        "it again")
    try:
        shard = pq.ParquetFile(path)
        schema = shard.schema_arrow
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{where}: shard {path.name} is not a readable parquet file ({excerpt(str(exc), 120)}); "
                        "prepare the data again") from None
    rows = shard.metadata.num_rows
    for column in SHARD_COLUMNS:
        if column not in schema.names:
            raise DataError(f"{where}: shard {path.name} has no {column!r} column (it has "
                            f"{', '.join(schema.names) or 'none'}); give a directory written by "
                            "`megatrain prepare`")
        kind = schema.field(column).type
        if rows and not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) \
                or rows and not (pa.types.is_integer(kind.value_type) or
                                 (column == "loss_mask" and pa.types.is_boolean(kind.value_type))):
            raise DataError(f"{where}: shard {path.name} column {column!r} is {kind}, not a list of integers "
                            "(token ids must be whole numbers); prepare the data again")
    return shard


def _mapped(f, dtype: np.dtype, total: int) -> np.ndarray:
    """A written temporary file as a read-only memory map: its pages are the page cache's, read back as
    training touches them, not the process's own memory."""
    if not total:
        return np.zeros(0, dtype=dtype)
    f.flush()
    return np.memmap(f, dtype=dtype, mode="r", shape=(total,))


class Documents:
    """One split of a prepared directory. The shards are read row group by row group (checked as they come)
    into memory-mapped flat arrays of token ids and loss mask (an unlinked file under TMPDIR), so memory holds
    only the per-document offsets, whatever the size of the split."""

    def __init__(self, directory: str, split: str, key: str):
        root = Path(directory)
        manifest_path = root / "manifest.json"
        if not manifest_path.is_file():
            raise DataError(f"{key}={directory!r} has no manifest.json: give a directory written by "
                            "`megatrain prepare`")
        where = f"{key}={directory!r}: manifest.json"
        self.manifest = read_json_object(manifest_path, where, DataError)
        splits = self.manifest.get("splits")
        if not isinstance(splits, dict):
            raise DataError(f"{where} has no 'splits' mapping; prepare the data again with `megatrain prepare`")
        split_info = splits.get(split)
        if split_info is None:
            raise DataError(f"{key}={directory!r} has no {split!r} split (it has "
                            f"{', '.join(map(str, splits))}); run megatrain prepare with --eval-fraction")
        files = split_info.get("files") if isinstance(split_info, dict) else None
        if not isinstance(files, list) or not files:
            raise DataError(f"{where}: split {split!r} lists no shard files; prepare the data again")
        self.where = f"{key}={directory!r} ({split})"
        shards = [_open_shard(contained(root, f, where, DataError), self.where) for f in files]
        if not sum(shard.metadata.num_rows for shard in shards):
            raise DataError(f"{self.where} holds no documents")
        self._stream(shards)
        self.images = ImageStore.of(shards, self.where)  # a vision-language model's data: each document's images

    def _stream(self, shards: list, rows_per_batch: int = 4096) -> None:
        """Row groups in order, checked, appended to two unlinked temporary files (under TMPDIR) that are then
        memory-mapped: memory holds one batch of rows and the per-document offsets."""
        import tempfile

        dtype = np.result_type(*(shard.schema_arrow.field("input_ids").type.value_type.to_pandas_dtype()
                                 for shard in shards if shard.metadata.num_rows))
        lengths: list[np.ndarray] = []
        self.low = self.high = total = 0
        with tempfile.TemporaryFile() as token_file, tempfile.TemporaryFile() as mask_file:
            for shard in shards:
                for batch in shard.iter_batches(batch_size=rows_per_batch, columns=list(SHARD_COLUMNS)):
                    values, mask_values, offsets = self._checked(batch.column(0), batch.column(1))
                    if len(values):
                        self.low, self.high = min(self.low, int(values.min())), max(self.high, int(values.max()))
                    token_file.write(values.astype(dtype, copy=False).tobytes())
                    mask_file.write(mask_values.astype(np.uint8, copy=False).tobytes())
                    lengths.append(np.diff(offsets))
                    total += len(values)
            self.tokens = _mapped(token_file, dtype, total)  # ids as stored (int32); rows are int64
            self.mask = _mapped(mask_file, np.uint8, total)
        self.lengths = np.concatenate(lengths).astype(np.int64)
        self.starts = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.starts[1:])

    def _checked(self, ids, mask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token ids, loss mask, offsets) of one batch of rows, or the DataError that says what is wrong."""
        offsets, mask_offsets = ids.offsets.to_numpy(), mask.offsets.to_numpy()
        if not np.array_equal(offsets - offsets[0], mask_offsets - mask_offsets[0]):
            raise DataError(f"{self.where}: input_ids and loss_mask differ in length; prepare the data again")
        values, mask_values = ids.flatten(), mask.flatten()
        if values.null_count or mask_values.null_count or ids.null_count or mask.null_count:
            raise DataError(f"{self.where}: input_ids or loss_mask holds missing (null) values; prepare the data "
                            "again")
        values, mask_values = values.to_numpy(zero_copy_only=False), mask_values.to_numpy(zero_copy_only=False)
        if len(mask_values) and (int(mask_values.min()) < 0 or int(mask_values.max()) > 1):
            raise DataError(f"{self.where}: loss_mask holds values other than 0 and 1; prepare the data again")
        return values, mask_values, offsets

    def __len__(self) -> int:
        return len(self.lengths)

    def check_vocabulary(self, model: ModelConfig) -> None:
        """Every token id inside model.vocab_size (the data was tokenized for this model)."""
        if self.high >= model.vocab_size or self.low < 0:
            bad = self.high if self.high >= model.vocab_size else self.low
            hint = ("model.path is empty, so the model is the config's random-init shape: set model.path to the "
                    "model whose tokenizer prepared the data") if not model.path else \
                "prepare it with the model's own tokenizer"
            raise DataError(f"{self.where} holds token id {bad} outside model.vocab_size={model.vocab_size}; {hint}")

    def check(self, model: ModelConfig, seq_len: int) -> None:
        """Token ids inside the vocabulary, documents that fit: raised before anything is allocated."""
        if not len(self):
            raise DataError(f"{self.where} holds no documents")
        self.check_vocabulary(model)
        if int(self.lengths.min()) < 2:
            raise DataError(f"{self.where}: document {int(self.lengths.argmin())} has fewer than 2 tokens, so no "
                            "target; prepare the data with `megatrain prepare`, which drops such documents")
        longest = int(self.lengths.max())
        doc = int(self.lengths.argmax())
        if longest > model.max_position_embeddings:
            raise DataError(f"{self.where}: document {doc} has {longest} tokens, more than the model's "
                            f"max_position_embeddings={model.max_position_embeddings}; prepare it again with "
                            f"--seq-len {min(model.max_position_embeddings, seq_len + 1)}")
        if longest > seq_len + 1:
            raise DataError(f"{self.where}: document {doc} has {longest} tokens, more than data.seq_len + 1 = "
                            f"{seq_len + 1}; raise data.seq_len or prepare it again with --seq-len {seq_len + 1}")


class DocumentBatches:
    """Rows of whole documents, packed (data.packing) or one per row; see the module docstring."""

    def __init__(self, cfg: DataConfig, model: ModelConfig, directory: str, split: str = "train",
                 key: str = "data.path", evaluation: bool = False):
        self.cfg = cfg
        self.shuffle = cfg.shuffle and not evaluation  # evaluation reads the same rows every time
        self.docs = Documents(directory, split, key)
        self.docs.check(model, cfg.seq_len)
        check_images_fit(self.docs.images, model.path, cfg.packing, self.docs.where)
        self._plan_cache: tuple[int, list[list[int]]] = (-1, [])
        self._rows_per_epoch: list[int] = []  # packed epochs differ in row count; only counts are kept
        if not evaluation and self._rows_in(0) < cfg.batch_size:
            raise DataError(f"{self.docs.where} fills {self._rows_in(0)} rows of data.seq_len={cfg.seq_len}, "
                            f"fewer than data.batch_size={cfg.batch_size}; lower data.batch_size or add data")

    def _plan(self, epoch: int) -> list[list[int]]:
        """The rows of an epoch, each a list of document indices, in training order (the last one cached)."""
        if self._plan_cache[0] == epoch:
            return self._plan_cache[1]
        n = len(self.docs)
        order = np.random.default_rng([self.cfg.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        if not self.cfg.packing:
            rows = [[int(d)] for d in order]
        else:
            rows, used = [[]], 0
            for d in order:
                need = int(self.docs.lengths[d]) - 1  # a document of L tokens gives L - 1 (input, label) pairs
                if used + need > self.cfg.seq_len:
                    rows.append([])
                    used = 0
                rows[-1].append(int(d))
                used += need
        self._plan_cache = (epoch, rows)
        return rows

    def _rows_in(self, epoch: int) -> int:
        while len(self._rows_per_epoch) <= epoch:
            e = len(self._rows_per_epoch)
            self._rows_per_epoch.append(len(self._plan(e)) if self.cfg.packing or not e else self._rows_per_epoch[0])
        return self._rows_per_epoch[epoch]

    def _locate(self, k: int) -> tuple[int, int]:
        """(epoch, row within it) of row k of the run: epochs follow each other, each with its own order."""
        epoch = 0
        while k >= self._rows_in(epoch):
            k -= self._rows_in(epoch)
            epoch += 1
        return epoch, k

    def _row(self, k: int) -> list[int]:
        epoch, row = self._locate(k)
        return self._plan(epoch)[row]

    def batch(self, step: int) -> Batch:
        b = self.cfg.batch_size
        return self.rows_batch([self._row(k) for k in range(step * b, step * b + b)])

    def eval_batches(self, count: int) -> list[Batch]:
        """The first `count` batches of the (unshuffled) split, fewer when it has fewer rows."""
        rows, b = self._plan(0), self.cfg.batch_size
        return [self.rows_batch(rows[k:k + b]) for k in range(0, min(len(rows), count * b), b)]

    def rows_batch(self, rows: list[list[int]]) -> Batch:
        t = self.cfg.seq_len
        ids = np.zeros((len(rows), t), dtype=np.int64)
        labels = np.full((len(rows), t), IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros((len(rows), t), dtype=np.int64) if self.cfg.packing else None
        segments = []
        for r, row in enumerate(rows):
            used, lengths = 0, []
            for d in row:
                start, end = int(self.docs.starts[d]), int(self.docs.starts[d + 1])
                n = end - start - 1
                ids[r, used:used + n] = self.docs.tokens[start:end - 1]
                target = self.docs.tokens[start + 1:end]
                labels[r, used:used + n] = np.where(self.docs.mask[start + 1:end] == 1, target, IGNORE_INDEX)
                if positions is not None:
                    positions[r, used:used + n] = np.arange(n)
                lengths.append(n)
                used += n
            if used < t:  # padding: a segment of its own, so it never joins a document's attention
                lengths.append(t - used)
                if positions is not None:
                    positions[r, used:] = np.arange(t - used)
            segments.append(tuple(lengths))
        if not self.cfg.packing:
            images = self.docs.images.batch_images([d for row in rows for d in row]) if self.docs.images else None
            return Batch(torch.from_numpy(ids), torch.from_numpy(labels), images=images)
        return Batch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(positions), tuple(segments))

    def epoch_of(self, step: int) -> float:
        epoch, row = self._locate(step * self.cfg.batch_size)
        return epoch + row / self._rows_in(epoch)


def is_prepared(path: str) -> bool:
    return Path(path).is_dir()


def refuse_missing(path: str, key: str, wanted: str) -> None:
    """A data path that does not exist is called missing (not a wrong kind of data), naming the key."""
    if not Path(path).exists():
        raise DataError(f"{key}={path!r}: no such file or directory; give {wanted} (a relative path is taken beside "
                        "the config file, then in the working directory)")


def make_batches(cfg: DataConfig, model: ModelConfig) -> TokenBatches | DocumentBatches:
    """The training batches data.path describes."""
    if is_prepared(cfg.path):
        return DocumentBatches(cfg, model, cfg.path)
    if cfg.path != "synthetic":
        refuse_missing(cfg.path, "data.path", "a directory written by `megatrain prepare`, a token file (.npy, .bin or "
                       ".txt) or 'synthetic'")
    if cfg.packing:
        raise ConfigError(f"data.packing needs documents: data.path={cfg.path!r} is a token stream; give a "
                          "directory written by `megatrain prepare`, or set data.packing=false")
    return TokenBatches(cfg, model.vocab_size)


def make_eval_batches(cfg: DataConfig, model: ModelConfig, count: int) -> list[Batch]:
    """train.eval_batches fixed batches: data.eval_path's documents, else the eval split of data.path."""
    if cfg.eval_path:
        refuse_missing(cfg.eval_path, "data.eval_path", "a directory written by `megatrain prepare`")
        if not is_prepared(cfg.eval_path):
            raise ConfigError(f"data.eval_path={cfg.eval_path!r} is not a directory written by `megatrain prepare`")
        source = DocumentBatches(cfg, model, cfg.eval_path, "train", "data.eval_path", evaluation=True)
    elif is_prepared(cfg.path):
        source = DocumentBatches(cfg, model, cfg.path, "eval", "data.path", evaluation=True)
    else:
        raise ConfigError("train.eval_every needs evaluation documents: set data.eval_path, or prepare data.path "
                          "with --eval-fraction")
    return source.eval_batches(count)
