"""The tokenizer check's verdict, kept between runs.

With worker processes, every run checks the spec its workers start with (the tokenizer files as they spell it)
against transformers' own reading of the directory (tokenizing.SpecCheck): a process that imports transformers
and torch and loads the tokenizer, 2.5 s of CPU taken from the workers on every run, for the same answer each time.
Where the two agree, the verdict (the spec's digest and transformers' vocabulary size) is stored under the cache
root (system/model_sources.cache_root, prepare-spec-checks/), keyed by everything transformers' reading depends
on: the directory's path, the content of every file in it (a weight file by name, size and modification time),
and the installed versions of transformers and tokenizers. A later run whose files' spec has the stored digest
under the same key skips the check; any change of a file, a version or the spec runs it again. Nothing else is
ever stored: a directory that transformers reads otherwise is checked on every run (and started again with
transformers' reading, as before).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megatrain_ray.data.prepare.chat_render import TokenizerSpec
from megatrain_ray.system.files import write_atomic

FORMAT = 1
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npy",
                   ".npz", ".ot")
HASHED_BYTES = 256 << 20
"""Files up to this size (and not weights) are keyed by their content; larger ones by name, size and mtime."""


def spec_digest(spec: TokenizerSpec) -> str:
    fields = [spec.backend_json, spec.template, spec.tool_template, spec.has_template,
              [list(item) for item in spec.special_tokens]]
    return hashlib.sha256(json.dumps(fields, ensure_ascii=False).encode("utf-8", "surrogatepass")).hexdigest()


def directory_key(directory: str) -> str | None:
    """The digest of what transformers' reading of `directory` depends on; None where it cannot be taken."""
    from importlib import metadata

    try:
        versions = [metadata.version("transformers"), metadata.version("tokenizers")]
        root = Path(directory).resolve()
        digest = hashlib.sha256(json.dumps([FORMAT, str(root), versions]).encode())
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            stat = path.stat()
            name = path.relative_to(root).as_posix()
            if path.suffix.lower() in WEIGHT_SUFFIXES or stat.st_size > HASHED_BYTES:
                digest.update(json.dumps([name, stat.st_size, stat.st_mtime_ns]).encode() + b"\0")
            else:
                digest.update(json.dumps([name, stat.st_size]).encode() + b"\0" + path.read_bytes() + b"\0")
        return digest.hexdigest()
    except (OSError, ValueError, metadata.PackageNotFoundError):
        return None


def _entry(key: str) -> Path:
    from megatrain_ray.system.model_sources import cache_root  # lazy: only where workers check a spec

    return cache_root() / "prepare-spec-checks" / f"{key}.json"


def stored_vocab_size(key: str | None, spec: TokenizerSpec) -> int | None:
    """transformers' vocabulary size of the directory of `key` (directory_key), where a stored verdict says its
    reading is exactly `spec`; else None."""
    if key is None:
        return None
    try:
        verdict = json.loads(_entry(key).read_text())
        if verdict.get("spec_sha256") == spec_digest(spec) and type(verdict.get("vocab_size")) is int:
            return verdict["vocab_size"]
    except (OSError, ValueError, AttributeError):
        pass
    return None


def store(key: str | None, spec: TokenizerSpec, vocab_size: int, directory: str) -> None:
    """Keeps the verdict that transformers reads the directory of `key` as `spec` (written whole or not at all; a
    failure to write only means that the next run checks again)."""
    if key is None:
        return
    path = _entry(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"spec_sha256": spec_digest(spec), "vocab_size": vocab_size,
                                       "directory": str(Path(directory).resolve())}))
    except OSError:
        pass
