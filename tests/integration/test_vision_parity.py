"""Vision-language models (model/vision/, engine/vision_engine.py) against transformers' own models.

Tiny random LLaVA (Llama + CLIP), Gemma 3 multimodal (Gemma 3 text + SigLIP), Qwen2.5-VL (Qwen2 text with M-RoPE,
its window-attention ViT and patch merger), Qwen3-VL and Qwen3-VL-MoE models, saved with save_pretrained
(tests/reference_vision.py), loaded by megatrain from that directory (model.path: HF safetensors in). Each batch has
two images in its first row, none in its second, one in its third.

- Logits equal transformers' (model(input_ids, pixel_values[, token_type_ids]).logits): float64 within 1e-10 (the
  language model's RoPE and norms in float64 on both sides, the vision modules as transformers computes them, since
  megatrain runs those very modules; measured 0.0), float32 within 4x the noise measured here (float32 against
  float64 of the same reference; measured 0.0). Gemma 3's bidirectional image blocks are proved to matter (the
  causal-only logits differ), so are Qwen2.5-VL's three position axes (transformers' logits with one axis differ in
  the image rows), and so do the pixels (other pixels change the image rows, not the text-only row).
- Training: 10 float64 steps against the transformers model with torch AdamW (matrices decayed) and
  clip_grad_norm_ over what trains: finetune.vision frozen (projector and language model train, the tower stays as
  loaded, bit for bit) and full (tower too); every loss and final tensor within 1e-10 (the tower's key biases,
  whose gradient is zero in exact arithmetic: both sides within 1e-12 of their start).
- HF round trip: the export loads with AutoModelForImageTextToText with no missing, unexpected or mismatched key,
  every tensor megatrain's rounded to the export's float32 bit for bit, and gives megatrain's logits (within the
  float32 rounding of the weights, 1e-6); resume from a checkpoint is bit-identical to the run without a stop.
- Qwen3-VL and Qwen3-VL-MoE (Qwen3 and Qwen3-MoE text on the native templates, interleaved M-RoPE, the deepstack
  features added after the first text layers): the same tests; without the deepstack features transformers' own
  logits differ; Qwen3-VL-MoE's experts in the hub's transposed layout read to the same logits.
- Refusals: image tokens that do not match the images' features, images to a text model, finetune.vision lora.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from megatrain_ray.exceptions import ConfigError  # noqa: E402
from megatrain_ray.messages import Batch  # noqa: E402
from megatrain_ray.model.vision.names import vision_module_name  # noqa: E402
from megatrain_ray.model.vision.splice import ImageTokenMismatch  # noqa: E402
from tests.conftest import learnable_tokens, tiny_raw  # noqa: E402
from tests.numerics import assert_exact, assert_within_noise, relative_error  # noqa: E402
from tests.reference_vision import (  # noqa: E402
    QWEN_FAMILIES,
    QWEN_GRIDS,
    batch,
    build,
    exact,
    hf_logits,
    image_inputs,
    in_tower,
    other_pixels,
    train_hf_vision,
)

FAMILIES = ["llava", "gemma3", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
STEPS = 10


class ListBatches:
    """Fixed batches with images in place of the data loader (the prepared-shard path: test_vision_prepare.py)."""

    def __init__(self, batches):
        self.batches = batches

    def batch(self, step: int) -> Batch:
        ids, labels, pixels = self.batches[step % len(self.batches)]
        return Batch(ids, labels, images=image_inputs(pixels))

    def epoch_of(self, step: int) -> float:
        return step / len(self.batches)


def vision_config(tmp_path, model_dir, dtype: str = "float64", **sections):
    tmp_path.mkdir(parents=True, exist_ok=True)
    raw = tiny_raw(precision={"master_dtype": dtype, "compute_dtype": dtype}, train={"steps": STEPS},
                   **sections)
    raw["model"] = {"path": str(model_dir), **sections.get("model", {})}
    raw["data"]["path"] = learnable_tokens(tmp_path / "tokens.npy", 96)
    raw["train"]["output_dir"] = str(tmp_path / "run")
    return load_config(raw=raw)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    return request.param, build(request.param, directory), directory


def test_logits_equal_transformers(family, tmp_path):
    name, model, directory = family
    ids, _, pixels = batch(name, 0)
    ref64, ref32 = hf_logits(name, exact(model), ids, pixels), hf_logits(name, model, ids, pixels)
    with Trainer(vision_config(tmp_path / "f64", directory)) as trainer:
        ours64 = trainer.logits(ids, image_inputs(pixels))
        other = trainer.logits(ids, image_inputs(other_pixels(pixels)))
    with Trainer(vision_config(tmp_path / "f32", directory, "float32")) as trainer:
        ours32 = trainer.logits(ids, image_inputs(pixels))
    assert ours64.dtype == torch.float64
    err = assert_exact("float64 logits", ours64, ref64)
    assert_within_noise("float32 logits", ours32, ref32, ref64)
    print(f"{name}: float64 {err:.1e}, float32 {relative_error(ours32, ref32):.1e} "
          f"(noise {relative_error(ref32, ref64):.1e})")
    assert relative_error(other[0], ours64[0]) > 1e-3 and relative_error(other[2], ours64[2]) > 1e-3
    # The text-only row sees no image: its logits move only by float64 rounding (an MoE groups the batch's tokens
    # per expert, so other pixels change the GEMMs' row counts and, with them, MKL's blocking on some CPUs).
    assert_exact("the text-only row under other pixels", other[1], ours64[1])
    if name == "gemma3":  # without its image blocks (causal only) transformers' own logits differ
        with torch.no_grad():
            causal = exact(model)(input_ids=ids, pixel_values=pixels.double()).logits
        assert relative_error(causal, ref64) > 1e-3
    if name in QWEN_FAMILIES:  # with one position axis (no image grid positions) transformers' own logits differ
        with torch.no_grad():
            one_axis = {} if name == "qwen2_5_vl" else {"position_ids": torch.arange(ids.shape[1]).expand_as(ids)}
            flat = exact(model)(input_ids=ids, pixel_values=pixels[0].double(), image_grid_thw=pixels[1],
                                **one_axis).logits
        assert relative_error(flat[0], ref64[0]) > 1e-3 and torch.equal(flat[1], ref64[1])
    if name in ("qwen3_vl", "qwen3_vl_moe"):  # and without the deepstack features added after the first layers
        plain = exact(model)
        language = plain.model.language_model
        language._deepstack_process = lambda hidden, masks, embeds: hidden
        assert relative_error(hf_logits(name, plain, ids, pixels)[0], ref64[0]) > 1e-3


def run_ours(cfg, batches, resume=None, steps=None, probe=None, export=None, records=None):
    """megatrain's run on `batches` (steps from the start or the checkpoint resumed up to `steps`, else
    cfg.train.steps; a checkpoint at the end when `steps` is given); returns (losses, text weights, vision state,
    logits of `probe` (ids, pixels) after the steps). `export`: the trained model exported there; `records`: a list
    the steps' metrics records are appended to."""
    with Trainer(cfg, resume=resume) as trainer:
        trainer.data = trainer.saver.data = ListBatches(batches)
        losses = []
        for step in range(trainer.next_step, steps or cfg.train.steps):
            record = trainer.step(step)
            losses.append(record["loss"])
            if records is not None:
                records.append(record)
            trainer.next_step = step + 1
        if steps is not None:
            trainer.save(wait=True)
        text, vision = trainer.master_weights(), trainer.vision_state()
        logits = trainer.logits(probe[0], image_inputs(probe[1])) if probe is not None else None
        if export is not None:
            trainer.export(export)
    return losses, text, vision, logits


