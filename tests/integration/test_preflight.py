"""Bad input is refused before Ray starts: the config file itself (encoding, YAML pathologies, duplicate keys),
prepared data directories, Hugging Face model directories, checkpoints, and the directories a run writes.

Each case runs the `megatrain` entry point in Ray mode with Ray's start replaced by a tripwire, and
checks what a user sees and what is left: exit 2, exactly one ERROR line naming the key or file, no
traceback, a short message (values are quoted as excerpts), Ray never started, and nothing created
(no run, checkpoint or export directory, no shared-memory segment). The older catalogue of
tests/integration/test_bad_input.py covers the config values one by one.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors.torch import save_file

from megatrain_ray.__main__ import main
from megatrain_ray.config.hf import hf_config_from_model
from megatrain_ray.config.load import load_config
from megatrain_ray.driver import trainer as trainer_module
from megatrain_ray.model.layout import build_layout
from tests.conftest import REPO, learnable_tokens, tiny_raw

VOCAB = 96


# ----------------------------------------------------------------------------- building inputs


def base(tmp: Path) -> dict:
    raw = tiny_raw(train={"steps": 4, "output_dir": str(tmp / "run")}, runtime={"mode": "ray", "dashboard": False})
    raw["data"]["path"] = learnable_tokens(tmp / "tokens.npy", VOCAB)
    return raw


def write_yaml(tmp: Path, raw: dict) -> str:
    path = tmp / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def train(edit: Callable[[dict, Path], object] = lambda raw, tmp: None, *extra: str) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        raw = base(tmp)
        edit(raw, tmp)
        return ["train", write_yaml(tmp, raw), *extra]
    return make


def config_text(text: str | bytes) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        path = tmp / "bad.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return ["train", str(path)]
    return make


def valid_yaml(tmp: Path) -> str:
    return yaml.safe_dump(base(tmp))


def config_edit(change: Callable[[str], str]) -> Callable[[Path], list[str]]:
    """A config written as text: `change` edits the YAML of a valid one."""
    def make(tmp: Path) -> list[str]:
        path = tmp / "bad.yaml"
        path.write_text(change(valid_yaml(tmp)))
        return ["train", str(path)]
    return make


ALIAS_BOMB = "".join(f"l{k}: &l{k} [{', '.join([f'*l{k - 1}'] * 9 if k else ['x'] * 9)}]\n" for k in range(9))


def shard(path: Path, ids: list, mask: list | None = None, ids_type: pa.DataType = pa.list_(pa.int32()),
          drop: str | None = None) -> None:
    columns = {"input_ids": pa.array(ids, type=ids_type),
               "loss_mask": pa.array(mask if mask is not None else [[1] * len(r) for r in ids],
                                     type=pa.list_(pa.int8()))}
    if drop:
        columns.pop(drop)
    pq.write_table(pa.table(columns), path)


def prepared(files: object = ("train-00000.parquet",), manifest: object = None,
             write: Callable[[Path], object] | None = None) -> Callable[[dict, Path], object]:
    """A prepared directory (manifest + shards); `write` damages it after the good version is written."""
    def edit(raw: dict, tmp: Path) -> None:
        root = tmp / "prepared"
        root.mkdir()
        shard(root / "train-00000.parquet", [[1, 2, 3, 4, 5, 6, 7, 8]] * 8)
        body = manifest if manifest is not None else {"splits": {"train": {"files": list(files)}}}  # type: ignore
        (root / "manifest.json").write_text(json.dumps(body))
        if write:
            write(root)
        raw["data"] = {**raw["data"], "path": str(root), "seq_len": 8}
    return edit


def model_dir(tmp: Path, hf_edit: Callable[[dict], object] = lambda hf: None,
              tensors_edit: Callable[[dict], object] = lambda t: None, index: dict | None = None) -> Path:
    """A Hugging Face directory of the tiny model (config.json + model.safetensors), then edited."""
    cfg = load_config(raw=tiny_raw()).model
    layout = build_layout(cfg)
    tensors = {stage.hf_name(slot): torch.randn(slot.shape) * 0.02 for stage in layout.stages for slot in stage.slots}
    tensors_edit(tensors)
    root = tmp / "hf"
    root.mkdir()
    hf = hf_config_from_model(cfg)
    hf_edit(hf)
    (root / "config.json").write_text(json.dumps(hf))
    if index is None:
        save_file(tensors, str(root / "model.safetensors"))
    else:
        save_file(tensors, str(root / "model-00001-of-00001.safetensors"))
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


def with_model(**how) -> Callable[[dict, Path], object]:
    def edit(raw: dict, tmp: Path) -> None:
        raw["model"] = {"path": str(model_dir(tmp, **how))}
    return edit


def with_config_json(text: str) -> Callable[[dict, Path], object]:
    def edit(raw: dict, tmp: Path) -> None:
        root = model_dir(tmp)
        (root / "config.json").write_text(text)
        raw["model"] = {"path": str(root)}
    return edit


def hf_set(**values) -> Callable[[dict], object]:
    return lambda hf: hf.update(values)


def hf_drop(key: str) -> Callable[[dict], object]:
    return lambda hf: hf.pop(key)


def outputs(**values) -> Callable[[dict, Path], object]:
    """train/checkpoint keys as paths relative to tmp; `file` and `file/below` paths are made a file first."""
    def edit(raw: dict, tmp: Path) -> None:
        (tmp / "file").write_text("not a directory")
        for dotted, rel in values.items():
            section, key = dotted.split("__")
            raw.setdefault(section, {})[key] = str(tmp / rel)
    return edit


def resume_damaged(damage: Callable[[dict, Path], object]) -> Callable[[Path], list[str]]:
    """A finished tiny run's checkpoint with its manifest edited, resumed from."""
    def make(tmp: Path) -> list[str]:
        raw = base(tmp)
        raw["train"]["output_dir"] = str(tmp / "done")
        raw["checkpoint"] = {"every": 2, "keep": 3}
        raw["runtime"] = {"mode": "local"}
        assert main(["train", write_yaml(tmp, raw)]) == 0
        ckpt = tmp / "done" / "checkpoints" / "step-00000004"
        manifest = json.loads((ckpt / "manifest.json").read_text())
        damage(manifest, ckpt)
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
        return ["train", write_yaml(tmp, base(tmp)), "--resume", str(ckpt)]
    return make


