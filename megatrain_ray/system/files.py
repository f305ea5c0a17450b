"""Files a run reads and writes: small text and JSON files read with their name in every error, paths read
from a file kept inside its directory, output directories checked before a run starts, and directories
that appear complete or not at all (exports, prepared data)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megatrain_ray.exceptions import MegatrainError, excerpt


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path` whole or not at all: written beside it (a name of this writer's own, so concurrent
    writers never share a temporary: a pid alone is not, as two containers sharing a cache can have the same pid)
    and renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_text_file(path: Path, what: str, error: type[MegatrainError], limit: int = 64 << 20) -> str:
    """A UTF-8 text file of at most `limit` bytes (a config, a manifest), refused with its name otherwise."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise error(f"{what} is {size / 2**20:.0f} MiB, more than a file of its kind holds (at most "
                        f"{limit >> 20} MiB): is it the right file?")
        data = path.read_bytes()
    except OSError as exc:
        raise error(f"{what} cannot be read: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}): "
                    "save it as UTF-8") from None


def read_json_object(path: Path, what: str, error: type[MegatrainError]) -> dict[str, Any]:
    """A JSON file holding an object (config.json, manifest.json, an index)."""
    text = read_text_file(path, what, error)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise error(f"{what} is not valid JSON ({exc}); it is damaged or not the file expected") from None
    if not isinstance(value, dict):
        raise error(f"{what} must hold a JSON object, not {type(value).__name__}")
    return value


def contained(directory: Path, name: Any, what: str, error: type[MegatrainError]) -> Path:
    """The file `name`, read from a file in `directory` (a manifest, an index), as a path kept inside
    `directory`: a relative name without `..` whose real path, symlinks followed, stays inside it. One
    exception: a Hugging Face hub snapshot (`.../snapshots/<revision>/`) links its files to the repository's
    `blobs/`, so there the link may end in that repository's blobs directory."""
    if not isinstance(name, str) or not name or "\x00" in name or os.path.isabs(name) \
            or ".." in Path(name).parts:
        raise error(f"{what}: entry {excerpt(name)} is not a relative file name inside {directory}; "
                    "the file was edited or written by another tool")
    root = directory.resolve()
    target = (root / name).resolve()
    allowed = [root]
    if root.parent.name == "snapshots":
        allowed.append(root.parent.parent / "blobs")
    if not any(target == base or base in target.parents for base in allowed):
        raise error(f"{what}: entry {name!r} leads outside {directory} (to {target}); every file it names must "
                    "be inside that directory")
    return target


def check_output_dir(path: Path, key: str, error: type[MegatrainError], need_bytes: int = 0) -> None:
    """A directory a run will create or write: not a file, not under a file, writable by this user, with
    `need_bytes` free. Checked before anything starts, so a run never fails at its first checkpoint."""
    where = f"{key}={str(path)!r}"
    if path.exists() and not path.is_dir():
        raise error(f"{where} is a file, not a directory: choose a directory path")
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing != path and not existing.is_dir():
        raise error(f"{where} lies under {str(existing)!r}, which is a file: choose a directory path")
    virtual = _virtual_filesystem(existing)
    if virtual:
        raise error(f"{where} lies on {virtual}, a virtual filesystem of the kernel where no run can write its "
                    "files: choose a directory on a disk")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise error(f"{where}: {str(existing)!r} is not writable by this user; choose a directory you may write "
                    "or fix its permissions")
    if need_bytes:
        free = shutil.disk_usage(existing).free
        if free < need_bytes:
            raise error(f"{where}: {free / 1e9:.2f} GB free on its disk, the run needs {need_bytes / 1e9:.2f} GB "
                        "there; free space or choose another disk")


# Filesystems that show the kernel's state (root may "write" to some of them), never a place for files.
VIRTUAL_FILESYSTEMS = {"proc", "sysfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "pstore",
                       "bpf", "configfs", "mqueue", "binfmt_misc", "fusectl", "efivarfs", "selinuxfs"}


def _virtual_filesystem(path: Path) -> str:
    """'<mount point> (<type>)' when `path` lies on a virtual filesystem (/proc, /sys), else ''."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
        real = str(path.resolve())
    except OSError:
        return ""
    best, kind = "", ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return f"{best} ({kind})" if kind in VIRTUAL_FILESYSTEMS else ""


def refuse_existing(out: Path, error: type[MegatrainError], what: str) -> None:
    """A result directory is never overwritten: it must not exist, or be empty."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise error(f"{what} {str(out)!r} already exists and is not empty; choose another directory or remove it")


@contextmanager
def atomic_directory(out: Path, error: type[MegatrainError], what: str) -> Iterator[Path]:
    """Yields a temporary sibling of `out` to fill; it is renamed to `out` when the block succeeds and
    removed when it fails, so a reader never sees half a result."""
    refuse_existing(out, error, what)
    check_output_dir(out, what, error)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def shared_file_mode() -> int:
    """The mode a new file of this process gets (0o666 less its umask, read from /proc so that nothing changes it):
    for files made private by the writer (safetensors 0.8's save_file creates 0600) that belong in a directory to
    share, such as an export."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o644


def lock_is_held(path: str | os.PathLike) -> bool | None:
    """Whether some process holds a `flock` on the file at `path` (shared or exclusive): True or False; None when
    the file is gone. The kernel drops a lock when its process ends, however it ends, so a lock file tells a live
    writer from a dead one where a process id cannot (another PID namespace, a reused pid)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def tree_bytes(path: Path) -> int:
    """Disk bytes the files under `path` take (allocated blocks, as `du` counts them); 0 when it does not exist."""
    if path.is_file():
        return path.stat().st_blocks * 512
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:  # removed meanwhile
                pass
    return total
