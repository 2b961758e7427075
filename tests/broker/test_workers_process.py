"""``server.workers = N``: the supervisor process, its workers, ports, signals and restarts."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import BrokerProcess, start_broker, wait_for
from meshmq.cluster.spec import resolve_workers
from meshmq.config import load_config
from meshmq.logsetup import configure_logging, set_worker
from meshmq.node.supervisor import CrashHistory, ReservationError, reserve_ports
from rawclient import RawClient

STARTED = re.compile(r"workers started count=(\d+) pids=([\d,]+) port=(\d+)")


def children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (every thread's children)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found.update(int(child) for child in (task / "children").read_text().split())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return {child for child in found if not is_gone(child)}


def is_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: it runs no more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def started_pids(broker: BrokerProcess) -> list[int]:
    """The worker pids, in index order, from the supervisor's started line."""
    match = wait_for(lambda: STARTED.search(broker.log()), what="the started line")
    return [int(pid) for pid in match.group(2).split(",")]


def connect_many(port: int, count: int, prefix: str) -> None:
    """``count`` MQTT connections, each CONNECTed and accepted, then closed."""
    for number in range(count):
        with RawClient(port) as raw:
            assert raw.connect(f"{prefix}-{number}").reason_code == 0


def connected_workers(log_text: str, prefix: str) -> set[str]:
    """Indexes of the workers that logged a connect of a client named ``prefix-*``."""
    pattern = rf"client connected client_id={prefix}-\d+ .*worker=(\d+)"
    return set(re.findall(pattern, log_text))


@pytest.fixture
def two_workers(tmp_path: Path) -> Iterator[BrokerProcess]:
    broker = start_broker(tmp_path, workers=2)
    yield broker
    broker.stop(signal.SIGKILL)


def test_two_workers_share_one_port_until_sigterm(two_workers: BrokerProcess) -> None:
    broker = two_workers
    pids = started_pids(broker)
    assert len(pids) == 2 and children(broker.proc.pid) == set(pids)
    port_file = broker.log_path.parent / "port"
    assert port_file.read_text() == f"{broker.port}\ntcp={broker.port}\n"
    connect_many(broker.port, 40, "spread")
    wait_for(lambda: connected_workers(broker.log(), "spread") == {"0", "1"},
             what="connects served by both workers")
    broker.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: set(re.findall(r"SIGHUP: reloading worker=(\d)", broker.log())) == {"0", "1"},
             what="both workers to reload")
    assert broker.stop(signal.SIGTERM) == 0
    assert all(is_gone(pid) for pid in pids)
    assert "Traceback" not in broker.log()


def test_a_killed_worker_is_restarted(two_workers: BrokerProcess) -> None:
    broker = two_workers
    leader, other = started_pids(broker)
    os.kill(leader, signal.SIGKILL)

    def replaced() -> set[int]:
        kids = children(broker.proc.pid)
        return kids if len(kids) == 2 and leader not in kids else set()

    assert other in wait_for(replaced, what="a new worker")
    wait_for(lambda: "worker restarted index=0" in broker.log(), what="the restart line")
    text = broker.log()
    assert f"worker exited unexpectedly index=0 pid={leader} status=signal:SIGKILL" in text
    connect_many(broker.port, 40, "after")
    wait_for(lambda: "0" in connected_workers(broker.log(), "after"),
             what="the restarted worker to serve a connect")
    assert broker.stop(signal.SIGTERM) == 0


def test_killing_the_supervisor_takes_the_workers_down(two_workers: BrokerProcess) -> None:
    broker = two_workers
    pids = started_pids(broker)
    broker.proc.kill()
    broker.proc.wait()
    wait_for(lambda: all(is_gone(pid) for pid in pids), what="the workers to die")


def serve(tmp_path: Path, config: str, *args: str) -> subprocess.CompletedProcess[str]:
    config_file = tmp_path / "meshmq.toml"
    config_file.write_text(config)
    return subprocess.run(
        [sys.executable, "-m", "meshmq", "serve", "--config", str(config_file), "--port", "0",
         "--bind", "127.0.0.1", "--data-dir", str(tmp_path / "data"), *args],
        capture_output=True, text=True, timeout=30,
    )


def test_bad_password_file_exits_2_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad-passwords"
    path.write_text("alice:$argon2id$ok\nthis line is wrong\n")
    result = serve(tmp_path, f'[auth]\npassword_file = "{path}"\n', "--workers", "2")
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and f"{path}:2" in lines[0], result.stderr