@pytest.mark.parametrize("vision", ["frozen", "full"])
def test_float64_training_matches_transformers(family, tmp_path, vision):
    name, model, directory = family
    cfg = vision_config(tmp_path, directory, finetune={"vision": vision})
    batches = [batch(name, seed) for seed in range(3)]
    records = []
    ours, text, state, _ = run_ours(cfg, batches, records=records)
    # The projector (and a trained tower) updates on the device: its time counts in gpu_busy.
    assert all(r["device_update_seconds"] > 0 for r in records), [r["device_update_seconds"] for r in records]
    ref, ref_state = train_hf_vision(name, model, cfg, [batches[s % 3] for s in range(STEPS)], torch.float64, vision)
    initial = {k: v.double() for k, v in model.state_dict().items()}
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert_exact(f"loss at step {step}", a, b)
    for key, value in text.items():
        assert_exact(key, value, ref_state[vision_module_name(key)])
    for key, value in state.items():
        if key.endswith("k_proj.bias") and vision == "full":
            # A key bias has no gradient in exact arithmetic (the softmax over the keys ignores a score added to
            # every key alike): both runs hold rounding noise of their start (zero), ~1e-14 after 10 steps.
            assert (value - initial[key]).abs().max() < 1e-12 and (ref_state[key] - initial[key]).abs().max() < 1e-12
            continue
        assert_exact(key, value, ref_state[key])
        if in_tower(name, key) and vision == "frozen":
            assert torch.equal(value, initial[key]), f"{key} moved with the tower frozen"
        elif not torch.equal(ref_state[key], initial[key]):  # unused ones (LLaVA's last tower layer) stay in both
            assert relative_error(value, initial[key]) > 1e-4, f"{key} barely moved"
    assert ours[-1] < ours[0]


