"""Chat records with images -> documents whose images are the model's processor's output, kept with them.

For a vision-language model directory (config.json of a family model/vision/ takes) `megatrain prepare` runs its
processor (transformers' AutoProcessor from the same directory: the image processor resizes, normalises and, for
Qwen-VL, patches; `--min-pixels` / `--max-pixels` where the image processor has those caps) and keeps what it
returns for the images (pixel_values and any further tensor, such as image_grid_thw) in the document's row, so
training decodes no image. Per record:

1. its images are found and decoded (image_records.py: image parts of OpenAI-style content, or `<image>`
   placeholders with an `images` column), each replaced in the turn's text by the placeholder the processor
   expands (LLaVA's `<image>`, Gemma 3's `<start_of_image>`, Qwen-VL's vision start / image pad / vision end);
2. the conversation is rendered by the chat template and its assistant spans located as for any chat record
   (tokenize.py), giving the tokens and loss mask of the text with one placeholder per image;
3. the processor takes that text and the images: its tokens are the text's with each image's tokens inserted (the
   processor expands the placeholders in the text, then tokenizes it). The mask follows the text's tokens, matched
   in order as a subsequence of the processor's (checked: a record whose text tokens are not is refused); an
   inserted token and any image token is never in the loss, whatever --train-on-inputs says.

An image in an assistant turn is refused (its tokens would be learned). More image tokens than --seq-len, or a
truncation that would cut into an image, stops the run naming the record (image_records.ImageRefused), as does an
unreadable or empty image: lower --max-pixels, raise --seq-len, or fix the record.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatrain_ray.data.prepare.image_records import (
    PLACEHOLDER,
    ImageRefused,
    flatten_turn,
    has_images,
    load_image,
    record_sources,
)
from megatrain_ray.data.prepare.records import BadRecord, Item, parse_item, to_messages
from megatrain_ray.exceptions import DataError

TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "offset_mapping")
"""Processor outputs that describe the text, not the images: not kept (the row's tokens are)."""
_PROCESSORS: dict[tuple, Any] = {}
"""The processor of each (directory, caps), loaded once a process."""


@dataclass(slots=True)
class VisionJob:
    """What the vision path of a chunk needs beyond Job: the processor's directory and caps, the image token."""

    directory: str
    image_token_id: int
    min_pixels: int = 0
    max_pixels: int = 0


def load_processor(job: VisionJob) -> Any:
    """transformers' AutoProcessor of the model directory, with the pixel caps (refused where it has none)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(job.directory, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise DataError(f"{job.directory} has no processor transformers' AutoProcessor can load ({exc}); a "
                        "vision-language model's directory needs its processor files (processor_config.json or "
                        "preprocessor_config.json, as processor.save_pretrained writes them)") from None
    images = getattr(processor, "image_processor", None)
    if images is None:
        raise DataError(f"{job.directory}: its processor ({type(processor).__name__}) has no image processor")
    caps = {k: v for k, v in (("min_pixels", job.min_pixels), ("max_pixels", job.max_pixels)) if v}
    if caps:
        valid = set(getattr(getattr(images, "valid_kwargs", None), "__annotations__", {}))
        for name in caps:
            if name not in valid and not hasattr(images, name):
                raise DataError(f"--{name.replace('_', '-')}: the image processor of {job.directory} "
                                f"({type(images).__name__}) has no {name} (it resizes to its own fixed size); "
                                "leave the flag out")
        processor = AutoProcessor.from_pretrained(job.directory, local_files_only=True, **caps)
    return processor


def placeholder_of(processor: Any) -> str:
    """The text the processor expands into an image's tokens."""
    if getattr(processor, "boi_token", None):  # Gemma 3: <start_of_image> becomes the image's whole sequence
        return processor.boi_token
    start, end = getattr(processor, "vision_start_token", None), getattr(processor, "vision_end_token", None)
    if type(processor).__name__.startswith("Qwen"):
        start, end = start or "<|vision_start|>", end or "<|vision_end|>"
        return f"{start}{processor.image_token}{end}"
    return processor.image_token


def record_messages(record: Any, fmt: str, cols: Any, where: str, placeholder: str,
                    base: Path) -> tuple[list[dict[str, Any]], list | None, list]:
    """(messages with one `placeholder` per image, tools, the decoded images in order)."""
    turns_key = cols.messages or ("conversations" if fmt == "sharegpt" else "messages")
    content_tag = cols.content_tag or ("value" if fmt == "sharegpt" else "content")
    sources: list = []
    if isinstance(record, dict) and isinstance(record.get(turns_key), list):
        record = copy.copy(record)
        record[turns_key] = [{**t, content_tag: flatten_turn(t.get(content_tag), placeholder, f"{where}, turn {k}",
                                                             sources)} if isinstance(t, dict) else t
                             for k, t in enumerate(record[turns_key])]
    messages, tools = to_messages(record, fmt, cols, where)
    if not sources and isinstance(record, dict) and record.get("images"):
        sources = record_sources(record, messages, "images", where)
        if placeholder != PLACEHOLDER:
            for m in messages:
                m["content"] = m["content"].replace(PLACEHOLDER, placeholder)
    for m in messages:
        if m["role"] == "assistant" and placeholder in m["content"] and sources:
            raise BadRecord("image in an assistant turn", f"{where}: an image in an assistant turn; images go in "
                            "user (or system) turns, the assistant's text is what is learned")
    images = [load_image(s, base, f"{where}, image {k}") for k, s in enumerate(sources)]
    return messages, tools, images


def expanded(text_ids: np.ndarray, text_mask: np.ndarray, ids: np.ndarray, image_token_id: int,
             where: str) -> np.ndarray:
    """The processor's tokens' loss mask: the text's, its tokens matched in order within `ids`; inserted tokens
    and image tokens 0."""
    mask = np.zeros(len(ids), dtype=np.uint8)
    i = 0
    for j, token in enumerate(ids):
        if i < len(text_ids) and token == text_ids[i]:
            mask[j] = text_mask[i]
            i += 1
    if i != len(text_ids):
        raise BadRecord("processor changed the text", f"{where}: the processor's tokens do not hold the rendered "
                        "conversation's tokens in order (its placeholder expansion changed the text around it)")
    mask[ids == image_token_id] = 0
    return mask


def encode_images(outputs: dict[str, Any]) -> bytes:
    """The processor's image tensors of one document as safetensors bytes (data/image_store.py reads them)."""
    from safetensors.numpy import save

    return save({k: np.ascontiguousarray(np.asarray(v)) for k, v in outputs.items() if k not in TEXT_KEYS})


def item_base(item: Item) -> Path:
    """The directory of the input file an item comes from (relative image paths are taken there)."""
    where = item[0]
    path = where.rsplit(":", 1)[0] if item[2] else where.rsplit(" record ", 1)[0]
    return Path(path).parent


def vision_chunk(tok: Any, job: Any, chunk: list[tuple[Item, int]]) -> list[tuple]:
    """process_chunk for a vision-language model: text-only records as chat records are, records with images
    through the processor (the module docstring); a "doc" result carries its images' bytes (None: no image)."""
    vision: VisionJob = job.vision
    key = (vision.directory, vision.min_pixels, vision.max_pixels)
    if key not in _PROCESSORS:
        _PROCESSORS[key] = load_processor(vision)
    processor = _PROCESSORS[key]
    placeholder = placeholder_of(processor)
    results: list[tuple | None] = [None] * len(chunk)
    texts, spans, slots, images = [], [], [], []
    for k, (item, number) in enumerate(chunk):
        try:
            where, record = parse_item(item, number)
            turns = job.cols.messages or ("conversations" if job.fmt == "sharegpt" else "messages")
            if has_images(record, turns):
                messages, tools, record_images = record_messages(record, job.fmt, job.cols, where, placeholder,
                                                                 item_base(item))
            else:
                (messages, tools), record_images = to_messages(record, job.fmt, job.cols, where), []
            text, turn_spans = tok.for_training(messages, tools, where, job.train_on_inputs)
            texts.append(text)
            spans.append(turn_spans)
            slots.append((k, where))
            images.append(record_images)
        except BadRecord as exc:
            results[k] = ("skipped", exc.reason, str(exc))
        except ImageRefused as exc:
            results[k] = ("refused", str(exc))
    docs = tok.chat_documents(texts, spans) if texts else []
    for (k, where), text, record_images, (ids, mask) in zip(slots, texts, images, docs):
        blob = None
        try:
            if record_images:
                out = processor(text=[text], images=record_images, add_special_tokens=False, return_tensors="np")
                text_ids, text_mask = ids, mask
                ids = np.asarray(out["input_ids"][0], dtype=np.int32)
                mask = expanded(text_ids, text_mask, ids, vision.image_token_id, where)
                blob = encode_images({k2: v for k2, v in out.items()})
            image_tokens = np.flatnonzero(ids == vision.image_token_id)
            truncated = bool(job.seq_len and len(ids) > job.seq_len)
            if len(image_tokens) and job.seq_len and image_tokens[-1] >= job.seq_len:
                raise ImageRefused(f"{where}: its {len(record_images)} image(s) take {len(image_tokens)} tokens, "
                                   f"ending at token {int(image_tokens[-1]) + 1}, past --seq-len {job.seq_len}: "
                                   "raise --seq-len, lower --max-pixels (where the processor has it) or shorten "
                                   "the record")
        except BadRecord as exc:
            results[k] = ("skipped", exc.reason, str(exc))
            continue
        except ImageRefused as exc:
            results[k] = ("refused", str(exc))
            continue
        if truncated:
            ids, mask = ids[:job.seq_len], mask[:job.seq_len]
        if not mask[1:].any():
            results[k] = ("dropped", "no loss tokens (after truncation)" if job.seq_len else "no loss tokens",
                          truncated)
        else:
            results[k] = ("doc", ids, mask, truncated, blob)
    return results  # type: ignore[return-value]
