"""Records of a dataset named on the Hugging Face hub (or a local dataset directory), through the
`datasets` library, for `megatrain prepare --hf-dataset`.

    owner/name   -> huggingface_hub snapshot of its data files only (parquet, json, jsonl, csv, arrow,
                    txt; HF_HOME, HF_TOKEN and HF_HUB_OFFLINE honoured, like model names)
    a directory  -> used as it is
    then `datasets.load_dataset(directory, subset, split=..., streaming=True)`: the files are read
    batch by batch, never whole, and no dataset script is ever run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatrain_ray.exceptions import DataError, excerpt
from megatrain_ray.system.model_sources import HUB_NAME, hub_snapshot

DATA_PATTERNS = ["*.parquet", "*.json", "*.jsonl", "*.jsonl.gz", "*.json.gz", "*.csv", "*.arrow", "*.txt",
                 "README.md", "*.yaml"]


def dataset_dir(spec: str, revision: str | None) -> Path:
    """The local directory of `spec`: a directory as it is, a hub name as its cached snapshot."""
    local = Path(spec).expanduser()
    if local.is_dir():
        if revision:
            raise DataError(f"--hf-dataset {spec!r} is a local directory; --hf-dataset-revision applies to a hub "
                            "name only")
        return local.resolve()
    if local.exists():
        raise DataError(f"--hf-dataset {spec!r} is a file: give it with --input, or give a dataset directory or a "
                        "hub name")
    if not HUB_NAME.match(spec):
        raise DataError(f"--hf-dataset {spec!r} is neither a directory nor a hub name (owner/name)")
    return Path(hub_snapshot(spec, revision, DATA_PATTERNS, "--hf-dataset", DataError, repo_type="dataset"))


def hub_dataset_records(spec: str, split: str, subset: str | None = None,
                        revision: str | None = None) -> Iterator[dict[str, Any]]:
    """The records of one split of a dataset, streamed."""
    try:
        import datasets
    except ImportError:
        raise DataError("--hf-dataset needs the datasets library: pip install 'megatrain-ray[datasets]'") from None
    directory = dataset_dir(spec, revision)
    try:
        splits = datasets.get_dataset_split_names(str(directory), subset)
    except Exception as exc:  # datasets raises many kinds for a directory it cannot read
        raise DataError(f"--hf-dataset {spec!r} ({directory}): the datasets library cannot read it: "
                        f"{excerpt(str(exc), 300)}") from None
    if split not in splits:
        raise DataError(f"--hf-dataset {spec!r} has no split {split!r}; it has: {', '.join(splits)} "
                        "(choose one with --hf-split)")
    yield from datasets.load_dataset(str(directory), subset, split=split, streaming=True)
