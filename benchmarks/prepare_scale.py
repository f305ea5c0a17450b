"""`megatrain prepare` at scale: time and peak RSS of preparing N synthetic four-turn conversations with a
real BPE tokenizer (SmolLM2-135M-Instruct's), before and after, at several sizes.

    python benchmarks/prepare_scale.py --tokenizer ~/.cache/megatrain/gguf/SmolLM2-135M-Instruct.Q4_1-... \\
        --label before --tree /tmp/prep-before --sizes 20000 100000
    python benchmarks/prepare_scale.py --tokenizer ... --label after --sizes 20000 100000

Each run is `python -m megatrain_ray prepare --format messages` in TREE with PYTHONPATH=TREE (a `git worktree` of
the commit to measure; default this tree). Peak memory is measured three ways: the largest single process
(getrusage of the children, as /usr/bin/time reports it; the forkserver's workers are not its children, so
its cpu_seconds are the main process's alone), and the whole process tree's summed RSS and summed PSS,
sampled every 0.1 s from /proc (workers included; RSS counts pages that forked workers share with their
forkserver in every process, PSS once). cpu_seconds_process_tree sums the CPU seconds of every process of
the tree, workers included, as last sampled (up to 0.1 s before each one ends); load_average_1min, the
machine's before and after the run, says how much else ran (wall times on a shared box are noisy). Runs are merged into one results file per host and day,
benchmarks/results/prepare-<host>-<date>.json, with the after/before ratios of every size measured by both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, git_commit  # noqa: E402

WORDS = ("the a of to and in is it that for on with as was at by be this from or have an they which one you were "
         "her all she there would their we him been has when who will more no if out so said what up its about "
         "into than them can only other new some could time these two may then do first any my now such like our "
         "over man me even most made after also did many before must through back years where much your way well "
         "down should because each just those people how too little state good very make world still own see men "
         "work long get here between both life being under never day same another know while last might us great "
         "old year off come since against go came right used take three tokenizer gradient transformer attention "
         "optimizer parquet shard tensor memory host device kernel throughput latency checkpoint résumé naïve 東京 "
         "42 3.14 2026 x=y+1 foo_bar() {\"k\": 1} <tag> https://example.com/path?q=1").split()
SYSTEM = "You are a helpful assistant."


def make_conversations(path: Path, n: int, seed: int) -> None:
    """n four-turn conversations (user, assistant, user, assistant; a system message in a third), jsonl."""
    rng = np.random.default_rng(seed)
    words = np.array(WORDS, dtype=object)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(n):
            messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.33 else []
            for role, (low, high) in (("user", (4, 60)), ("assistant", (8, 220)),
                                      ("user", (4, 60)), ("assistant", (8, 220))):
                text = " ".join(rng.choice(words, int(rng.integers(low, high))))
                messages.append({"role": role, "content": text[0].upper() + text[1:] + "."})
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")


def tree_sample(root_pid: int, cpu: dict[int, float]) -> tuple[int, int]:
    """(summed RSS, summed PSS) in bytes of a process and its descendants, from /proc; `cpu` gets each one's
    CPU seconds so far (user + system). RSS counts the pages forked workers share with their forkserver once
    per process; PSS splits them between the sharers."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    ticks: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry)
        children.setdefault(int(fields[1]), []).append(pid)
        rss[pid] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        ticks[pid] = (int(fields[11]) + int(fields[12])) / tick
    total = pss = 0
    todo = [root_pid]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        if pid in ticks:
            cpu[pid] = ticks[pid]
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                pss += next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
        todo += children.get(pid, [])
    return total, pss


