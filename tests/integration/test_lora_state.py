"""A LoRA run's state (finetune.method=lora): what the host holds, checkpoints, resume, faults and export.

References: the host segments against the config (the base once, nothing else); checkpoints against the
adapters and AdamW state the run holds; resume and a fault restart against an uninterrupted run, bit for
bit; the export against peft (PeftModel.from_pretrained on the Hugging Face base, no missing or unexpected
keys, megatrain's logits) and transformers (the merged directory, the same logits).

The logits are float32 against float32 references: within 4x the noise a float64 copy of each reference
measures, floor 16 float32 ulps (tests/numerics.py); MKL's float32 GEMMs sum in a CPU-dependent order.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.engine.adapters import ADAPTER_FILE, ADAPTER_STAGE
from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.store.checkpoint import CheckpointDir
from tests.conftest import interrupted_and_resumed, one_thread
from tests.integration.test_lora_parity import exported_adapter_logits, lora_config, losses, make_base
from tests.numerics import assert_within_noise, bound, relative_error


def assert_restart_is_exact(tmp_path: Path, base: Path, steps: int, drill: str,
                            reference: tuple[list[float], dict[str, torch.Tensor]] | None = None,
                            reference_sections: dict | None = None, **common) -> None:
    """A LoRA run whose process `drill` kills restarts from the adapters' checkpoint and ends bit-identical to an
    uninterrupted run: the same per-step losses and the same final adapters. `reference`: that run's losses and
    adapters if made already; else it is made here, with `common` updated by `reference_sections` (in-process
    rather than through Ray: the same actors' code, bit for bit)."""
    if reference is None:
        sections = {**common, **(reference_sections or {})}
        with Trainer(lora_config(tmp_path / "ref", base, steps=steps, **sections)) as trainer:
            trainer.train()
            reference = [loss for _, loss in losses(tmp_path / "ref" / "run")], trainer.adapters()
    cfg = lora_config(tmp_path / "cut", base, steps=steps, fault={"max_restarts": 1, "drill": drill}, **common)
    with Trainer(cfg) as trainer:
        trainer.train()
        assert trainer.restarts == 1
        adapters = trainer.adapters()
    assert losses(tmp_path / "cut" / "run") == list(enumerate(reference[0]))
    assert adapters.keys() == reference[1].keys()
    assert all(torch.equal(adapters[k], reference[1][k]) for k in reference[1])


def exported_logits_float64(base: Path, export_dir: Path, ids: torch.Tensor, **hf_kwargs
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 twins of the export's float32 logits (their noise): peft's model from `export_dir`/adapter on
    the base, and the `export_dir`/merged model, each loaded as a user would and converted to float64."""
    def loaded(directory: Path):
        return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **hf_kwargs)
    adapter = peft.PeftModel.from_pretrained(loaded(base), export_dir / "adapter")
    with torch.no_grad():
        return tuple(model.to(torch.float64).eval()(ids).logits for model in (adapter, loaded(export_dir / "merged")))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_base(tmp_path_factory.mktemp("lora") / "base", "qwen2")


def test_the_host_holds_the_base_once_in_the_streaming_dtype_and_nothing_else(tmp_path, base):
    cfg = lora_config(tmp_path, base, steps=2, precision={"master_dtype": "float32", "compute_dtype": "bfloat16"})
    with Trainer(cfg) as trainer:
        kinds = {(s.kind, s.dtype) for s in trainer.specs}
        assert kinds == {("master", "bfloat16"), ("gate", "int32")}
        assert sum(s.numel for s in trainer.specs if s.kind == "master") == \
            sum(stage.numel for stage in trainer.layout.stages)
        assert trainer.optimizers == []  # no CPU optimizer workers
        before = trainer.master_weights()
        records = [trainer.step(0), trainer.step(1)]
        after = trainer.master_weights()
        stream_bytes = sum(s.nbytes for s in trainer.specs if s.kind == "master")
        # Nothing comes back. The first step streams the whole base in; then the embedding and LM head stay in
        # their slots (the base never changes), and of the three layers, in two slots, each pass copies the one
        # its slot no longer holds (layer 2 in the forward, layer 0 in the backward).
        assert all(record["d2h_bytes"] == 0 for record in records)
        assert records[0]["h2d_bytes"] >= stream_bytes
        assert records[1]["h2d_bytes"] == 2 * trainer.layout.layers[0].numel * 2  # bf16
        assert all(torch.equal(before[k], after[k]) for k in before)  # the frozen base never changes
        hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
        assert all(torch.equal(after[k], hf[k].to(torch.bfloat16)) for k in after)


def test_checkpoints_hold_the_adapters_and_their_adamw_state(tmp_path, base):
    cfg = lora_config(tmp_path, base, steps=4, checkpoint={"every": 2})
    with Trainer(cfg) as trainer:
        trainer.train()
        adapters = trainer.adapters()
        engine = trainer.gpu.instance.engine  # runtime.mode=local: the worker object itself
        state = {name: engine.adapters.optimizer.state[t] for name, t in
                 zip(adapters, engine.adapters.params)}
    last = CheckpointDir(tmp_path / "run" / "checkpoints").latest()
    assert last.step == 4 and [e["stage"] for e in last.manifest["files"]] == [ADAPTER_STAGE]
    assert last.manifest["state_config"]["finetune"]["method"] == "lora"
    assert last.manifest["state_config"]["model"]["path"] == str(base)  # the base it belongs to
    entry = last.manifest["files"][0]
    path = last.directory / entry["path"]
    assert path.name == ADAPTER_FILE and zlib.crc32(path.read_bytes()) == entry["crc32"]
    with safe_open(str(path), framework="pt") as f:
        assert int(f.metadata()["adam_step"]) == 4
        names = set(f.keys())  # noqa: SIM118 (safe_open is not a dict)
        assert names == set(adapters) | {f"optimizer.{k}.{n}" for k in ("exp_avg", "exp_avg_sq") for n in adapters}
        for name, value in adapters.items():
            assert torch.equal(f.get_tensor(name), value)
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(f.get_tensor(f"optimizer.{kind}.{name}"), state[name][kind].cpu())


def test_resume_continues_bit_identically(tmp_path, base):
    reference = lora_config(tmp_path / "ref", base, steps=8)
    with Trainer(reference) as trainer:
        trainer.train()
        final = trainer.adapters()
    cfg = lora_config(tmp_path / "cut", base, steps=8, checkpoint={"every": 3})
    resumed_at, resumed = interrupted_and_resumed(cfg, 5, 3, Trainer.adapters)  # the last checkpoint: step 3
    assert resumed_at == 3
    assert losses(tmp_path / "cut" / "run") == losses(tmp_path / "ref" / "run")
    assert all(torch.equal(final[k], resumed[k]) for k in final)


def test_a_full_checkpoint_does_not_resume_a_lora_run(tmp_path, base):
    full = lora_config(tmp_path, base, steps=2, finetune={"method": "full"})
    with Trainer(full) as trainer:
        trainer.train()
    lora = lora_config(tmp_path, base, steps=2)
    with pytest.raises(CheckpointError, match="finetune.method='full', this config has 'lora'"):
        Trainer(lora, resume="auto")


def test_nan_gradient_drops_the_step_and_leaves_the_adapters(tmp_path, base):
    cfg = lora_config(tmp_path, base, steps=4, fault={"drill": "nan_grad@2"})
    with Trainer(cfg) as trainer:
        for step in range(2):
            trainer.step(step)
        before = trainer.adapters()
        record = trainer.step(2)
        assert record["skipped"]
        after = trainer.adapters()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert not trainer.step(3)["skipped"]


@pytest.mark.ray
def test_a_killed_gpu_worker_restarts_from_the_adapters_checkpoint(tmp_path, base, ray_session):
    assert_restart_is_exact(tmp_path, base, 8, "kill:gpu@4", runtime={"mode": "ray"}, checkpoint={"every": 3},
                            host={"num_shards": 2}, reference_sections={"runtime": {"mode": "local"}})


@pytest.mark.float32_parity
@pytest.mark.parametrize("saved", [[], ["embed_tokens", "lm_head"]], ids=["adapters", "modules_to_save"])
def test_export_loads_in_peft_and_merged_in_transformers_with_the_same_logits(tmp_path, base, saved):
    """megatrain's float32 logits against peft's and the merged model's float32 logits, within the noise their
    float64 twins measure. Measured on an AVX-512 Xeon: noise 1.8e-7 to 2.2e-7, errors 0 (peft's model: the same
    bits) and 2.2e-7 to 2.7e-7 (merged), bound 1.9e-6 (the floor); the adapters move the logits by 0.72 and 1.9
    (relative), far past 100x the bound."""
    if saved:  # an untied LM head
        base = make_base(tmp_path / "llama", "llama")
    cfg = lora_config(tmp_path, base, steps=6, optimizer={"lr": 1e-2},
                      train={"export_dir": str(tmp_path / "export")},
                      finetune={"method": "lora", "lora": {"r": 4, "lora_alpha": 8, "modules_to_save": saved}})
    ids = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with Trainer(cfg) as trainer:
        trainer.train()
        ours = trainer.logits(ids)
        adapters = trainer.adapters()
    assert all(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)  # the adapters matter
    adapter_dir, merged_dir = tmp_path / "export" / "adapter", tmp_path / "export" / "merged"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == \
        ("LORA", 4, 8, str(base))
    assert (config["modules_to_save"] or []) == saved

    # The saved keys are exactly those peft's own model has, and it loads them all.
    with one_thread():
        theirs, plain = exported_adapter_logits(base, adapter_dir, ids)
        theirs64, merged64 = exported_logits_float64(base, tmp_path / "export", ids)
        merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            merged_logits = merged(ids).logits
    assert_within_noise("logits of peft's model on the export", ours, theirs, theirs64)
    # the adapters change the logits
    assert relative_error(ours, plain) > 100 * bound(relative_error(theirs, theirs64))
    assert_within_noise("logits of the merged export", ours, merged_logits, merged64)

    # `megatrain export` of the run's last checkpoint: the same adapter and merged weights, from the
    # adapters' file over the base the checkpoint records.
    from safetensors.torch import load_file

    from megatrain_ray.store.export import export_weights_dir

    again = export_weights_dir(tmp_path / "run", tmp_path / "from-checkpoint", dtype="float32")
    for part, file in (("adapter", "adapter_model.safetensors"), ("merged", "model.safetensors")):
        ours_file, theirs_file = load_file(str(again / part / file)), load_file(str(tmp_path / "export" / part / file))
        assert ours_file.keys() == theirs_file.keys()
        assert all(torch.equal(ours_file[k], theirs_file[k]) for k in ours_file)
