"""benchmarks/optimizer_scaling.py runs end to end at a tiny size (the real sweep runs on the GPU machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tests.conftest import REPO


def test_optimizer_scaling_benchmark_writes_its_json_and_plot(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/optimizer_scaling.py", "--params", "200000", "--max-workers",
                           "2", "--repeats", "2", "--speculative", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, check=False,
                          timeout=120, env={**os.environ, "PYTHONPATH": REPO, "MEGATRAIN_COMMIT": "test"})
    assert proc.returncode == 0, proc.stderr
    [result_file] = tmp_path.glob("optimizer-scaling-*.json")
    result = json.loads(result_file.read_text())
    assert result["commit"] == "test" and result["cores"] >= 1 and result["numa_nodes"]
    solo = [r for r in result["rows"] if not r["h2d"]]
    assert [(r["workers"], r["speculative"]) for r in solo] == [(1, False), (1, True), (2, False), (2, True)]
    assert all(r["gparams_per_s"] > 0 for r in solo)
    assert all(len(r["core_map"]) == r["workers"] for r in result["rows"])
    if not torch.cuda.is_available():
        assert result["h2d"].startswith("skipped") and len(result["rows"]) == 4
    assert result_file.with_suffix(".png").stat().st_size > 0
