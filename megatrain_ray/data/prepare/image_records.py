"""Chat records with images: where their images are, and the images themselves, checked.

Two layouts, as the fine-tuning tools write them:

- OpenAI-style `messages` whose `content` is a list of parts: `{"type": "text", "text": ...}` and an image part,
  `{"type": "image", "image" | "path" | "url": SOURCE}` or `{"type": "image_url", "image_url": {"url": SOURCE}}`
  (axolotl's and transformers' spellings);
- ShareGPT / LLaMA-Factory records whose turns hold `<image>` placeholders, with the record's images in an `images`
  column (in order of the placeholders: as many images as placeholders).

A SOURCE is a local file (a path relative to the input file's directory, or absolute; a `file://` URL), a
`data:image/...;base64,` URL, raw bytes, or a `{"bytes": ..., "path": ...}` mapping (how the datasets library keeps
an Image column in parquet). http(s) URLs are refused: prepare reads no network. Every image is opened and decoded
here, once (PIL, then RGB as LLaMA-Factory converts them); an unreadable, empty or zero-size image is an `ImageRefused`,
which stops the run naming the record, whatever --on-bad-record says: a corrupt image is a broken dataset, not a
record to drop quietly.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

from megatrain_ray.data.prepare.records import BadRecord
from megatrain_ray.exceptions import DataError, excerpt

PLACEHOLDER = "<image>"
"""The ShareGPT / LLaMA-Factory placeholder of an image in a turn's text."""
IMAGE_PART_TYPES = ("image", "image_url")


class ImageRefused(DataError):
    """A record whose image cannot be used; the run stops with this message (the record named)."""


def has_images(record: Any, turns_key: str, images_key: str = "images") -> bool:
    """Whether a parsed record carries images (an `images` column, or image parts in its turns' content)."""
    if not isinstance(record, dict):
        return False
    if record.get(images_key):
        return True
    turns = record.get(turns_key)
    return isinstance(turns, list) and any(
        isinstance(t, dict) and isinstance(t.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in t["content"]) for t in turns)


def flatten_turn(content: Any, placeholder: str, where: str, sources: list) -> str:
    """A turn's content as text: a list of parts joined, each image part as `placeholder` (its source appended to
    `sources`); a string as it is."""
    if not isinstance(content, list):
        return "" if content is None else str(content)
    pieces = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or "type" not in part:
            raise BadRecord("bad content part", f"{where}, part {k}: a content part must be an object with a "
                            f"'type' (text or image); got {excerpt(part)}")
        if part["type"] == "text":
            pieces.append(str(part.get("text") or ""))
        elif part["type"] in IMAGE_PART_TYPES:
            source = part.get("image", part.get("path", part.get("url")))
            if part["type"] == "image_url":
                url = part.get("image_url")
                source = url.get("url") if isinstance(url, dict) else url
            if source is None:
                raise BadRecord("image part without a source", f"{where}, part {k}: an image part needs 'image', "
                                "'path' or 'url' (image_url: {'url': ...})")
            sources.append(source)
            pieces.append(placeholder)
        else:
            raise BadRecord("bad content part", f"{where}, part {k}: unknown content part type {part['type']!r} "
                            "(text, image or image_url)")
    return "".join(pieces)


def _bytes_of(source: Any, base: Path, where: str) -> tuple[bytes, str]:
    """(the encoded image, what to call it in a message)."""
    if isinstance(source, dict):
        if source.get("bytes"):
            return bytes(source["bytes"]), "its bytes"
        source = source.get("path")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), "its bytes"
    if not isinstance(source, str) or not source:
        raise ImageRefused(f"{where}: an image source must be a file path, a data: URL, bytes or "
                           f"{{'bytes', 'path'}}; got {excerpt(source)}")
    if source.startswith("data:"):
        head, _, payload = source.partition(",")
        if not head.endswith(";base64"):
            raise ImageRefused(f"{where}: the data: URL of an image must be base64 (data:image/png;base64,...)")
        try:
            return base64.b64decode(payload, validate=True), "its data: URL"
        except (binascii.Error, ValueError):
            raise ImageRefused(f"{where}: the data: URL of an image is not valid base64") from None
    if source.startswith(("http://", "https://")):
        raise ImageRefused(f"{where}: image {source!r} is a URL; prepare reads no network: download the images and "
                           "name the files")
    path = Path(source.removeprefix("file://"))
    path = path if path.is_absolute() else base / path
    if not path.is_file():
        raise ImageRefused(f"{where}: image file {str(path)!r} does not exist (a relative path is taken beside the "
                           "input file)")
    return path.read_bytes(), repr(str(path))


def load_image(source: Any, base: Path, where: str) -> Any:
    """One image as an RGB PIL image, decoded and checked (ImageRefused naming `where` when it cannot be used)."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:
        raise DataError("images in the data need Pillow: pip install pillow") from exc

    data, name = _bytes_of(source, base, where)
    if not data:
        raise ImageRefused(f"{where}: image {name} is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageRefused(f"{where}: image {name} is not a readable image ({excerpt(str(exc), 120)}); fix or "
                           "remove the record") from None
    if not image.width or not image.height:
        raise ImageRefused(f"{where}: image {name} has zero size ({image.width}x{image.height})")
    return image if image.mode == "RGB" else image.convert("RGB")


def record_sources(record: dict, messages: list[dict[str, Any]], images_key: str, where: str) -> list:
    """The image sources of a ShareGPT / LLaMA-Factory record (its `images` column), checked against the `<image>`
    placeholders of its turns (LLaMA-Factory: as many images as placeholders)."""
    images = record.get(images_key) or []
    if not isinstance(images, list):
        images = [images]
    placeholders = sum(str(m.get("content", "")).count(PLACEHOLDER) for m in messages)
    if placeholders != len(images):
        raise BadRecord("images and placeholders differ", f"{where}: {placeholders} {PLACEHOLDER} placeholder(s) in "
                        f"the turns but {len(images)} image(s) in {images_key!r}; each image needs its placeholder")
    return images
