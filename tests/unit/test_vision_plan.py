"""`megatrain plan` for a vision-language model (planning/vision.py): the tower and projector on the GPU worker and
an image's tokens, against the transformers model's own tensors and features.

Tiny LLaVA, Gemma 3, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (tests/reference_vision.py) saved with save_pretrained: the
plan's weight term is every tensor of the model's vision parts (its state_dict: parameters and persistent buffers) in
the master dtype, the state term a gradient and two AdamW moments per trained parameter (the projector with
finetune.vision frozen, the tower too with full); both are in the GPU peak; an image's tokens are the rows
get_image_features gives for one image. A text model's plan has no vision term.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.planning.machine import Machine  # noqa: E402
from megatrain_ray.planning.memory import plan_run  # noqa: E402
from megatrain_ray.planning.plan_text import format_plan  # noqa: E402
from megatrain_ray.planning.vision import VISION_KEYS, VISION_STATE, VISION_WEIGHTS  # noqa: E402
from tests.conftest import tiny_raw  # noqa: E402
from tests.reference_vision import QWEN_FAMILIES, build  # noqa: E402

MACHINE = Machine(64 * 2**30, 64 * 2**30, 64 * 2**30, None, 80 * 2**30, "H100", described=True)


@pytest.fixture(scope="module", params=["llava", "gemma3", *QWEN_FAMILIES])
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    return request.param, build(request.param, directory), directory


def planned(directory, vision: str, dtype: str):
    raw = tiny_raw(precision={"master_dtype": dtype, "compute_dtype": dtype}, finetune={"vision": vision},
                   engine={"device": "cuda"})
    raw["model"] = {"path": str(directory)}
    return plan_run(load_config(raw=raw), MACHINE)


@pytest.mark.parametrize("vision, dtype", [("frozen", "float32"), ("full", "float64")])
def test_the_tower_and_projector_are_counted_on_the_gpu(family, vision, dtype):
    name, model, directory = family
    plan = planned(directory, vision, dtype)
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    qwen = name in QWEN_FAMILIES  # one module: the tower (Qwen3-VL's deepstack mergers with it) and its merger
    parts = ("model.visual.",) if qwen else ("model.vision_tower.", "model.multi_modal_projector.")
    projector = "model.visual.merger." if qwen else "model.multi_modal_projector."
    tensors = sum(t.numel() for k, t in model.state_dict().items() if k.startswith(parts))
    trained = sum(p.numel() for k, p in model.named_parameters()
                  if k.startswith(projector if vision == "frozen" else parts))
    assert plan.gpu[VISION_WEIGHTS] == tensors * element
    assert plan.gpu[VISION_STATE] == 3 * trained * element
    without = {k: v for k, v in plan.gpu.items() if k not in VISION_KEYS}
    from megatrain_ray.planning.gpu_memory import peak_allocated

    assert plan.gpu_peak - peak_allocated(without) == (tensors + 3 * trained) * element
    text = format_plan(plan)
    assert f"vision ({name}, finetune.vision={vision})" in text and VISION_WEIGHTS in text
    if qwen:  # its images' tokens follow their sizes
        assert "an image's tokens depend on its size" in text
        return
    with torch.no_grad():  # one image's tokens: the rows of its features
        features = model.get_image_features(pixel_values=torch.randn(1, 3, 16, 16), return_dict=True).pooler_output
    features = torch.cat(list(features)) if isinstance(features, (list, tuple)) else features
    tokens = features.reshape(-1, features.shape[-1]).shape[0]
    assert f"an image is {tokens} tokens of data.seq_len=16" in text, text


def test_a_text_model_has_no_vision_terms():
    plan = plan_run(load_config(raw=tiny_raw(engine={"device": "cuda"})), MACHINE)
    assert not set(plan.gpu) & set(VISION_KEYS) and plan.vision is None
    assert "vision (" not in format_plan(plan)
