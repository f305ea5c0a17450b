"""Running `process_chunk` over the input: in this process, or in --workers processes, results in input order.

Chat formats with several workers start them at once with the tokenizer as its files spell it
(chat_render.spec_from_files), while one more process loads transformers' AutoTokenizer (`SpecCheck`:
the import and load take seconds) and this one compares the two specs. They agree for a plain
model directory; where they do not, `check` raises `SpecMismatch` and the run starts again with
transformers' spec, so what is written always comes from transformers' reading of the directory.
A verdict of agreement is kept (spec_check_cache.py): a later run on the same files, with the same
transformers and tokenizers, starts its workers without the check.

The forkserver (and so every worker forked from it) runs with jemalloc preloaded where Ray's copy is installed
(ray/core/libjemalloc.so, the allocator Ray preloads into its own processes): the Rust tokenizer allocates and
frees several small buffers per token, and glibc's malloc took a quarter of its time (encode 23 % faster, freeing
the encodings 6x). The allocator changes no output. MEGATRAIN_PREPARE_MALLOC names another library to preload,
or `system` for none.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from megatrain_ray.data.prepare import spec_check_cache
from megatrain_ray.data.prepare.chat_render import TokenizerSpec, spec_from_tokenizer
from megatrain_ray.data.prepare.tokenize import Job, Result, Tokenizer, load_tokenizer, process_chunk
from megatrain_ray.exceptions import DataError

MALLOC_ENV = "MEGATRAIN_PREPARE_MALLOC"
IN_FLIGHT_PER_WORKER = 4
"""Chunks submitted and not yet taken, per worker: memory stays bounded whatever the input size, and a worker
has chunks queued while this process waits for a core."""


def malloc_library() -> str | None:
    """The malloc library the workers' forkserver preloads: MEGATRAIN_PREPARE_MALLOC (a path; `system` or empty: none),
    else Ray's jemalloc where it is installed, else None."""
    setting = os.environ.get(MALLOC_ENV)
    if setting is not None:
        return None if setting in ("", "system") else setting
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("ray")  # finds the package without importing it
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "core" / "libjemalloc.so"
    return str(path) if path.is_file() else None


def start_forkserver(library: str | None) -> None:
    """multiprocessing's forkserver started now, with `library` in LD_PRELOAD of its process (and so of every worker
    forked from it) where given; this process's environment is as before once it has started. One already running
    is kept as it is."""
    from multiprocessing import forkserver

    previous = os.environ.get("LD_PRELOAD")
    if library is not None and os.path.isfile(library):
        os.environ["LD_PRELOAD"] = f"{library}:{previous}" if previous else library
    try:
        forkserver.ensure_running()
    finally:
        if previous is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = previous


class SpecMismatch(Exception):
    """The directory's files spell a tokenizer or template other than transformers loads: redo with `spec`."""

    def __init__(self, spec: TokenizerSpec, vocab_size: int):
        super().__init__("the tokenizer files differ from transformers' reading of them")
        self.spec, self.vocab_size = spec, vocab_size


def exact_spec(directory: str) -> tuple[TokenizerSpec, int]:
    """transformers' own spec and vocabulary size of `directory` (what SpecCheck's process runs)."""
    tok = load_tokenizer(directory)
    return spec_from_tokenizer(tok), len(tok)


class SpecCheck:
    """exact_spec(directory) in a process of its own: the import of transformers and torch and the load take
    seconds of CPU, which neither this process's thread feeding the workers nor the workers wait for."""

    def __init__(self, directory: str, context: Any):
        from concurrent.futures import ProcessPoolExecutor

        self.pool = ProcessPoolExecutor(1, mp_context=context)
        self.future = self.pool.submit(exact_spec, directory)

    def result(self, wait: bool) -> tuple[TokenizerSpec, int] | None:
        if not (wait or self.future.done()):
            return None
        from concurrent.futures.process import BrokenProcessPool

        try:
            return self.future.result()
        except BrokenProcessPool:
            raise DataError("the process loading the tokenizer with transformers died (out of memory?)") from None
        finally:
            self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Tokenizing:
    """Each chunk's results in input order: here (one worker), or from `workers` forked-from-a-forkserver
    processes with at most IN_FLIGHT_PER_WORKER chunks each in flight, so memory does not grow with the input.

    spec: what the workers tokenize chat records with; None: transformers' tokenizer, loaded in each worker
    (text, preference and prompts formats). vocab_size None with a spec: the spec is the files' and is checked; a
    check that finds it transformers' reading is kept under check_key (spec_check_cache.py)."""

    def __init__(self, directory: str, job: Job, workers: int, spec: TokenizerSpec | None = None,
                 vocab_size: int | None = None, check_key: str | None = None):
        self.job, self.workers, self.pool, self.tok = job, workers, None, None
        self.spec, self.vocab_size, self.check_spec = spec, vocab_size, None
        self.directory, self.check_key = directory, check_key
        if workers <= 1:
            self.tok = Tokenizer(directory, spec)
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from megatrain_ray.data.prepare import worker  # lazy: importing it turns tokenizer threads off

        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(worker.forkserver_preload(spec))
        if spec is None:
            os.environ[worker.TOKENIZER_ENV] = directory  # read once, by the forkserver as it starts
        start_forkserver(malloc_library())
        self.pool = ProcessPoolExecutor(workers, mp_context=context, initializer=worker.init_worker,
                                        initargs=(directory, job, os.getpid(), spec))
        if spec is not None and vocab_size is None:
            self.check_spec = SpecCheck(directory, context)

    def has_template(self) -> bool:
        """Whether chat records can be rendered: known at once where the workers have a spec."""
        return self.spec.has_template if self.spec is not None else self.info()[1]

    def info(self) -> tuple[int, bool]:
        """(vocabulary size, has a chat template); waits for the spec check, and raises SpecMismatch."""
        if self.tok is not None:
            return self.tok.info()
        if self.spec is not None:
            self.check(wait=True)
            assert self.vocab_size is not None
            return self.vocab_size, self.spec.has_template
        from megatrain_ray.data.prepare import worker  # lazy: only with worker processes

        try:
            return self._result(self.pool.submit(worker.info))
        finally:
            os.environ.pop(worker.TOKENIZER_ENV, None)

    def check(self, wait: bool = False) -> None:
        """Raises SpecMismatch once the spec check finds transformers' spec other than the workers' one."""
        if self.check_spec is None:
            return
        result = self.check_spec.result(wait)
        if result is None:
            return
        self.check_spec = None
        spec, vocab_size = result
        if spec != self.spec:
            raise SpecMismatch(spec, vocab_size)
        self.vocab_size = vocab_size
        spec_check_cache.store(self.check_key, spec, vocab_size, self.directory)

    def results(self, work_chunks: Iterable[list]) -> Iterator[list[Result]]:
        if self.tok is not None:
            for chunk in work_chunks:
                yield process_chunk(self.tok, self.job, chunk)
            return
        from megatrain_ray.data.prepare import worker  # lazy: only with worker processes

        pending: deque = deque()
        for chunk in work_chunks:
            pending.append(self.pool.submit(worker.work, chunk))
            if len(pending) >= IN_FLIGHT_PER_WORKER * self.workers:
                yield self._result(pending.popleft())
        while pending:
            yield self._result(pending.popleft())

    @staticmethod
    def _result(future: Any) -> Any:
        from concurrent.futures.process import BrokenProcessPool

        try:
            return future.result()
        except BrokenProcessPool:
            raise DataError("a tokenizing worker process died (out of memory?); try fewer --workers") from None

    def close(self) -> None:
        if self.check_spec is not None:
            self.check_spec.close()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
