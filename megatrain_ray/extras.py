"""The command that installs an optional extra, as this installation takes it: from a source checkout (an
editable install, as the README's commands make) `pip install -e '<checkout>[extra]'`, else the package's
name from the index."""

from __future__ import annotations

from functools import cache
from pathlib import Path

PACKAGE = "megatrain-ray"


@cache
def _checkout() -> Path | None:
    """The source checkout this package runs from (its pyproject.toml names the package), else None."""
    root = Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    try:
        return root if f'name = "{PACKAGE}"' in pyproject.read_text() else None
    except OSError:
        return None


def install_hint(extra: str) -> str:
    """`pip install ...` for the optional extra `extra` (pyproject.toml's optional-dependencies)."""
    checkout = _checkout()
    return f"pip install -e '{checkout}[{extra}]'" if checkout else f"pip install '{PACKAGE}[{extra}]'"
