"""benchmarks/plan_table.py, the script that writes docs/plan-large-models.md (a test of the script, so it
imports it): every large config planned on every preset, and the committed doc holding every row."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.plan_table import CONFIGS, FIXTURE, MACHINES, RESULTS, fixture, markdown, row, validation_rows
from tests.conftest import REPO


def test_the_large_model_table_plans_every_config_on_every_preset(tmp_path):
    rows = [row(os.path.join(REPO, c), m) for c in CONFIGS for m in ("h100-1tb", "h200-1.5tb")]
    by = {(Path(r["config"]).stem, r["machine"]): r for r in rows}
    assert by["dense-120b", "h200-1.5tb"]["host_fits"] and not by["dense-120b", "h100-1tb"]["host_fits"]
    # 960 GiB with bf16 moments: under the 1 TB box's RAM, above it less the 5 % Ray's memory monitor keeps free.
    assert not by["dense-120b", "h100-1tb"]["host_fits_bf16_moments"]
    assert by["dense-120b", "h200-1.5tb"]["host_fits_bf16_moments"]
    assert all(r["gpu_fits"] and r["expected_tok_per_s"] > 0 for r in rows)
    # The config's batch fits an 80 GB GPU once the layer inputs go to host memory (auto); not needed on an H200.
    assert by["llama3-70b", "h100-1tb"]["activation_offload"]
    assert by["llama3-70b", "h100-1tb"]["batch_size"] == by["llama3-70b", "h100-1tb"]["config_batch_size"]
    assert not by["llama3-70b", "h200-1.5tb"]["activation_offload"]
    text = markdown(rows, validation_rows(RESULTS))
    assert "tok/s is a prediction" in text and "optimizer.moment_dtype: bfloat16" in text
    assert "| dense-120b | 119.8 B | h200-1.5tb |" in text


def test_the_committed_large_model_doc_has_every_row():
    text = Path(REPO, "docs", "plan-large-models.md").read_text()
    for c in CONFIGS:
        for m in MACHINES:
            assert f"| {Path(c).stem} |" in text and f"| {m} |" in text
    assert "tok/s is a prediction" in text


def test_the_committed_fixture_is_what_the_results_give():
    """tests/fixtures/measured_points.json, which test_speed reads, is regenerated whenever benchmarks/results
    changes (python benchmarks/plan_table.py --write-fixture): a stale fixture fails here."""
    assert json.loads(FIXTURE.read_text()) == json.loads(json.dumps(fixture(RESULTS)))
