"""benchmarks/lora.py off the GPU machine: the peft baselines train the very adapters megatrain's LoRA trains
(same modules, shapes and count, as peft names them), and only those."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from benchmarks.common import VARIANTS
from benchmarks.lora import deepspeed_lora_config, peft_resident_model
from megatrain_ray.config.load import load_config
from megatrain_ray.model.lora import adapter_shapes, lora_params, peft_name
from tests.conftest import tiny_raw


def lora_cfg(**lora):
    return load_config(raw=tiny_raw(finetune={"method": "lora", "lora": {"r": 4, "lora_alpha": 8, **lora}},
                                    optimizer={"lr": 1e-2}))


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "down_proj"]])
def test_the_peft_baseline_trains_megatrains_adapters_and_nothing_else(targets):
    cfg = lora_cfg(target_modules=targets)
    model, _, train_step = peft_resident_model(cfg, compile_layers=False, checkpointing=True, device="cpu")
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trainable.values()) == lora_params(cfg)
    ours = {peft_name(i, f"{module}.lora_{part}.weight"): (r if part == "A" else out, inp if part == "A" else r)
            for i in range(cfg.model.num_layers) for module, (out, inp) in adapter_shapes(cfg.model, cfg.finetune.lora).items()
            for part, r in (("A", 4), ("B", 4))}
    theirs = {n: tuple(t.shape) for n, t in peft.get_peft_model_state_dict(model).items()}
    assert theirs == ours
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # B starts at zero: the second step's loss depends on the first step's update
        train_step(ids)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert all(p.abs().max() > 0 for n, p in trainable.items() if "lora_B" in n)


def test_the_deepspeed_baseline_offloads_the_parameters_and_the_optimizer():
    cfg = lora_cfg()
    ds = deepspeed_lora_config(cfg, batch=4)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ds["gradient_clipping"] == cfg.optimizer.grad_clip and ds["optimizer"]["params"]["lr"] == cfg.optimizer.lr
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["bf16"]["enabled"]


def test_megatrain_lora_variant_streams_the_base_in_bf16():
    base, overrides = VARIANTS["megatrain-lora"]
    cfg = load_config(raw=tiny_raw(precision={"master_dtype": "float32", "compute_dtype": "bfloat16",
                                              "stream_dtype": "float32"}), overrides=overrides)
    assert base == "megatrain" and cfg.finetune.method == "lora" and cfg.precision.resolved_stream_dtype == "bfloat16"


def test_megatrain_lora_resident_variant_keeps_the_base_on_the_gpu_where_it_fits():
    from megatrain_ray.config.resolved import RunSpec

    base, overrides = VARIANTS["megatrain-lora-resident"]
    cfg = load_config(raw=tiny_raw(), overrides=overrides)
    assert base == "megatrain" and cfg.finetune.method == "lora" and cfg.engine.gpu_resident == "auto"
    assert RunSpec.resolve(cfg).frozen_base  # accepted with LoRA; planning.gpu_memory.resolve_run counts the layers
    explicit = load_config(raw=tiny_raw(), overrides=[*VARIANTS["megatrain-lora"][1], "engine.gpu_resident=2"])
    assert RunSpec.resolve(explicit, device_type="cpu").resident_layers == 2

