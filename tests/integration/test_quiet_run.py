"""A normal run prints no third-party warning that a setting can silence (issue 47), and the core install
(`pip install -e .`, the README's first command) is enough for configs/tiny.yaml.

Found on 2 cores with `.[test]` installed: `megatrain train configs/tiny.yaml` through its private Ray printed Ray's
"Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out" (Ray warns whenever
it turns token auth on with RAY_AUTH_MODE unset; megatrain now sets it to `token` before ray.init). `megatrain
prepare`, `train --local` and `generate` on the SmolLM2 GGUF printed no warning; peft, whose import prints
bitsandbytes' "Failed to load CPU gemm_4bit_forward", is imported by no command (and is not in `.[quickstart]`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

RAY_TOKEN_WARNING = "Token authentication is enabled for this Ray cluster"
THIRD_PARTY_WARNINGS = (RAY_TOKEN_WARNING, "Failed to load CPU gemm_4bit_forward", "FutureWarning",
                        "DeprecationWarning", "UserWarning")


@pytest.mark.ray
def test_a_private_ray_run_prints_no_ray_token_warning(private_ray_cli_run):
    """tests/conftest.private_ray_cli_run: `megatrain train configs/tiny.yaml` with RAY_AUTH_MODE unset, through the
    private Ray it starts (token auth on, as before: only Ray's warning is gone)."""
    result = private_ray_cli_run["result"]
    assert result.returncode == 0, result.stderr
    assert "token auth on" in result.stderr
    printed = [w for w in THIRD_PARTY_WARNINGS if w in result.stderr + result.stdout]
    assert not printed, f"third-party warnings printed: {printed}\n{result.stderr}"


# Run as one process: the packages only the tests and the fine-tunes need are made absent (an import of any of them
# fails as if it were not installed), then `megatrain train configs/tiny.yaml --local` and the imports every command
# of a normal fine-tune makes; peft and bitsandbytes must never have been imported.
_CORE_ONLY = r"""
import importlib.abc, sys
ABSENT = {"transformers", "tokenizers", "gguf", "accelerate", "huggingface_hub", "peft", "bitsandbytes", "trl",
          "datasets", "matplotlib", "tensorboard", "mlflow", "wandb"}
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Absent())
from megatrain_ray.__main__ import main
code = main(sys.argv[1:])
print("IMPORTED", sorted(m for m in sys.modules if m.split(".")[0] in ABSENT))
sys.exit(code)
"""


def test_tiny_trains_with_the_core_install_only(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env["PYTHONPATH"] = REPO
    result = subprocess.run([sys.executable, "-c", _CORE_ONLY, "train", "configs/tiny.yaml", "--local", "--set",
                             f"train.output_dir={tmp_path / 'run'}", "--set", "train.steps=4", "--set",
                             "schedule.warmup_steps=1"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "IMPORTED []" in result.stdout, result.stdout
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 4


def test_no_command_imports_peft_or_bitsandbytes():
    """Every command's module and what a GGUF fine-tune, generate and export import; peft's import prints
    bitsandbytes' CPU-kernel warning, so none of them may pull it in."""
    probe = ("import sys, megatrain_ray.__main__, megatrain_ray.system.model_sources, megatrain_ray.data.prepare, "
             "megatrain_ray.driver.runtime, megatrain_ray.engine.adapters, megatrain_ray.model.lora\n"
             "from megatrain_ray.data.prepare import tokenize\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('peft', 'bitsandbytes', 'trl')))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
    assert "gemm_4bit_forward" not in result.stderr
