"""Per-step figures: model FLOPs, memory readings, metrics.jsonl and the console progress line."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from megatrain_ray.messages import StepResult


def optimizer_hidden_fraction(optimizer_seconds: float, step_seconds: float, compute_seconds: float) -> float:
    """Share of the optimizer's time hidden behind GPU work. The GPU's idle time in the step
    (step - compute) bounds the optimizer time that was exposed; the rest was hidden."""
    if not optimizer_seconds:
        return 1.0
    exposed = min(optimizer_seconds, max(0.0, step_seconds - compute_seconds))
    return 1.0 - exposed / optimizer_seconds


def proc_status_bytes(field: str, pid: int | str = "self") -> int:
    """A memory figure of /proc/PID/status (e.g. RssAnon, VmRSS) in bytes; 0 when unreadable
    (a process gone, or on another node)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_anon_bytes(pid: int | str = "self") -> int:
    """Private resident memory of a process (shared segments excluded, so nothing counts twice)."""
    return proc_status_bytes("RssAnon", pid)


def shm_bytes(paths: list[str]) -> int:
    """Bytes actually allocated to the given shared-memory files (pages touched so far)."""
    total = 0
    for p in paths:
        try:
            total += os.stat(p).st_blocks * 512
        except FileNotFoundError:
            pass
    return total


class MetricsWriter:
    """Appends one JSON object per step to RUN_DIR/metrics.jsonl, flushed each line, and hands the
    same record to each of `exporters` (ray_metrics.RayMetrics in Ray mode, tracking.Tracking with
    train.report_to): one source for all."""

    def __init__(self, path: Path, *exporters: Any):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.exporters = [e for e in exporters if e is not None]
        self._file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for exporter in self.exporters:
            exporter.record_step(record)

    def close(self) -> None:
        self._file.close()


class Progress:
    """A one-line progress bar on a terminal, a log line every `every` steps otherwise: loss, lr, gradient
    norm, speed and an ETA (DPO: reward accuracy and margin; GRPO: mean reward and completion length), and eval_loss
    (GRPO: eval_reward) on the steps that computed it (such a step always prints, and on a terminal keeps its line). The ETA leaves out the first step of the run (or of a resume), which pays for
    compilation and warm-up; until a second step ends it reads '--'."""

    def __init__(self, total: int, every: int, first: int = 0, stream: TextIO | None = None):
        self.total, self.every, self.first = total, every, first
        self.stream = stream or sys.stderr  # looked up now: tests and callers may have replaced it
        self.tty = self.stream.isatty()
        self.warm_since: float | None = None

    def update(self, record: dict[str, Any]) -> None:
        step, done = record["step"], record["step"] + 1
        now = time.perf_counter()
        evaluated = "eval_loss" in record or "eval_reward" in record
        if self.warm_since is None:  # the first step ends now: time the rest from here
            self.warm_since, eta = now, "--"
        else:
            per_step = (now - self.warm_since) / (step - self.first)
            eta = _duration(per_step * (self.total - done))
        text = (f"step {done}/{self.total} loss {record['loss']:.4f}"
                + (f" eval_loss {record['eval_loss']:.4f}" if "eval_loss" in record else "")
                + (f" reward {record['reward']:.3f} length {record['completions/mean_length']:.1f}"
                   if "completions/mean_length" in record else "")
                + (f" eval_reward {record['eval_reward']:.3f}" if "eval_reward" in record else "")
                + (f" reward_acc {record['rewards/accuracies']:.2f} margin {record['rewards/margins']:.3g}"
                   if "rewards/margins" in record else "")
                + f" lr {record['lr']:.2e} gnorm {record['grad_norm']:.3g} {record['tok_per_s']:,.0f} tok/s "
                f"{record['tflops']:.1f} TFLOPS eta {eta}")
        if self.tty:
            width = 24
            filled = int(width * done / self.total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}")
            if done == self.total or evaluated:  # the next step's bar starts below the evaluation
                self.stream.write("\n")
            self.stream.flush()
        elif done % self.every == 0 or done == self.total or evaluated:
            self.stream.write(f"[megatrain] {text}\n")
            self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def finite(result: StepResult) -> bool:
    """Whether a step's loss and gradient norm are finite (else its update was dropped or stops the run)."""
    return math.isfinite(result.loss) and math.isfinite(result.grad_norm)


def step_record(step: int, lr: float, result: StepResult, seconds: float, flops_per_token: float, params: int,
                gpus: int, host_memory_bytes: int, epoch: float) -> dict[str, Any]:
    """The metrics.jsonl record of a step (the console, the Ray metrics and the benchmarks read the same keys)."""
    tok_per_s = result.tokens / seconds
    return {
        "step": step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm, "tokens": result.tokens,
        "loss_tokens": result.valid_tokens,
        "tok_per_s": tok_per_s, "tflops": tok_per_s * flops_per_token / 1e12, "step_seconds": seconds,
        "compute_seconds": result.compute_seconds, "device_update_seconds": result.device_update_seconds,
        "gpu_busy": min(1.0, result.busy_seconds / seconds),
        "gpus": gpus, "comm_seconds": result.comm_seconds, "worker_seconds": result.seconds,
        **({"vision_seconds": result.vision_seconds} if result.vision_seconds else {}),
        "optimizer_seconds": result.optimizer_seconds, "update_wait_seconds": result.update_wait_seconds,
        "slab_wait_seconds": result.slab_wait_seconds,
        **({"rank_update_wait_seconds": list(result.rank_update_wait_seconds)}
           if result.rank_update_wait_seconds else {}),
        "optimizer_hidden": optimizer_hidden_fraction(result.optimizer_seconds, seconds, result.compute_seconds),
        "h2d_bytes": result.h2d_bytes, "d2h_bytes": result.d2h_bytes,
        "h2d_gbps": result.h2d_bytes / seconds / 1e9, "d2h_gbps": result.d2h_bytes / seconds / 1e9,
        "h2d_link_gbps": result.h2d_bytes / result.h2d_seconds / 1e9 if result.h2d_seconds else 0.0,
        "d2h_link_gbps": result.d2h_bytes / result.d2h_seconds / 1e9 if result.d2h_seconds else 0.0,
        "dram_bytes_per_param": (result.h2d_bytes + result.d2h_bytes + result.optimizer_bytes) / params,
        "host_mem_gib": host_memory_bytes / 2**30,
        "gpu_peak_gib": result.gpu_peak_bytes / 2**30, "skipped": not finite(result),
        "epoch": epoch, **({"aux_loss": result.aux_loss} if result.aux_loss is not None else {}),
        **({"speculative_redone": result.speculative_redone} if result.speculative_redone is not None else {}),
        **(result.objective_metrics or {}),  # DPO: rewards/chosen, rewards/rejected, rewards/accuracies, ...
    }
