"""Token batches: deterministic per step, every window once per epoch, clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from megatrain_ray.config.loop_sections import DataConfig
from megatrain_ray.data.token_batches import TokenBatches
from megatrain_ray.exceptions import DataError


def test_batches_are_a_function_of_the_step_and_cover_each_epoch(tmp_path):
    tokens = np.arange(1 + 10 * 8, dtype=np.int64) % 50
    np.save(tmp_path / "t.npy", tokens)
    cfg = DataConfig(path=str(tmp_path / "t.npy"), seq_len=8, batch_size=2, seed=5)
    data = TokenBatches(cfg, vocab_size=50)
    again = TokenBatches(cfg, vocab_size=50)
    first_epoch = [data.tokens_of(s) for s in range(5)]
    assert all(np.array_equal(a, again.tokens_of(s)) for s, a in enumerate(first_epoch))
    starts = sorted(int(row[0]) for b in first_epoch for row in b)
    assert starts == sorted(int(tokens[w * 8]) for w in range(10))  # each window exactly once
    windows = [tokens[w * 8:w * 8 + 9] for w in range(10)]
    for batch in first_epoch:
        for row in batch.numpy():
            assert any(np.array_equal(row, w) for w in windows)
    assert not all(np.array_equal(data.tokens_of(s), data.tokens_of(s + 5)) for s in range(5))  # new order per epoch


def test_windows_are_contiguous_slices(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 1000, 1001).astype(np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    data = TokenBatches(DataConfig(path=str(tmp_path / "t.bin"), seq_len=100, batch_size=3, shuffle=False), 1000)
    batch = data.tokens_of(1).numpy()
    assert np.array_equal(batch[0], tokens[300:401])


def test_text_is_bytes(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, " * 20)
    batch = TokenBatches(DataConfig(path=str(tmp_path / "a.txt"), seq_len=16, batch_size=2), 256).tokens_of(0)
    assert batch.shape == (2, 17) and int(batch.max()) < 128


def test_synthetic_is_seeded():
    cfg = DataConfig(path="synthetic", seq_len=16, batch_size=2, seed=1)
    assert np.array_equal(TokenBatches(cfg, 100).tokens_of(3), TokenBatches(cfg, 100).tokens_of(3))


def test_errors_name_the_field(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        TokenBatches(DataConfig(path=str(tmp_path / "missing.npy")), 100)
    np.save(tmp_path / "big.npy", np.array([0, 5, 200] * 100, dtype=np.int32))
    with pytest.raises(DataError, match="model.vocab_size"):
        TokenBatches(DataConfig(path=str(tmp_path / "big.npy"), seq_len=8, batch_size=1), 100).tokens_of(0)
    np.save(tmp_path / "float.npy", np.zeros(100, dtype=np.float32))
    with pytest.raises(DataError, match="integer"):
        TokenBatches(DataConfig(path=str(tmp_path / "float.npy"), seq_len=8), 100)
