"""The quick start's installs and first run, timed in fresh virtual environments (docs/quick-start.md's table).

    python benchmarks/install_time.py [--installs core quickstart test] [--out benchmarks/results]

For each install: `python3 -m venv V`, `pip install torch==2.13.0` (timed on its own), then the install the
docs name (`pip install -e .`, `-e ".[quickstart]"`, `-e ".[test]"`) timed; packages counted by `pip list`, the
venv's size by `du`. The core venv then runs the README's first training command, `megatrain train
configs/tiny.yaml`, in a copy of the config's directory (so no run directory of the checkout is touched), timed.
Wheels come from whatever index pip is configured with (a local mirror here: then no download time is in these).
Writes one JSON file naming the machine and the commit.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, provenance, write_result  # noqa: E402

TORCH = "torch==2.13.0"
INSTALLS = {"core": ".", "quickstart": ".[quickstart]", "test": ".[test]"}


def timed(command: list[str], **kwargs) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return time.perf_counter() - start


def venv_mb(venv: Path) -> int:
    return int(subprocess.run(["du", "-sm", str(venv)], capture_output=True, text=True).stdout.split()[0])


def packages(pip: Path) -> int:
    return len(subprocess.run([str(pip), "list", "--format=freeze"], capture_output=True, text=True).stdout.split())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--installs", nargs="+", choices=list(INSTALLS), default=list(INSTALLS))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    cpu = platform.processor() or "cpu"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    result = {**provenance(f"{os.cpu_count()}-core {cpu}"), "torch": TORCH, "rows": []}
    with tempfile.TemporaryDirectory(prefix="mt-install-") as tmp:
        for name in args.installs:
            venv = Path(tmp) / name
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            pip = venv / "bin" / "pip"
            torch_s = timed([str(pip), "install", "-q", TORCH])
            torch_mb = venv_mb(venv)
            install_s = timed([str(pip), "install", "-q", "-e", INSTALLS[name]], cwd=ROOT)
            row = {"install": f"pip install -e {INSTALLS[name]!r}" if name != "core" else "pip install -e .",
                   "torch_seconds": round(torch_s, 1), "venv_mb_with_torch_only": torch_mb,
                   "install_seconds_after_torch": round(install_s, 1), "packages": packages(pip),
                   "venv_mb": venv_mb(venv)}
            if name == "core":  # the README's first command's training run, as a new user runs it
                work = Path(tmp) / "tiny-run"
                shutil.copytree(ROOT / "configs", work / "configs")
                shutil.copytree(ROOT / "examples" / "data", work / "examples" / "data")
                row["tiny_train_seconds"] = round(timed([str(venv / "bin" / "megatrain"), "train",
                                                         "configs/tiny.yaml"], cwd=work), 1)
            result["rows"].append(row)
            print(row, flush=True)
            shutil.rmtree(venv)
    write_result("install-time", result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
