"""One log format for the driver and every actor: `[megatrain <actor>] message`."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s [megatrain %(actor)s] %(levelname)s %(message)s"
_warned: set[str] = set()


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record is emitted, not as it was when the logger was set up (as
    logging's own last-resort handler does): a caller that swaps sys.stderr (contextlib.redirect_stderr, pytest's
    capsys) gets the lines while it holds it, and a replacement closed since never receives one (in-process
    runs after a `main()` under capsys lost every log line to 'I/O operation on closed file')."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


class _ActorFilter(logging.Filter):
    def __init__(self, actor: str):
        super().__init__()
        self.actor = actor

    def filter(self, record: logging.LogRecord) -> bool:
        record.actor = self.actor
        return True


def init_logger(actor: str = "driver", level: str | None = None, force: bool = False) -> logging.Logger:
    """Configure the `megatrain_ray` logger tree once per process; `actor` names the process in each line.

    Actors call it in their constructor: in their own Ray process it sets their name; in-process
    (runtime.mode=local) the driver's configuration stays.
    """
    root = logging.getLogger("megatrain_ray")
    if root.handlers and not force:
        return root
    root.setLevel(level or os.environ.get("MEGATRAIN_LOG_LEVEL", "INFO"))
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_ActorFilter(actor))
    root.addHandler(handler)
    root.propagate = False
    return root


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name if name.startswith("megatrain_ray") else f"megatrain_ray.{name}")


def warn_once(logger: logging.Logger, message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
