"""LoRA with a GPU-resident base (finetune.method=lora, engine.gpu_resident) on the CPU device.

References: the same LoRA run with every layer streamed, bit for bit (the resident layers compute on the very
values a streamed layer's slot holds, through the same templates and adapters: no tolerance; an NF4 base's
resident layers are dequantized from the same packed bytes by the same function); peft's
training of the same adapters (tests/integration/test_lora_parity.py, its 1e-5); the copies counted by the
engine (a resident layer is never copied after the start); resume and a fault restart against an
uninterrupted run, bit for bit (the base is not in LoRA checkpoints: it is copied from the host store again).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from megatrain_ray.driver.trainer import Trainer
from tests.conftest import interrupted_and_resumed
from tests.integration.test_lora_parity import assert_lora_parity, lora_config, losses, make_base, run_both
from tests.integration.test_lora_state import assert_restart_is_exact


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_base(tmp_path_factory.mktemp("lora-resident") / "base", "qwen2")


def lora_run(cfg, steps: int | None = None) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Per-step records and the final adapters of a run."""
    with Trainer(cfg) as trainer:
        records = [trainer.step(s) for s in range(steps if steps is not None else cfg.train.steps)]
        return records, trainer.adapters()


def assert_bit_equal(a: tuple[list[dict], dict], b: tuple[list[dict], dict]) -> None:
    (records_a, adapters_a), (records_b, adapters_b) = a, b
    assert [(r["loss"], r["grad_norm"]) for r in records_a] == [(r["loss"], r["grad_norm"]) for r in records_b]
    assert adapters_a.keys() == adapters_b.keys()
    assert all(torch.equal(adapters_a[k], adapters_b[k]) for k in adapters_a)


@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clip", "noclip"])
def test_resident_base_layers_train_bit_identically_to_streamed_ones(tmp_path, base, clip):
    common = {"optimizer": {"grad_clip": clip, "lr": 1e-2}}
    streamed = lora_run(lora_config(tmp_path / "none", base, steps=6, **common))
    for count in (2, 3):  # two of three layers, and all of them
        run = lora_config(tmp_path / f"r{count}", base, steps=6, engine={"gpu_resident": count}, **common)
        assert run.engine.gpu_resident == count
        resident = lora_run(run)
        assert_bit_equal(resident, streamed)
        assert all(r["d2h_bytes"] == 0 for r in resident[0])


def test_resident_layers_are_never_copied_and_the_embedding_and_head_stay(tmp_path, base):
    """What crosses host->device (the engine's count): the first step copies the embedding, the LM head and the
    streamed layers once; later steps nothing, since a frozen base's slots stay valid and the resident layers are
    on the device. Streamed, every step copies the layers that do not fit the two slots again."""
    records, _ = lora_run(lora_config(tmp_path / "r2", base, steps=3, engine={"gpu_resident": 2}))
    with Trainer(lora_config(tmp_path / "layout", base, steps=1)) as trainer:
        layout, itemsize = trainer.layout, 4  # float32 base
    assert records[0]["h2d_bytes"] == (layout.embed.numel + layout.head.numel + layout.layers[2].numel) * itemsize
    assert [r["h2d_bytes"] for r in records[1:]] == [0, 0]
    records, _ = lora_run(lora_config(tmp_path / "all", base, steps=2, engine={"gpu_resident": 3}))
    assert records[0]["h2d_bytes"] == (layout.embed.numel + layout.head.numel) * itemsize
    assert records[1]["h2d_bytes"] == 0


def test_an_nf4_base_kept_packed_on_the_device_trains_bit_identically(tmp_path, base):
    """finetune.lora.base_quantization=nf4: the resident layers' packed bytes stay on the device and are
    dequantized at each use, by the same function from the same bytes as the streamed ones: equal runs, and after
    the first step (embedding and head, dense float32) nothing is copied."""
    nf4 = {"method": "lora", "lora": {"r": 4, "lora_alpha": 8, "base_quantization": "nf4"}}
    streamed = lora_run(lora_config(tmp_path / "none", base, steps=4, finetune=nf4))
    cfg = lora_config(tmp_path / "all", base, steps=4, finetune=nf4, engine={"gpu_resident": 3})
    with Trainer(cfg) as trainer:
        layout = trainer.layout
        records = [trainer.step(s) for s in range(cfg.train.steps)]
        resident = records, trainer.adapters()
    assert_bit_equal(resident, streamed)
    assert records[0]["h2d_bytes"] == (layout.embed.numel + layout.head.numel) * 4
    assert all(r["h2d_bytes"] == 0 for r in records[1:])
    assert all(r["h2d_bytes"] > 0 for r in streamed[0])  # the packed layers cross every step when streamed


@pytest.mark.float32_parity
def test_lora_with_every_layer_resident_matches_peft(tmp_path):
    assert_lora_parity(run_both(tmp_path, "llama", engine={"gpu_resident": 3}))


def test_resume_with_a_resident_base_continues_bit_identically(tmp_path, base):
    engine = {"gpu_resident": 2}
    streamed = lora_config(tmp_path / "ref", base, steps=8)
    with Trainer(streamed) as trainer:
        trainer.train()
        final = trainer.adapters()
    cfg = lora_config(tmp_path / "cut", base, steps=8, checkpoint={"every": 3}, engine=engine)
    resumed_at, resumed = interrupted_and_resumed(cfg, 5, 3, Trainer.adapters)
    assert resumed_at == 3
    assert losses(tmp_path / "cut" / "run") == losses(tmp_path / "ref" / "run")
    assert all(torch.equal(final[k], resumed[k]) for k in final)


def test_overwritten_base_weights_reach_the_resident_layers(tmp_path, base):
    """Trainer.load_weights writes the host's base; the device's copies (resident layers, and the embedding's and
    head's slots) are read again: the run then trains as a streamed one given the same weights."""
    with Trainer(lora_config(tmp_path / "read", base, steps=1)) as trainer:
        weights = trainer.master_weights()
    changed = {name: value * 1.5 for name, value in weights.items()}
    runs = []
    for name, engine in (("none", {}), ("all", {"gpu_resident": 3})):
        with Trainer(lora_config(tmp_path / name, base, steps=3, engine=engine)) as trainer:
            trainer.step(0)  # the slots and the resident layers hold the original base
            trainer.load_weights(changed)
            runs.append(([trainer.step(s) for s in (1, 2)], trainer.adapters()))
    assert_bit_equal(runs[1], runs[0])
    unchanged = lora_run(lora_config(tmp_path / "unchanged", base, steps=3))
    assert unchanged[0][1]["loss"] != runs[0][0][0]["loss"]  # the new weights mattered


@pytest.mark.float32_parity
@pytest.mark.ray
def test_two_gpu_workers_each_with_a_resident_base_match_peft_and_survive_a_restart(tmp_path, ray_session):
    """Through Ray: two GPU workers (parallel.gpus=2), each holding the whole base on its device, against peft on
    the whole batch; then a killed GPU worker restarts from the adapters' checkpoint, copies the base again and
    ends bit-identical to an uninterrupted run: the one compared with peft."""
    ray = {"runtime": {"mode": "ray"}, "parallel": {"gpus": 2}, "engine": {"gpu_resident": 3}}
    run = run_both(tmp_path / "peft", "qwen2", world=2, **ray)
    assert_lora_parity(run)
    assert_restart_is_exact(tmp_path, run.base, len(run.losses), "kill:gpu1@4", reference=(run.losses, run.final),
                            checkpoint={"every": 3}, **ray)
