"""Record (or compare) a float64 training run's per-step losses and final master weights, bit for bit.

A refactoring that must not change behaviour runs this at the commit before it and at the one after:

    python benchmarks/parity_snapshot.py record OUT_DIR      # at the old commit
    python benchmarks/parity_snapshot.py compare OUT_DIR     # at the new one: exit 1 on any difference

Cases: float64 on the CPU, the tiny test model, runtime local and ray, 1 and 3 optimizer workers,
clipping on and off (8 runs of 20 steps). Files: OUT_DIR/<case>.safetensors (final weights) and
OUT_DIR/losses.json (each case's losses as float.hex, so equality is exact).
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:  # the layered package
    from megatrain_ray.driver.trainer import Trainer
except ImportError:  # the flat one, before the re-layering
    from megatrain_ray.trainer import Trainer
from tests.conftest import tiny_config  # noqa: E402

CASES = [dict(mode=m, workers=w, clip=c) for m, w, c in itertools.product(("local", "ray"), (1, 3), (1.0, 0.0))]


def case_name(case: dict) -> str:
    return f"{case['mode']}-w{case['workers']}-{'clip' if case['clip'] else 'noclip'}"


def run_case(case: dict, work: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = tiny_config(work / case_name(case), optimizer={"workers": case["workers"], "grad_clip": case["clip"],
                                                         "lr": 1e-2},
                      precision={"master_dtype": "float64", "compute_dtype": "float64"},
                      runtime={"mode": case["mode"], "dashboard": False, "object_store_mb": 128})
    with Trainer(cfg) as trainer:
        losses = [trainer.step(s)["loss"] for s in range(cfg.train.steps)]
        return losses, {k: v.contiguous() for k, v in trainer.master_weights().items()}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("record", "compare"):
        print(__doc__)
        return 2
    action, out = argv[0], Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    recorded = json.loads((out / "losses.json").read_text()) if action == "compare" else {}
    losses_out, failures = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            name = case_name(case)
            losses, weights = run_case(case, Path(tmp))
            losses_out[name] = [x.hex() for x in losses]
            if action == "record":
                save_file(weights, str(out / f"{name}.safetensors"))
                print(f"{name}: recorded, final loss {losses[-1]!r}")
                continue
            old = load_file(str(out / f"{name}.safetensors"))
            same_loss = recorded[name] == losses_out[name]
            diff = [k for k in old if not torch.equal(old[k], weights[k])] + sorted(set(weights) ^ set(old))
            print(f"{name}: losses {'identical' if same_loss else 'DIFFER'}, "
                  f"weights {'identical' if not diff else 'DIFFER in ' + ', '.join(diff[:5])}")
            if not same_loss or diff:
                failures.append(name)
    if action == "record":
        (out / "losses.json").write_text(json.dumps(losses_out, indent=1))
    try:
        import ray
        ray.shutdown()
    except ImportError:
        pass
    if failures:
        print(f"{len(failures)} of {len(CASES)} cases differ: {', '.join(failures)}")
        return 1
    print(f"all {len(CASES)} cases {'recorded' if action == 'record' else 'bit-identical'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
