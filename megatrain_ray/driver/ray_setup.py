"""What a Ray started by megatrain needs to be private to its user: a token that is never readable by
others, a temporary tree no other local user may enter, ports that no other cluster expects.

- The token (~/.ray/auth_token) is created mode 0600 before Ray reads it; Ray would write it 0644.
- Ray's temporary tree (sessions, logs, sockets, the packages of submitted jobs) goes under
  /tmp/megatrain-<uid>, mode 0700: in Ray's default /tmp/ray any local user may swap a job's package
  directory and have code run as the cluster's owner.
- Every port is a free one: a private Ray that took the dashboard agent's default port (52365) would
  make every `ray job submit` to the user's own cluster fail ("No available agent to submit job").
- Without token auth anyone who reaches a port may run code as the cluster's owner: an embedded Ray
  starts only with it, unless runtime.allow_unauthenticated says otherwise.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

from megatrain_ray.exceptions import ConfigError
from megatrain_ray.observe.log import get_logger

log = get_logger(__name__)

AUTH_MODE_ENV = "RAY_AUTH_MODE"


def token_path() -> Path:
    return Path.home() / ".ray" / "auth_token"


def ensure_private_token() -> Path:
    """~/.ray/auth_token exists and only its owner may read it; created here (mode 0600 from the first byte)
    when missing, with a token as Ray generates them."""
    path = token_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists():
        from ray._private.authentication.authentication_token_generator import (  # lazy: Ray's import time
            generate_new_authentication_token,
        )

        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            fd = -1  # another process made it just now
        if fd >= 0:
            with os.fdopen(fd, "w") as f:
                f.write(generate_new_authentication_token())
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        path.chmod(0o600)
    return path


def auth_wanted(allow_unauthenticated: bool) -> bool:
    """Whether the Ray about to start uses token auth. RAY_AUTH_MODE set to anything but `token` turns it
    off, which is refused unless runtime.allow_unauthenticated is true (then said once, as a warning)."""
    mode = os.environ.get(AUTH_MODE_ENV, "").strip().lower()
    if mode in ("", "token"):
        return True
    if not allow_unauthenticated:
        raise ConfigError(f"{AUTH_MODE_ENV}={os.environ[AUTH_MODE_ENV]!r} would start Ray without token auth: anyone "
                          "who can reach its ports could run code as you. Unset it (megatrain starts Ray with "
                          "token auth), or set runtime.allow_unauthenticated=true to accept that")
    log.warning("%s=%s: this Ray runs WITHOUT token auth (runtime.allow_unauthenticated=true)", AUTH_MODE_ENV,
                os.environ[AUTH_MODE_ENV])
    return False


def set_token_auth_mode() -> None:
    """RAY_AUTH_MODE=token for the private Ray about to start (and its processes, which inherit it). Ray turns token
    auth on by itself when the variable is unset, but then warns on every start that it did; set explicitly, it does
    the same silently. Ray's cached configuration is read again, as Ray does when it sets the mode itself."""
    os.environ[AUTH_MODE_ENV] = "token"
    from ray._raylet import Config  # lazy: Ray's import time

    Config.initialize("")


def private_directory(path: Path) -> Path:
    """`path`, a directory of this user's with mode 0700 (made so when missing; refused when another user's)."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ConfigError(f"{path} (where megatrain keeps Ray's temporary files) is not a directory of this user: "
                          "another user made it, or it is a link. Remove it, or choose another directory")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)
    return path


def private_temp_dir() -> Path:
    """/tmp/megatrain-<uid>/ray: Ray makes its own temporary directory 0777 for users sharing a machine, so the
    privacy comes from the parent, mode 0700 (short: Ray's socket paths live below it and a socket path holds
    at most 107 bytes)."""
    return private_directory(Path(f"/tmp/megatrain-{os.getuid()}")) / "ray"


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports nothing listens on now, on 127.0.0.1 (the kernel's choice). Every socket stays
    bound until all are: one at a time, the kernel may hand the same port out twice, and Ray then refuses to start
    (two of its components on one port)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


def free_port() -> int:
    """A TCP port nothing listens on now, on 127.0.0.1."""
    return free_ports(1)[0]


AGENT_PORT_KEYS = ("dashboard_agent_listen_port", "runtime_env_agent_port", "metrics_agent_port", "metrics_export_port")
"""The per-node agents' ports, which Ray otherwise puts on fixed defaults (RayParams' names)."""


def agent_ports(*others: str) -> dict[str, int]:
    """Distinct free ports for the agents (AGENT_PORT_KEYS) and for `others`."""
    keys = (*AGENT_PORT_KEYS, *others)
    return dict(zip(keys, free_ports(len(keys))))


@contextlib.contextmanager
def ray_init_ports(ports: dict[str, int]) -> Iterator[None]:
    """`ray.init` passes no agent ports to the node it starts, so the dashboard agent takes 52365: inside
    this block the node's parameters get `ports` (an internal of Ray's, guarded by
    tests/integration/test_runtime.py, which reads the ports every socket listens on)."""
    import ray._private.parameter as parameter  # lazy: Ray's import time

    original = parameter.RayParams

    class RayParamsWithPorts(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            for key, port in ports.items():
                if kwargs.get(key) is None:
                    kwargs[key] = port
            super().__init__(*args, **kwargs)

    parameter.RayParams = RayParamsWithPorts
    try:
        yield
    finally:
        parameter.RayParams = original