def first_file(change: Callable[[dict], object]) -> Callable[[dict, Path], object]:
    return lambda manifest, ckpt: change(manifest["files"][0])


def command(*words: str, setup: Callable[[Path], object] = lambda tmp: None) -> Callable[[Path], list[str]]:
    """Another subcommand; `{tmp}` in a word is the test's directory."""
    def make(tmp: Path) -> list[str]:
        setup(tmp)
        return [w.replace("{tmp}", str(tmp)) for w in words]
    return make


def export_source_with_escaping_index(tmp: Path) -> None:
    cfg = load_config(raw=tiny_raw()).model
    names = [stage.hf_name(slot) for stage in build_layout(cfg).stages for slot in stage.slots]
    model_dir(tmp, index={"weight_map": {names[0]: "../outside.safetensors",
                                         **{n: "model-00001-of-00001.safetensors" for n in names[1:]}}})
    save_file({"x": torch.zeros(1)}, str(tmp / "outside.safetensors"))


def registry_escaping(tmp: Path) -> None:
    (tmp / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "../../../etc/passwd"}}))


def symlinked_shard(root: Path) -> None:
    outside = root.parent / "elsewhere.parquet"
    shard(outside, [[1, 2, 3, 4]] * 8)
    os.symlink(outside, root / "link.parquet")
    (root / "manifest.json").write_text(json.dumps({"splits": {"train": {"files": ["link.parquet"]}}}))


# ----------------------------------------------------------------------------- the catalogue

