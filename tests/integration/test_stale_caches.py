"""What earlier runs leave in the caches (issue 47): a damaged DPO reference file is found before Ray starts, set
aside and computed again (a resumed run, which cannot, stops naming it); a GGUF conversion killed half way leaves
a temporary directory that the next conversion removes, while one still converting keeps its own."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from megatrain_ray.config.load import load_config
from megatrain_ray.driver.reference import check_reference, load_or_compute, reference_key, reference_path
from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.exceptions import ConfigError, NonFiniteError
from megatrain_ray.system import model_sources
from tests.conftest import tiny_raw

PAIRS = 4


def preference_dir(root: Path) -> Path:
    """A prepared directory of PAIRS preference pairs, as `megatrain prepare --format preference` lays it out."""
    root.mkdir()
    ids = [[1, 2, 3, 4 + d % 7, 5, 6] for d in range(2 * PAIRS)]
    pq.write_table(pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32())),
                             "loss_mask": pa.array([[0, 0, 1, 1, 1, 1]] * len(ids), type=pa.list_(pa.int8())),
                             "pair_role": pa.array([d % 2 for d in range(len(ids))], type=pa.uint8())}),
                   root / "train-00000.parquet")
    (root / "manifest.json").write_text(json.dumps({"splits": {"train": {"files": ["train-00000.parquet"]}},
                                                    "preference_pairs": True}))
    return root


def dpo_config(tmp_path: Path):
    raw = tiny_raw(data={"path": str(preference_dir(tmp_path / "pairs")), "seq_len": 8, "batch_size": 2},
                   finetune={"objective": "dpo"}, train={"steps": 4, "output_dir": str(tmp_path / "run")},
                   checkpoint={"at_end": False})
    return load_config(raw=raw)


@pytest.fixture
def warnings_logged():
    """The WARNING records of megatrain's loggers (which stop propagating once the CLI configured them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("megatrain_ray")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def good(path: Path) -> None:
    save_file({"logps": -torch.arange(1.0, 2 * PAIRS + 1, dtype=torch.float64)}, str(path))


DAMAGE = {
    "truncated": lambda p: (good(p), os.truncate(p, p.stat().st_size - 7)),
    "no logps": lambda p: save_file({"values": torch.zeros(2 * PAIRS, dtype=torch.float64)}, str(p)),
    "NaN": lambda p: save_file({"logps": torch.tensor([-1.0, float("nan")] * PAIRS, dtype=torch.float64)}, str(p)),
    "another length": lambda p: save_file({"logps": torch.zeros(3, dtype=torch.float64)}, str(p)),
    "not safetensors": lambda p: p.write_bytes(b"\x00" * 64),
}
EXPECTED = {"truncated": "cannot be read as safetensors", "no logps": "holds no 'logps' tensor",
            "NaN": "4 of its values are not finite, the first that of sequence 1", "another length": "of shape [3], not float64",
            "not safetensors": "cannot be read as safetensors"}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_reference_file_is_set_aside_before_ray_starts(tmp_path, damage, warnings_logged):
    """The Trainer's constructor (no Ray, no actor yet) finds the damage: the file is moved to <name>.damaged
    with a warning naming it, so the run computes it again (load_or_compute then finds no file)."""
    cfg = dpo_config(tmp_path)
    path = tmp_path / "pairs" / "reference" / f"train-{reference_key(cfg, 'float32', str(tmp_path / 'pairs'))}" \
                                              ".safetensors"
    path.parent.mkdir()
    DAMAGE[damage](path)
    trainer = Trainer(cfg)
    assert reference_path(trainer.data, reference_key(trainer.cfg, trainer.run_spec.compute_dtype,
                                                      trainer.data.directory)) == path
    assert not path.exists() and path.with_name(path.name + ".damaged").is_file()
    assert trainer.data.reference is None  # computed when the run starts
    warning = " ".join(r.getMessage() for r in warnings_logged)
    assert str(path) in warning and EXPECTED[damage] in warning and "computing them again" in warning, warning


def test_a_good_reference_file_is_read_before_ray_starts_and_a_resume_stops_on_a_damaged_one(tmp_path):
    cfg = dpo_config(tmp_path)
    trainer_data = Trainer(cfg).data
    path = reference_path(trainer_data, reference_key(cfg, "float32", trainer_data.directory))
    path.parent.mkdir()
    good(path)
    check_reference(cfg, trainer_data, "float32", resuming=False)
    assert torch.equal(trainer_data.reference, -torch.arange(1.0, 2 * PAIRS + 1, dtype=torch.float64))
    DAMAGE["NaN"](path)
    with pytest.raises(ConfigError, match=rf"resuming a DPO run needs .* {re.escape(str(path))}, which is damaged: 4 "
                                          "of its values are not finite"):
        check_reference(cfg, trainer_data, "float32", resuming=True)
    assert path.is_file()  # left for the user to restore or remove


