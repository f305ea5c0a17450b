"""benchmarks/lean_pretrain.py's comparison of the full and lean runs (off the GPU machine)."""

from __future__ import annotations

import pytest

from benchmarks.lean_pretrain import host_memory, summary


def test_final_losses_are_the_tail_means_of_the_steps_both_runs_reached():
    full = [5.0, 4.0, 3.0, 2.0, 1.0]
    lean = [5.0, 4.0, 3.3, 2.2]  # cut one step short: only the first 4 steps are compared
    got = summary({"full": {"losses": full}, "lean": {"losses": lean}}, tail=2)
    assert got["steps_compared"] == 4 and got["tail"] == 2
    assert got["final_full"] == pytest.approx(2.5) and got["final_lean"] == pytest.approx(2.75)
    assert got["final_ratio"] == pytest.approx(1.1)
    assert got["last_ratio"] == pytest.approx(1.1)
    assert got["per_100_steps_rel_diff"] == []  # fewer than 100 steps: no window
    assert got["max_abs_window_rel_diff"] is None and got["max_abs_window_from_step"] is None


def test_windows_of_100_steps_and_a_tail_longer_than_the_runs():
    full = [2.0] * 250
    lean = [2.0] * 100 + [2.2] * 150
    got = summary({"full": {"losses": full}, "lean": {"losses": lean}}, tail=1000)
    assert got["tail"] == 250 and got["final_ratio"] == pytest.approx((100 * 2.0 + 150 * 2.2) / 500)
    assert [w["from_step"] for w in got["per_100_steps_rel_diff"]] == [0, 100]
    assert [w["lean_over_full_minus_1"] for w in got["per_100_steps_rel_diff"]] == pytest.approx([0.0, 0.1])
    assert got["max_abs_window_rel_diff"] == pytest.approx(0.1) and got["max_abs_window_from_step"] == 100
    lower = summary({"full": {"losses": full}, "lean": {"losses": [2.0] * 100 + [1.7] * 100 + [2.2] * 50}}, tail=1)
    assert lower["max_abs_window_rel_diff"] == pytest.approx(0.15) and lower["max_abs_window_from_step"] == 100
    assert summary({"full": {"losses": []}, "lean": {"losses": [1.0]}}, tail=10) == {"steps_compared": 0}


def test_host_memory_counts_shared_segments_by_kind_and_the_rest_as_private(tmp_path):
    """The disk tier's moment files (host.moments_tier=disk) are no host memory: host_memory_bytes leaves them out,
    and so must the breakdown, else the private part comes out short by their size."""
    import os
    from types import SimpleNamespace

    from megatrain_ray.store.segments import SegmentSpec

    def written(name: str, size: int) -> str:
        path = tmp_path / name
        path.write_bytes(b"x" * size)
        return str(path)

    specs = [SegmentSpec(written("m", 8192), "float32", 2048, "master", 0),
             SegmentSpec(written("a", 4096), "float32", 1024, "exp_avg", 0, on_disk=True)]
    shm = os.stat(specs[0].path).st_blocks * 512
    trainer = SimpleNamespace(specs=specs, host_memory_bytes=lambda: shm + 1000)  # as Cluster.host_memory_bytes
    got = host_memory(trainer, 10)
    assert got["host_bytes_per_param"] == (shm + 1000) / 10
    assert got["host_breakdown_bytes_per_param"] == {"master": shm / 10, "private_rss": 100.0}
