"""The benchmark harness's own logic that runs off the GPU machine (benchmarks/run.py)."""

from __future__ import annotations

import os

from benchmarks.run import kernel_oom_lines

# As the kernel printed them on nvidia-h200-x2 when DeepSpeed ran out of host memory (qwen14b, 48 layers).
KERNEL_LOG = """\
[  760.724930] 67108766 pages RAM
[  760.724938] NVRM: failed to allocate page table!
[  763.441683] oom_reaper: reaped process 17179 (python), now anon-rss:0kB, file-rss:9876kB, shmem-rss:66039972kB
[  770.000001] Out of memory: Killed process 171790 (python) total-vm:1kB
"""


def _fake_dmesg(tmp_path, monkeypatch, text: str | None) -> None:
    tool = tmp_path / "dmesg"
    tool.write_text("#!/bin/sh\n" + (f"cat <<'LOG'\n{text}LOG\n" if text is not None else "exit 1\n"))
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_a_killed_child_is_matched_to_the_kernels_oom_lines_by_its_pid(tmp_path, monkeypatch):
    _fake_dmesg(tmp_path, monkeypatch, KERNEL_LOG)
    assert kernel_oom_lines(17179) == [KERNEL_LOG.splitlines()[2]]
    assert kernel_oom_lines(171790) == [KERNEL_LOG.splitlines()[3]]  # not a prefix match of 17179
    assert kernel_oom_lines(1717) == []


def test_an_unreadable_kernel_log_gives_no_evidence(tmp_path, monkeypatch):
    _fake_dmesg(tmp_path, monkeypatch, None)
    assert kernel_oom_lines(17179) == []
