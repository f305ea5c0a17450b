"""The install commands a newcomer copies: the README's first command installs the core only and trains tiny.yaml,
its second installs the test extras and runs the suite exactly as .ci/run does, docs/quick-start.md repeats both,
and the quickstart extra holds what a first fine-tune imports, without the tests' references (issue 47)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[2]


def _bash_blocks(path: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S)


def _readme_commands() -> tuple[str, str]:
    blocks = _bash_blocks(REPO / "README.md")
    return blocks[0].strip(), blocks[1].strip()


def _extras() -> dict[str, list[str]]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[=<>\[ ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_readme_first_command_installs_the_core_only_and_trains_tiny():
    first, _ = _readme_commands()
    assert "\n" not in first, "the first command stays one line"
    assert 'pip install -e . &&' in first and ".[" not in first, first
    assert first.endswith("megatrain train configs/tiny.yaml")


def test_the_readme_test_command_is_the_one_ci_runs_and_installs_the_test_extras():
    _, second = _readme_commands()
    assert "\n" not in second
    assert 'pip install -e ".[test]"' in second and "python -m pytest tests -q" in second
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    commands = [line for line in ci if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1] == second, "the last command of .ci/run is the README's test command, character for character"
    assert _bash_blocks(REPO / "docs" / "testing.md")[0].strip() == second, "docs/testing.md shows the same command"


def test_the_quick_start_repeats_the_readme_commands_and_installs_quickstart_for_the_fine_tune():
    text = (REPO / "docs" / "quick-start.md").read_text()
    blocks = _bash_blocks(REPO / "docs" / "quick-start.md")
    first, second = _readme_commands()
    assert blocks[0].strip().splitlines() == [first, second]
    assert 'pip install -e ".[quickstart]"' in blocks[1], blocks[1]
    assert '".[test]"' not in "".join(blocks[1:]), "only the tests install .[test]"
    assert "MB" in text and "packages" in text, "the measured sizes of the light and the test installs"


def test_the_quickstart_extra_has_what_a_gguf_fine_tune_imports_and_none_of_the_test_references():
    extras = _extras()
    quickstart = set(extras["quickstart"])
    # prepare (tokenizers, jinja2 templates), a .gguf model.path (transformers, gguf, accelerate), hub names
    # (huggingface_hub): the gguf extra; megatrain plot: matplotlib.
    assert set(extras["gguf"]) <= quickstart
    assert "matplotlib==3.11.2" in quickstart
    assert not _names(extras["quickstart"]) & {"peft", "trl", "bitsandbytes", "pytest", "wandb", "mlflow-skinny"}
    test = set(extras["test"])
    assert quickstart <= test, f"the same pins as the tests': {sorted(quickstart - test)}"
