"""MoE decoder layers through torch.compile (engine.compile), on the CPU.

On the GPU a MoE layer compiles where its expert products take torch._grouped_mm (bfloat16, sm90): the shapes then
stay fixed whatever the routing. torch's CPU kernel of _grouped_mm takes bfloat16 too, so the same graph is
traced and built here by Inductor (C++), forward and recompute + backward, and compared with the eager template
and with a float64 run of it: the compiled layer must be as close to float64 as the eager one is (bfloat16
rounding), with the same routing, no graph break and every gradient present, with and without the
load-balancing loss's gradient. gpt-oss layers stay eager (ModelConfig.layers_compile says why).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.hf import model_config_from_hf  # noqa: E402
from megatrain_ray.config.resolved import RunSpec  # noqa: E402
from megatrain_ray.engine.compiled import CompiledDecoderLayer  # noqa: E402
from megatrain_ray.model import moe  # noqa: E402
from megatrain_ray.model.layer_spec import LayerSpec  # noqa: E402
from megatrain_ray.model.layout import build_layout  # noqa: E402
from megatrain_ray.model.moe import RouterRecord  # noqa: E402
from megatrain_ray.model.rope import rope_tables  # noqa: E402
from megatrain_ray.model.templates import bind, decoder_layer, decoder_layer_backward  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402
from tests.unit.test_moe import hf_moe_model  # noqa: E402


def _layer_inputs(name: str, dtype: torch.dtype):
    model = hf_moe_model(name)
    cfg = model_config_from_hf(model.config.to_dict())
    stage = build_layout(cfg).layers[0]
    state = model.state_dict()
    buffer = torch.zeros(stage.numel, dtype=torch.float64)
    for slot in stage.slots:
        value = state[stage.hf_name(slot)].double()
        if slot.name == "mlp.gate.weight":  # well-separated router logits: bfloat16 rounding flips no top-k
            value = value * 8
        buffer[slot.offset:slot.offset + slot.numel] = value.reshape(-1)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 33, cfg.hidden_size, generator=gen, dtype=torch.float64)
    grad_y = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    spec = LayerSpec.from_config(cfg, 0)
    w = bind(buffer.to(dtype), stage)
    rope = rope_tables(cfg, 33, x.device, dtype, local=spec.local_rope)
    return x.to(dtype), grad_y.to(dtype), w, rope, spec


def _run(layer, name: str, dtype: torch.dtype, aux_loss: bool):
    """The layer's output, and its recompute's input and weight gradients and routing counts; with `aux_loss`, a
    load-balancing loss's gradient on the summed router probabilities joins the backward (engine/router_aux.py)."""
    x, grad_y, w, rope, spec = _layer_inputs(name, dtype)
    with torch.no_grad():
        y = layer(x, w, rope, spec, None, 0, None)
    routing = RouterRecord()
    router_grad = torch.linspace(-1.0, 1.0, spec.moe.num_experts, dtype=torch.float32) if aux_loss else None
    grad_x, grads = decoder_layer_backward(x, w, rope, spec, None, grad_y, layer=layer, router=routing,
                                           router_grad=router_grad)
    return y, grad_x, grads, routing.counts


@pytest.mark.parametrize("aux_loss", [False, True], ids=["routing", "routing-aux-loss"])
@pytest.mark.parametrize("name", ["qwen3-moe-dense-layer", "mixtral-sliding"])
def test_compiled_moe_layer_matches_the_eager_template(monkeypatch, name, aux_loss):
    from torch._dynamo.utils import counters

    reference = _run(decoder_layer, name, torch.float64, aux_loss)  # the loop over experts, float64
    monkeypatch.setattr(moe, "grouped_mm_usable", lambda *tensors: True)  # the GPU's path, on torch's CPU kernel
    eager = _run(decoder_layer, name, torch.bfloat16, aux_loss)
    torch._dynamo.reset()
    counters.clear()
    compiled = _run(CompiledDecoderLayer(fall_back=False), name, torch.bfloat16, aux_loss)
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"]
    torch._dynamo.reset()

    assert torch.equal(compiled[3], eager[3]) and torch.equal(eager[3], reference[3])  # the same routing
    y64, gx64, grads64, _ = reference
    assert set(compiled[2]) == set(grads64)
    for label, want, got_eager, got_compiled in [("output", y64, eager[0], compiled[0]),
                                                 ("input gradient", gx64, eager[1], compiled[1]),
                                                 *((n, grads64[n], eager[2][n], compiled[2][n]) for n in grads64)]:
        scale = want.abs().max().item()
        eager_err = (got_eager.double() - want).abs().max().item() / scale
        compiled_err = (got_compiled.double() - want).abs().max().item() / scale
        assert compiled_err <= max(2 * eager_err, 2 ** -7), f"{label}: compiled {compiled_err:.2e}, eager {eager_err:.2e}"


def test_which_moe_models_compile(tmp_path):
    """engine.compile takes Qwen3-MoE and Mixtral layers in bfloat16 (on a GPU with sm90: torch._grouped_mm);
    gpt-oss (compiled, its router got no gradient: ModelConfig.layers_compile) and a float32 model stay eager."""
    def compiles(name: str, compute_dtype: str) -> bool:
        model = dataclasses.asdict(model_config_from_hf(hf_moe_model(name).config.to_dict()))
        cfg = tiny_config(tmp_path, model=model, data={"seq_len": 24}, engine={"compile": "auto"},
                          precision={"compute_dtype": compute_dtype, "master_dtype": "float32"})
        return RunSpec.resolve(cfg, device_type="cuda").compiles

    assert compiles("qwen3-moe-dense-layer", "bfloat16") and compiles("mixtral-sliding", "bfloat16")
    assert not compiles("gpt-oss", "bfloat16") and not compiles("qwen3-moe-dense-layer", "float32")
