"""The install command an error names for a missing optional extra (megatrain_ray/extras.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from megatrain_ray import extras
from tests.conftest import REPO


def test_from_a_checkout_the_hint_installs_that_checkout_s_extra():
    assert extras.install_hint("plot") == f"pip install -e '{Path(REPO).resolve()}[plot]'"


def test_an_installed_package_is_named_by_its_index_name(monkeypatch):
    monkeypatch.setattr(extras, "_checkout", lambda: None)
    assert extras.install_hint("track") == "pip install 'megatrain-ray[track]'"


@pytest.mark.parametrize("extra", ["hf", "gguf", "plot", "track", "datasets"])
def test_every_extra_an_error_names_exists(extra):
    with open(Path(REPO) / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["name"] == extras.PACKAGE and extra in project["optional-dependencies"]
