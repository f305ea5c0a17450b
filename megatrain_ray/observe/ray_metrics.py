"""The per-step figures of metrics.jsonl as Ray metrics, for the dashboard and Prometheus.

The driver feeds each step's record (the same dict written to metrics.jsonl) to `RayMetrics`,
which sets `ray.util.metrics` gauges tagged with the run and the model. Each node's metrics
agent serves them in Prometheus text with Ray's `ray_` prefix (`megatrain_loss` is scraped as
`ray_megatrain_loss`); the dashboard graphs them once Prometheus and Grafana run with the
configs Ray writes under its session directory (docs/operations.md, "Watching a run").
"""

from __future__ import annotations

import json
import os
from typing import Any

# metrics.jsonl key -> (Ray metric name, description, factor from the record's unit)
STEP_GAUGES: dict[str, tuple[str, str, float]] = {
    "loss": ("megatrain_loss", "Training loss of the last step", 1.0),
    "lr": ("megatrain_lr", "Learning rate of the last step", 1.0),
    "grad_norm": ("megatrain_grad_norm", "Global gradient norm before clipping", 1.0),
    "tok_per_s": ("megatrain_tokens_per_second", "Trained tokens per second of wall time", 1.0),
    "tflops": ("megatrain_model_tflops", "Model TFLOPS (6 N + 6 L T d_attn per token, no recompute)", 1.0),
    "step_seconds": ("megatrain_step_seconds", "Wall time of the last step", 1.0),
    "h2d_gbps": ("megatrain_h2d_gbps", "Host-to-device bytes per second of step time, GB/s", 1.0),
    "d2h_gbps": ("megatrain_d2h_gbps", "Device-to-host bytes per second of step time, GB/s", 1.0),
    "gpu_busy": ("megatrain_gpu_busy_fraction",
                 "Share of the step the device spent computing (the stages and the updates on the device)", 1.0),
    "optimizer_seconds": ("megatrain_optimizer_seconds", "CPU AdamW time of the step (slowest worker per stage)",
                          1.0),
    "optimizer_hidden": ("megatrain_optimizer_hidden_fraction", "Share of the optimizer time hidden behind GPU work",
                         1.0),
    "update_wait_seconds": ("megatrain_update_wait_seconds", "Time the layer stream waited for updates", 1.0),
    "host_mem_gib": ("megatrain_host_memory_bytes", "Host memory: shared segments touched + private RSS", 2.0**30),
    "gpu_peak_gib": ("megatrain_gpu_peak_bytes", "Peak GPU memory of the step", 2.0**30),
    "eval_loss": ("megatrain_eval_loss", "Loss on the eval batches at the last evaluation (train.eval_every)", 1.0),
    "epoch": ("megatrain_epoch", "Passes over the training data so far (fractional)", 1.0),
    "step": ("megatrain_step", "Index of the last step done (0-based)", 1.0),
}
HEARTBEAT_AGE = "megatrain_actor_heartbeat_age_seconds"
SKIPPED = "megatrain_skipped_steps"
STEP_TAGS = ("run", "model", "submission")
"""run: the run id (also in the log and checkpoints); submission: the Ray job's submission id, "" outside a
job, so a job, its run and its metrics can be joined."""


class RayMetrics:
    """Gauges and counters of one run; `record_step` takes a metrics.jsonl record."""

    def __init__(self, run: str, model: str, submission: str = ""):
        from ray.util import metrics

        tags = {"run": run, "model": model, "submission": submission}
        self.gauges = {}
        for key, (name, description, _) in STEP_GAUGES.items():
            self.gauges[key] = metrics.Gauge(name, description=description, tag_keys=STEP_TAGS)
            self.gauges[key].set_default_tags(tags)
        self.steps = metrics.Counter("megatrain_steps", description="Optimizer steps done", tag_keys=STEP_TAGS)
        self.tokens = metrics.Counter("megatrain_tokens", description="Tokens trained on", tag_keys=STEP_TAGS)
        self.skipped = metrics.Gauge(SKIPPED, description="Steps dropped for a non-finite loss or gradient so far",
                                     tag_keys=STEP_TAGS)
        self.skipped_count = 0
        self.heartbeat = metrics.Gauge(HEARTBEAT_AGE, description="Seconds since the actor last answered a heartbeat",
                                       tag_keys=(*STEP_TAGS, "actor"))
        for metric in (self.steps, self.tokens, self.skipped, self.heartbeat):
            metric.set_default_tags(tags)

    def record_step(self, record: dict[str, Any]) -> None:
        for key, (_, _, factor) in STEP_GAUGES.items():
            if record.get(key) is not None:
                self.gauges[key].set(float(record[key]) * factor)
        self.steps.inc(1)
        self.tokens.inc(record["tokens"])
        self.skipped_count += bool(record.get("skipped"))
        self.skipped.set(self.skipped_count)  # from the first step on, 0 included: a panel has a series to show

    def heartbeat_age(self, actor: str, seconds: float) -> None:
        self.heartbeat.set(seconds, tags={"actor": actor})


def model_tag(family: str, num_params: int) -> str:
    """The `model` tag: family and size, e.g. llama-3.50B or llama-0.8M."""
    return f"{family}-{num_params / 1e9:.2f}B" if num_params >= 1e9 else f"{family}-{num_params / 1e6:.1f}M"


def submission_id() -> str:
    """The Ray job submission id of this driver (`ray job submit` passes it in the job config), or ""."""
    try:
        config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "") or "{}")
    except ValueError:
        return ""
    metadata = config.get("metadata") if isinstance(config, dict) else None
    value = metadata.get("job_submission_id", "") if isinstance(metadata, dict) else ""
    return value if isinstance(value, str) else ""


def ray_metrics_for(mode: str, run: str, family: str, num_params: int) -> RayMetrics | None:
    """The run's Ray metrics, or None in-process (runtime.mode=local), where there is no Ray to export to."""
    return RayMetrics(run, model_tag(family, num_params), submission_id()) if mode == "ray" else None
