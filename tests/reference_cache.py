"""Reference runs made once: a parity test's reference (an independent model trained from the same weights on the
same batches) depends on those inputs and a few settings alone, and a module asks for the same one several times
(the local and the Ray run, 1 or 3 optimizer workers, the float64 test and the float64 twin of a float32 one).
The key is the content itself (every tensor's bytes), so a run is reused only where it would be recomputed bit for
bit the same; each caller gets its own copy."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tests.numerics import current_perturbation

T = TypeVar("T")


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        digest.update(f"tensor{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, bytes):
        digest.update(b"bytes%d" % len(value))
        digest.update(value)
    elif isinstance(value, dict):
        digest.update(b"dict")
        for k in sorted(value, key=repr):
            _feed(digest, k)
            _feed(digest, value[k])
    elif isinstance(value, (list, tuple)):
        digest.update(f"seq{len(value)}".encode())
        for v in value:
            _feed(digest, v)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        _feed(digest, {"@dataclass": type(value).__qualname__, **dataclasses.asdict(value)})
    else:
        digest.update(repr(value).encode())


def content_key(*parts: Any) -> str:
    """A digest of `parts`: tensors by dtype, shape and bytes; bytes as they are; dicts, lists and dataclasses by
    their contents; anything else by repr."""
    digest = hashlib.sha256()
    for part in parts:
        _feed(digest, part)
    return digest.hexdigest()


def _function(fn: Any) -> Any:
    if fn is None:
        return None
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    where = (code.co_filename, code.co_firstlineno) if code is not None else None
    return getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn)), where, repr(getattr(fn, "__defaults__",
                                                                                                   None))


def code_of(model: torch.nn.Module) -> list:
    """What code a model's forward runs: each module's class and its forward (the class's, or one set on the module
    itself), by name, source location and default arguments; a forward a test patched in, on the class or on the
    module, is another key."""
    return sorted({(type(m).__module__, type(m).__qualname__, repr(_function(type(m).forward)),
                    repr(_function(m.__dict__.get("forward")))) for m in model.modules()})


class ReferenceRuns:
    """Results of reference runs by the content of everything they read."""

    def __init__(self) -> None:
        self._runs: dict[str, Any] = {}

    def get(self, compute: Callable[[], T], *inputs: Any) -> T:
        """`compute()`'s result, made once per distinct `inputs` (all that `compute` reads); a copy each time."""
        key = content_key(current_perturbation(), *inputs)  # a perturbed run is another run
        if key not in self._runs:
            self._runs[key] = compute()
        return copy.deepcopy(self._runs[key])
