"""Plots and a markdown table from benchmark results, written next to the JSON file.

    python benchmarks/plot.py benchmarks/results/bench-h200-....json [more.json ...]
    python benchmarks/plot.py --combine benchmarks/results/NAME a.json b.json ...   # one plot of several files
    python benchmarks/plot.py --smooth 20 benchmarks/results/lean-pretrain-....json   # loss curves, 20-step mean

For each file: <name>-throughput.png (tok/s against tokens per step, one line per system, at
each depth), <name>-depth.png (model TFLOPS against depth, when several depths ran) and
<name>.md (the table the README quotes). A file of loss curves (a "runs" object of runs with "losses":
benchmarks/lean_convergence.py, benchmarks/lean_pretrain.py) gets <name>-loss.png instead: each run's loss
against step (a moving average over --smooth steps where that is more than 1, with the raw losses faint).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatrain_ray.observe.plot import Line, line_chart, pyplot

COLORS = {"megatrain": "tab:blue", "megatrain-noclip": "tab:cyan", "megatrain-compile": "tab:purple",
          "megatrain-noclip-compile": "tab:pink", "megatrain-eager": "tab:olive", "megatrain-noclip-eager": "tab:brown",
          "resident": "tab:green", "deepspeed": "tab:red"}
SPARE = ("tab:orange", "tab:gray", "black")


def colors(rows) -> dict[str, str]:
    """A color for every system of the rows: the fixed ones first, then the spare ones in order."""
    spare = iter(SPARE * len(rows))
    found = {r["system"] for r in rows}
    return {**{s: c for s, c in COLORS.items() if s in found}, **{s: next(spare) for s in sorted(found - set(COLORS))}}


def ok(rows):
    return [r for r in rows if r["status"] == "ok"]


def throughput_plot(result: dict, path: Path) -> None:
    rows = result["rows"]
    deepest = max(r["layers"] for r in rows)
    lines = [Line(f"{system} ({depth} layers)", [(r["tokens_per_step"], r["tok_per_s"]) for r in ok(rows)
                                                 if r["system"] == system and r["layers"] == depth],
                  color, "-" if depth == deepest else "--")
             for depth in sorted({r["layers"] for r in rows}) for system, color in colors(rows).items()]
    line_chart(path, [line for line in lines if line.points], "tokens per step", "tokens / s",
               f"{result['config']} on {result['device']}", log2_x=True)


def depth_plot(result: dict, path: Path) -> bool:
    rows = ok(result["rows"])
    if len({r["layers"] for r in rows}) < 2:
        return False
    lines = [Line(f"{system}, {tokens} tok/step", [(r["layers"], r["tflops"]) for r in rows
                                                  if r["system"] == system and r["tokens_per_step"] == tokens], color)
             for system, color in colors(rows).items()
             for tokens in sorted({r["tokens_per_step"] for r in rows if r["system"] == system})]
    line_chart(path, [line for line in lines if line.points], "layers", "model TFLOPS", y_from_zero=True)
    return True


def table(result: dict) -> str:
    lines = [f"{result['config']} on {result['device']} (commit {result['commit'][:12]}, {result['date']})", "",
             "| system | layers | tokens/step | tok/s | model TFLOPS | vs GPU-resident | GPU peak GiB | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["rows"], key=lambda r: (r["layers"], r["tokens_per_step"], r["system"])):
        if r["status"] != "ok":
            lines.append(f"| {r['system']} | {r['layers']} | {r['tokens_per_step']} | {r['status'].upper()} | | | | "
                         f"{r.get('error', '')[:80].replace('|', '/')} |")
            continue
        notes = ""
        if r["system"].startswith("megatrain"):
            notes = (f"busy {r['gpu_busy']:.2f}, optimizer hidden {r['optimizer_hidden_fraction']:.2f}, "
                     f"host {r['host_bytes_per_param']:.1f} B/param, roofline "
                     f"{'n/a' if r['roofline_fraction'] is None else format(r['roofline_fraction'], '.2f')}, "
                     f"clip {r['clip']}")
        vs = f"{r['vs_resident']:.2f}" if "vs_resident" in r else ""
        lines.append(f"| {r['system']} | {r['layers']} | {r['tokens_per_step']} | {r['tok_per_s']:,.0f} | "
                     f"{r['tflops']:.0f} | {vs} | {r['gpu_peak_gib']:.1f} | {notes} |")
    return "\n".join(lines) + "\n"


def combine(paths: list[Path]) -> dict:
    """One result from several files of the same config and device (rows concatenated)."""
    results = [json.loads(p.read_text()) for p in paths]
    keys = {(r["config"], r["device"]) for r in results}
    if len(keys) != 1:
        raise SystemExit(f"--combine needs files of one config and device, got {sorted(keys)}")
    merged = dict(results[0])
    merged["rows"] = [row for r in results for row in r["rows"]]
    merged["commit"] = ", ".join(sorted({r["commit"][:12] for r in results}))
    merged["date"] = ", ".join(sorted({r["date"][:10] for r in results}))
    merged["sources"] = [p.name for p in paths]
    return merged


def loss_plot(result: dict, path: Path, smooth: int) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    spare = iter(("tab:blue", "tab:red", "tab:green", *SPARE))
    for name, run in result["runs"].items():
        losses, color = run["losses"], next(spare)
        window = max(1, min(smooth, len(losses)))
        if window > 1:
            ax.plot(range(len(losses)), losses, color=color, alpha=0.18, linewidth=0.6)
        averaged = [sum(losses[i + 1 - window:i + 1]) / window for i in range(window - 1, len(losses))]
        ax.plot(range(window - 1, len(losses)), averaged, color=color, linewidth=1.4,
                label=name + (f" ({window}-step mean)" if window > 1 else ""))
    summary = result.get("summary", {})
    title = f"{result.get('model') or _shape(result)} on {result['device']}"
    if "final_ratio" in summary:
        n, tail = summary["steps_compared"], summary["tail"]
        title += (f"\nmean of steps {n - tail}-{n - 1}: full {summary['final_full']:.4f}, lean "
                  f"{summary['final_lean']:.4f} (lean/full {summary['final_ratio']:.4f})")
    cut = [f"{name} cut at step {run['cut_at_step']} of {result['steps']}" for name, run in result["runs"].items()
           if "cut_at_step" in run]
    if cut:
        title += "; " + ", ".join(cut)
    ax.set(xlabel="step", ylabel="training loss" + (" (nats per byte)" if "bytes" in str(result.get("vocab")) else ""),
           title=title)
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def _shape(result: dict) -> str:
    shape = result.get("shape", {})
    params = next((r["params"] for r in result["runs"].values() if "params" in r), None)
    size = f"{params / 1e9:.2f} B-param " if params else ""
    return f"{size}Llama ({shape.get('layers')} x {shape.get('hidden')})" if shape else "loss"


def write(result: dict, stem: Path, smooth: int = 1) -> None:
    if "runs" in result:
        loss_plot(result, stem.with_name(stem.name + "-loss.png"), smooth)
        return
    throughput_plot(result, stem.with_name(stem.name + "-throughput.png"))
    depth_plot(result, stem.with_name(stem.name + "-depth.png"))
    text = table(result)
    if result.get("sources"):
        text += "\nFrom: " + ", ".join(result["sources"]) + "\n"
    stem.with_name(stem.name + ".md").write_text(text)
    print(f"wrote plots and table {stem}.md")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--combine"]:
        write(combine([Path(p) for p in argv[2:]]), Path(argv[1]))
        return 0
    smooth = 1
    if argv[:1] == ["--smooth"]:
        smooth, argv = int(argv[1]), argv[2:]
    for name in argv:
        path = Path(name)
        write(json.loads(path.read_text()), path.with_suffix(""), smooth)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
