"""`megatrain prepare --hf-dataset`: a dataset by hub name resolves offline from a hub cache the test
builds (data files only); the datasets library names the files of each split, and prepare writes the
same shards from them as from the same records given with --input."""

from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("datasets")
pytest.importorskip("huggingface_hub")
pytest.importorskip("transformers")

from megatrain_ray.data.hub_datasets import hub_dataset_files
from megatrain_ray.exceptions import DataError
from tests.conftest import REPO
from tests.hub_cache import add_snapshot
from tests.integration.test_cli import megatrain, side_by_side

CHATS = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                       {"role": "assistant", "content": f"{i} + {i} = {2 * i}."}]} for i in range(7)]


@pytest.fixture
def offline_dataset_hub(tmp_path, monkeypatch):
    source = tmp_path / "source"
    source.mkdir()
    pq.write_table(pa.Table.from_pylist(CHATS[:5]), source / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(CHATS[5:]), source / "test-00000-of-00001.parquet")
    home = tmp_path / "hf-home"
    add_snapshot(home, "tiny-org/chats", source, repo_type="dataset")
    import huggingface_hub.constants as constants  # read at import: point this process at the test cache

    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return source


def _rows(files) -> list:
    return [row for f in files for row in pq.read_table(f).to_pylist()]


def test_the_split_files_of_a_hub_dataset(offline_dataset_hub):
    assert _rows(hub_dataset_files("tiny-org/chats", "train")) == CHATS[:5]
    assert _rows(hub_dataset_files("tiny-org/chats", "test")) == CHATS[5:]
    assert _rows(hub_dataset_files(str(offline_dataset_hub), "test")) == CHATS[5:]  # a local directory


def test_hub_dataset_errors_name_what_to_do(offline_dataset_hub, tmp_path):
    with pytest.raises(DataError, match="has no split 'validation'; it has: .*train.*--hf-split"):
        hub_dataset_files("tiny-org/chats", "validation")
    with pytest.raises(DataError, match="not in the hub cache .*HF_HUB_OFFLINE.*--repo-type dataset"):
        hub_dataset_files("tiny-org/missing", "train")
    (tmp_path / "one.jsonl").write_text("{}\n")
    with pytest.raises(DataError, match="is a file: give it with --input"):
        hub_dataset_files(str(tmp_path / "one.jsonl"), "train")


def test_prepare_from_a_hub_dataset_equals_the_same_records_as_input(offline_dataset_hub, tmp_path):
    sys.path.insert(0, f"{REPO}/examples/finetune_qwen2")
    from make_tiny_qwen2 import make_tiny_qwen2

    model = make_tiny_qwen2(tmp_path / "model")
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS[:5]))
    common = ["--tokenizer", str(model), "--format", "messages", "--workers", "1"]
    by_name, by_file, missing = side_by_side(
        lambda: megatrain("prepare", *common, "--hf-dataset", "tiny-org/chats", "--output", str(tmp_path / "a")),
        lambda: megatrain("prepare", *common, "--input", str(tmp_path / "chats.jsonl"), "--output", str(tmp_path / "b")),
        lambda: megatrain("prepare", *common, "--hf-dataset", "tiny-org/chats", "--hf-split", "dev",
                          "--output", str(tmp_path / "c")))
    assert by_name.returncode == 0, by_name.stderr
    assert by_file.returncode == 0, by_file.stderr
    shards = sorted(p.name for p in (tmp_path / "a").glob("*.parquet"))
    assert shards and all(pq.read_table(tmp_path / "a" / s).equals(pq.read_table(tmp_path / "b" / s)) for s in shards)
    assert missing.returncode == 2 and "has no split 'dev'" in missing.stderr and "Traceback" not in missing.stderr
