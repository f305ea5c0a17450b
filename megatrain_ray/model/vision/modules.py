"""The vision tower and multimodal projector of a vision-language checkpoint as transformers' own modules.

The model class config.json names (LlavaForConditionalGeneration, Gemma3ForConditionalGeneration) is built on the
meta device; its base model (`model`) keeps its vision parts (config/hf_vision.py VisionFamily.parts), built for real
(a PreTrainedModel part from its own sub-config, a plain module such as the projector from the whole config, as the
base model's constructor builds them), and loses its language model (the text model streams, model/vision/ never
holds it). The image features are the base model's own `get_image_features` (the tower, the feature layer and CLS
cropping as configured, the projector): what transformers splices into the token embeddings, and Qwen3-VL's
deepstack features beside them (what its text model adds after its first layers). A tower whose attention runs over
segment bounds (Qwen-VL's windows and images) takes it in one SDPA call per segment length (model/vision/attention.py)
instead of transformers' one per segment. Eval mode (no dropout),
in the run's master dtype on the GPU worker's device; the weights come from the checkpoint by their module names
(model/vision/names.py), every one of them, and a checkpoint with vision tensors the modules do not have is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatrain_ray.config.hf import read_hf_config
from megatrain_ray.config.hf_generic import hf_pretrained_config
from megatrain_ray.config.hf_vision import FAMILIES, trains, vision_config
from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.model.vision.attention import use_segment_attention


def meta_model(model_dir: str) -> Any:
    """transformers' vision-language model of `model_dir` on the meta device (a new instance each call)."""
    import transformers

    where = str(Path(model_dir) / "config.json")
    hf = read_hf_config(model_dir)
    config = hf_pretrained_config(model_dir, hf, where)
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None or not hasattr(cls, "base_model_prefix"):
        raise CheckpointError(f"{where}: architectures {archs!r} names no transformers class")
    with torch.device("meta"):
        return cls(config)


class VisionModules:
    """The tower and projector of `model_dir` on `device` in `dtype`, their weights read from `source` (an
    HFDirectory of the same directory)."""

    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype, source: Any):
        from transformers import PreTrainedModel

        where = str(Path(model_dir) / "config.json")
        self.vision = vision_config(read_hf_config(model_dir), where)
        if self.vision is None:
            raise CheckpointError(f"{where} is not a vision-language model of a family the vision path takes "
                                  f"({', '.join(FAMILIES)})")
        full = meta_model(model_dir)
        self.segmented = False
        """Whether the tower's segmented attention runs one SDPA call per segment length (model/vision/attention.py)."""
        self.prefix = f"{full.base_model_prefix}."
        base = getattr(full, full.base_model_prefix)
        for name in self.vision.family.parts:
            part = getattr(base, name)
            real = type(part)._from_config(part.config) if isinstance(part, PreTrainedModel) else \
                type(part)(full.config)
            if isinstance(real, PreTrainedModel):
                self.segmented = use_segment_attention(real) or self.segmented
            setattr(base, name, real)
        base.language_model = torch.nn.Module()  # streamed by the engine, never built here
        left = [n for n, p in [*base.named_parameters(), *base.named_buffers()] if p.is_meta]
        if left:
            raise CheckpointError(f"{where}: the base model holds tensors outside its vision parts and language "
                                  f"model (first {left[0]!r}); the vision path does not know them")
        self.base = base.eval()
        self.config = full.config
        self._load(source, where)
        self.base.to(device=device, dtype=dtype)
        self.device, self.dtype = device, dtype

    def _load(self, source: Any, where: str) -> None:
        wanted = {self.prefix + n: t for n, t in self.base.state_dict().items()}
        extra = sorted(set(source.vision_names) - set(wanted))
        if extra:
            raise CheckpointError(f"{source.dir} holds {len(extra)} vision tensor(s) the model of its config.json does "
                                  f"not have, first {extra[0]!r}; the weights and config.json do not belong together")
        with torch.no_grad():
            for name, target in wanted.items():
                if name not in source.vision_names:
                    raise CheckpointError(f"{source.dir} has no tensor {name!r}, which config.json's vision tower "
                                          "or projector needs; the weights and config.json do not belong together")
                value = source.read_vision(name)
                if tuple(value.shape) != tuple(target.shape):
                    raise CheckpointError(f"{source.dir}: tensor {name!r} has shape {list(value.shape)} but "
                                          f"{where} implies {list(target.shape)}")
                if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    raise CheckpointError(f"{source.dir}: tensor {name!r} holds non-finite values; the checkpoint "
                                          "is damaged")
                target.copy_(value)

    def parameters(self) -> dict[str, torch.nn.Parameter]:
        """The vision parts' parameters by module name (`model.vision_tower.…`)."""
        return {self.prefix + n: p for n, p in self.base.named_parameters()}

    def trains(self, name: str, parts: tuple[str, ...]) -> bool:
        """Whether a module name (`model.vision_tower.…`) lies in one of `parts` (config/hf_vision.trained_parts)."""
        return trains(name.removeprefix(self.prefix), parts)

    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor the export writes (parameters and persistent buffers) by module name."""
        return {self.prefix + n: t for n, t in self.base.state_dict().items()}

    def features(self, pixel_values: torch.Tensor,
                 extra: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The image features [image tokens, hidden] in order of the images (and of their tokens in the rows), and
        Qwen3-VL's deepstack features (one [image tokens, hidden] per deepstack layer; none for other families)."""
        pixels = pixel_values.to(self.device, self.dtype)
        kwargs = {k: v.to(self.device) for k, v in extra.items()}
        out = self.base.get_image_features(pixel_values=pixels, return_dict=True, **kwargs)
        deepstack = [_rows(f) for f in (getattr(out, "deepstack_features", None) or [])]
        return _rows(out.pooler_output), deepstack


def _rows(out: torch.Tensor | list | tuple) -> torch.Tensor:
    """Features split per image (transformers' Qwen-VL) or batched, as one [image tokens, hidden]."""
    if isinstance(out, (list, tuple)):
        out = torch.cat(list(out), dim=0)
    return out.reshape(-1, out.shape[-1])
