"""A private Ray started by megatrain listens on 127.0.0.1 only, with token auth on."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from megatrain_ray.config.runtime_sections import RuntimeConfig
from megatrain_ray.driver.runtime import spawn, start_ray

pytestmark = pytest.mark.ray
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


@pytest.fixture(scope="module")
def private_ray_with_dashboard():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    started = start_ray(RuntimeConfig(dashboard=True, object_store_mb=128))
    assert started, "a private Ray should start when none runs"
    yield
    ray.shutdown()


def _hex_ip(text: str) -> str:
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]  # four little-endian 32-bit words
    full = b"".join(words)
    if full[:12] == b"\0" * 10 + b"\xff\xff":
        return "::ffff:" + ".".join(str(b) for b in full[12:])
    return ":".join(full[i:i + 2].hex() for i in range(0, 16, 2))


def listening_sockets() -> list[tuple[str, int, int]]:
    """(ip, port, pid) of every TCP socket in LISTEN state, read from /proc (no extra tools)."""
    inodes = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for line in list(f)[1:]:
                parts = line.split()
                if parts[3] == "0A":
                    ip, port = parts[1].split(":")
                    inodes[parts[9]] = (_hex_ip(ip), int(port, 16))
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    out.append((*inodes[target[8:-1]], int(pid)))
        except OSError:
            continue
    return out


def _is_ray_process(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return pid == os.getpid() or "ray" in cmd


def _private_ray_tree() -> set[int]:
    """The processes of this test's private Ray: those ray.init started and everything below them."""
    from megatrain_ray.driver.runtime import private_ray_pids

    tree: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat_line = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        tree.setdefault(int(stat_line.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = set(), [*private_ray_pids(), os.getpid()]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += tree.get(pid, [])
    return found


def test_every_ray_socket_listens_on_loopback_on_a_free_port(private_ray_with_dashboard):
    ours = [s for s in listening_sockets() if _is_ray_process(s[2])]
    assert len(ours) >= 4, f"expected the GCS, raylet, dashboard and workers to listen: {ours}"
    exposed = [s for s in ours if s[0] not in LOOPBACK]
    assert not exposed, f"Ray sockets open beyond loopback: {exposed}"
    # Ray's fixed defaults (GCS, dashboard, dashboard agent, client server) stay free for the user's own cluster.
    tree = _private_ray_tree()
    private = [s for s in listening_sockets() if s[2] in tree]
    assert len(private) >= 4, private
    assert not [s for s in private if s[1] in (6379, 8265, 52365, 10001)], private


def test_the_private_ray_keeps_its_temporary_tree_to_its_user(private_ray_with_dashboard):
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    root = session.parent.parent  # Ray makes its own temporary directory 0777; its parent keeps others out
    assert root == Path(f"/tmp/megatrain-{os.getuid()}"), session
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and root.stat().st_uid == os.getuid()
    assert not Path("/tmp/ray/session_latest").resolve() == session.resolve()


def test_token_auth_is_on_and_the_token_is_private(private_ray_with_dashboard):
    token = Path.home() / ".ray" / "auth_token"
    assert token.is_file()
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    from ray._raylet import AuthenticationMode, get_authentication_mode

    assert get_authentication_mode() == AuthenticationMode.TOKEN


def test_dashboard_needs_the_token(private_ray_with_dashboard):
    import urllib.error
    import urllib.request

    import ray

    url = "http://" + ray._private.worker._global_node.webui_url + "/api/version"
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(url, timeout=10)
    assert info.value.code in (401, 403)
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


class Echo:
    def echo(self, value: int) -> int:
        return value


def test_a_handle_offers_the_actor_methods_and_refuses_others_at_once():
    handle = spawn("local", Echo, name="echo")
    try:
        assert handle.echo(3).result() == 3
        with pytest.raises(AttributeError, match="no method 'ecko'"):
            handle.ecko(3)
    finally:
        handle.kill()
