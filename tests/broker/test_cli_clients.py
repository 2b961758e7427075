"""``meshmq pub`` and ``meshmq sub`` against a real broker: both protocol versions, TLS and
WebSocket listeners, publishes the broker refuses."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from conftest import start_broker, wait_for


def meshmq(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshmq", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.parametrize("version", ["311", "5"])
def test_pub_reaches_sub(broker, client_factory, version: str) -> None:
    port = str(broker.port)
    sub = meshmq("sub", "-p", port, "-t", "cli/#", "-q", "1", "-C", "2", "-v", "-V", version,
                 "-i", f"cli-sub-{version}")
    probe = client_factory("probe", 5)
    probe.connect(broker.port)
    probe.subscribe("cli/#", qos=1)
    wait_for(lambda: f"subscribed client_id=cli-sub-{version}" in broker.log(),
             what="meshmq sub to subscribe")
    for payload in ("one", "two"):
        pub = meshmq("pub", "-p", port, "-t", "cli/x", "-m", payload, "-q", "1", "-V", version)
        assert pub.wait(timeout=30) == 0, pub.stderr.read()
        assert probe.expect().payload == payload.encode()
    out, err = sub.communicate(timeout=30)
    assert sub.returncode == 0, err
    assert out.splitlines() == ["cli/x one", "cli/x two"]


def test_pub_to_closed_port_fails_with_one_line(tmp_path) -> None:
    import socket

    with socket.socket() as sock:  # a port that is certainly closed: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
        pub = meshmq("pub", "-p", port, "-t", "x", "-m", "y")
        assert pub.wait(timeout=30) == 1
    err = pub.stderr.read().strip().splitlines()
    assert len(err) == 1 and "cannot connect" in err[0]


def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshmq", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# ---------------------------------------------------------------------------- TLS, WebSocket

WS_PATH = "/custom/mqtt"  # not the default path, so --ws-path must be passed on


@dataclass
class Certificates:
    ca: Path
    server: tuple[Path, Path]  # for "localhost" only: 127.0.0.1 is a name it does not have
    client: tuple[Path, Path]

    def options(self, ca: Path | None = None) -> list[str]:
        """pub/sub options: trust ``ca`` (default ours), present the client certificate."""
        return ["--cafile", str(ca or self.ca), "--cert", str(self.client[0]),
                "--key", str(self.client[1])]


def write_leaf(leaf: trustme.LeafCert, directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    return cert, key


def make_certificates(directory: Path) -> Certificates:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    return Certificates(
        directory / "ca.pem",
        write_leaf(ca.issue_cert("localhost"), directory, "server"),
        write_leaf(ca.issue_cert("cli.clients.example", common_name="cli"), directory, "cli"))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory, certs: Certificates):
    """TCP, mutual TLS, WebSocket and WebSocket over TLS (mutual), WebSocket on WS_PATH."""
    config = (
        f'[tls]\nenabled = true\nport = 0\ncertfile = "{certs.server[0]}"\n'
        f'keyfile = "{certs.server[1]}"\ncafile = "{certs.ca}"\nrequire_client_cert = true\n'
        f'[ws]\nenabled = true\nport = 0\npath = "{WS_PATH}"\n'
        f'[wss]\nenabled = true\nport = 0\npath = "{WS_PATH}"\n')
    broker = start_broker(tmp_path_factory.mktemp("secure"), config, "secure")
    yield broker
    broker.stop()


@pytest.mark.parametrize("listener", ["tls", "ws", "wss"])
def test_pub_reaches_sub_over_tls_and_websocket(secure_broker, certs, listener: str) -> None:
    port = str(secure_broker.port_of(listener))
    options = ["-h", "localhost", "-p", port, "-q", "1"]
    if listener != "ws":
        options += certs.options()  # the broker requires a client certificate
    if listener != "tls":
        options += ["--ws", "--ws-path", WS_PATH]
    sub = meshmq("sub", *options, "-t", f"{listener}/#", "-C", "1", "-v",
                 "-i", f"cli-sub-{listener}")
    wait_for(lambda: f"subscribed client_id=cli-sub-{listener}" in secure_broker.log(),
             what="meshmq sub to subscribe")
    pub = run("pub", *options, "-t", f"{listener}/x", "-m", "hello", "-i", f"cli-pub-{listener}")
    assert pub.returncode == 0, pub.stderr
    out, err = sub.communicate(timeout=30)
    assert sub.returncode == 0, err
    assert out.splitlines() == [f"{listener}/x hello"]


def test_insecure_skips_only_the_host_name_check(secure_broker, certs, tmp_path) -> None:
    port = str(secure_broker.port_of("tls"))
    publish = ["pub", "-h", "127.0.0.1", "-p", port, "-t", "x", "-m", "y"]
    refused = run(*publish, *certs.options())  # the certificate names localhost only
    assert refused.returncode == 1
    line = one_error_line(refused)
    assert line.startswith(f"meshmq pub: cannot connect to mqtts://127.0.0.1:{port}: ")
    assert "certificate verify failed" in line
    accepted = run(*publish, *certs.options(), "--insecure")
    assert accepted.returncode == 0, accepted.stderr
    other = make_certificates(tmp_path)  # the chain is still verified: another CA fails
    untrusted = run(*publish, *certs.options(ca=other.ca), "--insecure")
    assert untrusted.returncode == 1
    assert "certificate verify failed" in one_error_line(untrusted)


def test_a_wrong_websocket_path_fails_with_one_line(secure_broker) -> None:
    port = secure_broker.port_of("ws")
    result = run("pub", "-p", str(port), "--ws", "-t", "x", "-m", "y")  # default path /mqtt
    assert result.returncode == 1
    assert one_error_line(result).startswith(
        f"meshmq pub: cannot connect to ws://127.0.0.1:{port}/mqtt: WebSocket handshake")


def test_unreadable_certificates_fail_with_one_line(certs, tmp_path) -> None:
    missing = tmp_path / "absent.pem"
    result = run("pub", "-p", "1", "--cafile", str(missing), "-t", "x", "-m", "y")
    assert result.returncode == 1
    assert one_error_line(result) == (
        f"meshmq pub: cannot load --cafile {missing}: No such file or directory")
    result = run("sub", "-p", "1", "--cafile", str(certs.ca), "--cert", str(missing), "-t", "x")
    assert result.returncode == 1
    assert one_error_line(result) == (
        f"meshmq sub: cannot load --cert {missing}: No such file or directory")


# ---------------------------------------------------------------------------- refused publishes

LIMIT = 1000
TOPIC = "big/t"


def publish_size(payload: int, qos: int) -> int:
    """Bytes of a 5.0 PUBLISH with no properties (spec 3.3), for the sizes used here: fixed
    header 1 + remaining length 2 (128..16383), topic 2 + len, packet id 2 (QoS > 0),
    property length 1, payload."""
    return 1 + 2 + 2 + len(TOPIC) + (2 if qos else 0) + 1 + payload


@pytest.mark.parametrize("qos", [0, 1])
def test_pub_over_the_maximum_packet_size_from_connack_is_not_sent(
        broker_factory, client_factory, qos: int) -> None:
    broker = broker_factory(f"[mqtt]\nmax_packet_size = {LIMIT}\n")
    probe = client_factory("probe", 5)
    probe.connect(broker.port)
    probe.subscribe(TOPIC, qos=1)
    fits = LIMIT - publish_size(0, qos)
    assert publish_size(fits, qos) == LIMIT
    exact = run("pub", "-p", str(broker.port), "-t", TOPIC, "-m", "x" * fits, "-q", str(qos))
    assert exact.returncode == 0, exact.stderr
    assert len(probe.expect().payload) == fits
    over = run("pub", "-p", str(broker.port), "-t", TOPIC, "-m", "x" * (fits + 1),
               "-q", str(qos), "-i", "too-big")
    assert over.returncode == 1
    assert one_error_line(over) == (
        f"meshmq pub: message refused: the PUBLISH would be {LIMIT + 1} bytes, over the "
        f"broker's maximum packet size of {LIMIT} bytes (from its CONNACK)")
    # Never sent: the client left with a normal DISCONNECT, the broker saw no oversized packet.
    wait_for(lambda: any("client disconnected client_id=too-big " in line
                         and line.endswith('reason="DISCONNECT 0x00 normal disconnection"')
                         for line in broker.log().splitlines()),
             what="the refused publisher's normal disconnect")
    assert "exceeds maximum packet size" not in broker.log()


@pytest.mark.parametrize("qos", [0, 1])
def test_pub_too_large_for_a_311_broker_reports_the_closed_connection(
        broker_factory, qos: int) -> None:
    broker = broker_factory(f"[mqtt]\nmax_packet_size = {LIMIT}\n")
    result = run("pub", "-p", str(broker.port), "-V", "311", "-t", TOPIC, "-m", "x" * 2 * LIMIT,
                 "-q", str(qos))
    assert result.returncode == 1
    assert one_error_line(result) == (
        "meshmq pub: the broker closed the connection instead of taking the message (MQTT "
        "3.1.1 gives no reason: a message over the broker's maximum packet size is one)")


def test_pub_qos0_refused_by_a_5_broker_names_its_reason(broker_factory) -> None:
    broker = broker_factory("[mqtt]\nretain_available = false\n")
    result = run("pub", "-p", str(broker.port), "-t", "r", "-m", "kept?", "-r")
    assert result.returncode == 1
    assert one_error_line(result) == (
        "meshmq pub: the broker refused the message and closed the connection: "
        "Retain not supported (0x9A)")
