"""`megatrain prepare --hf-dataset`: a dataset by hub name resolves offline from a hub cache the test
builds (data files only), and its records stream through the datasets library equal to the files'."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("datasets")
pytest.importorskip("huggingface_hub")

from megatrain_ray.data.hub_datasets import hub_dataset_records
from megatrain_ray.exceptions import DataError
from tests.hub_cache import add_snapshot

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


def test_hub_dataset_streams_the_records_of_a_split(offline_dataset_hub):
    assert list(hub_dataset_records("tiny-org/chats", "train")) == CHATS[:5]
    assert list(hub_dataset_records("tiny-org/chats", "test")) == CHATS[5:]
    assert list(hub_dataset_records(str(offline_dataset_hub), "test")) == CHATS[5:]  # a local directory


def test_hub_dataset_errors_name_what_to_do(offline_dataset_hub, tmp_path):
    with pytest.raises(DataError, match="has no split 'validation'; it has: .*train.*--hf-split"):
        list(hub_dataset_records("tiny-org/chats", "validation"))
    with pytest.raises(DataError, match="not in the hub cache .*HF_HUB_OFFLINE"):
        list(hub_dataset_records("tiny-org/missing", "train"))
    (tmp_path / "one.jsonl").write_text("{}\n")
    with pytest.raises(DataError, match="is a file: give it with --input"):
        list(hub_dataset_records(str(tmp_path / "one.jsonl"), "train"))
