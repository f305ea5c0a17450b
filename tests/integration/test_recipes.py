"""configs/recipes/: each fine-tune recipe loads with its model resolved by hub name (offline, from a
test hub cache holding the published config.json), has the published parameter count, and
`megatrain plan` fits it on every machine its `# machines:` line names."""

from __future__ import annotations

import glob
import math
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

from megatrain_ray.__main__ import main
from megatrain_ray.config.load import load_config
from megatrain_ray.model.layout import build_layout
from tests.conftest import REPO
from tests.hub_cache import published_configs_hub

RECIPES = sorted(glob.glob(os.path.join(REPO, "configs", "recipes", "*.yaml")))
# Published parameter counts (model cards and safetensors index totals).
PUBLISHED_BILLIONS = {"Qwen/Qwen2.5-7B-Instruct": 7.62, "Qwen/Qwen2.5-32B-Instruct": 32.76,
                      "meta-llama/Llama-3.1-8B-Instruct": 8.03, "meta-llama/Llama-3.1-70B-Instruct": 70.55}


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("hf-home")
    published_configs_hub(home)
    return home


@pytest.fixture
def offline(hub, monkeypatch) -> Path:
    import huggingface_hub.constants as constants  # read at import: point this process at the test cache

    for key, value in {"HF_HOME": str(hub), "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


def test_the_recipes_cover_the_models_the_guide_names():
    names = {re.search(r"^  path: (\S+)", Path(p).read_text(), re.M).group(1) for p in RECIPES}
    assert names == set(PUBLISHED_BILLIONS)


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_recipe_resolves_its_hub_model_and_fits_the_machines_it_names(recipe, offline, capsys):
    text = Path(recipe).read_text()
    cfg = load_config(recipe)
    hub_name = re.search(r"^  path: (\S+)", text, re.M).group(1)
    assert Path(cfg.model.path).parent.parent.name == "models--" + hub_name.replace("/", "--")
    params = build_layout(cfg.model).num_params
    assert math.isclose(params / 1e9, PUBLISHED_BILLIONS[hub_name], rel_tol=0.005), params
    assert cfg.train.export_dir and cfg.train.eval_every and cfg.checkpoint.every  # a whole fine-tune
    assert f"megatrain prepare --tokenizer {hub_name}" in text
    machines = re.search(r"^# machines: ([\w.,\s-]+?)\s{2,}", text, re.M).group(1).split(", ")
    assert machines
    for machine in machines:  # the command in-process (its own process would import torch again: 2 s each)
        code = main(["plan", recipe, "--machine", machine])
        out, err = capsys.readouterr()
        assert code == 0, f"{machine}: {out[-600:]}{err}"
        assert "fits." in out and "tok/s" in out
