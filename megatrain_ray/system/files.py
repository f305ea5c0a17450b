"""Directories that appear complete or not at all (exports, prepared data)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatrain_ray.exceptions import MegatrainError


def refuse_existing(out: Path, error: type[MegatrainError], what: str) -> None:
    """A result directory is never overwritten: it must not exist, or be empty."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise error(f"{what} {str(out)!r} already exists and is not empty; choose another directory or remove it")


@contextmanager
def atomic_directory(out: Path, error: type[MegatrainError], what: str) -> Iterator[Path]:
    """Yields a temporary sibling of `out` to fill; it is renamed to `out` when the block succeeds and
    removed when it fails, so a reader never sees half a result."""
    refuse_existing(out, error, what)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
