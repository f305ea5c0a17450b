"""Config loading: every shipped YAML loads; bad keys, types and values name the dotted key."""

from __future__ import annotations

import glob
import math
import os
from pathlib import Path

import pytest

from megatrain_ray.config.load import load_config
from megatrain_ray.config.sections import Config
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.model.layout import build_layout
from tests.conftest import REPO, tiny_raw

# configs/recipes/ name hub models: tests/integration/test_recipes.py plans them from a test hub cache.
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml"))
                 + glob.glob(os.path.join(REPO, "configs", "shapes", "*.yaml")))


def test_every_required_config_ships():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"tiny.yaml", "llama-3.5b-bench.yaml", "llama3-8b.yaml", "qwen2.5-7b.yaml", "qwen2.5-32b.yaml",
            "mistral-7b.yaml", "phi3-mini.yaml", "gemma3-27b.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    build_layout(cfg.model)  # the shape is buildable


# Parameter counts of the published models these shapes copy (from their model cards / safetensors index).
@pytest.mark.parametrize("name, billions", [
    ("llama3-8b.yaml", 8.03), ("qwen2.5-7b.yaml", 7.62), ("qwen2.5-32b.yaml", 32.76), ("mistral-7b.yaml", 7.24),
    ("qwen2.5-14b.yaml", 14.77), ("llama-3.5b-bench.yaml", 3.5), ("llama3-70b.yaml", 70.55),
    ("qwen2.5-72b.yaml", 72.71), ("dense-120b.yaml", 119.82), ("phi3-mini.yaml", 3.82),
    # Gemma 3 27B, text only: the Gemma 3 technical report (Table 1) gives 25,600 M non-embedding and 1,416 M
    # embedding parameters (27.0 B; plus a 417 M vision encoder that Gemma3ForCausalLM does not have). The
    # layout's exact count, 27,009,346,304, is asserted in test_the_gemma3_27b_shape_has_its_layout_count.
    ("gemma3-27b.yaml", 27.02),
    # The text models of Qwen3.5-27B and Qwen3.5-397B-A17B (cards: 27B; 397B); DeepSeek-V3 and GLM-4.5-Air (native)
    # from config.json alone (cards: 671B, its 685B with the multi-token-prediction module; 106B).
    ("qwen3.5-27b.yaml", 27.0), ("qwen3.5-397b-a17b.yaml", 397.0), ("deepseek-v3.yaml", 671.0),
    ("glm-4.5-air.yaml", 106.0),
])
def test_model_shapes_have_the_published_size(name, billions):
    layout = build_layout(load_config(os.path.join(REPO, "configs", "shapes", name)).model)
    assert math.isclose(layout.num_params / 1e9, billions, rel_tol=0.01)


@pytest.mark.parametrize("name, total, active, billions", [
    # Activated parameters as the model cards count them: Qwen3.5-397B-A17B's 17B and DeepSeek-V3's 37B with the
    # embedding and the LM head, GLM-4.5-Air's 12B without them. The native templates count the experts by their
    # config (top-8 of 256 and of 128), the routing biases (buffers) not among the parameters; the generic path, by
    # transformers' model (config/generic_shape.expert_fractions), gave the same counts.
    ("qwen3.5-397b-a17b.yaml", 396_346_350_336, 17_349_040_896, 17.0),
    ("deepseek-v3.yaml", 671_026_404_352, 37_552_282_624, 37.0),
    ("glm-4.5-air.yaml", 106_852_245_504, 12_182_609_920, 12.0),
])
def test_moe_shapes_have_the_published_active_count(name, total, active, billions):
    from megatrain_ray.model.flops import active_params

    path = os.path.join(REPO, "configs", "shapes", name)
    model = load_config(path).model
    layout = build_layout(model)
    embeddings = 2 * model.vocab_size * model.hidden_size  # untied: the embedding and the LM head
    counted = active_params(model, layout) - (embeddings if name.startswith("glm") else 0)
    assert (layout.num_params, counted) == (total, active)
    assert math.isclose(counted / 1e9, billions, rel_tol=0.03)
    assert f"{total:,}" in Path(path).read_text() and f"{active:,}" in Path(path).read_text()
    if name.startswith("deepseek"):  # the plan's header says it, generic or native
        from megatrain_ray.planning.machine import Machine
        from megatrain_ray.planning.memory import plan_run
        from megatrain_ray.planning.plan_text import format_plan

        header = format_plan(plan_run(load_config(path), Machine.from_preset("h200-1.5tb"))).splitlines()[0]
        assert header.startswith("megatrain plan: deepseek_v3, 671 B parameters (37.6 B active per token)"), header


