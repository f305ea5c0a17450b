"""benchmarks/lora.py's compiled peft baseline (peft-resident-compile) end to end on the CPU, Inductor compiling its
layers: the harness's out-of-memory retry, with activation checkpointing on, really runs (the first attempt's
model let go before the second is built, as a GPU needs for room)."""

from __future__ import annotations

import math

import pytest
import torch

peft = pytest.importorskip("peft")

from megatrain_ray.model.lora import lora_params
from tests.conftest import tiny_raw


def test_peft_resident_compile_retries_with_checkpointing_after_running_out_of_memory(tmp_path, monkeypatch):
    """The compiled peft baseline end to end on the CPU (Inductor), as benchmarks/run.py's child runs it: the first
    attempt, every activation kept, runs out of memory in its first forward (injected: after the compiled layers
    ran, in the LM head); the harness lets go of that model before building the next, which trains with activation
    checkpointing on every layer, and the row says so."""
    import gc
    import weakref

    import yaml
    from torch._dynamo.utils import counters

    import benchmarks.lora as lora

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_raw(finetune={"method": "lora", "lora": {"r": 4, "lora_alpha": 8}},
                                              engine={"device": "cpu"})))
    real, attempts, first, second = lora.peft_resident_model, [], [], []

    def out_of_memory_without_checkpointing(cfg, compile_layers, checkpointing, device="cuda"):
        gc.collect()
        attempts.append((checkpointing, first[0]() if first else None))
        model, opt, train_step = real(cfg, compile_layers, checkpointing, device)
        if checkpointing:
            second.append(model)
        else:
            first.append(weakref.ref(model))

            def oom(*_):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

            model.get_base_model().lm_head.register_forward_hook(oom)
        return model, opt, train_step

    monkeypatch.setattr(lora, "peft_resident_model", out_of_memory_without_checkpointing)
    spec = {"config": str(config), "overrides": [], "batch": 2, "layers": 2, "steps": 2, "warmup": 1,
            "run_dir": str(tmp_path / "run"), "device": "cpu"}
    counters.clear()
    row = lora.run_peft_resident_compile(spec)
    assert [checkpointing for checkpointing, _ in attempts] == [False, True]
    assert attempts[1][1] is None  # the first model was gone before the second was built
    assert row["checkpointing"] is True and row["compiled"] is True and row["finetune"] == "lora"
    assert len(row["losses"]) == 3 and all(math.isfinite(x) for x in row["losses"])
    from benchmarks.run import _load

    assert row["tok_per_s"] > 0 and row["adapter_params"] == lora_params(_load(spec))
    assert all(layer.gradient_checkpointing for layer in second[0].get_base_model().model.layers)
    assert counters["stats"]["unique_graphs"] >= 1  # the layers ran through Dynamo and Inductor