def run_prepare(tree: Path, tokenizer: str, data: Path, out: Path, extra: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "megatrain_ray", "prepare", "--tokenizer", tokenizer, "--format", "messages",
           "--input", str(data), "--output", str(out), "--seed", "1", "--eval-fraction", "0.01", *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0, 0]
    cpu: dict[int, float] = {}

    def sample() -> None:
        while proc.poll() is None:
            rss, pss = tree_sample(proc.pid, cpu)
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = proc.communicate()[0]
    seconds = time.perf_counter() - t0
    sampler.join()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"prepare failed ({proc.returncode}):\n{output[-3000:]}")
    manifest = json.loads((out / "manifest.json").read_text())
    return {"seconds": round(seconds, 2), "records_per_s": round(manifest["records"] / seconds, 1),
            "peak_rss_mb_largest_process": round(usage.ru_maxrss / 1024, 1),
            "peak_rss_mb_process_tree": round(peak[0] / 2**20, 1),
            "peak_pss_mb_process_tree": round(peak[1] / 2**20, 1),
            "cpu_seconds": round(usage.ru_utime + usage.ru_stime - before.ru_utime - before.ru_stime, 1),
            "cpu_seconds_process_tree": round(sum(cpu.values()), 1),
            "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "documents": manifest["documents"],
            "tokens": sum(s["tokens"] for s in manifest["splits"].values()), "args": extra,
            "log_tail": output.strip().splitlines()[-1][-300:] if output.strip() else ""}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="the tokenizer directory (a converted GGUF directory)")
    p.add_argument("--label", required=True, help="before or after (the key of these runs in the results)")
    p.add_argument("--tree", default=str(ROOT), help="the source tree to run (PYTHONPATH); default this one")
    p.add_argument("--sizes", type=int, nargs="+", default=[20_000, 100_000], help="conversations per run")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic conversations")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "megatrain-prepare-bench"),
                   help="where the generated inputs and outputs go")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more prepare arguments (last)")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tree = Path(args.tree).resolve()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()
    day = datetime.date.today().strftime("%Y%m%d")
    path = RESULTS / f"prepare-{socket.gethostname()}-{day}.json"
    results = json.loads(path.read_text()) if path.is_file() else {"runs": {}}
    results.update({"benchmark": "megatrain prepare, synthetic four-turn conversations (messages format)",
                    "host": socket.gethostname(), "cpu_count": os.cpu_count(),
                    "cpus_available": len(os.sched_getaffinity(0)), "cpu_model": cpu_model(),
                    "python": platform.python_version(), "tokenizer": args.tokenizer, "benchmark_commit": git_commit()})
    for n in args.sizes:
        data = work / f"conversations-{n}-{args.seed}.jsonl"
        if not data.is_file():
            make_conversations(data, n, args.seed)
        out = work / f"out-{args.label}-{n}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        print(f"{args.label} {n}: running ...", file=sys.stderr, flush=True)
        row = run_prepare(tree, args.tokenizer, data, out, args.extra)
        row.update({"commit": commit, "conversations": n, "input_mb": round(data.stat().st_size / 2**20, 1),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
        print(json.dumps(row), file=sys.stderr, flush=True)
        results["runs"].setdefault(args.label, {})[str(n)] = row
        subprocess.run(["rm", "-rf", str(out)], check=True)
        ratios = {}
        for size, after in results["runs"].get("after", {}).items():
            before = results["runs"].get("before", {}).get(size)
            if before:
                ratios[size] = {"speedup": round(before["seconds"] / after["seconds"], 2),
                                "peak_rss_tree_after_over_before": round(
                                    after["peak_rss_mb_process_tree"] / before["peak_rss_mb_process_tree"], 3),
                                "peak_pss_tree_after_over_before": round(
                                    after.get("peak_pss_mb_process_tree", 0)
                                    / before.get("peak_pss_mb_process_tree", float("inf")), 3)}
        for label, runs in results["runs"].items():
            sizes = sorted(runs, key=int)
            if len(sizes) > 1:  # flat in the input size: the largest run's peak over the smallest's
                results.setdefault("memory_growth", {})[label] = {
                    f"{sizes[-1]}_over_{sizes[0]}": round(runs[sizes[-1]]["peak_rss_mb_process_tree"]
                                                          / runs[sizes[0]]["peak_rss_mb_process_tree"], 3)}
        results["ratios"] = ratios
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
    print(path)


if __name__ == "__main__":
    main()
