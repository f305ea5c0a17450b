"""A rollout's decode step over an NF4 MoE base reads the experts in NF4 where they lie (engine/packed_stream.py,
quant/nf4_triton.NF4Experts): greedy generation of tiny gpt-oss and Qwen3-MoE bases (LoRA on attention, every
layer's packed bytes on the device; each of the 3 layers' experts read in NF4 at every decode step) gives the
tokens of the same engine with every expert dequantized first, and log-probs within 4x the float32 noise measured
by the dequantizing engine in float64 (floor 1e-6).

The Triton kernels run in Triton's interpreter on the CPU, which must be switched on before triton is imported:
the runs are a subprocess of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = r'''
import json, sys
from pathlib import Path
import torch
from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.engine.rollout import passes
from megatrain_ray.engine.rollout.interface import SamplingSettings
from megatrain_ray.quant.nf4_triton import NF4Experts
from tests.integration.test_lora_moe_parity import ATTENTION, moe_lora_config
from tests.unit.test_moe import hf_moe_model

name, tmp = sys.argv[1], Path(sys.argv[2])
family, extra = {"gpt-oss": ("gpt-oss", dict(num_experts_per_tok=2, intermediate_size=32)),
                 "qwen3-moe": ("qwen3-moe-dense-layer", dict(num_experts_per_tok=3, num_experts=5,
                                                             moe_intermediate_size=64, mlp_only_layers=[]))}[name]
hf_moe_model(family, hidden_size=64, **extra).save_pretrained(tmp / "base")
prompts = [[5, 9, 17, 3, 44], [7, 2], [90, 91, 92, 93, 94, 95, 96]]
sampling = SamplingSettings(max_new_tokens=6, temperature=0)
dequantizing = passes.RolloutPasses._experts_in_nf4
products, calls = NF4Experts.products, []


def counted(self, rows, ends, transposed):
    calls.append(self.shape)
    return products(self, rows, ends, transposed)


NF4Experts.products = counted
out = {}
for run, dtype, nf4_experts in (("nf4", "float32", True), ("dense", "float32", False), ("dense64", "float64", False)):
    passes.RolloutPasses._experts_in_nf4 = dequantizing if nf4_experts else (lambda self, copy: False)
    (tmp / run).mkdir()
    cfg = moe_lora_config(tmp / run, tmp / "base", name, ATTENTION, dtype,
                          finetune={"method": "lora", "lora": {"r": 4, "lora_alpha": 8, "target_modules": ATTENTION,
                                                               "base_quantization": "nf4"}},
                          engine={"device": "cpu", "gpu_resident": 3, "nf4_kernels": "triton"})
    with Trainer(cfg) as trainer:
        calls.clear()  # after the start-up probe of the kernels (quant/nf4_triton_probe.py): the decode's own
        result = trainer.gpu.generate(prompts, sampling).result()
    out[run] = {"tokens": result.tokens.tolist(), "logps": result.logps.double().tolist(),
                "experts_in_nf4": result.stats["experts_in_nf4"], "products": len(calls),
                "decode_steps": result.stats["decode_steps"] - 1}
print("RESULT" + json.dumps(out))
'''


@pytest.mark.float32_parity
@pytest.mark.parametrize("name", ["gpt-oss", "qwen3-moe"])
def test_decoding_with_the_experts_in_nf4_equals_dequantizing_them(tmp_path, name):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, name, str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(proc.stdout.split("RESULT", 1)[1])
    nf4, dense, dense64 = runs["nf4"], runs["dense"], runs["dense64"]
    assert nf4["experts_in_nf4"] == 1.0 and dense["experts_in_nf4"] == 0.0
    # every decode step (the first token comes from prefill), every one of the 3 MoE layers, both expert tensors
    assert nf4["products"] == nf4["decode_steps"] * 3 * 2 > 0 and dense["products"] == 0
    assert nf4["tokens"] == dense["tokens"] == dense64["tokens"]
    import torch

    ref = torch.tensor(dense64["logps"])
    noise = (torch.tensor(dense["logps"]) - ref).abs().max()
    error = (torch.tensor(nf4["logps"]) - ref).abs().max()
    assert error <= 4 * noise + 1e-6, \
        f"NF4 experts' log-probs {error:.3g} from float64, dequantized float32 {noise:.3g}"