def damage_state_of_worker_1(data: Path) -> None:
    (data / "state-1").mkdir(parents=True)
    (data / "state-1" / "snapshot.json").write_text("not json")


def log_with_other_partitions(data: Path) -> None:  # only worker 0 opens the log
    (data / "log").mkdir(parents=True)
    meta = {"format": "meshmq-log", "format_version": 1, "partitions": 3}
    (data / "log" / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(("damage", "code", "expected"), [
    (damage_state_of_worker_1, 1, "cannot read the broker state"),
    (log_with_other_partitions, 2, "was created with 3 partitions"),
])
def test_a_worker_that_cannot_start_stops_the_node_with_its_status(
    tmp_path: Path, damage, code: int, expected: str,
) -> None:
    damage(tmp_path / "data")
    result = serve(tmp_path, "", "--workers", "2")
    assert result.returncode == code
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and expected in errors[0], result.stderr
    if code == 1:  # worker 1's own state: that worker says it
        assert errors[0].endswith("worker=1")
    else:  # the node's log: the supervisor opens it before any worker starts
        assert " meshmq.supervisor " in errors[0] and "worker=" not in errors[0]


def test_workers_0_means_one_per_cpu(tmp_path: Path) -> None:
    expected = resolve_workers(0)
    if expected == 1:
        pytest.skip("one CPU: workers = 0 runs a single process")
    broker = start_broker(tmp_path, "[log]\nenabled = false\n", workers=0)
    try:
        match = wait_for(lambda: STARTED.search(broker.log()), what="the started line")
        assert int(match.group(1)) == expected == len(children(broker.proc.pid))
    finally:
        code = broker.stop(signal.SIGTERM)
    assert code == 0


def second_node(tmp_path: Path, port: int, workers: int) -> tuple[int, list[str]]:
    """Start ``meshmq serve`` on ``port`` (already in use); return its exit status and error
    lines once it stops by itself. A node that starts instead (shares the port) fails."""
    log_path = tmp_path / f"second-{workers}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshmq", "serve", "--port", str(port), "--bind",
             "127.0.0.1", "--data-dir", str(tmp_path / f"second-{workers}"), "--workers",
             str(workers)], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: proc.poll() is not None or "listening bind=" in log_path.read_text(),
                 what="the second node to stop or to listen")
        if proc.poll() is None:
            pytest.fail(f"a second node started on port {port}, in use:\n{log_path.read_text()}")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    errors = [line for line in log_path.read_text().splitlines() if " ERROR " in line]
    return proc.returncode, errors


def in_use(port: int) -> str:
    return f"cannot listen listener=tcp bind=127.0.0.1 port={port} error=Address already in use"


@pytest.mark.parametrize("workers", [1, 2])  # 1: the comparison, as it always was
def test_a_port_of_another_node_stops_a_second_node_as_with_one_worker(
    tmp_path: Path, two_workers: BrokerProcess, workers: int,
) -> None:
    code, errors = second_node(tmp_path, two_workers.port, workers)
    assert code == 1
    assert len(errors) == 1 and errors[0].endswith(in_use(two_workers.port)), errors
    connect_many(two_workers.port, 10, "first-node")  # the first node keeps every connection
    wait_for(lambda: len(re.findall(r"client connected client_id=first-node-",
                                    two_workers.log())) == 10, what="the first node's connects")


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("reuse_port", [False, True])
def test_a_plain_listening_socket_stops_a_node_as_with_one_worker(
    tmp_path: Path, workers: int, reuse_port: bool,
) -> None:
    """Another program's listener, with or without SO_REUSEPORT (same user, so the kernel
    would let a SO_REUSEPORT socket share its port)."""
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(reuse_port))
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, errors = second_node(tmp_path, port, workers)
    assert code == 1
    assert len(errors) == 1 and errors[0].endswith(in_use(port)), errors


# ---------------------------------------------------------------------- in-process parts


