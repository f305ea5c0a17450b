"""The tokenizing worker processes of `megatrain prepare`.

They come from a forkserver (never a fork of the main process, which may run threads) that imports
this module once (FORKSERVER_PRELOAD). Chat formats: the workers get a TokenizerSpec (chat_render.py)
and need only the Rust tokenizer, jinja2 and transformers' chat-template module, which the forkserver
imports once for all of them (the main process never needs it); with a template chat_assembled.py
renders without Jinja, only the Rust tokenizer.
Text, preference and prompts formats use transformers' tokenizer: with MEGATRAIN_PREPARE_TOKENIZER set the
forkserver loads it once, and every worker forked from it starts with it loaded instead of importing
transformers and loading it again. Each worker tokenizes with one thread: the processes are the
parallelism. A worker whose main process is gone (killed) exits within a second rather than wait on
its queue for ever.
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"

from megatrain_ray.data.prepare.chat_assembled import assembled_template  # noqa: E402
from megatrain_ray.data.prepare.chat_render import TokenizerSpec  # noqa: E402
from megatrain_ray.data.prepare.tokenize import Job, Result, Tokenizer, process_chunk  # noqa: E402
from megatrain_ray.system.processes import exit_when_gone  # noqa: E402

TOKENIZER_ENV = "MEGATRAIN_PREPARE_TOKENIZER"
FORKSERVER_PRELOAD = [__name__, "transformers.utils.chat_template_utils"]  # a missing one is skipped


def forkserver_preload(spec: TokenizerSpec | None) -> list[str]:
    """FORKSERVER_PRELOAD, less transformers' chat-template module where the workers never render with Jinja:
    a template chat_assembled.py renders, in a conversation without tools (one with tools imports it then)."""
    if spec is not None and spec.template == spec.tool_template and assembled_template(spec.template) is not None:
        return [__name__]
    return FORKSERVER_PRELOAD


def _preload() -> Tokenizer | None:
    try:
        return Tokenizer(os.environ[TOKENIZER_ENV]) if os.environ.get(TOKENIZER_ENV) else None
    except Exception:  # the worker loads it again, and reports the error through info()
        return None


_preloaded = _preload()
_worker: tuple[Tokenizer, Job] | None = None
_error: BaseException | None = None


def init_worker(directory: str, job: Job, main_pid: int, spec: TokenizerSpec | None) -> None:
    """spec: chat formats (the Rust tokenizer loaded from it here); None: transformers' tokenizer."""
    global _worker, _error
    exit_when_gone(main_pid)
    try:
        if spec is not None:
            tok = Tokenizer(directory, spec)
        elif _preloaded is not None and _preloaded.directory == directory:
            tok = _preloaded
        else:
            tok = Tokenizer(directory)
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
