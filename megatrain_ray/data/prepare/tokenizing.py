"""Running `process_chunk` over the input: in this process, or in --workers processes, results in input order.

Chat formats with several workers start them at once with the tokenizer as its files spell it
(chat_render.spec_from_files), while this process loads transformers' AutoTokenizer on a thread
(`SpecCheck`: the import and load take seconds) and compares the two specs. They agree for a plain
model directory; where they do not, `check` raises `SpecMismatch` and the run starts again with
transformers' spec, so what is written always comes from transformers' reading of the directory.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from megatrain_ray.data.prepare.chat_render import TokenizerSpec, spec_from_tokenizer
from megatrain_ray.data.prepare.tokenize import Job, Result, Tokenizer, load_tokenizer, process_chunk
from megatrain_ray.exceptions import DataError

IN_FLIGHT_PER_WORKER = 2
"""Chunks submitted and not yet taken, per worker: memory stays bounded whatever the input size."""


class SpecMismatch(Exception):
    """The directory's files spell a tokenizer or template other than transformers loads: redo with `spec`."""

    def __init__(self, spec: TokenizerSpec, vocab_size: int):
        super().__init__("the tokenizer files differ from transformers' reading of them")
        self.spec, self.vocab_size = spec, vocab_size


class SpecCheck:
    """transformers' own spec and vocabulary size of `directory`, loaded on a thread of this process."""

    def __init__(self, directory: str):
        self.spec: TokenizerSpec | None = None
        self.vocab_size = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._load, args=(directory,), daemon=True, name="tokenizer-check")
        self.thread.start()

    def _load(self, directory: str) -> None:
        try:
            tok = load_tokenizer(directory)
            self.vocab_size, self.spec = len(tok), spec_from_tokenizer(tok)
        except BaseException as exc:  # raised in the main thread by result()
            self.error = exc

    def result(self, wait: bool) -> tuple[TokenizerSpec, int] | None:
        if wait:
            self.thread.join()
        if self.thread.is_alive():
            return None
        if self.error is not None:
            raise self.error
        assert self.spec is not None
        return self.spec, self.vocab_size


class Tokenizing:
    """Each chunk's results in input order: here (one worker), or from `workers` forked-from-a-forkserver
    processes with at most IN_FLIGHT_PER_WORKER chunks each in flight, so memory does not grow with the input.

    spec: what the workers tokenize chat records with; None: transformers' tokenizer, loaded in each worker
    (text and preference formats). vocab_size None with a spec: the spec is the files' and is checked."""

    def __init__(self, directory: str, job: Job, workers: int, spec: TokenizerSpec | None = None,
                 vocab_size: int | None = None):
        self.job, self.workers, self.pool, self.tok = job, workers, None, None
        self.spec, self.vocab_size, self.check_spec = spec, vocab_size, None
        if workers <= 1:
            self.tok = Tokenizer(directory, spec)
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from megatrain_ray.data.prepare import worker  # lazy: importing it turns tokenizer threads off

        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["megatrain_ray.data.prepare.worker"])
        if spec is None:
            os.environ[worker.TOKENIZER_ENV] = directory  # read once, by the forkserver as it starts
        self.pool = ProcessPoolExecutor(workers, mp_context=context, initializer=worker.init_worker,
                                        initargs=(directory, job, os.getpid(), spec))
        if spec is not None and vocab_size is None:
            self.check_spec = SpecCheck(directory)

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
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
