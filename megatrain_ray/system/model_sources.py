"""Where a model comes from: a local Hugging Face directory, a hub name, or a GGUF file.

    model.path / prepare --tokenizer
      a directory            -> used as it is
      owner/name             -> huggingface_hub snapshot (HF_HOME, HF_HUB_OFFLINE and revision honoured):
                                config, JSON and tokenizer files first (enough for `plan` and `prepare`),
                                safetensors weights only when a run loads them (`fetch_weights`)
      FILE.gguf              -> converted once (transformers reads GGUF, dequantized to float32) into a
                                cached Hugging Face directory under `cache_root()/gguf/`

Only safetensors, JSON and tokenizer files are downloaded: no pickled weights ever.

A GGUF conversion writes into a hidden temporary directory beside its target
(`.<target>.<pid>.<random>.converting`) and renames it into place. The converting process holds an exclusive
`flock` on a lock file inside it until then; the kernel drops the lock however the process ends. Every
conversion first removes the temporary directories whose lock nobody holds (a driver killed mid-conversion
leaves a directory as large as the model), and those without a lock file (older versions) once they are a day
old; a conversion in progress, in this process namespace or another sharing the cache, keeps its lock and
its directory. Only one process converts a given file at a time: another that asks for it meanwhile waits for
that conversion and uses it (`_one_conversion_of`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from megatrain_ray.exceptions import CheckpointError, MegatrainError, excerpt
from megatrain_ray.extras import install_hint
from megatrain_ray.observe.log import get_logger
from megatrain_ray.system.files import lock_is_held, tree_bytes, write_atomic

log = get_logger(__name__)

HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
CONFIG_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"]
WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]


def cache_root() -> Path:
    """$MEGATRAIN_CACHE, else $XDG_CACHE_HOME/megatrain, else ~/.cache/megatrain."""
    if os.environ.get("MEGATRAIN_CACHE"):
        return Path(os.environ["MEGATRAIN_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "megatrain"


def resolve_model_dir(spec: str, where: str, base_dir: Path, revision: str | None,
                      error: type[MegatrainError]) -> str:
    """A local Hugging Face model directory for `spec` (a directory, a hub name or a .gguf file).
    `where` names the setting in errors; relative paths are tried beside `base_dir`, then here."""
    local = _local_path(spec, base_dir)
    if local is not None:
        if revision:
            raise error(f"{where}={spec!r} is a local path; a revision ({revision!r}) only applies to a hub name: "
                        "remove the revision")
        if local.is_dir():
            return str(local)
        if local.is_file() and local.suffix.lower() == ".gguf":
            return str(gguf_to_hf_dir(local, where, error))
        raise error(f"{where}={spec!r} is a file but not a .gguf model; give a Hugging Face model directory, "
                    "a hub name (owner/name) or a .gguf file")
    if HUB_NAME.match(spec):
        return hub_snapshot(spec, revision, CONFIG_PATTERNS, where, error)
    raise error(f"{where}={spec!r} does not exist; give a Hugging Face model directory, a hub name such as "
                "Qwen/Qwen2.5-0.5B-Instruct, or a .gguf file")


def _local_path(spec: str, base_dir: Path) -> Path | None:
    path = Path(spec).expanduser()
    candidates = [path] if path.is_absolute() else [base_dir / path, Path.cwd() / path]
    for candidate in candidates:
        if candidate.exists():
            return candidate.resolve()
    return None


def hub_snapshot(name: str, revision: str | None, patterns: list[str], where: str,
                 error: type[MegatrainError], repo_type: str = "model") -> str:
    """The local snapshot directory of hub repository `name` holding the files `patterns` match
    (downloaded unless cached; HF_HOME, HF_TOKEN and HF_HUB_OFFLINE honoured); one clear error otherwise."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise error(f"{where}={name!r} is no local path; hub names need huggingface_hub: "
                    f"{install_hint('hf')}") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    at = f" at revision {revision!r}" if revision else ""
    try:
        return snapshot_download(name, revision=revision, allow_patterns=patterns, repo_type=repo_type)
    except GatedRepoError:
        raise error(f"{where}={name!r} is a gated repository: accept its license on the hub and log in "
                    "(hf auth login or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise error(f"{where}={name!r}: the hub has no revision {revision!r}; give a branch, tag or commit "
                    "that exists") from None
    except RepositoryNotFoundError:
        raise error(f"{where}={name!r} is no local path, and the hub has no such repository (or it is private: "
                    "log in with hf auth login or HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        why = "while HF_HUB_OFFLINE is set" if offline else "and the hub could not be reached"
        raise _unreachable(error(
            f"{where}={name!r} is no local path, and as a hub name it is not in the hub cache{at} "
            f"({_hub_cache_dir()}) {why}; download it where there is a network (hf download {name}"
            f"{' --repo-type dataset' if repo_type == 'dataset' else ''}), or give a local directory"), name) from None
    except Exception as exc:  # network and HTTP errors vary with huggingface_hub's backend
        raise _unreachable(error(f"{where}={name!r}: the hub download failed: {excerpt(str(exc), 300)}"),
                           name) from None


def _unreachable(exc: MegatrainError, name: str) -> MegatrainError:
    """`exc`, marked as a hub repository that could not be had (`hub_name`): `megatrain plan` adds its offline
    alternative."""
    exc.hub_name = name  # type: ignore[attr-defined]
    return exc


def _hub_cache_dir() -> str:
    try:
        from huggingface_hub import constants
        return str(constants.HF_HUB_CACHE)
    except ImportError:
        return "~/.cache/huggingface/hub"


def _snapshot_repo(model_dir: Path) -> tuple[str, str] | None:
    """(repo id, commit) when `model_dir` is a hub cache snapshot: .../models--owner--name/snapshots/<commit>."""
    if model_dir.parent.name != "snapshots" or not model_dir.parent.parent.name.startswith("models--"):
        return None
    owner_name = model_dir.parent.parent.name[len("models--"):]
    if "--" not in owner_name:
        return None
    owner, name = owner_name.split("--", 1)
    return f"{owner}/{name}", model_dir.name


def _has_weights(model_dir: Path) -> bool:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            return True  # HFDirectory reports a broken index with its own error
        return all((model_dir / n).is_file() for n in names)
    return any(model_dir.glob("*.safetensors"))


def fetch_weights(model_dir: str) -> None:
    """Bring a hub snapshot's safetensors weights into the cache when a run is about to load them
    (plan and prepare never need them). A local directory is left as it is."""
    path = Path(model_dir)
    repo = _snapshot_repo(path)
    if repo is None or _has_weights(path):
        return
    name, commit = repo
    log.info("downloading the safetensors weights of %s (%s) into the hub cache", name, commit[:12])
    hub_snapshot(name, commit, WEIGHT_PATTERNS, "model.path", CheckpointError)
    if not _has_weights(path):
        raise CheckpointError(f"model.path {name!r} ({path}) has no safetensors weights in the hub cache and none "
                              f"could be downloaded; run `hf download {name}` where there is a network")


# ----------------------------------------------------------------------------- GGUF


def gguf_to_hf_dir(gguf: Path, where: str, error: type[MegatrainError]) -> Path:
    """The cached Hugging Face directory of a GGUF file, converted on first use (float32 weights,
    config.json, tokenizer with its chat template). Keyed by the file's contents, so every checkout and
    environment holding the same file shares one conversion."""
    target = cache_root() / "gguf" / f"{gguf.stem}-{_content_key(gguf)}"
    if (target / "config.json").is_file():
        if not (target / GGUF_ORIGIN).is_file():  # converted before the origin was recorded: record it now
            try:
                write_atomic(target / GGUF_ORIGIN, json.dumps(_gguf_origin(gguf), indent=2))
            except Exception as exc:  # gguf missing or the file unreadable: the export stays float32, as before
                log.debug("could not record %s's GGUF types: %s", gguf, exc)
        return target
    try:
        import accelerate  # noqa: F401
        import gguf as _gguf  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise error(f"{where}={str(gguf)!r}: reading GGUF needs transformers, gguf and accelerate: "
                    f"{install_hint('gguf')}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    with _one_conversion_of(target, gguf):
        if (target / "config.json").is_file():  # converted by the process this one waited for
            return target
        sweep_stale_conversions(target.parent)
        log.info("converting %s into a Hugging Face directory at %s (once; dequantized to float32)", gguf, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=CONVERTING, dir=target.parent))
        # Locked under another name, then renamed: no sweeper ever sees the lock file unlocked.
        lock = os.open(tmp / (CONVERSION_LOCK + ".new"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            os.rename(tmp / (CONVERSION_LOCK + ".new"), tmp / CONVERSION_LOCK)
            _convert_gguf(gguf, tmp, where, error)
            try:
                os.rename(tmp, target)  # the lock file comes along, still held, and goes below
            except OSError:  # another process converted the same file meanwhile (one of an older version)
                if not (target / "config.json").is_file():
                    raise
            else:
                (target / CONVERSION_LOCK).unlink(missing_ok=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            os.close(lock)
    return target


TURN = ".turn"


@contextlib.contextmanager
def _one_conversion_of(target: Path, gguf: Path) -> Iterator[None]:
    """One process at a time converts into `target`: an exclusive flock on `.<target>.turn` beside it, so a second
    process asking for the same file (a `train` started while `prepare` converts) waits and reuses the first one's
    conversion instead of doing it again. The holder removes the file before it lets go; a waiter that then gets
    the lock of a removed file opens the new one and waits again."""
    path = target.parent / f".{target.name}{TURN}"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("waiting for another process converting %s into %s", gguf, target)
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
        except BaseException:  # interrupted while waiting: the descriptor goes, its lock (if taken) with it
            os.close(fd)
            raise
        if current:
            break
        os.close(fd)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


GGUF_ORIGIN = "megatrain-gguf-origin.json"
"""Beside a converted GGUF's config.json: the file it came from and how many of its matrices each GGUF type holds
(facts only; model/hf_io.gguf_export_dtype decides the export's dtype from them). The weights here are float32
(dequantized) and config.json says so."""
CONVERTING = ".converting"
CONVERSION_LOCK = ".lock"
UNLOCKED_STALE_SECONDS = 24 * 3600
"""A temporary directory without a lock file (an older version's, or one a second old) is removed once it is this
old."""
_OLD_TEMPORARY = re.compile(r"^\..+-[0-9a-f]{16}\.[a-z0-9_]{8}$")  # tempfile.mkdtemp(prefix=".<target>.")


def _abandoned(lock_path: Path) -> bool:
    """Nobody holds the lock of this conversion's lock file (False when the file went: its conversion finished)."""
    return lock_is_held(lock_path) is False


def sweep_stale_conversions(directory: Path) -> int:
    """Remove the temporary directories of GGUF conversions in `directory` that no process is writing (see the
    module docstring); the count removed."""
    removed = 0
    for entry in directory.iterdir():
        if not entry.name.startswith(".") or entry.is_symlink() or not entry.is_dir():
            continue
        if entry.name.endswith(CONVERTING) and (entry / CONVERSION_LOCK).exists():
            stale = _abandoned(entry / CONVERSION_LOCK)
        elif entry.name.endswith(CONVERTING) or _OLD_TEMPORARY.match(entry.name):
            try:
                stale = time.time() - entry.stat().st_mtime > UNLOCKED_STALE_SECONDS
            except FileNotFoundError:  # renamed or removed meanwhile
                continue
        else:
            continue
        if stale:
            size = tree_bytes(entry)
            shutil.rmtree(entry, ignore_errors=True)
            log.warning("removed %s (%.0f MB), left by a GGUF conversion that stopped before it finished", entry,
                        size / 1e6)
            removed += 1
    return removed


def _content_key(path: Path) -> str:
    """16 hex digits of the file's SHA-256 (a 100 MB GGUF reads in well under a second)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, gguf's reader made once per file and its tensor-name map once per architecture and depth.
    transformers parses a GGUF file's metadata (the whole vocabulary) again for the tokenizer, the config and the
    weights, and builds the tensor-name map again for every tensor: SmolLM2-135M's conversion took 28 s on 2 cores,
    25 s of them there. transformers imports both names from gguf when it calls them, so they are swapped here."""
    import gguf as gguf_package

    reader, name_map = gguf_package.GGUFReader, gguf_package.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def cached_reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf_package.GGUFReader = cached_reader
    gguf_package.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf_package.GGUFReader, gguf_package.get_tensor_name_map = reader, name_map


def _convert_gguf(gguf: Path, out: Path, where: str, error: type[MegatrainError]) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            try:  # transformers read it through the same reader, so this does not fail in practice
                origin = _gguf_origin(gguf)
            except Exception as exc:
                log.warning("could not list %s's matrix types (%s): its export defaults to float32", gguf, exc)
                origin = {"gguf_file": gguf.name, "matrix_types": {}}
    except Exception as exc:  # transformers raises many kinds for files it cannot read
        raise error(f"{where}={str(gguf)!r}: transformers cannot read this GGUF file: {excerpt(str(exc), 300)}") \
            from None
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_atomic(out / GGUF_ORIGIN, json.dumps(origin, indent=2))
    tokenizer.save_pretrained(out)


def _gguf_origin(gguf: Path) -> dict:
    """GGUF_ORIGIN's contents: the file's name and the count of each GGUF type among its matrices (2-D or more;
    norms and biases stay F32 in every quantized file)."""
    import gguf as gguf_package

    types: dict[str, int] = {}
    for tensor in gguf_package.GGUFReader(gguf).tensors:
        if len(tensor.shape) >= 2:
            types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    return {"gguf_file": gguf.name, "matrix_types": types}