def test_export_round_trip_and_resume(family, tmp_path):
    name, model, directory = family
    batches = [batch(name, seed) for seed in range(3)]
    ids, _, pixels = batch(name, 5)
    cfg = vision_config(tmp_path / "whole", directory, finetune={"vision": "full"})
    whole = run_ours(cfg, batches, probe=(ids, pixels), export=tmp_path / "export")
    stopped = vision_config(tmp_path / "stopped", directory, finetune={"vision": "full"})
    run_ours(stopped, batches, steps=4)
    resumed = run_ours(stopped, batches, resume="auto")
    assert resumed[0] == whole[0][4:]  # every loss after the resume, bit for bit
    for part in (1, 2):
        assert all(torch.equal(resumed[part][k], v) for k, v in whole[part].items())
    loaded, info = transformers.AutoModelForImageTextToText.from_pretrained(
        tmp_path / "export", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(loaded) is type(model)
    # The export's dtype is config.json's (float32): every tensor is ours rounded to it, bit for bit.
    trained = {vision_module_name(k): v for k, v in whole[1].items()} | whole[2]
    saved = loaded.state_dict()
    for key, value in trained.items():
        assert torch.equal(saved[key], value.to(torch.float32)), key
    assert set(saved) - set(trained) <= ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    theirs = hf_logits(name, exact(loaded), ids, pixels)  # float32 weights: float32 rounding of ours
    # Both in float64, no float32 GEMM: what differs is the weights' float32 rounding (2^-24 each), on any CPU.
    assert relative_error(whole[3], theirs) < 1e-6
    # The export spells its tensors as transformers' modules do (model.language_model.*), where save_pretrained
    # wrote the legacy names (language_model.model.*): megatrain reads that spelling too, to the same logits.
    with Trainer(vision_config(tmp_path / "again", tmp_path / "export")) as trainer:
        assert_exact("logits from the export", trainer.logits(ids, image_inputs(pixels)), theirs)


def test_qwen3_vl_moe_experts_in_the_hub_layout(tmp_path):
    """The hub's Qwen3-VL-MoE checkpoints keep each layer's experts transposed ([experts, hidden, 2 x width]), which
    transformers transposes on load: megatrain reads that layout to the same logits as save_pretrained's."""
    from safetensors.torch import load_file, save_file

    model = build("qwen3_vl_moe", tmp_path / "saved")
    hub = tmp_path / "hub"
    hub.mkdir()
    for f in (tmp_path / "saved").iterdir():
        if f.name != "model.safetensors":
            (hub / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(tmp_path / "saved" / "model.safetensors"))
    experts = [k for k in tensors if ".mlp.experts." in k]
    save_file({k: v.transpose(1, 2).contiguous() if k in experts else v for k, v in tensors.items()},
              str(hub / "model.safetensors"), metadata={"format": "pt"})
    assert len(experts) == 4  # two MoE layers' gate_up and down
    ids, _, pixels = batch("qwen3_vl_moe", 0)
    theirs = transformers.AutoModelForImageTextToText.from_pretrained(hub, dtype=torch.float64)
    reference = hf_logits("qwen3_vl_moe", exact(theirs), ids, pixels)
    assert_exact("transformers from the hub layout", reference, hf_logits("qwen3_vl_moe", exact(model), ids, pixels))
    with Trainer(vision_config(tmp_path / "run", hub)) as trainer:
        assert_exact("logits from the hub layout", trainer.logits(ids, image_inputs(pixels)), reference)


def test_bad_input_is_refused(family, tmp_path):
    name, model, directory = family
    ids, labels, pixels = batch(name, 0)
    with Trainer(vision_config(tmp_path / "run", directory)) as trainer:
        with pytest.raises(ImageTokenMismatch, match="image tokens"):
            fewer = (pixels[0][:48], pixels[1][:2]) if name in QWEN_FAMILIES else pixels[:2]
            trainer.logits(ids, image_inputs(fewer))  # three images' tokens, two images
        with pytest.raises(ImageTokenMismatch, match="image tokens"):
            trainer.logits(ids)  # image tokens, no images
    with pytest.raises(ConfigError, match="finetune.vision=lora"):
        Trainer(vision_config(tmp_path / "lora", directory, finetune={"vision": "lora"}))


def test_images_to_a_text_model_are_refused(tmp_path):
    raw = tiny_raw()
    raw["data"]["path"] = learnable_tokens(tmp_path / "tokens.npy", 96)
    raw["train"]["output_dir"] = str(tmp_path / "run")
    ids, _, pixels = batch("llava", 0)
    with Trainer(load_config(raw=raw)) as trainer:
        with pytest.raises(ValueError, match="no vision tower"):
            trainer.gpu.logits(ids.clamp(max=95), image_inputs(pixels)).result()


@pytest.mark.ray
def test_ray_float64_training_matches_transformers(tmp_path, ray_session):
    """The Ray path: host shard, GPU worker and 2 optimizer workers as actors; the images travel with the batch."""
    directory = tmp_path / "hf"
    model = build("gemma3", directory)
    cfg = vision_config(tmp_path, directory, optimizer={"workers": 2}, runtime={"mode": "ray"})
    batches = [batch("gemma3", seed) for seed in range(3)]
    ours, text, state, _ = run_ours(cfg, batches)
    ref, ref_state = train_hf_vision("gemma3", model, cfg, [batches[s % 3] for s in range(STEPS)], torch.float64,
                                     "frozen")
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert_exact(f"loss at step {step}", a, b)
    for key, value in {**{vision_module_name(k): v for k, v in text.items()}, **state}.items():
        assert_exact(key, value, ref_state[key])


def test_image_inputs_through_rays_object_store(ray_session):
    """The batch's images through Ray's object store (out-of-band numpy buffers, read there without a copy:
    messages.ImageInputs.__reduce__; the object store's buffers are read-only) with every value, dtype and shape."""
    import ray

    ids, labels, pixels = batch("qwen2_5_vl", 0)
    sent = Batch(ids, labels, images=image_inputs(pixels))
    got = ray.get(ray.put(sent)).images
    assert got.pixel_values.dtype == sent.images.pixel_values.dtype
    assert torch.equal(got.pixel_values, sent.images.pixel_values)
    assert got.extra.keys() == sent.images.extra.keys()
    assert all(torch.equal(got.extra[k], v) for k, v in sent.images.extra.items())
    assert got.count == len(QWEN_GRIDS)
    assert torch.equal(got.pixel_values.to(torch.float64), sent.images.pixel_values.double())  # readable as a tensor
