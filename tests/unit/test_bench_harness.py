"""The benchmark harness's own logic that runs off the GPU machine (benchmarks/run.py)."""

from __future__ import annotations

import os
import sys

from benchmarks.run import TIMEOUT_LOG_LINES, derive, kernel_oom_lines, run_child

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


def test_the_trace_analysis_splits_the_optimizers_time_and_names_the_tail(tmp_path):
    """benchmarks/update_trace.py on a hand-made trace of one step: two updates, idle between their runs
    (busy 0.35 s of the 0.40 s from the first order to the last end) ending 0.35 s after the backward."""
    from benchmarks.update_trace import analyse, busy_union, load

    assert busy_union([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == 3.0
    events = [(1, -1, "step_start", 0.0), (1, -1, "backward_end", 0.15), (1, -1, "step_end", 0.2),
              (1, 0, "emit", 0.01), (1, 0, "gpu_drained", 0.05), (1, 0, "drained", 0.06), (1, 0, "sent", 0.1),
              (1, 0, "run_start", 0.1), (1, 0, "run_end", 0.3),
              (1, 1, "emit", 0.02), (1, 1, "gpu_drained", 0.10), (1, 1, "drained", 0.2), (1, 1, "sent", 0.2),
              (1, 1, "run_start", 0.35), (1, 1, "run_end", 0.5)]
    (tmp_path / "update-trace-g1-rank0-7.jsonl").write_text(
        "".join(f'{{"step": {s}, "stage": {i}, "event": "{e}", "t": {t}}}\n' for s, i, e, t in events))
    result = analyse(load(tmp_path), skip=0)
    step = result["steps"][0]
    assert abs(step["optimizer_busy"] - 0.35) < 1e-9 and abs(step["optimizer_idle"] - 0.05) < 1e-9
    assert abs(step["tail_after_backward"] - 0.35) < 1e-9
    assert abs(result["links_median_ms"]["done on GPU -> seen by dispatcher"] - 55.0) < 1e-6


def test_vs_resident_is_over_the_fastest_resident_row_of_the_same_point():
    def row(system, tok, seq=2048, batch=16):
        return {"system": system, "status": "ok", "layers": 16, "batch": batch, "seq_len": seq, "tok_per_s": tok}
    rows = [row("resident", 17_500.0), row("resident-compile", 21_700.0), row("megatrain", 15_000.0),
            row("resident-compile", 99_999.0, seq=4096), row("resident", 1.0, batch=4)]
    rows[2].update(optimizer_seconds=0.0, step_seconds=1.0, compute_seconds=1.0)
    derive(rows, None)
    assert rows[2]["vs_resident"] == 15_000.0 / 21_700.0 and rows[2]["vs_resident_system"] == "resident-compile"
    assert rows[0]["vs_resident_system"] == "resident-compile"


def test_a_lora_row_is_compared_with_the_lora_baselines_and_bounded_by_its_h2d_stream():
    """A megatrain LoRA row: ratios over peft's rows of the same point (never the full fine-tuning ones), and a
    roofline of max(GPU compute, H2D bytes / probed H2D bandwidth): 64 GB at 50 GB/s is 1.28 s > 1.0 s compute."""
    def row(system, tok, finetune="full"):
        return {"system": system, "status": "ok", "layers": 64, "batch": 1, "seq_len": 8192, "tok_per_s": tok,
                "finetune": finetune}
    rows = [row("resident-compile", 9_000.0), row("deepspeed", 500.0), row("peft-resident", 2_000.0, "lora"),
            row("peft-resident-compile", 3_000.0, "lora"), row("peft-deepspeed", 1_000.0, "lora"),
            row("megatrain-lora", 2_400.0, "lora")]
    rows[-1].update(optimizer_seconds=0.0, step_seconds=1.6, compute_seconds=1.0, h2d_gb_per_step=64.0,
                    h2d_probe_gbps=50.0)
    derive(rows, 20.0)
    ours = rows[-1]
    assert ours["vs_resident"] == 2_400.0 / 3_000.0 and ours["vs_resident_system"] == "peft-resident-compile"
    assert ours["vs_deepspeed"] == 2.4
    assert ours["roofline_bound"] == "h2d" and abs(ours["roofline_seconds"] - 1.28) < 1e-12
    assert abs(ours["roofline_fraction"] - 0.8) < 1e-12
    assert rows[2]["vs_resident_system"] == "peft-resident-compile" and rows[1]["vs_resident_system"] == "resident-compile"


def test_a_point_that_times_out_keeps_the_end_of_its_log():
    """A point stopped at --timeout records where it was: its last lines (stdout and stderr), not only the time."""
    script = ("import sys, time\n"
              "for i in range(100):\n"
              "    print(f'log line {i}', file=sys.stderr, flush=True)\n"
              "time.sleep(60)\n")
    row = run_child([sys.executable, "-c", script], timeout=3)
    assert row["status"] == "error" and row["error"] == "timed out after 3 s"
    assert row["log_tail"] == [f"log line {i}" for i in range(100 - TIMEOUT_LOG_LINES, 100)]


def test_a_point_that_exits_without_a_result_reports_its_exit_and_log():
    row = run_child([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"], timeout=30)
    assert row == {"status": "error", "error": "exit 3: boom\n"}


def test_a_point_waits_for_the_previous_points_shared_memory(tmp_path, monkeypatch):
    """wait_for_shm returns once the folder's free space is back to the harness's start (less the slack), and
    gives up after SHM_WAIT_S when it does not come back."""
    import time

    from benchmarks import run

    free = run.shm_free_bytes(str(tmp_path))
    calls = []
    space = iter([free - 5 * 2**30, free - 3 * 2**30, free])  # a previous point's 5 GiB coming back
    monkeypatch.setattr(run, "shm_free_bytes", lambda _d: calls.append(1) or next(space))
    monkeypatch.setattr(run.time, "sleep", lambda _s: None)
    run.wait_for_shm(str(tmp_path), free)
    assert len(calls) == 3
    monkeypatch.setattr(run, "shm_free_bytes", lambda _d: free - 5 * 2**30)
    monkeypatch.setattr(run, "SHM_WAIT_S", 0.05)
    t0 = time.monotonic()
    run.wait_for_shm(str(tmp_path), free)
    assert 0.05 <= time.monotonic() - t0 < 5


def test_vs_streamed_is_over_the_streamed_row_of_the_same_point():
    def row(system, tok, batch=2):
        return {"system": system, "status": "ok", "layers": 32, "batch": batch, "seq_len": 4096, "tok_per_s": tok,
                "optimizer_seconds": 0.0, "step_seconds": 1.0, "compute_seconds": 1.0}
    rows = [row("megatrain", 8_000.0), row("megatrain-streamed", 3_200.0), row("megatrain-streamed", 1.0, batch=4)]
    derive(rows, None)
    assert rows[0]["vs_streamed"] == 8_000.0 / 3_200.0
    assert "vs_streamed" not in rows[1] and "vs_streamed" not in rows[2]
