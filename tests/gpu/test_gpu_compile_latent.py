"""engine.compile with DeepSeek-V3 and GLM-4.5 MoE on CUDA (marker `gpu`; skipped without CUDA): a small random
model of each family (a dense first layer, then MoE layers: the sigmoid router's group-limited top-k, grouped
experts through torch._grouped_mm, shared experts; DeepSeek-V3's latent attention, GLM-4.5's GQA with partial RoPE,
qkv biases and q/k norms) trained compiled (Inductor's Triton kernels, bfloat16) against the eager run from the same
seed and batches. tests/unit/test_deepseek_compile.py traces DeepSeek-V3's MoE layer on the CPU (aot_eager); only
here do the layers run through Inductor on a GPU, as engine.compile auto takes them on an sm90 GPU.

The bounds are tests/gpu/test_gpu.py's for the compiled Qwen3-MoE layers (bfloat16): the first loss within 2e-3
relative, the next losses within 1 %, every stage's gradient after the first step within 10 % relative (at random
initialisation bfloat16 rounding sends near-tied tokens to other experts in the two runs, moving those experts'
gradients; the losses agree as tightly as dense layers' do). Run on the GPU machine:

    python -m pytest tests/gpu/test_gpu_compile_latent.py -m gpu -s
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.hf import model_config_from_hf  # noqa: E402
from megatrain_ray.config.resolved import RunSpec  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from tests.gpu.test_gpu import _stage_grads, gpu_config  # noqa: E402

pytestmark = pytest.mark.gpu

EXPERTS = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
               num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
               topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
               max_position_embeddings=2048, pad_token_id=None, num_nextn_predict_layers=0)
"""One dense layer, one MoE layer (16 experts in 4 groups, a token's top-4 from 2 groups, one shared expert);
widths multiples of 8 (torch._grouped_mm's)."""

FAMILIES = {
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **EXPERTS, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=192, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **EXPERTS, num_attention_heads=8, num_key_value_heads=4, head_dim=64, attention_bias=True, use_qk_norm=True),
}


def _config(tmp_path, family: str, compile_: bool | str):
    model = dataclasses.asdict(model_config_from_hf(FAMILIES[family]().to_dict()))
    return gpu_config(tmp_path, layers=2, hidden=512, ffn=1024, batch=4, seq=1024, model=model,
                      precision={"stream_dtype": "float32"}, optimizer={"grad_clip": 1.0, "workers": 2},
                      train={"steps": 6}, engine={"compile": compile_})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_latent_family_tracks_the_eager_run_on_the_gpu(tmp_path, family):
    from torch._dynamo.utils import counters

    assert RunSpec.resolve(_config(tmp_path / "auto", family, "auto")).layers_compiled  # auto compiles them here
    runs, grads = {}, []
    for name, compile_ in (("compiled", True), ("eager", False)):
        torch._dynamo.reset()
        counters.clear()
        with Trainer(_config(tmp_path / name, family, compile_)) as trainer:
            assert trainer.run_spec.layers_compiled == compile_
            first = trainer.step(0)
            grads.append(_stage_grads(trainer))
            runs[name] = (first, [trainer.step(s)["loss"] for s in range(1, trainer.cfg.train.steps)])
        breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
        if compile_:
            compiled_graphs, compiled_breaks = graphs, breaks
    errors = [((x - y).norm() / y.norm()).item() for x, y in zip(*grads)]
    (a, ra), (b, rb) = runs["compiled"], runs["eager"]
    print(f"\n{family} compiled vs eager: {compiled_graphs} graphs, {compiled_breaks} graph breaks; loss "
          f"{a['loss']:.5f} vs {b['loss']:.5f}; per-stage gradient relative error "
          f"{[f'{e:.2e}' for e in errors]}; losses of steps 1-5 {[round(x, 4) for x in ra]} vs "
          f"{[round(x, 4) for x in rb]}; GPU peak {a['gpu_peak_gib']:.2f} vs {b['gpu_peak_gib']:.2f} GiB")
    assert compiled_graphs >= 2 and compiled_breaks == 0
    assert abs(a["loss"] - b["loss"]) <= 2e-3 * b["loss"]
    assert max(errors) <= 0.1
    assert all(abs(x - y) <= 1e-2 * y for x, y in zip(ra, rb))