def test_a_reference_pass_giving_non_finite_values_stops_the_run_and_writes_nothing(tmp_path):
    """The initial model's pass itself gives a NaN (a forward that overflows): NonFiniteError naming the sequence
    and what to change, and no file, so no later run reads the NaN and drops every step."""
    cfg = dpo_config(tmp_path)
    data = Trainer(cfg).data

    class NaNWorker:  # the GPU worker's sequence_logps, one row's value NaN
        def sequence_logps(self, batch):
            values = -torch.ones(batch.input_ids.shape[0], dtype=torch.float64)
            values[-1] = float("nan")
            return SimpleNamespace(result=lambda: values)

    with pytest.raises(NonFiniteError, match=r"the DPO reference pass gave 4 non-finite log-probabilities \(sequence "
                                             r"1 of .*precision.compute_dtype=float32"):
        load_or_compute(cfg, data, NaNWorker(), "float32", resuming=False)
    assert not [p for p in (tmp_path / "pairs" / "reference").iterdir()]  # nothing written, no temporary left


def test_a_killed_gguf_conversion_is_swept_and_a_live_one_kept(tmp_path, monkeypatch, warnings_logged):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))
    cache = tmp_path / "cache" / "gguf"
    cache.mkdir(parents=True)

    def conversion(name: str, held: bool | None, age_s: float = 0.0) -> Path:
        """A temporary conversion directory; held: its lock taken by a live process (this one), None: no lock."""
        path = cache / name
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"\0" * 4096)
        if held is not None:
            fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            if held:
                fcntl.flock(fd, fcntl.LOCK_EX)  # a new description: the sweeper's own open cannot take it
                opened.append(fd)
            else:
                os.close(fd)
        os.utime(path, (time.time() - age_s, time.time() - age_s))
        return path

    opened: list[int] = []
    killed = conversion(".m-0123456789abcdef.999999.k1ll3d00.converting", held=False)
    live = conversion(".m-0123456789abcdef.4242.l1v3xxxx.converting", held=True, age_s=3 * 86400)
    starting = conversion(".m-0123456789abcdef.4243.st4rtxxx.converting", held=None)
    old_style = conversion(".m-0123456789abcdef.ab_cd123", held=None, age_s=2 * 86400)
    young_old_style = conversion(".m-0123456789abcdef.youngxxx", held=None)
    other = conversion(".not-ours", held=None, age_s=10 * 86400)
    finished = conversion("m-0123456789abcdef", held=None, age_s=10 * 86400)

    def fake_convert(gguf: Path, out: Path, where: str, error: type) -> None:
        assert (out / ".lock").is_file() and not model_sources._abandoned(out / ".lock")  # held while converting
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_sources, "_convert_gguf", fake_convert)
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF" + b"\x01" * 60)
    target = model_sources.gguf_to_hf_dir(tmp_path / "tiny.gguf", "model.path", ConfigError)
    try:
        assert (target / "config.json").is_file() and not (target / ".lock").exists()
        assert not killed.exists() and not old_style.exists()
        assert live.is_dir() and starting.is_dir() and young_old_style.is_dir() and other.is_dir()
        assert finished.is_dir()
        warnings = [r.getMessage() for r in warnings_logged]
        assert len(warnings) == 2 and str(killed) in " ".join(warnings), warnings
        assert not [p for p in cache.iterdir() if p.name.startswith(f".{target.name}.")]  # its own temporary went
    finally:
        for fd in opened:
            os.close(fd)


def test_two_processes_asking_for_one_gguf_conversion_convert_it_once(tmp_path, monkeypatch):
    """A second caller (a `train` started while `prepare` converts) waits for the conversion in progress and uses
    it; the turn file beside the target goes with the last one. Threads stand in for processes: flock excludes two
    open file descriptions in one process as it does in two."""
    import threading

    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))
    started, release, calls = threading.Event(), threading.Event(), []

    def slow_convert(gguf: Path, out: Path, where: str, error: type) -> None:
        calls.append(out)
        started.set()
        assert release.wait(10)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_sources, "_convert_gguf", slow_convert)
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF" + b"\x02" * 60)
    targets: list[Path] = []

    def ask() -> None:
        targets.append(model_sources.gguf_to_hf_dir(tmp_path / "tiny.gguf", "model.path", ConfigError))

    first = threading.Thread(target=ask)
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=ask)
    second.start()
    time.sleep(0.3)  # the second is waiting on the turn, not converting
    assert len(calls) == 1 and second.is_alive()
    release.set()
    first.join(10)
    second.join(10)
    assert len(calls) == 1 and len(targets) == 2 and targets[0] == targets[1]
    assert (targets[0] / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir()) == [targets[0].name]


def test_a_caller_interrupted_while_waiting_for_the_turn_closes_its_descriptor(tmp_path, monkeypatch):
    """_one_conversion_of: a waiter stopped while blocked on the turn's lock (Ctrl-C) leaves no descriptor open and
    takes no turn; the holder's turn is untouched."""
    turn = tmp_path / ".x.turn"
    holder = os.open(turn, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    real = fcntl.flock

    def interrupted(fd, operation):
        if not operation & fcntl.LOCK_NB:  # the blocking wait
            raise KeyboardInterrupt
        return real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", interrupted)
    try:
        before = sorted(os.listdir("/proc/self/fd"))
        with pytest.raises(KeyboardInterrupt):
            with model_sources._one_conversion_of(tmp_path / "x", tmp_path / "x.gguf"):
                raise AssertionError("the turn is held by another")
        assert sorted(os.listdir("/proc/self/fd")) == before
        assert turn.is_file()
    finally:
        os.close(holder)
