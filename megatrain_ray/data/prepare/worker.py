"""The tokenizing worker processes of `megatrain prepare`.

They come from a forkserver (never a fork of the main process, which may run threads) that imports
this module once: with MEGATRAIN_PREPARE_TOKENIZER set, it also loads that tokenizer once, and every
worker forked from it starts with it loaded instead of importing transformers and loading it again.
Each worker tokenizes with one thread: the processes are the parallelism. A worker whose main process
is gone (killed) exits within a second rather than wait on its queue for ever.
"""

from __future__ import annotations

import os
import threading
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"

from megatrain_ray.data.prepare.tokenize import Job, Result, Tokenizer, process_chunk  # noqa: E402

TOKENIZER_ENV = "MEGATRAIN_PREPARE_TOKENIZER"


def _preload() -> Tokenizer | None:
    try:
        return Tokenizer(os.environ[TOKENIZER_ENV]) if os.environ.get(TOKENIZER_ENV) else None
    except Exception:  # the worker loads it again, and reports the error through info()
        return None


_preloaded = _preload()
_worker: tuple[Tokenizer, Job] | None = None
_error: BaseException | None = None


def _exit_with(main_pid: int) -> None:
    while True:
        time.sleep(1.0)
        try:
            os.kill(main_pid, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:  # alive, another user's: cannot be ours after a pid reuse within a second
            pass


def init_worker(directory: str, job: Job, main_pid: int) -> None:
    global _worker, _error
    threading.Thread(target=_exit_with, args=(main_pid,), daemon=True, name="main-watch").start()
    try:
        tok = _preloaded if _preloaded is not None and _preloaded.directory == directory else Tokenizer(directory)
        _worker = (tok, job)
    except Exception as exc:  # kept for info(), so the main process raises the tokenizer's own error
        _error = exc


def info() -> tuple[int, bool]:
    """(vocabulary size, has a chat template), or the error loading the tokenizer raised."""
    if _error is not None:
        raise _error
    assert _worker is not None, "init_worker was not run"
    return _worker[0].info()


def work(chunk: list) -> list[Result]:
    if _error is not None:
        raise _error
    assert _worker is not None, "init_worker was not run"
    return process_chunk(_worker[0], _worker[1], chunk)