def test_reserved_ports_are_concrete_and_not_listening() -> None:
    config = load_config(None, {"server.bind": "127.0.0.1", "server.port": 0,
                                "ws.enabled": True, "ws.port": 0})
    worker_config, sockets = reserve_ports(config)
    try:
        tcp, ws = worker_config.server.port, worker_config.ws.port
        assert tcp and ws and tcp != ws
        assert [sock.getsockname()[1] for sock in sockets] == [tcp, ws]
        with pytest.raises(ConnectionRefusedError):  # bound, not listening
            socket.create_connection(("127.0.0.1", tcp), timeout=5).close()
    finally:
        for sock in sockets:
            sock.close()


def test_reservation_handles_ipv6() -> None:
    try:
        probe = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("no IPv6 loopback")
    worker_config, sockets = reserve_ports(load_config(None, {"server.bind": "::1",
                                                              "server.port": 0}))
    try:
        assert sockets[0].family == socket.AF_INET6 and worker_config.server.port != 0
    finally:
        sockets[0].close()


def test_a_port_in_use_is_one_line_naming_the_listener() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = load_config(None, {"server.bind": "127.0.0.1", "server.port": port})
        with pytest.raises(ReservationError) as caught:
            reserve_ports(config)
    message = str(caught.value)
    assert "\n" not in message
    assert f"listener=tcp bind=127.0.0.1 port={port} error=" in message


def test_a_port_reserved_by_another_node_is_refused_while_no_worker_listens() -> None:
    """Another node holds its ports between start and ready, and while its workers restart:
    its reservation alone (nothing listening) makes the check fail."""
    first_config, first = reserve_ports(load_config(None, {"server.bind": "127.0.0.1",
                                                           "server.port": 0}))
    port = first_config.server.port
    try:
        with pytest.raises(ReservationError) as caught:
            reserve_ports(load_config(None, {"server.bind": "127.0.0.1", "server.port": port}))
        assert str(caught.value) == in_use(port)
    finally:
        first[0].close()


def worker_listener(port: int) -> socket.socket:
    """A socket set up as a worker's listener (asyncio: SO_REUSEADDR + SO_REUSEPORT)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_workers_and_a_restarted_worker_listen_on_the_reserved_port() -> None:
    worker_config, sockets = reserve_ports(load_config(None, {"server.bind": "127.0.0.1",
                                                              "server.port": 0}))
    port = worker_config.server.port
    try:
        with worker_listener(port), worker_listener(port):
            pass  # both workers listen; then both are gone (crashed)
        with worker_listener(port) as restarted:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            restarted.accept()[0].close()
    finally:
        sockets[0].close()


def test_closed_connections_of_a_previous_listener_do_not_block_the_reservation() -> None:
    """TIME_WAIT leftovers of a listener without SO_REUSEPORT (a one-worker node stopped a
    moment ago) hold the port against a bind without SO_REUSEADDR; the node starts anyway,
    as a one-worker node would."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        listener.accept()[0].close()  # the server side closes first: it keeps TIME_WAIT
        assert client.recv(1) == b""
        client.close()

    def leftover_holds_the_port() -> bool:
        with socket.socket() as plain:
            try:
                plain.bind(("127.0.0.1", port))
            except OSError:
                return True
            return False

    wait_for(leftover_holds_the_port, what="the TIME_WAIT leftover")
    worker_config, sockets = reserve_ports(load_config(None, {"server.bind": "127.0.0.1",
                                                              "server.port": port}))
    sockets[0].close()
    assert worker_config.server.port == port


def test_two_listeners_on_one_address_are_refused() -> None:
    """SO_REUSEPORT would let them share the port: the config check compares the spelling,
    this one the address (``127.1`` is ``127.0.0.1``)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = load_config(None, {"server.bind": "127.0.0.1", "server.port": port,
                                "ws.enabled": True, "ws.bind": "127.1", "ws.port": port})
    with pytest.raises(ReservationError, match=r"listener=ws .* error=the port of listener tcp"):
        reserve_ports(config)


def test_crash_backoff_doubles_per_worker_and_the_budget_stops() -> None:
    history = CrashHistory(window=60.0, budget=10)
    delays = [history.record(0, float(second)) for second in range(7)]
    assert delays == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert history.record(1, 7.0) == 0.2  # another worker has its own backoff
    assert history.record(1, 8.0) == 0.4
    assert history.record(1, 9.0) == 0.8
    assert history.record(1, 10.0) is None  # the 11th crash within 60 s
    assert CrashHistory().record(0, 0.0) == 0.2
    assert history.record(0, 200.0) == 0.2  # old crashes are forgotten


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    set_worker(None)
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("restore_logging")
def test_log_lines_name_the_worker(capsys: pytest.CaptureFixture[str]) -> None:
    log = logging.getLogger("meshmq.server")
    set_worker(1)
    configure_logging("info", "text")
    log.info("listening port=%d", 1883)
    configure_logging("info", "json")
    log.info("listening")
    set_worker(None)
    log.info("supervisor")
    text, tagged, plain = capsys.readouterr().err.splitlines()
    assert text.endswith(" INFO meshmq.server listening port=1883 worker=1")
    assert json.loads(tagged)["worker"] == 1
    assert "worker" not in json.loads(plain)


# ---------------------------------------------------------------------- the mesh's doors

_KNOCK = r"""
import os, socket, struct, sys
token, index, uid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if uid:
    os.setgid(uid)
    os.setuid(uid)
