"""Native CPU kernels, compiled on first use with the system's C++ compiler and loaded with ctypes.

The shared library is cached under ~/.cache/megatrain_ray (or $MEGATRAIN_CACHE), keyed by the
source, the compiler and the flags, and is built into a temporary file then renamed, so that
optimizer workers starting together never load a half-written file. Without a compiler the
callers fall back to torch's kernels (`optimizer.kernel: auto`).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from megatrain_ray.observe.log import get_logger

log = get_logger(__name__)

SOURCE = Path(__file__).with_name("adamw.cpp")
LEAN_SOURCE = Path(__file__).with_name("lean_adamw.cpp")
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


def _build(source_path: Path, flags: list[str], what: str) -> ctypes.CDLL:
    """Compile `source_path` with `flags` (cached by source, compiler and flags) and load it."""
    cxx = _compiler()
    # The source and the headers it may include (kernels/*.h): a change to either is another library.
    source = source_path.read_bytes() + b"".join(h.read_bytes() for h in sorted(source_path.parent.glob("*.h")))
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(source + repr((cxx, version, flags, os.uname().machine)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source_path.stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # One builder at a time per library: the optimizer workers of a run start together, and on an empty cache
        # each compiled the same file (the rename kept that safe, not cheap). A waiter finds the library built.
        with open(target.parent / f".{target.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():
                _compile(cxx, flags, source_path, target)
                log.info("built the native %s kernel: %s", what, target)
    return ctypes.CDLL(str(target))


def _compile(cxx: str, flags: list[str], source_path: Path, target: Path) -> None:
    """Compile into a temporary file beside `target`, then rename it into place (a reader never loads half)."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    proc = subprocess.run([cxx, *flags, str(source_path), "-o", tmp], capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise KernelUnavailable(f"compiling {source_path.name} failed: {proc.stderr.strip()[:2000]}")
    os.replace(tmp, target)


@lru_cache(maxsize=1)
def adamw_library() -> ctypes.CDLL:
    """The compiled AdamW kernel (raises KernelUnavailable when it cannot be built)."""
    lib = _build(SOURCE, FLAGS, "AdamW")
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


LEAN_FLAGS = [*FLAGS, "-ffp-contract=off",
              *(["-mprefer-vector-width=512"] if platform.machine().lower() in ("x86_64", "amd64") else [])]
"""The lean kernel repeats optim/lean_adamw.py's float32 math bit for bit: no multiply-add may be fused. On x86 the
loops GCC vectorizes take 512-bit vectors where the CPU has them (bf16 moments: 1.95 ns per element on a Sapphire
Rapids core against 2.4 with GCC's default 256); the flag does nothing on a CPU without AVX-512."""


@lru_cache(maxsize=1)
def lean_library() -> ctypes.CDLL:
    """The compiled lean AdamW kernel (kernels/lean_adamw.cpp; raises KernelUnavailable when it cannot be built)."""
    lib = _build(LEAN_SOURCE, LEAN_FLAGS, "lean AdamW")
    pointer, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    # p, comp, m, v, m_scale, v_scale, g, n, index of element 0 in the stage, elements with weight decay (from
    # element 0), then the float32 constants (1-beta1, beta2, 1-beta2, eps, bc2_sqrt, step size, lr*wd, grad_coef),
    # block, the maps (values, prefix table, zero: optim/quant8.ByteCode) of exp_avg and exp_avg_sq, the noise key and
    # the threads.
    signature = [pointer] * 7 + [i64, i64, i64] + [f32] * 8 + [i32] + [pointer, pointer, i32] * 2 + \
        [ctypes.c_uint32, i32]
    for name in ("megatrain_lean_adamw_f32grad_q8", "megatrain_lean_adamw_bf16grad_q8",
                 "megatrain_lean_adamw_f32grad_bf16m", "megatrain_lean_adamw_bf16grad_bf16m"):
        fn = getattr(lib, name)
        fn.argtypes = signature
        fn.restype = None
    return lib
