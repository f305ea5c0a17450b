"""Vision-language checkpoints (config.json of an image-text-to-text model): which families megatrain takes, their
text model as a native family, and the facts the vision path needs (model/vision/).

A vision-language model is the language model megatrain streams (a native text family: Llama, Mistral, Qwen2, Gemma 3
text, Qwen3, Qwen3-MoE) plus a vision tower and a multimodal projector that run as ordinary modules on the GPU worker.
Its config.json holds the text model under `text_config` and the tower under `vision_config`; this module reads the
first as the text class's config.json would be (so model.family is the text family and the layers stream as today) and
the rest as `VisionFamily`, for the vision path. Its weights on disk carry transformers' names of either spelling (the
legacy `language_model.model.*` that transformers 5 still writes, or the module names `model.language_model.*`);
model/vision/names.py maps them with transformers' own conversion rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megatrain_ray.exceptions import CheckpointError, ConfigError, excerpt
from megatrain_ray.system.files import read_json_object


@dataclass(frozen=True, slots=True)
class VisionFamily:
    """What the vision path needs to know of a vision-language family."""

    model_type: str
    text_model_types: tuple[str, ...]
    """The text model_types (text_config.model_type) whose native templates this family's language model runs on."""
    attention: Literal["causal", "image_blocks"]
    """causal: images are tokens like any other. image_blocks (Gemma 3): each image's tokens also attend to one
    another in both directions (transformers' token_type_ids mask: causal OR same image block, and in the sliding
    layers that AND the window)."""
    default_tie: bool
    """The config class's tie_word_embeddings when config.json has none."""
    parts: tuple[str, ...]
    """The vision modules' attribute names in the base model (transformers' XModel): trained and exported."""
    projector: tuple[str, ...] = ("multi_modal_projector",)
    """The modules (dotted, under the base model) that train with finetune.vision=frozen: the projector (Qwen-VL's
    patch merger lives inside its tower)."""
    rope: Literal["standard", "mrope", "mrope_interleaved"] = "standard"
    """mrope (Qwen2.5-VL): the text layers' rotary positions have three axes (time, height, width), an image's tokens
    placed on its grid, each axis taking one run of the rotary frequencies; mrope_interleaved (Qwen3-VL): the axes'
    frequencies interleaved (model/vision/mrope.py)."""
    deepstack: bool = False
    """Qwen3-VL: the tower's intermediate features (vision_config.deepstack_visual_indexes, each through its own
    merger) are added to the hidden states at the image tokens after the first decoder layers, one per layer."""


FAMILIES: dict[str, VisionFamily] = {
    "llava": VisionFamily("llava", ("llama", "mistral", "qwen2"), "causal", False,
                          ("vision_tower", "multi_modal_projector")),
    "gemma3": VisionFamily("gemma3", ("gemma3_text",), "image_blocks", True,
                           ("vision_tower", "multi_modal_projector")),
    "qwen2_5_vl": VisionFamily("qwen2_5_vl", ("qwen2_5_vl_text",), "causal", False, ("visual",), ("visual.merger",),
                               "mrope"),
    # As LLaMA-Factory's qwen3_vl: the projector is visual.merger; the deepstack mergers count with the tower.
    "qwen3_vl": VisionFamily("qwen3_vl", ("qwen3_vl_text",), "causal", False, ("visual",), ("visual.merger",),
                             "mrope_interleaved", deepstack=True),
    "qwen3_vl_moe": VisionFamily("qwen3_vl_moe", ("qwen3_vl_moe_text",), "causal", False, ("visual",),
                                 ("visual.merger",), "mrope_interleaved", deepstack=True),
}
TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "gemma3_text": "Gemma3ForCausalLM", "qwen2_5_vl_text": "Qwen2ForCausalLM",
                      "qwen3_vl_text": "Qwen3ForCausalLM", "qwen3_vl_moe_text": "Qwen3MoeForCausalLM"}
MROPE_TEXT_TYPES = {"qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3", "qwen3_vl_moe_text": "qwen3_moe"}
"""The native text family whose layers an M-RoPE family's text model has (its model_type in the text config.json)."""
PLANNED = {"llava_onevision": "LLaVA-OneVision", "mistral3": "Mistral 3", "llava_next": "LLaVA-NeXT",
           "internvl": "InternVL", "glm4v": "GLM-4V", "llama4": "Llama 4", "paligemma": "PaliGemma"}
"""Vision-language model_types transformers ships that the vision path does not take yet (issue 44)."""


def trained_parts(family: VisionFamily, mode: str) -> tuple[str, ...]:
    """finetune.vision: the modules (dotted, under the base model) that train (frozen: the projector, as
    LLaMA-Factory's default; full: every vision part)."""
    return family.projector if mode == "frozen" else family.parts


def trains(name: str, parts: tuple[str, ...]) -> bool:
    """Whether a base-model tensor name (`vision_tower.x.weight`) lies in one of `parts`."""
    return any(name == p or name.startswith(p + ".") for p in parts)


