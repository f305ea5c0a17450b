"""Every kind of bad input a user can give: one clear message naming the key or file, a non-zero exit,
and nothing left behind (no run directory, no shared-memory segment, an existing run unchanged)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import yaml

from megatrain_ray.__main__ import main
from tests.conftest import REPO, learnable_tokens, tiny_raw


def segments() -> set[str]:
    """This process's shared-memory segments (a run's id names the driver's pid; other test runs on the
    machine are not ours to count)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith("megatrain-") and f"-{os.getpid()}-" in f}


def write_config(tmp: Path, raw: dict) -> str:
    path = tmp / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def base(tmp: Path) -> dict:
    raw = tiny_raw(train={"steps": 4, "output_dir": str(tmp / "run")})
    raw["data"]["path"] = learnable_tokens(tmp / "tokens.npy", raw["model"]["vocab_size"])
    return raw


def with_section(section: str, **values) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        raw = base(tmp)
        raw[section] = {**raw.get(section, {}), **values}
        return ["train", write_config(tmp, raw)]
    return make


def with_raw(edit: Callable[[dict, Path], object]) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        raw = base(tmp)
        edit(raw, tmp)
        return ["train", write_config(tmp, raw)]
    return make


def with_data_file(name: str, write: Callable[[Path], object]) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        raw = base(tmp)
        path = tmp / name
        write(path)
        raw["data"]["path"] = str(path)
        return ["train", write_config(tmp, raw)]
    return make


def with_args(*extra: str) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        return ["train", write_config(tmp, base(tmp)), *extra]
    return make


def raw_text(text: str) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        path = tmp / "bad.yaml"
        path.write_text(text)
        return ["train", str(path)]
    return make


def trained_checkpoint(tmp: Path) -> Path:
    """A finished tiny run elsewhere, with checkpoints at steps 2 and 4."""
    raw = base(tmp)
    raw["train"]["output_dir"] = str(tmp / "done")
    raw["checkpoint"] = {"every": 2, "keep": 3}
    raw["runtime"] = {"mode": "local"}
    assert main(["train", write_config(tmp, raw)]) == 0
    return tmp / "done" / "checkpoints"


def resume_from(damage: Callable[[Path], object], **changes) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        ckpt = trained_checkpoint(tmp) / "step-00000004"
        damage(ckpt)
        raw = base(tmp)
        for section, values in changes.items():
            raw[section] = {**raw[section], **values}
        return ["train", write_config(tmp, raw), "--resume", str(ckpt)]
    return make


def flip_last_byte(ckpt: Path) -> None:
    stage = ckpt / "stage-0002.safetensors"
    data = bytearray(stage.read_bytes())
    data[-1] ^= 0x55
    stage.write_bytes(bytes(data))


def existing_run(tmp: Path) -> list[str]:
    (tmp / "run").mkdir()
    (tmp / "run" / "metrics.jsonl").write_text('{"step": 0}\n')
    return ["train", write_config(tmp, base(tmp))]


