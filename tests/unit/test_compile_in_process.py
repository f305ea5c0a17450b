"""engine/compiled.py compile_in_process: Inductor compiles in the calling process (no pool of compile workers, which
held about 5 GiB of host RAM for a whole run on the H200 box), unless the user set TORCHINDUCTOR_COMPILE_THREADS."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

PROBE = """
import os, sys, torch
from megatrain_ray.engine.compiled import CompiledFunction
fn = CompiledFunction(lambda x: torch.sin(x) * 2 + 1, fall_back=False, what="a probe")
from tests.numerics import assert_within_noise
x = torch.randn(64, device=sys.argv[1], generator=torch.Generator(sys.argv[1]).manual_seed(0))
# Against the eager function in float32 and float64: the bound is the measured float32 noise (tests/numerics.py),
# over the whole vector, so an output near 0 (sin(x) near -1/2) weighs no more than any other.
assert_within_noise("the compiled probe", fn(x), torch.sin(x) * 2 + 1, torch.sin(x.double()) * 2 + 1)
import torch._inductor.config as c
children = [p for p in os.listdir("/proc") if p.isdigit() and
            open(f"/proc/{p}/stat").read().split(") ")[1].split()[1] == str(os.getpid())]
print(c.compile_threads, len(children))
"""


def probe(device: str, **env: str) -> tuple[int, int]:
    """(Inductor's compile_threads, child processes) after a function compiled on `device`, in a fresh process."""
    clean = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_COMPILE_THREADS"}
    proc = subprocess.run([sys.executable, "-c", PROBE, device], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**clean, "PYTHONPATH": REPO, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    threads, children = proc.stdout.split()[-2:]
    return int(threads), int(children)


def test_compile_in_process_leaves_the_users_choice(monkeypatch):
    import torch._inductor.config as inductor_config

    from megatrain_ray.engine.compiled import compile_in_process

    default = inductor_config.decide_compile_threads()  # torch's choice on this machine (its cores)
    if default == 1:
        pytest.skip("torch compiles in process on a one-core machine anyway")
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    # Inductor's own patch: monkeypatch.setattr on its config module leaves the key unreadable afterwards.
    with inductor_config.patch(compile_threads=default):
        compile_in_process()
        assert inductor_config.compile_threads == 1
    with inductor_config.patch(compile_threads=default + 3):  # set in code by the user
        compile_in_process()
        assert inductor_config.compile_threads == default + 3
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", str(default))
    with inductor_config.patch(compile_threads=default):
        compile_in_process()
        assert inductor_config.compile_threads == default


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_inductor_compiles_in_process_unless_the_user_asks_for_workers():
    """On the CPU Inductor starts no pool either way (it serves Triton only): the setting is what is checked. The two
    probes run side by side (each is a fresh process importing torch on one core first)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        default = pool.submit(probe, "cpu")
        chosen = pool.submit(probe, "cpu", TORCHINDUCTOR_COMPILE_THREADS="2")
        assert default.result() == (1, 0)
        assert chosen.result()[0] == 2  # the user's choice stands

