"""A vision-language model's tower and projector in the plan: their parameters, their device memory and the image
tokens (engine/vision_tier.py holds them on the GPU worker).

The tower and projector live on the device in the run's master dtype (float32; float64 in a float64 run): every
tensor of theirs (parameters and persistent buffers), and for what trains (finetune.vision: frozen trains the
projector, full the tower too) its gradient and AdamW's two moments in the same dtype. The counts are of
transformers' own modules, built on the meta device from config.json (model/vision/modules.py meta_model), so
they are the model's exact sizes. Not counted: the tower's activations in a step (kept for the backward when it
trains), nor its time in the speed model.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain_ray.config.hf import read_hf_config
from megatrain_ray.config.hf_vision import image_tokens_per_image, trained_parts, trains, vision_config_of_dir
from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.dtypes import DTYPE_BYTES

VISION_WEIGHTS = "vision tower and projector"
VISION_STATE = "vision gradients and AdamW moments"
VISION_KEYS = (VISION_WEIGHTS, VISION_STATE)
"""plan.gpu's terms of the vision parts: fixed buffers, counted in the peak (planning/gpu_memory.peak_allocated)."""


@dataclass(frozen=True, slots=True)
class VisionCounts:
    family: str
    parts: dict[str, int]
    """Parameters of each vision part (vision_tower, multi_modal_projector) by its module name."""
    buffers: int
    """Elements of their persistent buffers (position ids and the like)."""
    trained: int
    """Parameters that train under finetune.vision."""
    image_tokens: int | None
    """The image tokens of one image (None: it depends on the image)."""


def vision_counts(cfg: Config) -> VisionCounts | None:
    """The vision parts of cfg.model.path (None: a text model)."""
    vision = vision_config_of_dir(cfg.model.path)
    if vision is None:
        return None
    from megatrain_ray.model.vision.modules import meta_model  # lazy: builds transformers' classes (meta device)

    full = meta_model(cfg.model.path)
    base = getattr(full, full.base_model_prefix)
    parts = {name: sum(p.numel() for p in getattr(base, name).parameters()) for name in vision.family.parts}
    buffers = sum(b.numel() for name in vision.family.parts
                  for b in getattr(base, name).state_dict(keep_vars=True).values()) - sum(parts.values())
    chosen = trained_parts(vision.family, cfg.finetune.vision)
    trained = sum(p.numel() for name, p in base.named_parameters() if trains(name, chosen))
    return VisionCounts(vision.family.model_type, parts, buffers, trained,
                        image_tokens_per_image(read_hf_config(cfg.model.path)))


def vision_gpu_bytes(counts: VisionCounts | None, run: RunSpec) -> dict[str, int]:
    """plan.gpu's vision terms: every tensor in the master dtype, and a gradient and two moments per trained one."""
    if counts is None:
        return {}
    element = DTYPE_BYTES[run.master_dtype]
    return {VISION_WEIGHTS: (sum(counts.parts.values()) + counts.buffers) * element,
            VISION_STATE: 3 * counts.trained * element}


def vision_lines(cfg: Config, counts: VisionCounts | None) -> list[str]:
    """The plan's lines on the vision parts: their sizes, what trains, an image's tokens."""
    if counts is None:
        return []
    sizes = ", ".join(f"{name} {n / 1e6:.2f} M" for name, n in counts.parts.items())
    tokens = (f"an image is {counts.image_tokens} tokens of data.seq_len={cfg.data.seq_len} "
              f"(at most {cfg.data.seq_len // counts.image_tokens} images a row)" if counts.image_tokens else
              "an image's tokens depend on its size (the processor's pixel caps bound them)")
    return [f"vision ({counts.family}, finetune.vision={cfg.finetune.vision}): {sizes} parameters, "
            f"{counts.trained / 1e6:.2f} M of them trained, on the GPU worker in {cfg.precision.master_dtype}; "
            f"{tokens}; the tower's activations are not counted", ""]
