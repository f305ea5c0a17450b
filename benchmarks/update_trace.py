"""Where the optimizer's overlap with the backward goes, from engine.update_trace files.

    python benchmarks/update_trace.py DIR [--skip 1] [--stages]

DIR holds one run's trace files (one per rank, megatrain_ray/engine/telemetry.py). For every step after
the first `--skip` (compilation, warm-up), it prints the median latency of each hand-off of a stage's
update, the optimizer's busy and idle time between the first order and the last update's end, how
far the updates ran past the end of the backward (the tail the next forward waits for), and each
rank's waits. `--stages` adds one line per stage of the last step.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

LINKS = (  # (name, from event, to event, whose events): the hand-offs of one stage's update, in order
    ("D2H queued -> done on GPU", "emit", "gpu_drained", "each"),
    ("done on GPU -> seen by dispatcher", "gpu_drained", "drained", "each"),
    ("seen -> other ranks' pieces landed", "drained", "landed", "leader"),
    ("seen -> own piece announced", "drained", "landed", "others"),
    ("landed -> ordered", "landed", "sent", "leader"),
    ("ordered -> optimizer starts", "sent", "run_start", "leader"),
    ("optimizer runs", "run_start", "run_end", "leader"),
    ("optimizer ends -> published", "run_end", "applied", "leader"),
)


def load(directory: Path) -> dict[int, dict[tuple[int, int, str], float]]:
    """rank -> {(step, stage, event): time}; several events of one key (pieces of a stage): the last."""
    ranks: dict[int, dict[tuple[int, int, str], float]] = {}
    for path in sorted(directory.glob("update-trace-g*-rank*-*.jsonl")):
        rank = int(re.search(r"-rank(\d+)-", path.name).group(1))
        if rank in ranks:
            raise SystemExit(f"{directory}: two trace files of rank {rank}; give one run's directory")
        events = ranks[rank] = {}
        for line in path.read_text().splitlines():
            e = json.loads(line)
            events[(e["step"], e["stage"], e["event"])] = e["t"]
    if not ranks:
        raise SystemExit(f"{directory}: no update-trace-*.jsonl files (set engine.update_trace={directory})")
    return ranks


def busy_union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def analyse(ranks: dict[int, dict[tuple[int, int, str], float]], skip: int) -> dict:
    leader = ranks[0]
    steps = sorted({s for (s, i, e) in leader if e == "step_start"})[skip:]
    steps = [s for s in steps if (s, -1, "step_end") in leader]
    links: dict[str, list[float]] = defaultdict(list)
    per_step = []
    for step in steps:
        stages = sorted({i for (s, i, e) in leader if s == step and e == "sent"})
        for name, a, b, whose in LINKS:
            for rank, events in ranks.items():
                if (whose == "leader" and rank) or (whose == "others" and not rank):
                    continue
                links[name] += [events[(step, i, b)] - events[(step, i, a)] for i in stages
                                if (step, i, a) in events and (step, i, b) in events]
        runs = [(leader[(step, i, "run_start")], leader[(step, i, "run_end")]) for i in stages
                if (step, i, "run_start") in leader]
        backward_end = leader[(step, -1, "backward_end")]
        first_sent = min(leader[(step, i, "sent")] for i in stages)
        last_end = max(b for _, b in runs) if runs else first_sent
        busy = busy_union(runs)
        waits = {rank: sum(ev[(s, i, "wait_end")] - ev[(s, i, "wait_start")] for (s, i, e) in ev
                           if e == "wait_start" and s == step + 1 and (s, i, "wait_end") in ev)
                 for rank, ev in ranks.items()}  # waits at the next step's loads (and slabs) for this step's updates
        per_step.append({
            "step": step, "seconds": leader[(step, -1, "step_end")] - leader[(step, -1, "step_start")],
            "optimizer_busy": busy,
            "optimizer_idle": last_end - first_sent - busy, "tail_after_backward": last_end - backward_end,
            "next_step_waits_by_rank": waits})
    return {"links_median_ms": {k: statistics.median(v) * 1e3 for k, v in links.items() if v},
            "links_max_ms": {k: max(v) * 1e3 for k, v in links.items() if v}, "steps": per_step,
            "ranks": len(ranks)}


def stage_lines(ranks: dict, step: int) -> list[str]:
    leader = ranks[0]
    t0 = leader[(step, -1, "step_start")]
    stages = sorted({i for (s, i, e) in leader if s == step and e == "sent"}, key=lambda i: leader[(step, i, "sent")])
    names = ["emit", "gpu_drained", "drained", "landed", "sent", "run_start", "run_end", "applied"]
    lines = [f"step {step}, ms from its start (leader; other ranks' drained/landed after '|')",
             "stage " + " ".join(f"{n:>11}" for n in names)]
    for i in stages:
        row = " ".join(f"{(leader[(step, i, n)] - t0) * 1e3:11.1f}" if (step, i, n) in leader else f"{'-':>11}"
                       for n in names)
        others = " ".join(f"{(ev[(step, i, n)] - t0) * 1e3:.1f}" for r, ev in ranks.items() if r
                          for n in ("gpu_drained", "drained", "landed") if (step, i, n) in ev)
        lines.append(f"{i:5d} {row}" + (f" | {others}" if others else ""))
    ends = ("backward_end", "device_idle", "step_end")
    lines.append("  ".join(f"{e} {(leader[(step, -1, e)] - t0) * 1e3:.1f}" for e in ends if (step, -1, e) in leader))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--skip", type=int, default=1, help="first steps to leave out (compilation, warm-up)")
    parser.add_argument("--stages", action="store_true", help="one line per stage of the last step")
    parser.add_argument("--json", action="store_true", help="print the analysis as JSON")
    args = parser.parse_args(argv)
    ranks = load(args.directory)
    result = analyse(ranks, args.skip)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{args.directory}: {result['ranks']} rank(s), {len(result['steps'])} step(s) analysed")
    for name, _, _, _ in LINKS:
        if name in result["links_median_ms"]:
            print(f"  {name:38s} median {result['links_median_ms'][name]:8.2f} ms   max "
                  f"{result['links_max_ms'][name]:8.2f} ms")
    for s in result["steps"]:
        waits = " ".join(f"{w:.3f}" for w in s["next_step_waits_by_rank"].values())
        print(f"  step {s['step']}: {s['seconds']:.3f} s; first order -> last update end "
              f"{s['optimizer_busy'] + s['optimizer_idle']:.3f} s (optimizer busy {s['optimizer_busy']:.3f}, idle "
              f"{s['optimizer_idle']:.3f}); updates end {s['tail_after_backward']:.3f} s after the backward; "
              f"next step's waits by rank {waits} s")
    if args.stages and result["steps"]:
        print("\n".join(stage_lines(ranks, result["steps"][-1]["step"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
