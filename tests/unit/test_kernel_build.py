"""optim/kernels._build: the native kernels compile once per library even when several processes ask at once (the
optimizer workers of a run start together; on an empty cache each compiled the same source). Threads stand in for
processes: flock excludes two open file descriptions in one process as it does in two."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from megatrain_ray.optim import kernels


def test_two_builders_of_one_library_compile_it_once(tmp_path, monkeypatch):
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "src" / "probe.cpp"
    source.parent.mkdir()
    source.write_text('extern "C" int megatrain_probe() { return 7; }\n')
    compiled, real = [], kernels.subprocess.run

    def slow_compiler(command, **kwargs):
        if "-o" in command:  # the compilation (the other call asks the compiler's version)
            compiled.append(Path(command[-1]))
            time.sleep(0.5)  # the second caller arrives while the first compiles
        return real(command, **kwargs)

    monkeypatch.setattr(kernels.subprocess, "run", slow_compiler)
    libraries = []
    builders = [threading.Thread(target=lambda: libraries.append(
        kernels._build(source, ["-O0", "-shared", "-fPIC"], "probe"))) for _ in range(2)]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join(60)
    assert len(compiled) == 1, compiled
    assert len(libraries) == 2 and all(lib.megatrain_probe() == 7 for lib in libraries)
    assert len([p for p in (tmp_path / "cache").iterdir() if p.suffix == ".so"]) == 1  # no temporary left
