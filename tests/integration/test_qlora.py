"""QLoRA (finetune.lora.base_quantization=nf4): LoRA on a frozen NF4 base streamed in 4 bits, dequantized on the
device as each layer arrives (store/nf4_base.py, engine/packed_stream.py).

The exact reference: transformers (+ peft) on the same Hugging Face model whose decoder matrices were replaced by
megatrain_ray.quant.nf4's dequantize_nf4(quantize_nf4(W)) (bitsandbytes-exact; tests/unit/test_nf4.py), the
values the engine computes with. Embedding, LM head and norms stay as they are, as QLoRA keeps them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.quant.nf4 import dequantize_nf4, quantize_nf4
from tests.integration.test_lora_parity import lora_config, make_base, peft_model

NF4 = {"method": "lora", "lora": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear",
                                   "base_quantization": "nf4"}}


def dequantized_copy(base: Path, out: Path) -> Path:
    """The model at `base` with every decoder-layer matrix replaced by deq(q(W)) (blocksize 64, double quant)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".layers." in name and param.dim() == 2:
                param.copy_(dequantize_nf4(quantize_nf4(param, 64, double_quant=True), torch.float32))
    model.save_pretrained(out)
    return out


def random_adapters(adapters: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Non-zero A and B (B starts at zero), so that the adapters take part in the logits."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=g) * 0.1 for name, t in adapters.items()}


def test_nf4_lora_logits_equal_transformers_on_the_dequantized_model(tmp_path):
    """fp32 compute: the engine's logits against peft's on the dequantized model, within 1e-5 absolute (float32
    sums in another order, ~1e-7 relative on logits of size ~1); against the original base they differ far more,
    which proves the base really streams in NF4."""
    base = make_base(tmp_path / "base", "llama")
    reference_base = dequantized_copy(base, tmp_path / "dequantized")
    cfg = lora_config(tmp_path, base, steps=2, finetune=NF4)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
    with Trainer(cfg) as trainer:
        adapters = random_adapters(trainer.adapters(), seed=3)
        trainer.set_adapters(adapters)
        ours = trainer.logits(ids)
        base_seen = trainer.master_weights()
    with torch.no_grad():
        ref = peft_model(reference_base, cfg, adapters)(input_ids=ids).logits.float()
        dense = peft_model(base, cfg, adapters)(input_ids=ids).logits.float()
    err = float((ours - ref).abs().max())
    assert err <= 1e-5, f"max |logits - reference| = {err:.2e}"
    assert float((dense - ref).abs().max()) > 100 * 1e-5, "NF4 changed nothing: the test would prove nothing"
    # The base the run reports (and exports) is the dequantized one, exactly.
    reference_state = transformers.AutoModelForCausalLM.from_pretrained(reference_base, dtype=torch.float32).state_dict()
    for name, value in base_seen.items():
        assert torch.equal(value, reference_state[name]), name
