"""A Hugging Face hub cache built by a test, laid out as huggingface_hub writes one (blobs, snapshots
linking to them, refs), so that names resolve offline (HF_HOME=..., HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

HUB_CONFIGS = Path(__file__).parent / "fixtures" / "hub_configs"


def add_snapshot(hf_home: Path, name: str, source: Path, ref: str = "main", with_weights: bool = True,
                 repo_type: str = "model") -> Path:
    """Put `source`'s files into the hub cache as commit sha1(source, ref), with refs/<ref> naming it."""
    repo = hf_home / "hub" / (f"{repo_type}s--" + name.replace("/", "--"))
    commit = hashlib.sha1(f"{source}:{ref}:{with_weights}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(source.iterdir()):
        if file.suffix == ".safetensors" and not with_weights:
            continue
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def published_configs_hub(hf_home: Path) -> dict[str, Path]:
    """A hub cache holding the published config.json of every model in tests/fixtures/hub_configs."""
    return {d.name.replace("--", "/", 1): add_snapshot(hf_home, d.name.replace("--", "/", 1), d)
            for d in sorted(HUB_CONFIGS.iterdir()) if d.is_dir()}