text = token.encode()
body = struct.pack(">HHH", 1 - index if index < 2 else 0, 2, len(text)) + text + b"\0\0\0\0"
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(10)
sock.connect(f"\0meshmq-{token}-{index}")
got = b""
try:  # the worker may close before our HELLO is even written: a broken pipe is a refusal too
    sock.sendall(struct.pack(">IB", len(body) + 1, 1) + body)  # a valid HELLO, with the token
    while chunk := sock.recv(65536):
        got += chunk
except (TimeoutError, ConnectionError):
    pass
print(len(got))
"""


def mesh_token(pid: int) -> str:
    """The node's mesh token, read as any local user can: the abstract socket names a worker
    listens on (/proc/net/unix, the sockets of ``pid``)."""
    inodes = {os.readlink(fd).removeprefix("socket:[").rstrip("]")
              for fd in Path(f"/proc/{pid}/fd").iterdir()
              if os.readlink(fd).startswith("socket:[")}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("@meshmq-"):
            return fields[7].removeprefix("@meshmq-").rsplit("-", 1)[0]
    raise AssertionError("no mesh socket found")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to knock as another user")
def test_a_process_that_is_not_a_worker_of_the_node_cannot_join_its_mesh(
        two_workers: BrokerProcess) -> None:
    """The mesh's socket names are readable by every local user, and its HELLO checked only
    the token in that name: any local process could join and receive every publish. The
    kernel's peer credentials now decide (the node's user, a child of its supervisor)."""
    broker = two_workers
    pids = started_pids(broker)
    token = mesh_token(pids[0])
    for uid in (0, 65534):  # this test process (the node's user, not a worker), and nobody
        knock = subprocess.run([sys.executable, "-c", _KNOCK, token, "0", str(uid)],
                               capture_output=True, text=True, timeout=30)
        assert knock.returncode == 0, knock.stderr
        assert knock.stdout.strip() == "0"  # closed at once: not even our HELLO came back
    wait_for(lambda: broker.log().count("link refused") >= 2, what="the refusals logged")
    assert "uid=65534 runs as another user" in broker.log()
    assert "is not a worker of this node" in broker.log()
    connect_many(broker.port, 4, "still")  # the workers go on linked
    assert broker.stop(signal.SIGTERM) == 0


def test_a_restarting_worker_serves_while_a_peer_is_stopped(tmp_path: Path) -> None:
    """A restarting worker had to link every peer within 60 s; a SIGSTOPped peer accepts and
    never answers, so the restart failed in a loop. It now serves with the peers it reaches
    (a stopped peer's link times out its handshake) and links the other when it runs again."""
    broker = start_broker(tmp_path, workers=3)
    try:
        pids = started_pids(broker)
        os.kill(pids[2], signal.SIGSTOP)
        try:
            os.kill(pids[1], signal.SIGKILL)
            wait_for(lambda: "worker restarted index=1" in broker.log(), timeout=40,
                     what="worker 1 serving again while worker 2 is stopped")
            assert re.search(r"worker 1 serves without workers \[2\]", broker.log())
        finally:
            os.kill(pids[2], signal.SIGCONT)
        wait_for(lambda: re.search(r"linked peer=2 worker=1\b", broker.log().split(
            "worker restarted index=1", 1)[1]), timeout=30, what="worker 1 linking worker 2")
        connect_many(broker.port, 30, "after")
        assert broker.stop(signal.SIGTERM) == 0
    finally:
        broker.stop(signal.SIGKILL)  # (nothing left to stop once the test passed)
