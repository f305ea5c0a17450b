"""Native CPU kernels, compiled on first use with the system's C++ compiler and loaded with ctypes.

The shared library is cached under ~/.cache/megatrain_ray (or $MEGATRAIN_CACHE), keyed by the
source, the compiler and the flags, and is built into a temporary file then renamed, so that
optimizer workers starting together never load a half-written file. Without a compiler the
callers fall back to torch's kernels (`optimizer.kernel: auto`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from megatrain_ray.observe.log import get_logger

log = get_logger(__name__)

SOURCE = Path(__file__).with_name("adamw.cpp")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]


class KernelUnavailable(RuntimeError):
    pass


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise KernelUnavailable("no C++ compiler found (set CXX, or install g++)")


def _cache_dir() -> Path:
    return Path(os.environ.get("MEGATRAIN_CACHE", Path.home() / ".cache" / "megatrain_ray"))


@lru_cache(maxsize=1)
def adamw_library() -> ctypes.CDLL:
    """The compiled AdamW kernel (raises KernelUnavailable when it cannot be built)."""
    cxx = _compiler()
    source = SOURCE.read_bytes()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(source + repr((cxx, version, FLAGS, os.uname().machine)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"adamw-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
        os.close(fd)
        proc = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            raise KernelUnavailable(f"compiling {SOURCE.name} failed: {proc.stderr.strip()[:2000]}")
        os.replace(tmp, target)
        log.info("built the native AdamW kernel: %s", target)
    lib = ctypes.CDLL(str(target))
    pointer, i64, f32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double
    # p, m, v, g, out, n, lr, beta1, beta2 (double, as torch takes them), eps, weight_decay, bc1, bc2_sqrt,
    # grad_coef, threads, the index of element 0 in its stage and the noise key (of the bf16 moments' rounding),
    # then where a speculative update writes master and moments (null: in place) and saves the gradient (null: no).
    signature = [pointer, pointer, pointer, pointer, pointer, i64, f32, f64, f64] + [f32] * 5 + \
        [ctypes.c_int, i64, ctypes.c_uint32] + [pointer] * 4
    for name in ("megatrain_adamw_f32grad", "megatrain_adamw_bf16grad", "megatrain_adamw_f32grad_bf16m",
                 "megatrain_adamw_bf16grad_bf16m"):
        fn = getattr(lib, name)
        fn.argtypes = signature
        fn.restype = None
    lib.megatrain_adamw_streams.argtypes = []
    lib.megatrain_adamw_streams.restype = ctypes.c_int  # 1: a speculative update streams its other set out
    return lib
