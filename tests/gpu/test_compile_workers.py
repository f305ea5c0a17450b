"""engine/compiled.py compile_in_process on a GPU, where Inductor would otherwise start its pool of compile worker
processes (it serves the Triton backend)."""

from __future__ import annotations

import pytest

from tests.unit.test_compile_in_process import probe


@pytest.mark.gpu
def test_no_compile_workers_run_beside_a_gpu_worker():
    """With Triton (CUDA), the pool of compile worker processes starts unless compile_in_process ran first (the
    `gpu` marker skips it without CUDA: tests/conftest.py)."""
    assert probe("cuda") == (1, 0)
    threads, children = probe("cuda", TORCHINDUCTOR_COMPILE_THREADS="2")
    assert threads == 2 and children >= 1