CASES: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    # the config file itself
    "config file missing": (lambda tmp: ["train", str(tmp / "nope.yaml")], "nope.yaml"),
    "yaml syntax error": (raw_text("model: {hidden_size: 64\n"), "bad.yaml"),
    "config not a mapping": (raw_text("- 1\n- 2\n"), "mapping"),
    "unknown section": (with_raw(lambda r, t: r.update(modle={})), "'modle'"),
    "unknown key": (with_section("optimizer", learning_rate=1e-3), "'optimizer.learning_rate'"),
    "wrong type": (with_section("train", steps="ten"), "'train.steps'"),
    "negative lr": (with_section("optimizer", lr=-1.0), "optimizer.lr"),
    "unknown dtype": (with_section("precision", master_dtype="float8"), "precision.master_dtype"),
    "heads do not divide hidden": (with_section("model", num_attention_heads=6), "num_attention_heads=6"),
    "kv heads do not divide heads": (with_section("model", num_key_value_heads=3), "model.num_key_value_heads"),
    "sequence beyond max positions": (with_section("data", seq_len=128), "data.seq_len"),
    "warmup beyond steps": (with_section("schedule", warmup_steps=50), "schedule.warmup_steps"),
    "zero batch": (with_section("data", batch_size=0), "data.batch_size"),
    "zero steps": (with_section("train", steps=0), "train.steps"),
    "negative workers": (with_section("optimizer", workers=-2), "optimizer.workers"),
    "keep zero checkpoints": (with_section("checkpoint", keep=0), "checkpoint.keep"),
    "malformed fault drill": (with_section("fault", drill="explode@3"), "fault.drill"),
    "actor kill drill without ray": (with_section("fault", drill="kill:optim0@2"), "fault.drill"),
    "unknown family": (with_section("model", family="gpt5"), "model.family"),
    "disk tier without a directory": (with_section("host", moments_tier="disk"), "host.disk_dir"),
    "bf16 moments on a float64 master": (with_raw(lambda r, t: (r["precision"].update(master_dtype="float64"),
                                                                r["optimizer"].update(moment_dtype="bfloat16"))),
                                         "optimizer.moment_dtype"),
    "override without '='": (with_args("--set", "optimizer.lr"), "section.key=value"),
    "override of an unknown key": (with_args("--set", "optimizer.speed=3"), "'optimizer.speed'"),
    # data
    "data file missing": (with_section("data", path="/nonexistent/tokens.npy"), "data.path"),
    "unknown data suffix": (with_data_file("tokens.csv", lambda p: p.write_text("1,2,3")), "data.path"),
    "2-D token array": (with_data_file("t.npy", lambda p: np.save(p, np.zeros((4, 4), np.int32))), "1-D"),
    "float token array": (with_data_file("t.npy", lambda p: np.save(p, np.zeros(4096, np.float32))), "integer"),
    "pickled object array": (with_data_file("t.npy", lambda p: np.save(p, np.array([{}] * 8, dtype=object),
                                                                         allow_pickle=True)), "data.path"),
    "too few tokens": (with_data_file("t.npy", lambda p: np.save(p, np.arange(20, dtype=np.int32))), "fewer"),
    "token id beyond vocab": (with_data_file("t.npy", lambda p: np.save(p, np.arange(4096, dtype=np.int32))),
                              "model.vocab_size"),
    "empty text file": (with_raw(lambda r, t: (r["model"].update(vocab_size=256), (t / "e.txt").write_text(""),
                                              r["data"].update(path=str(t / "e.txt")))), "data.path"),
    # checkpoints
    "resume from a missing directory": (with_args("--resume", "/nonexistent/step-00000004"), "does not exist"),
    "resume from a partial checkpoint": (resume_from(lambda c: (c / "manifest.json").unlink()), "incomplete"),
    "corrupt manifest": (resume_from(lambda c: (c / "manifest.json").write_text("{")), "corrupt"),
    "truncated checkpoint file": (resume_from(lambda c: os.truncate(c / "stage-0001.safetensors", 100)),
                                  "wrong size"),
    "checkpoint bytes changed": (resume_from(flip_last_byte), "CRC-32 mismatch"),
    "checkpoint of another model": (resume_from(lambda c: None, model={"intermediate_size": 96}),
                                    "model.intermediate_size"),
    "checkpoint beyond train.steps": (resume_from(lambda c: None, train={"steps": 3}), "train.steps"),
    "checkpoint of other moments": (resume_from(lambda c: None, optimizer={"moment_dtype": "bfloat16"}),
                                    "optimizer.moment_dtype='float32'"),
    "run directory already used": (existing_run, "already holds a run"),
    # the environment
    "shared memory too small": (with_section("model", num_layers=4000, hidden_size=256, intermediate_size=512),
                                "host.shm_dir"),
    "shm_dir not a directory": (with_section("host", shm_dir="/nonexistent/shm"), "host.shm_dir"),
    "disk_dir not a directory": (with_section("host", moments_tier="disk", disk_dir="/nonexistent/nvme"),
                                 "host.disk_dir='/nonexistent/nvme' is not a directory"),
}


def run_main(args: list[str]) -> int:
    try:
        return main(args)
    except SystemExit as exc:  # argparse's own usage errors
        return int(exc.code or 0)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_with_one_clear_message(case, tmp_path, capsys):
    make, expected = CASES[case]
    args = make(tmp_path)
    capsys.readouterr()
    before_segments = segments()
    before_run = (tmp_path / "run" / "metrics.jsonl").read_text() if (tmp_path / "run").exists() else None
    assert run_main([*args, "--local"]) != 0
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if " ERROR " in line]) == 1, err
    assert expected in err, err
    assert "Traceback" not in err
    assert segments() == before_segments
    if before_run is None:
        assert not (tmp_path / "run").exists(), "a refused run left a run directory"
    else:
        assert (tmp_path / "run" / "metrics.jsonl").read_text() == before_run


def test_the_catalogue_has_at_least_thirty_distinct_cases():
    assert len(CASES) >= 30 and len({expected for _, expected in CASES.values()}) >= 20


def test_plan_reports_the_numbers_for_a_box_it_does_not_run_on(capsys):
    config = os.path.join(REPO, "configs", "shapes", "qwen2.5-32b.yaml")
    assert main(["plan", config, "--host-memory", "512GiB", "--gpu-memory", "141GB"]) == 0
    out = capsys.readouterr().out
    assert "fits." in out and "AdamW second moment" in out
    assert main(["plan", config, "--host-memory", "256GiB", "--gpu-memory", "141GB"]) == 2
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "host RAM" in out
