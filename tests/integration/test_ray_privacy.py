"""A Ray that megatrain starts is private to its user: the token is never readable by others, auth is never
off by accident, and what the run writes is its user's alone."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.ray


def _train(home: Path, out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    environment.update({"HOME": str(home), "PYTHONPATH": REPO, **(env or {})})
    return subprocess.run([sys.executable, "-m", "megatrain_ray", "train", "configs/tiny.yaml", "--set",
                           f"train.output_dir={out}", "--set", "train.steps=6", *extra],
                          cwd=REPO, env=environment, capture_output=True, text=True, timeout=300)


def test_the_token_is_0600_from_its_first_moment_and_auth_is_on(private_ray_cli_run):
    """A run through the private Ray it starts, in a HOME without a token (tests/conftest.private_ray_cli_run,
    whose watcher saw every mode the token file had, from before the run started)."""
    result, home = private_ray_cli_run["result"], private_ray_cli_run["home"]
    assert result.returncode == 0, result.stderr
    assert "token auth on" in result.stderr
    modes = private_ray_cli_run["modes"]
    assert modes == {0o600}, f"modes seen: {sorted(oct(m) for m in modes)}"
    assert stat.S_IMODE((home / ".ray").stat().st_mode) & 0o077 == 0


def test_auth_turned_off_by_the_environment_is_refused_before_ray_unless_allowed(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    home = tmp_path / "home"
    home.mkdir()
    off = {"RAY_AUTH_MODE": "disabled"}
    with ThreadPoolExecutor(2) as pool:  # side by side: the refused run ends before the other's Ray is up
        refusing = pool.submit(_train, home, tmp_path / "run", env=off)
        allowing = pool.submit(_train, home, tmp_path / "run2", "--set", "runtime.allow_unauthenticated=true", env=off)
        refused, allowed = refusing.result(), allowing.result()
    assert refused.returncode == 2, refused.stderr
    errors = [line for line in refused.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "RAY_AUTH_MODE='disabled'" in errors[0] and "runtime.allow_unauthenticated" in errors[0]
    assert "Traceback" not in refused.stderr and not (tmp_path / "run").exists()
    assert allowed.returncode == 0, allowed.stderr
    assert "token auth OFF" in allowed.stderr and "token auth on" not in allowed.stderr


@pytest.fixture
def other_user():
    """A second local user, created for the test and removed after it."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("runuser"):
        pytest.skip("needs root, useradd and runuser to create a second local user")
    name = f"mtother{os.getpid() % 100000}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def _as(user: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", user, "--", "sh", "-c", command], capture_output=True, text=True,
                          timeout=60)


def test_another_local_user_cannot_read_checkpoints_or_touch_rays_temporary_tree(tmp_path, other_user, ray_session):
    import ray

    base = Path(tempfile.mkdtemp(dir="/tmp"))  # world-traversable, as a lab's shared disk would be
    try:
        base.chmod(0o755)
        result = _train(Path.home(), base / "run", "--local", "--set", "checkpoint.every=3")
        assert result.returncode == 0, result.stderr
        checkpoint = next((base / "run" / "checkpoints").glob("step-*/manifest.json"))
        assert _as(other_user, f"cat {checkpoint}").returncode != 0, "another user read a checkpoint"
        assert _as(other_user, f"cat {base / 'run' / 'metrics.jsonl'}").returncode != 0
        assert _as(other_user, f"ls {base / 'run'}").returncode != 0
        session = Path(ray._private.worker._global_node.get_session_dir_path())
        for target in (session, session / "runtime_resources", session.parent):
            probe = _as(other_user, f"ls {target} || exit 1; touch {target}/intruder")
            assert probe.returncode != 0 and not (target / "intruder").exists(), f"{target}: {probe.stdout}"
    finally:
        shutil.rmtree(base, ignore_errors=True)
