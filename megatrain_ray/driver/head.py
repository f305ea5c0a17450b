"""`megatrain cluster start|stop|env`: a one-box Ray head set up as megatrain's private Ray is.

`start` runs `ray start --head` bound to 127.0.0.1, with token auth (the token 0600 before Ray reads it),
Ray's temporary tree under a 0700 directory of the user's, a free port for every service and agent (Ray's
usual ports where they are free), and one `numa_node_<i>` resource per NUMA node. It writes the exports
every later command needs to ~/.megatrain/cluster.env (mode 0600): `source` it in each terminal that runs
`ray job ...` or `megatrain train`. `stop` ends exactly that cluster's processes (not other Ray clusters of
the user, as `ray stop` would) and removes the file.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from megatrain_ray.driver.placement import numa_resources
from megatrain_ray.driver.ray_setup import (
    auth_wanted,
    ensure_private_token,
    free_ports,
    private_directory,
    private_temp_dir,
)
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.observe.grafana import install_dashboard
from megatrain_ray.observe.log import get_logger
from megatrain_ray.system.processes import children_map, cmdline, is_guardian
from megatrain_ray.system.topology import detect_topology

log = get_logger(__name__)

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": every Ray socket on 127.0.0.1 (driver/runtime.py)
TEMP_DIR_KEY = "MEGATRAIN_CLUSTER_DIR"
CLIENT_PORT_KEY = "MEGATRAIN_CLIENT_SERVER_PORT"
CLIENT_SERVER = b"ray.util.client.server"  # the module `ray start --head` runs as the Ray client server


def env_file() -> Path:
    return Path.home() / ".megatrain" / "cluster.env"


def cluster_temp_dir(private_parent: Path | None = None) -> Path:
    """Ray's temporary tree of the cluster: `cluster` in /tmp/megatrain-<uid> or in `private_parent`, both made
    0700 (Ray makes the tree itself 0777)."""
    if private_parent is None:
        return private_temp_dir().parent / "cluster"
    return private_directory(private_parent) / "cluster"


def _port(preferred: int, fallback: int) -> int:
    """Ray's usual port when nothing listens there, else `fallback` (a free one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            return fallback


def _cluster_processes(temp_dir: Path, client: tuple[str, str] | None = None) -> list[int]:
    """The cluster's processes: those whose command line names its temporary tree (GCS, raylet, dashboard,
    monitors), its Ray client server (`client`: the GCS address it serves and its own port; its command line names
    no temporary tree, and `ray start` leaves it to init), and every process below them (agents, workers, job
    drivers), the user's own only, guardians excepted: a guardian ends after its owner, by itself, and removes the
    owner's segments then (system/guardian.py)."""
    marker = str(temp_dir).encode()
    flags = [f"--address={client[0]}\0".encode(), f"--port={client[1]}\0".encode()] if client else []
    children = children_map()

    def belongs(pid: int) -> bool:
        line = cmdline(pid)
        return marker in line or bool(flags) and CLIENT_SERVER in line and all(f in line for f in flags)
    roots = [pid for pid in {p for kids in children.values() for p in kids}
             if pid != os.getpid() and _owned(pid) and belongs(pid)]
    found: set[int] = set()
    while roots:
        pid = roots.pop()
        if pid not in found and not is_guardian(pid):
            found.add(pid)
            roots += children.get(pid, [])
    return sorted(found)