def test_the_gemma3_27b_shape_has_its_layout_count():
    """62 layers of 412,898,560 (q, k, v, o 66,060,288; MLP 346,816,512; four norms of 5376 and the q/k norms
    of 128) and the tied 262208 x 5376 embedding, and the final norm: the count its comment states."""
    path = os.path.join(REPO, "configs", "shapes", "gemma3-27b.yaml")
    model = load_config(path).model
    assert build_layout(model).num_params == 27_009_346_304 == 62 * 412_898_560 + 262208 * 5376 + 5376
    assert "27,009,346,304" in Path(path).read_text()
    assert [model.layer_slides(i) for i in range(12)] == [True] * 5 + [False] + [True] * 5 + [False]


def test_the_120b_shape_has_the_count_its_comment_derives():
    path = os.path.join(REPO, "configs", "shapes", "dense-120b.yaml")
    assert build_layout(load_config(path).model).num_params == 119_817_349_120
    assert "total 119,817,349,120" in Path(path).read_text()


@pytest.mark.parametrize("overrides, key", [
    (["optimizer.lrr=1"], "optimizer.lrr"),
    (["bogus.x=1"], "bogus"),
    (["optimizer.lr=fast"], "optimizer.lr"),
    (["optimizer.lr=-1"], "optimizer.lr"),
    (["optimizer.workers=two"], "optimizer.workers"),
    (["optimizer.beta2=1.0"], "optimizer.beta2"),
    (["model.num_key_value_heads=3"], "model.num_key_value_heads"),
    (["model.hidden_size=0"], "model.hidden_size"),
    (["model.family=gpt2"], "model.family"),
    (["model.final_logit_softcapping=30"], "model.final_logit_softcapping"),  # Gemma keys on a Llama
    (["model.family=gemma3"], "model.qk_norm"),  # Gemma 3 has q/k norms
    (["model.family=gemma3", "model.qk_norm=true", "model.attn_logit_softcapping=50"], "model.attn_logit_softcapping"),
    (["model.family=gemma2", "model.rope_local_base_freq=10000"], "model.rope_local_base_freq"),
    (["model.family=gemma2", "model.layer_types=[full_attention]"], "model.layer_types"),
    (["precision.compute_dtype=float64"], "precision.compute_dtype"),
    (["precision.stream_dtype=float64"], "precision.stream_dtype"),
    (["data.seq_len=100000"], "data.seq_len"),
    (["data.batch_size=0"], "data.batch_size"),
    (["train.steps=0"], "train.steps"),
    (["schedule.warmup_steps=500"], "schedule.warmup_steps"),
    (["runtime.mode=cluster"], "runtime.mode"),
    (["engine.grad_slabs=1"], "engine.grad_slabs"),
    (["model.rope_scaling.factor=0.5"], "model.rope_scaling.factor"),
    (["train.steps=true"], "train.steps"),
    (["model.tie_word_embeddings=1"], "model.tie_word_embeddings"),
])
def test_bad_values_name_their_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config(raw=tiny_raw(), overrides=overrides)
    assert f"'{key}" in str(info.value), str(info.value)


def test_overrides_are_typed_and_nested():
    cfg = load_config(raw=tiny_raw(), overrides=["optimizer.lr=1e-4", "optimizer.workers=3",
                                                 "model.rope_scaling.factor=4", "precision.stream_dtype=float32"])
    assert cfg.optimizer.lr == 1e-4 and cfg.optimizer.workers == 3
    assert cfg.model.rope_scaling is not None and cfg.model.rope_scaling.factor == 4.0
    assert cfg.model.rope_scaling.rope_type == "llama3"
    assert cfg.precision.stream_is_master


def test_missing_data_path_is_required():
    raw = tiny_raw()
    del raw["data"]["path"]
    with pytest.raises(ConfigError, match="data.path"):
        load_config(raw=raw)


def test_config_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_data_path_is_resolved_beside_the_config():
    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"))
    assert os.path.isfile(cfg.data.path)


def test_every_key_is_documented_and_the_reference_is_current():
    import dataclasses

    from megatrain_ray.config.docs import SECTIONS, field_docs, render

    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"undocumented keys in {section}: {missing}"
    with open(os.path.join(REPO, "docs", "config.md")) as f:
        assert f.read() == render(), "docs/config.md is stale: python -m megatrain_ray.config.docs > docs/config.md"
