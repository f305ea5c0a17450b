"""The data files of one split of a dataset named on the Hugging Face hub (or a local dataset directory),
for `megatrain prepare --hf-dataset`.

    owner/name   -> huggingface_hub snapshot of its data files only (parquet, json, jsonl, txt, and the
                    README whose YAML names configs and splits; HF_HOME, HF_TOKEN and HF_HUB_OFFLINE
                    honoured, like model names)
    a directory  -> used as it is
    then the `datasets` library says which files make the split (its conventions: configs in the
    README, split names in file and folder names), and prepare reads them as it reads --input files:
    parquet row group by row group, jsonl line by line, in parallel, never whole. No dataset script
    is ever run.
"""

from __future__ import annotations

from pathlib import Path

from megatrain_ray.exceptions import DataError, excerpt
from megatrain_ray.extras import install_hint
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


READABLE = (".parquet", ".jsonl", ".json", ".txt")


def hub_dataset_files(spec: str, split: str, subset: str | None = None, revision: str | None = None) -> list[Path]:
    """The files of one split of a dataset, in the dataset's order."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"--hf-dataset needs the datasets library: {install_hint('datasets')}") from None
    directory = dataset_dir(spec, revision)
    try:
        data_files = {str(name): files for name, files in
                      (datasets.load_dataset_builder(str(directory), subset).config.data_files or {}).items()}
    except Exception as exc:  # datasets raises many kinds for a directory it cannot read
        raise DataError(f"--hf-dataset {spec!r} ({directory}): the datasets library cannot read it: "
                        f"{excerpt(str(exc), 300)}") from None
    if split not in data_files:
        raise DataError(f"--hf-dataset {spec!r} has no split {split!r}; it has: {', '.join(data_files) or 'none'} "
                        "(choose one with --hf-split)")
    files = [Path(f) for f in data_files[split]]
    unreadable = [f.name for f in files if not f.name.lower().endswith(READABLE)]
    if unreadable:
        raise DataError(f"--hf-dataset {spec!r}: split {split!r} is in files prepare cannot read ({unreadable[0]}); "
                        f"it reads {', '.join(READABLE)}")
    return files
