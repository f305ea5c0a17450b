"""observe/log.init_logger's handler writes to sys.stderr as it is at each record: a stream swapped in after the
logger was set up (contextlib.redirect_stderr, pytest's capsys) receives the lines, and one closed since is never
written to (before, in-process runs after a `main()` under capsys printed 'I/O operation on closed file' for every
line and lost them)."""

from __future__ import annotations

import contextlib
import io
import logging

from megatrain_ray.observe.log import get_logger, init_logger


def test_log_lines_follow_sys_stderr_after_setup():
    first, second = io.StringIO(), io.StringIO()
    root = logging.getLogger("megatrain_ray")
    saved = (list(root.handlers), root.level, root.propagate)
    try:
        with contextlib.redirect_stderr(first):
            init_logger("driver", force=True)
            get_logger("probe").info("one")
        first.close()  # as capsys closes its stream at the end of a test
        with contextlib.redirect_stderr(second):
            get_logger("probe").info("two")
        assert second.getvalue().endswith("[megatrain driver] INFO two\n"), second.getvalue()
    finally:
        root.handlers[:], root.level, root.propagate = saved
