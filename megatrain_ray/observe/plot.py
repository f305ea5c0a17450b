"""Line charts to PNG: a run's curves (`megatrain plot RUN_DIR`) and the benchmark figures.

matplotlib is an optional extra (`pip install 'megatrain-ray[plot]'`); it is imported only when
a chart is drawn, with the non-interactive Agg backend (no display needed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatrain_ray.exceptions import MegatrainError
from megatrain_ray.extras import install_hint


@dataclass(frozen=True, slots=True)
class Line:
    label: str
    points: list[tuple[float, float]]
    color: str | None = None
    linestyle: str = "-"
    marker: str | None = "o"


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise MegatrainError(f"plotting needs matplotlib: {install_hint('plot')}") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_chart(path: Path, lines: list[Line], xlabel: str, ylabel: str, title: str = "", log2_x: bool = False,
               y_from_zero: bool = False, secondary_y: tuple[str, float] | None = None) -> Path:
    """One chart of `lines`; `secondary_y` = (label, factor) adds a right axis showing y * factor."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for line in lines:
        if line.points:
            ax.plot(*zip(*sorted(line.points)), marker=line.marker, color=line.color, linestyle=line.linestyle,
                    label=line.label)
    if log2_x:
        ax.set_xscale("log", base=2)
    if y_from_zero:
        ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if secondary_y:
        label, factor = secondary_y
        ax.secondary_yaxis("right", functions=(lambda y: y * factor, lambda y: y / factor)).set_ylabel(label)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(lines) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise MegatrainError(f"{path} does not exist: pass a run directory (train.output_dir of a run)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """loss.png (loss and, where evaluated, eval_loss against step) and throughput.png (tok/s, with model TFLOPS on the right axis)."""
    records = read_metrics(run_dir)
    if not records:
        raise MegatrainError(f"{run_dir / 'metrics.jsonl'} holds no steps yet")
    out = out_dir or run_dir
    name = run_dir.resolve().name
    loss = [(r["step"], r["loss"]) for r in records if not r.get("skipped")]
    eval_loss = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    throughput = [(r["step"], r["tok_per_s"]) for r in records]
    # TFLOPS = tok/s x FLOPs per token, the same factor every step: one right axis shows both.
    flops_per_token = records[-1]["tflops"] * 1e12 / records[-1]["tok_per_s"] if records[-1]["tok_per_s"] else 0.0
    marker = "o" if len(records) <= 50 else None
    return [
        line_chart(out / "loss.png", [Line("loss (train)", loss, "tab:blue", marker=marker),
                                      *([Line("eval_loss", eval_loss, "tab:orange", marker="s")] if eval_loss else [])],
                   "step", "loss", f"{name}: loss"),
        line_chart(out / "throughput.png", [Line("tokens / s", throughput, "tab:green", marker=marker)], "step",
                   "tokens / s", f"{name}: throughput", y_from_zero=True,
                   secondary_y=("model TFLOPS", flops_per_token / 1e12) if flops_per_token else None),
    ]
