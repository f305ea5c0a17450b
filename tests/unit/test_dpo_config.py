"""finetune.objective=dpo: what the config refuses, each with one message naming the key."""

from __future__ import annotations

import pytest

from megatrain_ray.config.load import load_config
from megatrain_ray.exceptions import ConfigError
from tests.conftest import tiny_raw


def dpo(**sections):
    raw = tiny_raw(**sections)
    raw["finetune"] = {"objective": "dpo", **raw.get("finetune", {})}
    return load_config(raw=raw)


def test_defaults_are_trls():
    cfg = dpo()
    assert (cfg.finetune.dpo.beta, cfg.finetune.dpo.label_smoothing, cfg.finetune.dpo.loss_type) == (0.1, 0.0, "sigmoid")
    assert load_config(raw=tiny_raw()).finetune.objective == "sft"


@pytest.mark.parametrize("sections,key", [
    ({"data": {"batch_size": 3}}, "data.batch_size"),
    ({"data": {"packing": True}}, "data.packing"),
    ({"data": {"batch_size": 6}, "parallel": {"gpus": 2}, "runtime": {"mode": "ray"}}, "data.batch_size"),
    ({"finetune": {"dpo": {"beta": 0.0}}}, "finetune.dpo.beta"),
    ({"finetune": {"dpo": {"label_smoothing": 0.5}}}, "finetune.dpo.label_smoothing"),
    ({"finetune": {"dpo": {"loss_type": "ipo"}}}, "finetune.dpo.loss_type"),
])
def test_refused_with_the_key_named(sections, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        dpo(**sections)