def image_tokens_per_image(hf: dict[str, Any]) -> int | None:
    """The image tokens one image takes in a row, from config.json (None: it depends on the image)."""
    vision = hf.get("vision_config") or {}
    if hf.get("model_type") == "gemma3":
        return int(hf.get("mm_tokens_per_image", 256))
    if hf.get("model_type") == "llava" and vision.get("image_size") and vision.get("patch_size"):
        full = hf.get("vision_feature_select_strategy", "default") == "full"  # the CLS token kept
        return (int(vision["image_size"]) // int(vision["patch_size"])) ** 2 + full
    return None


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The vision facts of one checkpoint (its config.json)."""

    family: VisionFamily
    image_token_id: int
    text_vocab_size: int
    mrope_section: tuple[int, ...] = ()
    """mrope: how many rotary frequencies each position axis (time, height, width) takes."""
    deepstack_layers: int = 0
    """deepstack: the decoder layers 0..n-1 after which the tower's intermediate features are added."""


def is_vision_config(hf: dict[str, Any]) -> bool:
    return hf.get("model_type") in FAMILIES or hf.get("model_type") in PLANNED


def vision_text_part(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The text model of a vision-language config.json as its text class's config.json (its architecture, the
    vision model's tie_word_embeddings); other config.json files as they are. A family the vision path does not
    take yet is refused, naming it."""
    model_type = hf.get("model_type")
    if model_type in PLANNED:
        raise ConfigError(f"{where}: {PLANNED[model_type]} ({model_type}) is a vision-language family the vision path "
                          f"does not take yet (taken: {', '.join(FAMILIES)}; issue 44)")
    if model_type not in FAMILIES:
        return hf
    family, text = FAMILIES[model_type], hf.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{where}: a {model_type} config.json needs a text_config mapping; got {excerpt(text)}")
    text_type = text.get("model_type")
    if text_type not in family.text_model_types:
        raise ConfigError(f"{where}: {model_type} with a {excerpt(text_type)} language model is not supported (the "
                          f"vision path streams native text families: {', '.join(family.text_model_types)})")
    tie = hf.get("tie_word_embeddings")
    tie = family.default_tie if tie is None else bool(tie)
    if model_type == "llava":  # LlavaConfig: the text config's tie counts where the top level's is off
        tie = tie or bool(text.get("tie_word_embeddings"))
    text = {**text, "architectures": [TEXT_ARCHITECTURES[text_type]], "tie_word_embeddings": tie}
    if family.rope != "standard":  # the text model's own tables are the 1-axis ones; mrope.py makes the three axes'
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope.pop("mrope_section", None)
        rope.pop("mrope_interleaved", None)
        text.update(rope_parameters=rope, model_type=MROPE_TEXT_TYPES[text_type])
        text.pop("rope_scaling", None)
    if text_type == "qwen3_vl_moe_text":  # its router always renormalises the top-k (Qwen3VLMoeTextTopKRouter)
        text["norm_topk_prob"] = True
    return text


def vision_config(hf: dict[str, Any], where: str = "config.json") -> VisionConfig | None:
    """The vision facts of a config.json; None for a text model."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        return None
    text = vision_text_part(hf, where)
    token = hf.get("image_token_id", hf.get("image_token_index"))
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise CheckpointError(f"{where}: image_token_id = {excerpt(token)} must be a token id >= 0")
    vocab = text.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise CheckpointError(f"{where}: text_config.vocab_size = {excerpt(vocab)} must be a whole number >= 1")
    section: tuple[int, ...] = ()
    if FAMILIES[model_type].rope != "standard":
        raw = hf.get("text_config") or {}
        section = tuple((raw.get("rope_parameters") or raw.get("rope_scaling") or {}).get("mrope_section") or ())
        if not section or not all(isinstance(n, int) and n > 0 for n in section) or len(section) != 3:
            raise CheckpointError(f"{where}: text_config.rope_parameters.mrope_section = {excerpt(section)} must "
                                  "be three whole numbers (the time, height and width axes' rotary frequencies)")
    deepstack = 0
    if FAMILIES[model_type].deepstack:
        indexes = (hf.get("vision_config") or {}).get("deepstack_visual_indexes", [8, 16, 24])  # the config's default
        if not isinstance(indexes, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in indexes):
            raise CheckpointError(f"{where}: vision_config.deepstack_visual_indexes = {excerpt(indexes)} must be a "
                                  "list of tower layer indexes")
        deepstack = len(indexes)
        if deepstack > int(text.get("num_hidden_layers") or 0):
            raise CheckpointError(f"{where}: {deepstack} deepstack features (vision_config.deepstack_visual_indexes) "
                                  f"but the text model has {text.get('num_hidden_layers')} layers to add them after")
    return VisionConfig(FAMILIES[model_type], token, vocab, section, deepstack)


def vision_config_of_dir(model_dir: str | Path | None) -> VisionConfig | None:
    """The vision facts of a model directory (None: no directory, or a text model)."""
    if not model_dir:
        return None
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    return vision_config(read_json_object(path, str(path), CheckpointError), str(path))
