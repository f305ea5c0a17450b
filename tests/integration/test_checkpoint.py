"""Checkpoints and resume: the files are plain safetensors holding the exact state; a run killed at any
point (even in the middle of a checkpoint write) resumes to the same loss curve, bit for bit."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.store.checkpoint import CheckpointDir, read_manifest
from megatrain_ray.store.segments import HostStore
from tests.conftest import REPO, learnable_tokens, tiny_config, tiny_raw
from tests.integration.test_lora_parity import float64_transformers  # noqa: F401 - a fixture
from tests.numerics import assert_within_noise


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def test_checkpoint_files_are_safetensors_with_the_exact_state(tmp_path):
    cfg = tiny_config(tmp_path, checkpoint={"every": 3, "keep": 2}, train={"steps": 9})
    with Trainer(cfg) as trainer:
        trainer.train()
        master = trainer.master_weights()
        moments = {k: HostStore([s for s in trainer.specs if s.kind == k]).read_tensors(trainer.layout, k)
                   for k in ("exp_avg", "exp_avg_sq")}
    done = CheckpointDir(tmp_path / "run" / "checkpoints").complete()
    assert [c.step for c in done] == [6, 9]  # keep: 2, and one at the end
    last = done[-1]
    assert last.manifest["updates_applied"] == 9
    seen = set()
    for entry in last.manifest["files"]:
        path = last.directory / entry["path"]
        assert zlib.crc32(path.read_bytes()) == entry["crc32"] and path.stat().st_size == entry["bytes"]
        with safe_open(str(path), framework="pt") as f:  # the reference reader
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.startswith("optimizer."):
                    kind, hf_name = name.split(".", 2)[1], name.split(".", 2)[2]
                    expected = moments[kind][hf_name]
                else:
                    expected = master[name]
                assert torch.equal(f.get_tensor(name), expected), name
                seen.add(name)
    assert seen == set(master) | {f"optimizer.{k}.{n}" for k in ("exp_avg", "exp_avg_sq") for n in master}


def test_resume_continues_bit_identically_and_rewrites_later_metrics(tmp_path):
    reference = tiny_config(tmp_path / "ref", train={"steps": 14})
    with Trainer(reference) as trainer:
        trainer.train()
        final = trainer.master_weights()
    cfg = tiny_config(tmp_path / "cut", checkpoint={"every": 5}, train={"steps": 14})
    with Trainer(cfg) as trainer:  # stops after 8 steps without a checkpoint of its own: the last one is step 5
        for step in range(8):
            trainer.step(step)
            trainer.next_step = step + 1
            if trainer.next_step % 5 == 0:
                trainer.save(wait=True)
    with Trainer(cfg, resume="auto") as trainer:
        assert trainer.next_step == 5
        trainer.train()
        resumed = trainer.master_weights()
    assert losses(tmp_path / "cut" / "run") == losses(tmp_path / "ref" / "run")
    assert all(torch.equal(final[k], resumed[k]) for k in final)


def test_a_corrupt_or_foreign_checkpoint_is_refused(tmp_path):
    cfg = tiny_config(tmp_path, checkpoint={"every": 2, "keep": 3}, train={"steps": 4})
    with Trainer(cfg) as trainer:
        trainer.train()
    root = tmp_path / "run" / "checkpoints"
    newest = root / "step-00000004"
    stage = newest / "stage-0001.safetensors"
    data = bytearray(stage.read_bytes())
    data[-5] ^= 0xFF
    stage.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="CRC-32 mismatch"):
        Trainer(cfg, resume=str(newest)).start()
    (newest / "manifest.json").write_text("{not json")
    assert CheckpointDir(root).latest().step == 2  # auto skips the broken one
    wider = tiny_config(tmp_path, model={"hidden_size": 128}, checkpoint={"every": 2}, train={"steps": 4})
    with pytest.raises(CheckpointError, match="model.hidden_size=64"):
        Trainer(wider, resume=str(root / "step-00000002"))


# ----------------------------------------------------------------------------- the CLI, killed


def megatrain_popen(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatrain_ray", *args], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def cli_args(config: Path, out: Path, *extra: str) -> list[str]:
    return ["train", str(config), "--local", "--set", f"train.output_dir={out}", *extra]


@pytest.fixture(scope="module")
def tiny_yaml(tmp_path_factory) -> Path:
    import yaml

    directory = tmp_path_factory.mktemp("tiny")
    raw = tiny_raw(train={"steps": 16, "seed": 7, "log_every": 100}, checkpoint={"every": 4})
    raw["data"]["path"] = learnable_tokens(directory / "tokens.npy", raw["model"]["vocab_size"])
    path = directory / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def reference(tiny_yaml, tmp_path_factory) -> Iterator[Callable[[], list[tuple[int, float]]]]:
    """(step, loss) of the uninterrupted run of tiny_yaml through the CLI, made once: what every run below that is
    killed or stopped and then resumed must give, bit for bit. The run starts with the first test that asks and
    trains beside that test's own runs (a child importing torch leaves the other core idle); calling the fixture's
    value waits for it."""
    out = tmp_path_factory.mktemp("reference") / "ref"
    proc = megatrain_popen(*cli_args(tiny_yaml, out))
    done: list[list[tuple[int, float]]] = []

    def wait() -> list[tuple[int, float]]:
        if not done:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err
            done.append(losses(out))
        return done[0]
    yield wait
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def run_to_end(*args: str) -> subprocess.CompletedProcess:
    proc = megatrain_popen(*args)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def wait_for_steps(run_dir: Path, count: int, proc: subprocess.Popen) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"the run did not reach {count} steps: {proc.poll()}")


def test_kill_9_of_the_driver_at_a_random_step_then_resume(tmp_path, tiny_yaml, reference):
    kill_at = random.Random().randint(6, 14)  # the checkpoint of step 4 is complete once step 5 ran
    proc = megatrain_popen(*cli_args(tiny_yaml, tmp_path / "cut"))
    wait_for_steps(tmp_path / "cut", kill_at, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = run_to_end(*cli_args(tiny_yaml, tmp_path / "cut", "--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at step" in resumed.stderr, f"killed after {kill_at} steps"
    assert losses(tmp_path / "cut") == reference(), f"killed after {kill_at} steps"


def test_kill_in_the_middle_of_a_checkpoint_write_uses_the_previous_one(tmp_path, tiny_yaml, reference):
    cut = run_to_end(*cli_args(tiny_yaml, tmp_path / "cut", "--set", "fault.drill=kill_during_checkpoint@8"))
    assert cut.returncode == -signal.SIGKILL, cut.stderr
    root = tmp_path / "cut" / "checkpoints"
    partial = [p.name for p in root.iterdir() if p.name.startswith(".partial-step-00000008")]
    assert partial and not (root / "step-00000008").exists()
    assert CheckpointDir(root).latest().step == 4
    resumed = run_to_end(*cli_args(tiny_yaml, tmp_path / "cut", "--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at step 4" in resumed.stderr
    assert losses(tmp_path / "cut") == reference()
    assert not [p for p in root.iterdir() if p.name.startswith(".partial-")]  # swept once a newer one completed
    for done in CheckpointDir(root).complete():
        read_manifest(done.directory)


@pytest.mark.parametrize("mode", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_sigterm_saves_a_checkpoint_exits_143_and_prints_a_resume_command_that_continues_this_run(
        tmp_path, tiny_yaml, reference, mode):
    """Under Ray too: ray.init installs Ray's own SIGTERM handler (it logs and dies), which `ray job stop`
    and `kill -TERM` met before. The printed command keeps the run's overrides, so it resumes this run."""
    args = cli_args(tiny_yaml, tmp_path / "run", "--set", "checkpoint.every=0")
    if mode == "ray":
        args.remove("--local")
    proc = megatrain_popen(*args)
    wait_for_steps(tmp_path / "run", 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    latest = CheckpointDir(tmp_path / "run" / "checkpoints").latest()
    assert latest is not None and latest.step == len(losses(tmp_path / "run"))
    printed = re.search(r"resume with: (megatrain train .*--resume auto)$", err, re.MULTILINE)
    assert printed, err
    command = shlex.split(printed.group(1))
    assert command[:2] == ["megatrain", "train"] and "checkpoint.every=0" in command
    resumed = run_to_end(*command[1:])
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at step {latest.step}" in resumed.stderr
    assert losses(tmp_path / "run") == reference()


@pytest.mark.float32_parity
def test_export_of_a_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path, float64_transformers):  # noqa: F811
    """The export holds the checkpoint's float32 weights bit for bit, and transformers' logits on it are ours within
    4x the float32 noise of its own logits (float32 against the same model in float64), floor 16 ulps; measured
    on an AVX-512 Xeon: noise 2.5e-7, ours bit-identical to transformers' float32 logits (logits off by 1e-3:
    500x the bound). No float64 twin: an export is float32 or bfloat16, so a float64 run's export is rounded and
    no longer its weights."""
    from transformers import AutoModelForCausalLM

    from megatrain_ray.store.export import export_weights_dir

    cfg = tiny_config(tmp_path, checkpoint={"every": 3}, train={"steps": 6})
    with Trainer(cfg) as trainer:
        trainer.train()
        ids = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        ours = trainer.logits(ids)
        master = trainer.master_weights()
    export_weights_dir(tmp_path / "run" / "checkpoints" / "step-00000006", tmp_path / "hf")
    theirs = {}
    for dtype in (torch.float32, torch.float64):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=dtype, attn_implementation="sdpa").eval()
        if dtype == torch.float32:
            state = model.state_dict()
            assert all(torch.equal(state[k], v) for k, v in master.items())
        with torch.no_grad():
            theirs[dtype] = model(ids).logits
    assert_within_noise("logits", ours, theirs[torch.float32], theirs[torch.float64])