CASES: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    # the config file: encoding, YAML pathologies, duplicate keys, values
    "config not UTF-8": (config_text(b"model:\n  family: llama\xff\xfe\n"), "not UTF-8"),
    "config is a directory": (command("train", "{tmp}"), "not a regular file"),
    "alias bomb in one value": (config_edit(lambda text: ALIAS_BOMB + text.replace("steps: 4", "steps: *l8")),
                                "aliases"),
    "duplicate top-level key": (config_edit(lambda text: text + "train:\n  steps: 5\n"), "appears twice"),
    "duplicate key in a section": (config_edit(lambda text: text.replace("steps: 4", "steps: 4\n  steps: 9")),
                                   "appears twice"),
    "duplicate key in an override": (train(lambda r, t: None, "--set", "optimizer={lr: 1.0e-3, lr: 2.0e-3}"),
                                     "appears twice"),
    "megabyte value for a number": (train(lambda r, t: r["train"].update(steps="x" * 2**20)), "'train.steps'"),
    "NaN learning rate": (config_edit(lambda text: text.replace("lr: 0.001", "lr: .nan")), "optimizer.lr"),
    "YAML nested ten thousand deep": (config_text("a: " + "[" * 10000 + "]" * 10000 + "\n"), "bad.yaml"),
    # prepared data directories: manifest, shards, columns, dtypes, emptiness, values, paths
    "manifest not JSON": (train(prepared(write=lambda d: (d / "manifest.json").write_text("{splits:"))),
                          "not valid JSON"),
    "manifest not UTF-8": (train(prepared(write=lambda d: (d / "manifest.json").write_bytes(b'{"\xff": 1}'))),
                           "not UTF-8"),
    "manifest a list": (train(prepared(manifest=[1, 2])), "JSON object"),
    "manifest without splits": (train(prepared(manifest={"files": []})), "'splits'"),
    "split without files": (train(prepared(manifest={"splits": {"train": {"files": []}}})), "lists no shard files"),
    "manifest entry climbing out": (train(prepared(files=["../../../../etc/passwd"])), "not a relative file name"),
    "manifest entry absolute": (train(prepared(files=["/etc/passwd"])), "not a relative file name"),
    "manifest entry a symlink out": (train(prepared(write=symlinked_shard)), "leads outside"),
    "manifest entry not a string": (train(prepared(files=[{"name": "x"}])), "not a relative file name"),
    "shard missing": (train(prepared(files=["train-00009.parquet"])), "is missing"),
    "shard not parquet": (train(prepared(write=lambda d: (d / "train-00000.parquet").write_bytes(b"PAR1 junk"))),
                          "not a readable parquet"),
    "shard without input_ids": (train(prepared(write=lambda d: shard(d / "train-00000.parquet", [[1, 2]] * 8,
                                                                     drop="input_ids"))), "no 'input_ids' column"),
    "float token ids": (train(prepared(write=lambda d: shard(d / "train-00000.parquet", [[1.5, 2.0, 3.0]] * 8,
                                                             ids_type=pa.list_(pa.float32())))),
                        "not a list of integers"),
    "shard with no rows": (train(prepared(write=lambda d: shard(d / "train-00000.parquet", []))),
                           "holds no documents"),
    "token id beyond the vocabulary": (train(prepared(write=lambda d: shard(d / "train-00000.parquet",
                                                                            [[1, 2, 500, 4]] * 8))),
                                       "model.vocab_size"),
    "loss mask of 2": (train(prepared(write=lambda d: shard(d / "train-00000.parquet", [[1, 2, 3]] * 8,
                                                            mask=[[0, 2, 1]] * 8))), "other than 0 and 1"),
    "null token id": (train(prepared(write=lambda d: shard(d / "train-00000.parquet", [[1, None, 3]] * 8))),
                      "null"),
    "token file of odd size": (train(lambda r, t: ((t / "t.bin").write_bytes(b"\x01" * 4097),
                                                   r["data"].update(path=str(t / "t.bin"), token_dtype="uint16"))),
                               "whole number"),
    # Hugging Face model directories: config.json fields before arithmetic, weights against the layout
    "config.json without hidden_size": (train(with_model(hf_edit=hf_drop("hidden_size"))), "'hidden_size'"),
    "config.json with 0 heads": (train(with_model(hf_edit=hf_set(num_attention_heads=0))), "num_attention_heads"),
    "config.json with a text vocabulary size": (train(with_model(hf_edit=hf_set(vocab_size="96"))), "vocab_size"),
    "config.json heads not a multiple of kv heads": (train(with_model(hf_edit=hf_set(num_key_value_heads=3))),
                                                     "num_key_value_heads 3"),
    "config.json not JSON": (train(with_config_json("{'hidden_size': 64}")), "not valid JSON"),
    "config.json a list": (train(with_config_json("[]")), "JSON object"),
    "config.json with malformed RoPE scaling": (train(with_model(hf_edit=hf_set(rope_scaling={"rope_type": "llama3"}))),
                                                "RoPE"),
    "weights with a layer too many": (train(with_model(tensors_edit=lambda t: t.update(
        {"model.layers.3.mlp.up_proj.weight": torch.zeros(128, 64)}))), "model.layers.3.mlp.up_proj.weight"),
    "weights missing a tensor": (train(with_model(tensors_edit=lambda t: t.pop("model.norm.weight"))),
                                 "'model.norm.weight'"),
    "weights of another shape": (train(with_model(tensors_edit=lambda t: t.update(
        {"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 96)}))), "has shape"),
    "integer weights": (train(with_model(tensors_edit=lambda t: t.update(
        {"model.norm.weight": torch.ones(64, dtype=torch.int32)}))), "I32"),
    "index entry climbing out": (train(with_model(index={"weight_map": {"model.norm.weight": "../x.safetensors"}})),
                                 "not a relative file name"),
    "index without a weight map": (train(with_model(index={"metadata": {}})), "safetensors index"),
    # checkpoints resumed from: every manifest entry checked and kept inside the checkpoint
    "checkpoint entry climbing out": (resume_damaged(first_file(lambda e: e.update(path="../../tokens.npy"))),
                                      "not a relative file name"),
    "checkpoint entry without a size": (resume_damaged(first_file(lambda e: e.pop("bytes"))), "corrupt"),
    "checkpoint files not a list": (resume_damaged(lambda m, c: m.update(files={"a": 1})), "corrupt"),
    "checkpoint step a string": (resume_damaged(lambda m, c: m.update(step="4")), "corrupt"),
    # the directories a run writes
    "output_dir is a file": (train(outputs(train__output_dir="file")), "train.output_dir"),
    "output_dir under a file": (train(outputs(train__output_dir="file/run")), "which is a file"),
    "checkpoint.dir is a file": (train(outputs(checkpoint__dir="file")), "checkpoint.dir"),
    "export_dir under a file": (train(outputs(train__export_dir="file/export")), "train.export_dir"),
    # the other subcommands
    "export from an index leading out": (command("export", "{tmp}/hf", "{tmp}/out",
                                                 setup=export_source_with_escaping_index), "not a relative file name"),
    "export into a path under a file": (command("export", "{tmp}/hf", "{tmp}/file/out",
                                                setup=lambda t: (model_dir(t), (t / "file").write_text("x"))),
                                        "which is a file"),
    "prepare with a negative --seq-len": (command("prepare", "--tokenizer", "{tmp}", "--input", "{tmp}/x.jsonl",
                                                  "--output", "{tmp}/out", "--seq-len", "-5"), "--seq-len -5"),
    "prepare from a registry entry leading out": (command("prepare", "--tokenizer", "{tmp}", "--registry",
                                                          "{tmp}/dataset_info.json", "--dataset", "mine", "--output",
                                                          "{tmp}/out", setup=registry_escaping),
                                                  "not a relative file name"),
}


def our_segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("megatrain-") and f"-{os.getpid()}-" in f}


def run_main(args: list[str]) -> int:
    try:
        return main(args)
    except SystemExit as exc:  # argparse's own usage errors
        return int(exc.code or 0)


@pytest.fixture
def ray_tripwire(monkeypatch):
    started: list[object] = []

    def start_ray(*args, **kwargs):
        started.append(args)
        raise AssertionError("Ray was started for an input that could be checked before it")

    monkeypatch.setattr(trainer_module, "start_ray", start_ray)
    return started


@pytest.mark.parametrize("case", list(CASES))
def test_refused_before_ray_with_one_short_message_and_nothing_created(case, tmp_path, capsys, ray_tripwire):
    make, expected = CASES[case]
    args = make(tmp_path)
    capsys.readouterr()
    before = our_segments()
    entries_before = set(os.listdir(tmp_path))
    code = run_main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert len(errors) == 1, err
    assert expected in err, err
    assert "Traceback" not in err
    assert len(err) < 1500, f"a {len(err)}-character message: values must be quoted as excerpts"
    assert not ray_tripwire
    assert our_segments() == before
    created = set(os.listdir(tmp_path)) - entries_before
    assert not created & {"run", "checkpoints", "out", "export"}, created
    for written in ("run", "file/run", "file/export", "out"):
        assert not (tmp_path / written).is_dir(), f"{written} was created"


def test_the_catalogue_has_forty_new_cases_across_the_categories():
    assert len(CASES) >= 40 and len({expected for _, expected in CASES.values()}) >= 30


@pytest.mark.parametrize("mode", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_a_non_finite_weight_is_named_when_it_is_loaded(tmp_path, mode, request, capsys):
    """NaN found while the weights stream into the host store (the data is read there, once), in the
    HostShard's process: the tensor is named by the CLI, the run directory is not created and the
    segments are gone. Locally as a child process; through Ray the command runs in this process, on the suite's
    Ray (tests/conftest.ray_session: a private Ray's start is some 8 s on 2 cores), the shard an actor."""
    raw = base(tmp_path)
    raw["runtime"]["mode"] = mode
    nan = torch.full((64,), float("nan"))
    raw["model"] = {"path": str(model_dir(tmp_path, tensors_edit=lambda t: t.update({"model.norm.weight": nan})))}
    if mode == "ray":
        request.getfixturevalue("ray_session")
        capsys.readouterr()
        code, pid = run_main(["train", write_yaml(tmp_path, raw)]), os.getpid()
        stderr = capsys.readouterr().err
    else:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        with subprocess.Popen([sys.executable, "-m", "megatrain_ray", "train", write_yaml(tmp_path, raw)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
            _, stderr = child.communicate(timeout=300)
        code, pid = child.returncode, child.pid
    errors = [line for line in stderr.splitlines() if " ERROR " in line]
    assert code == 2 and len(errors) == 1, stderr[-3000:]
    assert "'model.norm.weight' holds 64 non-finite value(s)" in errors[0], errors
    assert "Traceback" not in stderr
    assert not (tmp_path / "run").exists()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("megatrain-") and f"-{pid}-" in f]


def test_a_checkpoint_dir_without_room_is_refused_before_ray(tmp_path, capsys, monkeypatch, ray_tripwire):
    import shutil as real_shutil

    from megatrain_ray.system import files

    usage = real_shutil.disk_usage(tmp_path)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    capsys.readouterr()
    assert run_main(["train", write_yaml(tmp_path, base(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.dir=" in err and "0.00 GB free" in err, err
    assert not ray_tripwire and not (tmp_path / "run").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any directory")
def test_an_output_dir_this_user_cannot_write_is_refused(tmp_path, capsys, ray_tripwire):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    raw = base(tmp_path)
    raw["train"]["output_dir"] = str(locked / "run")
    assert run_main(["train", write_yaml(tmp_path, raw)]) == 2
    assert "not writable" in capsys.readouterr().err
    assert not ray_tripwire


def test_a_header_claiming_more_than_the_file_is_refused_by_export(tmp_path, capsys):
    """A safetensors file whose header length exceeds the file: one error naming the file."""
    root = model_dir(tmp_path)
    data = (root / "model.safetensors").read_bytes()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(data) * 10) + data[8:])
    capsys.readouterr()
    assert run_main(["export", str(root), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_token_file_values_are_not_truncated(tmp_path):
    """Float token ids in a .npy are refused, not truncated to integers (the older catalogue checks the CLI)."""
    from megatrain_ray.data.token_batches import load_tokens
    from megatrain_ray.exceptions import DataError

    np.save(tmp_path / "t.npy", np.array([1.7, 2.2] * 100, dtype=np.float64))
    cfg = load_config(raw={**tiny_raw(), "data": {"path": str(tmp_path / "t.npy"), "seq_len": 8, "batch_size": 1}})
    with pytest.raises(DataError, match="integer"):
        load_tokens(cfg.data)
