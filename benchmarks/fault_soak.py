"""The fault tests, many times in a row, on a busy machine: does fault handling hold when the CPU is loaded
and another megatrain run shares the box? (Heartbeats, restarts and kill -9 trials all race the clock.)

    python benchmarks/fault_soak.py --repeat 20            # with a CPU stress load and a concurrent run
    python benchmarks/fault_soak.py --repeat 3 --quiet-box   # neither, for comparison

The stress load is one busy-looping process per core; the concurrent run is the tiny config training
in-process (`--local`) for as long as the soak lasts. Writes benchmarks/results/fault-soak-<host>-<time>.json
with each round's outcome and time, the machine and the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUSY_LOOP = "while True: pass"


def commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return result.stdout.strip() + ("-dirty" if dirty else "")


def concurrent_run(directory: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatrain_ray", "train", "configs/tiny.yaml", "--local", "--set",
                             "train.steps=1000000", "--set", f"train.output_dir={directory / 'run'}", "--set",
                             "train.log_every=1000"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--quiet-box", action="store_true", help="no stress load and no concurrent run")
    parser.add_argument("--tests", default="tests/integration/test_faults.py")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    load: list[subprocess.Popen] = []
    rounds = []
    with tempfile.TemporaryDirectory() as scratch:
        if not args.quiet_box:
            load = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(cores)]
            load.append(concurrent_run(Path(scratch)))
        try:
            for index in range(args.repeat):
                t0 = time.perf_counter()
                result = subprocess.run([sys.executable, "-m", "pytest", args.tests, "-q", "-p", "no:cacheprovider"],
                                        cwd=REPO, capture_output=True, text=True)
                seconds = time.perf_counter() - t0
                summary = (result.stdout.strip().splitlines() or [""])[-1]
                concurrent_alive = bool(load) and load[-1].poll() is None
                rounds.append({"round": index + 1, "exit": result.returncode, "seconds": round(seconds, 1),
                               "summary": summary, "concurrent_run_alive": concurrent_alive})
                print(f"round {index + 1}/{args.repeat}: exit {result.returncode} in {seconds:.0f} s: {summary}",
                      flush=True)
                if result.returncode != 0:
                    print(result.stdout[-4000:], flush=True)
        finally:
            for process in load:
                process.kill()
                process.wait()
    passed = sum(r["exit"] == 0 for r in rounds)
    out = REPO / "benchmarks" / "results" / (
        f"fault-soak-{socket.gethostname()}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}.json")
    out.write_text(json.dumps({
        "what": f"{args.tests}, {args.repeat} times in a row", "device": f"cpu ({cores} cores, {socket.gethostname()})",
        "commit": commit(), "stress": None if args.quiet_box else f"{cores} busy-loop processes + a concurrent "
                                                                 "megatrain run (configs/tiny.yaml --local)",
        "passed_rounds": passed, "rounds": rounds}, indent=1) + "\n")
    print(f"{passed}/{len(rounds)} rounds passed; {out}")
    return 0 if passed == len(rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