def _owned(pid: int) -> bool:
    """The process is this user's (another user's Ray is never ours to stop)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _recorded(key: str) -> str | None:
    """An export of the running cluster, as cluster.env records it."""
    path = env_file()
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.startswith(f"export {key}="):
                return shlex.split(line.split("=", 1)[1])[0]
    return None


def _recorded_marks() -> tuple[Path, tuple[str, str] | None]:
    """What tells the processes of the cluster cluster.env describes (_cluster_processes' arguments): its temporary
    tree (the default one where none is recorded) and its client server's GCS address and port."""
    temp_dir, address, client_port = _recorded(TEMP_DIR_KEY), _recorded("RAY_ADDRESS"), _recorded(CLIENT_PORT_KEY)
    return (Path(temp_dir) if temp_dir else cluster_temp_dir(),
            (address, client_port) if address and client_port else None)


def start(num_gpus: int | None = None, allow_unauthenticated: bool = False,
          private_parent: Path | None = None) -> dict[str, str]:
    """Start the head; the exports of cluster.env. `private_parent`: the 0700 directory holding Ray's temporary
    tree (default /tmp/megatrain-<uid>; short, as Ray's socket paths live below it)."""
    if env_file().exists() and _cluster_processes(*_recorded_marks()):
        raise ConfigError(f"a megatrain cluster already runs (see {env_file()}); stop it with `megatrain cluster "
                          "stop` first")
    token = auth_wanted(allow_unauthenticated)
    if token:
        ensure_private_token()
    temp_dir = cluster_temp_dir(private_parent)
    free = free_ports(7)  # distinct: two components on one port and Ray refuses to start
    ports = {"port": _port(6379, free[5]), "dashboard-port": _port(8265, free[6]),
             "dashboard-agent-listen-port": free[0], "dashboard-agent-grpc-port": free[1],
             "runtime-env-agent-port": free[2], "metrics-export-port": free[3], "ray-client-server-port": free[4]}
    env = {**os.environ, LOOPBACK_ENV: "0"}
    if token:
        env["RAY_AUTH_MODE"] = "token"
    env.pop("RAY_ADDRESS", None)
    command = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--disable-usage-stats",
               "--dashboard-host=127.0.0.1", f"--temp-dir={temp_dir}",
               f"--resources={json.dumps(numa_resources(detect_topology()))}",
               *(f"--{key}={value}" for key, value in ports.items())]
    if num_gpus is not None:
        command.append(f"--num-gpus={num_gpus}")
    log.info("starting the Ray head: %s", shlex.join(command))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise ConfigError(f"`ray start` failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")
    install_dashboard(temp_dir / "session_latest")
    exports = {LOOPBACK_ENV: "0", "RAY_ADDRESS": f"127.0.0.1:{ports['port']}",
               "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{ports['dashboard-port']}",
               "MEGATRAIN_METRICS_PORT": str(ports["metrics-export-port"]), TEMP_DIR_KEY: str(temp_dir),
               CLIENT_PORT_KEY: str(ports["ray-client-server-port"])}
    if token:
        exports["RAY_AUTH_MODE"] = "token"
    path = env_file()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(f"{path}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# megatrain cluster: source this in every terminal that runs ray job ... or megatrain train\n")
        f.writelines(f"export {key}={shlex.quote(value)}\n" for key, value in exports.items())
    os.replace(f"{path}.tmp", path)
    return exports


def stop(wait_s: float = 15.0) -> int:
    """End the cluster's processes (SIGTERM, then SIGKILL after `wait_s`); how many there were. The GCS last, as
    `ray stop` does: sent SIGTERM while the raylet and its agents are going down, Ray's GCS waits on a flush of its
    events that never ends and is only killed after `wait_s`; alone, it ends at once (well under a second)."""
    marks = _recorded_marks()
    pids = _cluster_processes(*marks)
    gcs = [pid for pid in pids if _is_gcs(pid)]
    deadline = time.monotonic() + wait_s
    _terminate([pid for pid in pids if pid not in gcs], marks, deadline, keep=set(gcs))
    _terminate(gcs, marks, deadline)
    for pid in _cluster_processes(*marks):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone, or no longer ours (its pid reused)
            pass
    env_file().unlink(missing_ok=True)
    return len(pids)


def _is_gcs(pid: int) -> bool:
    return os.path.basename(cmdline(pid).split(b"\0", 1)[0]) == b"gcs_server"


def _terminate(pids: list[int], marks: tuple[Path, tuple[str, str] | None], deadline: float,
               keep: set[int] = frozenset()) -> None:
    """SIGTERM to `pids`, then wait until the cluster's processes (those `marks` tell: _recorded_marks) are `keep`
    alone, or until `deadline`."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):  # gone, or no longer ours (its pid reused)
            pass
    while time.monotonic() < deadline and set(_cluster_processes(*marks)) - keep:
        time.sleep(0.1)


def exports_text() -> str:
    """cluster.env's text, for `eval "$(megatrain cluster env)"`."""
    path = env_file()
    if not path.is_file():
        raise ConfigError(f"no megatrain cluster runs ({path} does not exist): start one with `megatrain cluster start`")
    return path.read_text()
