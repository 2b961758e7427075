"""Where a node listens when no address is given, and a bind host that does not resolve.

With anonymous access on (no ``auth.password_file``) and neither ``--bind`` nor a bind key in
the file, the node listens on 127.0.0.1 only, as Mosquitto 2 does until a configuration opens
it, and says so in one line; an explicit address, or authentication, opens it as before. The
tests run real ``meshmq serve`` processes and connect over TCP: to 127.0.0.1 (must work) and to
another address of this machine (must be refused while the node is loopback only).
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import WAIT, wait_for
from meshmq.mqtt.codec import encode_packet
from meshmq.mqtt.packets import Connect

WORKERS = [1, 2]  # one process, and a supervisor that holds the ports for its workers
LOCAL_ONLY = "listening on 127.0.0.1 only"


def other_local_address() -> str:
    """An IPv4 address of this machine that is not 127.0.0.1: a non-loopback interface's
    (``ip -4 addr``), else 127.0.0.2. Every 127.0.0.0/8 address reaches this machine (Linux
    routes the whole block to ``lo``) and a socket bound to 127.0.0.1 does not accept on it,
    while one bound to 0.0.0.0 does, so the test means the same on a loopback-only machine."""
    ip = shutil.which("ip")
    if ip is not None:
        lines = subprocess.run([ip, "-4", "-o", "addr", "show"], capture_output=True,
                               text=True, timeout=WAIT).stdout.splitlines()
        for line in lines:
            fields = line.split()
            if "inet" in fields:
                address = fields[fields.index("inet") + 1].split("/")[0]
                if not ipaddress.ip_address(address).is_loopback:
                    return address
    return "127.0.0.2"


def connack_code(host: str, port: int) -> int:
    """CONNECT (3.1.1) to ``host:port``; the CONNACK's return code. ConnectionRefusedError
    when nothing listens there."""
    with socket.create_connection((host, port), timeout=WAIT) as sock:
        sock.sendall(encode_packet(Connect("bind-probe", 4, keep_alive=60), 4))
        reply = b""
        while len(reply) < 4:
            chunk = sock.recv(4 - len(reply))
            assert chunk, f"{host}:{port} closed the connection before CONNACK"
            reply += chunk
        assert reply[0] == 0x20, reply  # CONNACK
        return reply[3]


def refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=WAIT).close()
    except ConnectionRefusedError:
        return True
    return False


class Node:
    """A ``meshmq serve`` process started *without* ``--bind`` unless the flags give one."""

    def __init__(self, tmp_path: Path, config: str, flags: list[str], workers: int) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.port_file = tmp_path / "port"
        self.log_path = tmp_path / "broker.log"
        config_file = tmp_path / "meshmq.toml"
        config_file.write_text(config)
        cmd = [sys.executable, "-m", "meshmq", "serve", "--config", str(config_file),
               "--port", "0", "--data-dir", str(tmp_path / "data"), "--port-file",
               str(self.port_file), "--workers", str(workers), *flags]
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        wait_for(self.ready, what="the node to listen")
        first, *named = self.port_file.read_text().split()
        self.ports = {"tcp": int(first)} | {
            name: int(port) for name, port in (line.split("=") for line in named)}

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"meshmq serve exited with {self.proc.returncode}:\n{self.log()}")
        return self.port_file.exists() and self.port_file.read_text().strip() != ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=WAIT)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[Node]]:
    started: list[Node] = []
    yield started
    for node in started:
        node.stop()


def start(nodes: list[Node], tmp_path: Path, config: str = "", flags: list[str] | None = None,
          workers: int = 1) -> Node:
    node = Node(tmp_path / f"node{len(nodes)}", config, flags or [], workers)
    nodes.append(node)
    return node


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "passwords"
    added = subprocess.run([sys.executable, "-m", "meshmq", "passwd", "add", str(path), "alice",
                            "--password-stdin"], input="wonderland\n", capture_output=True,
                           text=True, timeout=60)
    assert added.returncode == 0, added.stderr
    return path


# ---------------------------------------------------------------------- the default


@pytest.mark.parametrize("workers", WORKERS)
def test_an_anonymous_node_without_a_bind_listens_on_loopback_only(
    nodes: list[Node], tmp_path: Path, workers: int,
) -> None:
    """`make serve` (no file, no --bind): reachable here, refused from another address; the
    WebSocket listener, which has no bind of its own either, follows server.bind."""
    node = start(nodes, tmp_path, "[ws]\nenabled = true\nport = 0\n", workers=workers)
    other = other_local_address()
    assert connack_code("127.0.0.1", node.ports["tcp"]) == 0
    for name in ("tcp", "ws"):
        assert refused(other, node.ports[name]), f"{name} accepts on {other}"
    log = node.log()
    lines = [line for line in log.splitlines() if LOCAL_ONLY in line]
    assert len(lines) == 1, log  # once per node, whatever the number of workers
    assert "--bind 0.0.0.0" in lines[0] and "server.bind" in lines[0]
    assert "auth.password_file" in lines[0]
    assert "bind=127.0.0.1 " in log  # the started line says where
    assert "ANONYMOUS ACCESS IS ON" not in log  # nothing beyond loopback to warn about


@pytest.mark.parametrize(("config", "flags"), [
    ("", ["--bind", "0.0.0.0"]),
    ('[server]\nbind = "0.0.0.0"\n', []),
], ids=["flag", "file"])
def test_an_explicit_bind_listens_where_it_says(
    nodes: list[Node], tmp_path: Path, config: str, flags: list[str],
) -> None:
    node = start(nodes, tmp_path, config, flags)
    assert connack_code(other_local_address(), node.ports["tcp"]) == 0
    assert connack_code("127.0.0.1", node.ports["tcp"]) == 0
    log = node.log()
    assert LOCAL_ONLY not in log
    assert "ANONYMOUS ACCESS IS ON" in log  # open to all, without authentication: said loudly


def test_an_explicit_loopback_bind_is_not_announced_as_a_default(
    nodes: list[Node], tmp_path: Path,
) -> None:
    node = start(nodes, tmp_path, flags=["--bind", "127.0.0.1"])
    assert refused(other_local_address(), node.ports["tcp"])
    assert LOCAL_ONLY not in node.log()


def test_with_a_password_file_the_default_is_every_interface(
    nodes: list[Node], tmp_path: Path, password_file: Path,
) -> None:
    """Authentication configured: no client gets in anonymously, so the node opens up as it
    always did (server.bind empty = 0.0.0.0 then)."""
    node = start(nodes, tmp_path, f'[auth]\npassword_file = "{password_file}"\n')
    assert connack_code(other_local_address(), node.ports["tcp"]) == 5  # not authorized
    log = node.log()
    assert LOCAL_ONLY not in log and "bind=0.0.0.0 " in log



# ---------------------------------------------------------------------- an unresolvable host


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize(("config", "flags", "key"), [
    ("", ["--bind", "no-such-host.invalid"], "server.bind"),
    ('[server]\nbind = "no-such-host.invalid"\n', [], "server.bind"),
    ('[ws]\nenabled = true\nport = 0\nbind = "no-such-host.invalid"\n', ["--bind", "127.0.0.1"],
     "ws.bind"),
    ('[admin]\nlisten = "no-such-host.invalid:0"\napi_key = "k"\n', ["--bind", "127.0.0.1"],
     "admin.listen"),
], ids=["flag", "file", "ws", "admin"])
def test_a_bind_host_that_does_not_resolve_is_a_configuration_error(
    tmp_path: Path, config: str, flags: list[str], key: str, workers: int,
) -> None:
    config_file = tmp_path / "meshmq.toml"
    config_file.write_text(config)
    result = subprocess.run(
        [sys.executable, "-m", "meshmq", "serve", "--config", str(config_file), "--port", "0",
         "--data-dir", str(tmp_path / "data"), "--workers", str(workers), *flags],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and " ERROR " in lines[0], result.stderr
    assert lines[0].split(" ERROR ", 1)[1].startswith(
        f"meshmq.server {key}: cannot resolve 'no-such-host.invalid' (")
