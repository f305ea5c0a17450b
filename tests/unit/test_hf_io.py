"""Hugging Face directories in and out: bit-identical round trips, trained exports that transformers
reads back to megatrain's own logits, and one clear error per broken checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open
from safetensors.torch import save_file

from megatrain_ray.config.hf import UnsupportedArchitectureError
from megatrain_ray.config.load import load_config
from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.exceptions import CheckpointError, ConfigError
from megatrain_ray.model.hf_io import HFDirectory
from megatrain_ray.store.export import export_weights_dir
from tests.conftest import one_thread, tiny_raw
from tests.numerics import assert_within_noise
from tests.unit.test_templates import float64_twin, hf_model

# One model per family, each with the feature that family adds.
FAMILY_MODELS = {"llama": "llama-gqa", "mistral": "mistral-sliding-window", "qwen2": "qwen2-bias-tied",
                 "qwen3": "qwen3-qknorm-headdim", "phi3": "phi3-longrope-partial", "gemma3": "gemma3-local-global",
                 "gemma2": "gemma2-softcap"}


def save_hf(name: str, directory: Path, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None) -> Path:
    model = hf_model(name).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names = f.keys()
            out.update({k: f.get_tensor(k) for k in names})
    return out


def finetune_config(tmp_path: Path, model_dir: Path, **sections):
    raw = tiny_raw(**sections)
    raw["model"] = {"path": str(model_dir), **sections.get("model", {})}
    raw["train"]["output_dir"] = str(tmp_path / "run")
    return load_config(raw=raw)


@pytest.mark.parametrize("family", list(FAMILY_MODELS))
@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_load_then_export_is_bit_identical(tmp_path, family, sharded):
    dtype = torch.bfloat16 if sharded else torch.float32  # both source formats, both layouts
    source = save_hf(FAMILY_MODELS[family], tmp_path / "src", dtype, "40KB" if sharded else None)
    assert (source / "model.safetensors.index.json").is_file() == sharded
    cfg = finetune_config(tmp_path, source)
    assert cfg.model.family == family
    with Trainer(cfg) as trainer:
        out = trainer.export(tmp_path / "out")
    expected, got = safetensors_of(source), safetensors_of(out)
    assert set(got) == set(expected)  # tied models have no lm_head.weight on either side
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert json.loads((out / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    weights = sorted(out.glob("*.safetensors"))  # as readable as config.json (safetensors itself writes 0600)
    assert weights and {f.stat().st_mode & 0o777 for f in weights} == {(out / "config.json").stat().st_mode & 0o777}


@pytest.mark.float32_parity
@pytest.mark.parametrize("name", ["qwen3-qknorm-headdim", "phi3-longrope-partial", "gemma3-local-global",
                                  "gemma3-pattern-softcap", "gemma2-softcap"])
def test_trained_export_loads_in_transformers_with_our_logits(tmp_path, name):
    """Phi-3: trained on 16-token rows (LongRoPE's short factors), read back on 20 tokens (the long ones).
    Gemma: rows longer than the sliding window; tied (no lm_head.weight on either side) and untied.
    megatrain's float32 logits against transformers' on the export within 4x the noise a float64 copy of the
    exported model measures (tests/numerics.py; floor 16 ulps): on an AVX-512 Xeon noise 2.7e-7 to 8.1e-7,
    error 0 (Gemma 2) to 6.2e-7, bound 1.9e-6 to 3.2e-6."""
    source = save_hf(name, tmp_path / "src")
    export_dir = tmp_path / "exported"
    cfg = finetune_config(tmp_path, source, train={"steps": 3, "export_dir": str(export_dir)},
                          data={"path": "synthetic", "seq_len": 16, "batch_size": 2})
    ids = torch.randint(0, cfg.model.vocab_size, (2, 20), generator=torch.Generator().manual_seed(4))
    with Trainer(cfg) as trainer:
        trainer.train()
        ours = trainer.logits(ids)
        trained = trainer.master_weights()
    start = safetensors_of(source)
    assert any(not torch.equal(trained[k], start[k]) for k in start)  # the export is of the trained weights
    model, info = transformers.AutoModelForCausalLM.from_pretrained(export_dir, attn_implementation="eager",
                                                                     output_loading_info=True)
    assert type(model).__name__ == type(hf_model(name)).__name__
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    with torch.no_grad(), one_thread():
        theirs, theirs64 = model(ids).logits, float64_twin(model)(ids).logits
    assert_within_noise(f"{name}: logits of the export", ours, theirs, theirs64)
    # `megatrain export` re-shards the exported directory (or the run directory) without changing a bit.
    resharded = export_weights_dir(cfg.train.output_dir, tmp_path / "resharded", shard_bytes=30_000)
    assert len(list(resharded.glob("*.safetensors"))) > 1
    again = safetensors_of(resharded)
    assert all(torch.equal(again[k], v) for k, v in safetensors_of(export_dir).items())


def test_shape_keys_in_yaml_must_agree_with_config_json(tmp_path):
    source = save_hf("llama-gqa", tmp_path / "src")
    assert finetune_config(tmp_path, source, model={"hidden_size": 64}).model.hidden_size == 64
    with pytest.raises(ConfigError, match=r"model.hidden_size.*disagrees with .*config.json"):
        finetune_config(tmp_path, source, model={"hidden_size": 128})


def test_unsupported_architecture_is_named(tmp_path):
    source = save_hf("llama-gqa", tmp_path / "src")
    hf = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**hf, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedArchitectureError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM.*"
                       r"model.template to auto or generic"):
        finetune_config(tmp_path, source, model={"template": "native"})
    # model.template auto: the generic path takes it, and refuses GPT-2's learned position embeddings by name.
    with pytest.raises(UnsupportedArchitectureError, match=r"GPT2LMHeadModel cannot run on the generic path: .*"
                       r"learned position embeddings \(wpe\)"):
        finetune_config(tmp_path, source)


def test_missing_shard(tmp_path):
    source = save_hf("llama-gqa", tmp_path / "src", max_shard_size="40KB")
    shard = sorted(source.glob("model-*.safetensors"))[1]
    os.unlink(shard)
    with pytest.raises(CheckpointError, match=f"shard {shard.name} .* is missing"):
        HFDirectory(source)


def test_truncated_shard(tmp_path):
    source = save_hf("llama-gqa", tmp_path / "src")
    data = (source / "model.safetensors").read_bytes()
    (source / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        HFDirectory(source)


def broken_copy(tmp_path: Path, change) -> Path:
    """A one-file llama directory whose tensors went through `change` (a dict -> dict function)."""
    source = save_hf("llama-gqa", tmp_path / "src")
    save_file(change(safetensors_of(source)), str(source / "model.safetensors"), metadata={"format": "pt"})
    return source


def test_missing_tensor_fails_before_allocation(tmp_path):
    source = broken_copy(tmp_path, lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.1.mlp.up_proj.weight'"):
        Trainer(finetune_config(tmp_path, source))


def test_shape_mismatch_with_config_json(tmp_path):
    source = broken_copy(tmp_path, lambda t: {**t, "model.norm.weight": torch.ones(65)})
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \[65\] but config.json implies \[64\]"):
        Trainer(finetune_config(tmp_path, source))


def test_integer_tensors_cannot_become_master_weights(tmp_path):
    source = broken_copy(tmp_path, lambda t: {**t, "model.norm.weight": torch.ones(64, dtype=torch.int8)})
    with pytest.raises(CheckpointError, match="stored as I8, which cannot be converted"):
        Trainer(finetune_config(tmp_path, source))


def test_export_never_overwrites(tmp_path):
    source = save_hf("llama-gqa", tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        export_weights_dir(source, tmp_path / "out")
    with pytest.raises(ConfigError, match="train.export_dir .* already exists"):  # before training, not after
        Trainer(finetune_config(tmp_path, source, train={"export_dir": str(tmp_path / "out")}))
    assert os.listdir(tmp_path / "out") == ["keep.txt"]


def test_an_export_without_tokenizer_files_says_why(tmp_path, caplog):
    """An export whose source has no tokenizer files, and a byte-level run's (no model.path), each say that no
    tokenizer files were written and why; its size is printed in MB when under 0.1 GB."""
    import logging

    from megatrain_ray.model.hf_io import export_hf
    from megatrain_ray.model.layout import build_layout

    source = save_hf("llama-gqa", tmp_path / "src")
    with caplog.at_level(logging.INFO):
        export_weights_dir(source, tmp_path / "out")
    assert f"no tokenizer files written: {source} has none" in caplog.text and " MB float32" in caplog.text
    caplog.clear()
    model = load_config(raw=tiny_raw()).model
    tensors = {stage.hf_name(slot): torch.zeros(slot.shape) for stage in build_layout(model).stages
               for slot in stage.slots}
    with caplog.at_level(logging.INFO):
        export_hf(tensors, model, tmp_path / "bytes")
    assert "no tokenizer files written: the run has no model.path (a byte-level model" in caplog.text
    assert not [p for p in os.listdir(tmp_path / "bytes") if "token" in p]
