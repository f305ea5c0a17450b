"""How long the test suite takes on this machine, and where the time goes: runs `python -m pytest tests -q`
(or summarises a JUnit XML a run already wrote) and writes benchmarks/results/test-suite-<host>-<time>.json
with the machine (CPU model, cores), the commit, the wall time, the CPU's idle share during the run, the
counts, the time per test file and the slowest tests.

    python benchmarks/test_suite_time.py -- -n 2 --dist loadfile  # the whole suite as the README runs it
    python benchmarks/test_suite_time.py                          # the whole suite, serial
    python benchmarks/test_suite_time.py -- -m float32_parity     # extra pytest arguments after --
    python benchmarks/test_suite_time.py --cold                   # with empty caches, as on a fresh machine
    python benchmarks/test_suite_time.py --junit run.xml --wall 1297.8 --commit de9bb81   # a run made before
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cpu_times() -> tuple[int, int]:
    """(total, idle) jiffies of all CPUs since boot (/proc/stat's first line)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    return sum(fields), fields[3] + fields[4]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def summary(junit: Path) -> dict:
    root = ET.parse(junit).getroot()
    cases = list(root.iter("testcase"))
    outcome = collections.Counter()
    per_file: collections.Counter = collections.Counter()
    timed = []
    for case in cases:
        seconds = float(case.get("time", 0))
        kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        if kind == "skipped" and "xfail" in (case.find("skipped").get("type", "") + case.find("skipped").get(
                "message", "")):
            kind = "xfailed"
        outcome[kind] += 1
        module = case.get("classname", "")
        per_file[module] += seconds
        timed.append((seconds, f"{module}::{case.get('name')}"))
    return {"counts": dict(outcome), "seconds_in_tests": round(sum(s for s, _ in timed), 1),
            "seconds_per_file": {k: round(v, 1) for k, v in per_file.most_common()},
            "slowest": [{"test": name, "seconds": round(s, 2)} for s, name in sorted(timed, reverse=True)[:40]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--junit", type=Path, help="summarise this JUnit XML instead of running the suite")
    parser.add_argument("--wall", type=float, help="with --junit: the run's wall seconds, as pytest printed them")
    parser.add_argument("--idle", type=float, help="with --junit: the CPUs' idle share during that run, if known")
    parser.add_argument("--commit", help="with --junit: the commit that ran (default: this checkout's HEAD)")
    parser.add_argument("--cold", action="store_true",
                        help="run with empty caches, as a fresh machine (CI's first run) has them: XDG_CACHE_HOME "
                             "(GGUF conversions, prepare's checks, matplotlib, datasets), MEGATRAIN_CACHE (the native "
                             "kernels) and TORCHINDUCTOR_CACHE_DIR (Inductor's compiled graphs) in a new directory")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = parser.parse_args()
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                           text=True).stdout.strip()
    record = {"what": "python -m pytest tests -q " + " ".join(args.pytest_args), "commit": commit,
              "host": socket.gethostname(), "cpu": cpu_model(), "cores": os.cpu_count(),
              "python": platform.python_version(), "cold_caches": args.cold,
              "environment": {k: v for k, v in os.environ.items() if k.startswith(("MKL_", "OMP_", "TORCHINDUCTOR_"))}}
    if args.junit:
        if args.wall is None:
            parser.error("--junit needs --wall (the wall time pytest printed)")
        record.update(wall_seconds=args.wall, cpu_idle_share=args.idle, **summary(args.junit))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            junit = Path(tmp) / "suite.xml"
            env = dict(os.environ)
            if args.cold:
                env.update({name: str(Path(tmp) / name.lower()) for name in
                            ("XDG_CACHE_HOME", "MEGATRAIN_CACHE", "TORCHINDUCTOR_CACHE_DIR")})
            total0, idle0 = cpu_times()
            start = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider",
                                   f"--junitxml={junit}", *args.pytest_args], cwd=REPO, env=env)
            wall = time.monotonic() - start
            total1, idle1 = cpu_times()
            record.update(exit_status=proc.returncode, wall_seconds=round(wall, 1),
                          cpu_idle_share=round((idle1 - idle0) / max(total1 - total0, 1), 3), **summary(junit))
    import torch

    record["torch"] = torch.__version__
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = REPO / "benchmarks" / "results" / f"test-suite-{socket.gethostname()}-{stamp}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{record['wall_seconds']:.0f} s wall, {record['counts']}: {out}")


if __name__ == "__main__":
    main()
