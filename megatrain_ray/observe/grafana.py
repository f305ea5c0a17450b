"""A Grafana dashboard of megatrain's Ray metrics, placed where Ray's generated Grafana provisioning reads.

Ray writes, under its session directory, a Grafana config whose dashboard provider reads every JSON file
in `metrics/grafana/dashboards/`, and a Prometheus config that scrapes each node's metrics agent. The driver
adds `megatrain_grafana_dashboard.json` there when it starts on the head's machine, so a Grafana started
with Ray's config (docs/operations.md, "Watching a run") shows a "megatrain" dashboard beside Ray's own.
Every panel's query is evaluated against a real Prometheus scraping a real run in
tests/integration/test_job_flow.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DASHBOARD_FILE = "megatrain_grafana_dashboard.json"
DASHBOARD_UID = "megatrain"
SELECT = 'run=~"$run"'

# (title, unit, [(PromQL, legend)]): one panel each, in reading order.
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Loss", "none", [(f"ray_megatrain_loss{{{SELECT}}}", "train {{run}}"),
                      (f"ray_megatrain_eval_loss{{{SELECT}}}", "eval {{run}}")]),
    ("Tokens per second", "none", [(f"ray_megatrain_tokens_per_second{{{SELECT}}}", "{{run}}")]),
    ("Model TFLOPS", "none", [(f"ray_megatrain_model_tflops{{{SELECT}}}", "{{run}}")]),
    ("Learning rate", "none", [(f"ray_megatrain_lr{{{SELECT}}}", "{{run}}")]),
    ("Gradient norm (before clipping)", "none", [(f"ray_megatrain_grad_norm{{{SELECT}}}", "{{run}}")]),
    ("Step time", "s", [(f"ray_megatrain_step_seconds{{{SELECT}}}", "{{run}}")]),
    ("Step and epoch", "none", [(f"ray_megatrain_step{{{SELECT}}}", "step {{run}}"),
                                (f"ray_megatrain_epoch{{{SELECT}}}", "epoch {{run}}")]),
    ("Skipped steps (non-finite)", "none", [(f"ray_megatrain_skipped_steps{{{SELECT}}}", "{{run}}")]),
    ("GPU busy and optimizer hidden", "percentunit",
     [(f"ray_megatrain_gpu_busy_fraction{{{SELECT}}}", "GPU busy {{run}}"),
      (f"ray_megatrain_optimizer_hidden_fraction{{{SELECT}}}", "optimizer hidden {{run}}")]),
    ("Host-device traffic", "none", [(f"ray_megatrain_h2d_gbps{{{SELECT}}}", "H2D GB/s {{run}}"),
                                     (f"ray_megatrain_d2h_gbps{{{SELECT}}}", "D2H GB/s {{run}}")]),
    ("Optimizer and update wait", "s", [(f"ray_megatrain_optimizer_seconds{{{SELECT}}}", "AdamW {{run}}"),
                                        (f"ray_megatrain_update_wait_seconds{{{SELECT}}}", "GPU waited {{run}}")]),
    ("Memory", "bytes", [(f"ray_megatrain_host_memory_bytes{{{SELECT}}}", "host {{run}}"),
                         (f"ray_megatrain_gpu_peak_bytes{{{SELECT}}}", "GPU peak {{run}}")]),
    ("Actor heartbeat age", "s",
     [(f"max by (run, actor) (ray_megatrain_actor_heartbeat_age_seconds{{{SELECT}}})", "{{actor}} {{run}}")]),
]


def _variable(name: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": name, "type": "query", "datasource": "${datasource}", "query": query,
            "definition": query, "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}}


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model: one time series panel per entry of PANELS, two to a row."""
    panels = []
    for index, (title, unit, queries) in enumerate(PANELS):
        panels.append({
            "id": index + 1, "type": "timeseries", "title": title, "datasource": "${datasource}",
            "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"expr": expr, "legendFormat": legend, "refId": chr(ord("A") + k)}
                        for k, (expr, legend) in enumerate(queries)],
        })
    return {
        "uid": DASHBOARD_UID, "title": "megatrain", "tags": ["megatrain"], "schemaVersion": 27, "version": 1,
        "refresh": "10s", "time": {"from": "now-1h", "to": "now"}, "panels": panels,
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source",
             "current": {"selected": True, "text": "Prometheus", "value": "Prometheus"}},
            _variable("run", "label_values(ray_megatrain_loss, run)"),
            _variable("submission", "label_values(ray_megatrain_loss, submission)"),
        ]},
    }


def panel_queries() -> list[str]:
    """Every PromQL expression of the dashboard, as written (with $run)."""
    return [expr for _, _, queries in PANELS for expr, _ in queries]


def install_dashboard(session_dir: str | Path) -> Path | None:
    """Write the dashboard into Ray's Grafana dashboards directory of this session, if this machine has it
    (a driver on another node of the cluster has no such directory: nothing is written)."""
    directory = Path(session_dir) / "metrics" / "grafana" / "dashboards"
    if not directory.is_dir():
        return None
    path = directory / DASHBOARD_FILE
    tmp = directory / f".{DASHBOARD_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(dashboard(), indent=1))
    os.replace(tmp, path)
    return path
