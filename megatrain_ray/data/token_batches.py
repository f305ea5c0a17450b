"""Training batches of a token stream (a token file, byte-level text, synthetic): non-overlapping windows of
seq_len + 1 tokens (the inputs and their shifted labels). Sample k of the run is window perm_e[k mod n] of epoch
e = k // n, where perm_e is a permutation seeded by (data.seed, e) (data/batches.py holds the prepared documents'
batches and picks between the two)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from megatrain_ray.config.loop_sections import DataConfig
from megatrain_ray.exceptions import DataError
from megatrain_ray.messages import Batch

_BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "int64": np.int64}


def load_tokens(cfg: DataConfig) -> np.ndarray:
    path = Path(cfg.path)
    if not path.is_file():
        raise DataError(f"data.path={cfg.path!r}: no such file (give a .npy, .bin or .txt file, or 'synthetic')")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return np.frombuffer(path.read_bytes(), dtype=np.uint8)
    if suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise DataError(f"data.path={cfg.path!r} is not a plain .npy array: {exc}") from exc
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(f"data.path={cfg.path!r} must hold a 1-D integer array, got {tokens.dtype} "
                            f"of shape {tokens.shape}")
        return tokens
    if suffix == ".bin":
        itemsize = np.dtype(_BIN_DTYPES[cfg.token_dtype]).itemsize
        if path.stat().st_size % itemsize or not path.stat().st_size:
            raise DataError(f"data.path={cfg.path!r} has {path.stat().st_size} bytes, not a whole number of "
                            f"{cfg.token_dtype} tokens ({itemsize} bytes each): set data.token_dtype to the "
                            "type it was written with")
        return np.memmap(path, dtype=_BIN_DTYPES[cfg.token_dtype], mode="r")
    raise DataError(f"data.path={cfg.path!r}: unknown file type {suffix!r}; use .npy, .bin (with data.token_dtype) "
                    "or .txt")


def token_range(tokens: np.ndarray, chunk: int = 1 << 26) -> tuple[int, int]:
    """(min, max) of a token file, read in chunks so a memory-mapped file is never loaded whole."""
    low, high = 0, 0
    for begin in range(0, len(tokens), chunk):
        part = np.asarray(tokens[begin:begin + chunk])
        low, high = min(low, int(part.min())), max(high, int(part.max()))
    return low, high


class TokenBatches:
    def __init__(self, cfg: DataConfig, vocab_size: int):
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.window = cfg.seq_len + 1
        if cfg.path == "synthetic":
            self.tokens = None
            self.num_windows = 0
            return
        self.tokens = load_tokens(cfg)
        self.num_windows = (len(self.tokens) - 1) // cfg.seq_len
        if self.num_windows < cfg.batch_size:
            raise DataError(f"data.path={cfg.path!r} holds {len(self.tokens)} tokens: fewer than "
                            f"data.batch_size={cfg.batch_size} sequences of data.seq_len={cfg.seq_len} + 1; "
                            f"lower data.seq_len or data.batch_size, or give more data")
        self._perm_epoch = -1
        self._perm = np.arange(self.num_windows)
        low, high = token_range(self.tokens)
        if high >= vocab_size or low < 0:
            raise DataError(f"data.path={cfg.path!r} holds token id {high if high >= vocab_size else low} outside "
                            f"model.vocab_size={vocab_size}: the file was tokenized for another model")

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm_epoch = epoch
            if self.cfg.shuffle:
                self._perm = np.random.default_rng([self.cfg.seed, epoch]).permutation(self.num_windows)
            else:
                self._perm = np.arange(self.num_windows)
        return self._perm

    def batch(self, step: int) -> Batch:
        """The inputs and shifted labels of step `step`."""
        return Batch.from_tokens(self.tokens_of(step))

    def tokens_of(self, step: int) -> torch.Tensor:
        """[batch_size, seq_len + 1] int64 token ids of step `step` (inputs plus the next token)."""
        b, t = self.cfg.batch_size, self.cfg.seq_len
        if self.tokens is None:
            rng = np.random.default_rng([self.cfg.seed, step])
            return torch.from_numpy(rng.integers(0, self.vocab_size, (b, t + 1), dtype=np.int64))
        rows = []
        for k in range(step * b, step * b + b):
            window = int(self._order(k // self.num_windows)[k % self.num_windows])
            rows.append(np.asarray(self.tokens[window * t: window * t + self.window], dtype=np.int64))
        out = np.stack(rows)
        top = int(out.max())
        if top >= self.vocab_size or int(out.min()) < 0:
            raise DataError(f"data.path={self.cfg.path!r} holds token id {top if top >= self.vocab_size else out.min()}"
                            f" outside model.vocab_size={self.vocab_size} (step {step})")
        return torch.from_numpy(out)

    def epoch_of(self, step: int) -> float:
        if not self.num_windows:
            return 0.0
        return step * self.cfg.batch_size / self.num_windows
