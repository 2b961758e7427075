"""TLS and mutual TLS listeners with real clients (paho-mqtt, ssl sockets, mosquitto_pub/sub).

Certificates come from trustme (tlscerts.py); every broker is a real ``meshmq serve`` process.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from tlscerts import PKI, make_pki, tls_section

from conftest import WAIT, BrokerProcess, start_broker, wait_for
from meshmq.auth.passwords import hash_password, write_password_file
from meshmq.mqtt.codec import encode_packet
from meshmq.mqtt.packets import Connect


def tls_client(client_factory, pki: PKI, version: int = 5, client_id: str = "",
               cert: tuple[Path, Path] | None = None):
    client = client_factory(client_id, version)
    client.paho.tls_set_context(pki.client_context(cert))
    return client


def handshake(port: int, context: ssl.SSLContext) -> tuple[ssl.SSLSocket, int]:
    """A TLS connection to ``port`` (caller closes it) and its local port, as the log shows."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    local = sock.getsockname()[1]
    try:
        return context.wrap_socket(sock, server_hostname="127.0.0.1"), local
    except BaseException:
        sock.close()
        raise


def read_to_end(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset counts as closed)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, ssl.SSLError):
            return data
        if not chunk:
            return data
        data += chunk


def mqtt_connect_bytes(client_id: str, version: int = 5) -> bytes:
    return encode_packet(Connect(client_id, protocol_level=version), version)


def wait_log(broker: BrokerProcess, *parts: str) -> str:
    """Wait for a broker log line containing every one of ``parts``; return it."""
    def line() -> str | None:
        for text in broker.log().splitlines():
            if all(part in text for part in parts):
                return text
        return None

    return wait_for(line, what=f"a log line with {parts}")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    """An unrelated CA: its certificates must be refused everywhere."""
    return make_pki(tmp_path_factory.mktemp("other-pki"))


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory, pki: PKI):
    broker = start_broker(tmp_path_factory.mktemp("tls"), tls_section(pki), "tls")
    yield broker
    broker.stop()


# ---------------------------------------------------------------------------- server TLS


@pytest.mark.parametrize("version", [4, 5])
def test_paho_over_tls_talks_to_tcp_clients(tls_broker, pki, client_factory, version) -> None:
    secure = tls_client(client_factory, pki, version, f"secure-{version}")
    secure.connect(tls_broker.port_of("tls"))
    plain = client_factory(f"plain-{version}", version)
    plain.connect(tls_broker.port)
    secure.subscribe(f"tls/{version}/in", qos=1)
    plain.subscribe(f"tls/{version}/out", qos=1)
    plain.publish(f"tls/{version}/in", b"to the TLS client", qos=1)
    assert secure.expect().payload == b"to the TLS client"
    secure.publish(f"tls/{version}/out", b"from the TLS client", qos=1)
    assert plain.expect().payload == b"from the TLS client"


def test_tls_defaults_are_modern(tls_broker, pki) -> None:
    port = tls_broker.port_of("tls")
    sock, _ = handshake(port, pki.client_context())
    with sock:
        assert sock.version() in ("TLSv1.2", "TLSv1.3")
        assert sock.compression() is None
    capped = pki.client_context()
    capped.maximum_version = ssl.TLSVersion.TLSv1_2
    sock, _ = handshake(port, capped)
    with sock:
        assert sock.version() == "TLSv1.2"
    old = pki.client_context()
    old.set_ciphers("DEFAULT:@SECLEVEL=0")  # let this client even try TLS 1.0/1.1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TLS 1.0/1.1 are: that's the point
        old.minimum_version = ssl.TLSVersion.TLSv1
        old.maximum_version = ssl.TLSVersion.TLSv1_1
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        local = sock.getsockname()[1]
        with pytest.raises(ssl.SSLError):
            old.wrap_socket(sock, server_hostname="127.0.0.1")
    wait_log(tls_broker, f"TLS handshake failed listener=tls peer=127.0.0.1:{local} ",
             "the client offers only TLS versions below tls.min_version")


def test_client_trusting_another_ca_is_refused(tls_broker, other_pki) -> None:
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(tls_broker.port_of("tls"), other_pki.client_context())[0].close()
    wait_log(tls_broker, "TLS handshake failed listener=tls",
             "the client does not trust the server certificate")


@pytest.mark.parametrize("version", [4, 5])
def test_plain_mqtt_to_the_tls_port_is_closed_and_logged(tls_broker, version) -> None:
    with socket.create_connection(("127.0.0.1", tls_broker.port_of("tls")), timeout=WAIT) as sock:
        local = sock.getsockname()[1]
        sock.sendall(mqtt_connect_bytes("plain-on-tls", version))
        answer = read_to_end(sock)
    assert not answer.startswith(b"\x20")  # no CONNACK: at most a TLS alert, then the close
    wait_log(tls_broker, f"TLS handshake failed listener=tls peer=127.0.0.1:{local} ",
             "not a TLS client: first byte 0x10 (plain MQTT on a TLS port?)")


def test_tls_client_to_the_plain_port_is_closed_and_logged(tls_broker, pki) -> None:
    sock = socket.create_connection(("127.0.0.1", tls_broker.port), timeout=WAIT)
    local = sock.getsockname()[1]
    with pytest.raises(OSError):  # ssl.SSLError or a reset: the broker closed the socket
        pki.client_context().wrap_socket(sock, server_hostname="127.0.0.1")
    sock.close()
    wait_log(tls_broker, f"TLS handshake on a plain port listener=tcp peer=127.0.0.1:{local}:")


def test_an_honest_client_is_unaffected_by_failed_handshakes(tls_broker, pki,
                                                             client_factory) -> None:
    honest = tls_client(client_factory, pki, 5, "honest")
    honest.connect(tls_broker.port_of("tls"))
    honest.subscribe("honest/t", qos=1)
    for _ in range(5):  # garbage and refused handshakes around it
        with socket.create_connection(("127.0.0.1", tls_broker.port_of("tls"))) as sock:
            sock.sendall(b"\x10\x00garbage")
            read_to_end(sock)
    for number in range(20):
        honest.publish("honest/t", str(number), qos=1)
    assert [honest.expect().payload for _ in range(20)] == [str(n).encode() for n in range(20)]


# ---------------------------------------------------------------------------- mutual TLS


def auth_section(directory: Path) -> str:
    """A password file with alice, anonymous refused, and ACLs for device-1 and alice."""
    passwords = directory / "passwords"
    write_password_file(passwords, {"alice": hash_password("wonderland")})
    acl = directory / "acl"
    acl.write_text("user:device-1 readwrite devices/device-1/#\n"
                   "user:alice readwrite alice/#\n")
    return (f'[auth]\npassword_file = "{passwords}"\nanonymous = "deny"\n'
            f'acl_file = "{acl}"\n')


@pytest.fixture(scope="module")
def mtls_broker(tmp_path_factory: pytest.TempPathFactory, pki: PKI):
    directory = tmp_path_factory.mktemp("mtls")
    config = tls_section(pki, cafile=True, require_client_cert=True, cert_username=True)
    broker = start_broker(directory, config + auth_section(directory), "mtls")
    yield broker
    broker.stop()


@pytest.mark.parametrize("version", [4, 5])
def test_mtls_certificate_cn_is_the_user_name(mtls_broker, pki, client_factory,
                                              version) -> None:
    device = tls_client(client_factory, pki, version, f"dev1-{version}", pki.client("device-1"))
    device.connect(mtls_broker.port_of("tls"))  # no user name, no password: the CN says who
    assert [code.value for code in device.subscribe("devices/device-1/#", qos=1)] == [1]
    denied = device.subscribe("devices/#", qos=1)
    assert [code.value for code in denied] == [0x87 if version == 5 else 0x80]
    device.publish(f"devices/device-1/{version}", b"mine", qos=1)
    assert device.expect().payload == b"mine"


def test_mtls_acl_applies_to_the_cn_not_to_a_claimed_user(mtls_broker, pki,
                                                          client_factory) -> None:
    device = tls_client(client_factory, pki, 5, "dev1-claims-alice", pki.client("device-1"))
    device.paho.username_pw_set("alice", "not alice's password")  # ignored: the CN wins
    device.connect(mtls_broker.port_of("tls"))
    info = device.publish("alice/inbox", b"pretending", qos=1)
    mid, code = device.acked.get(timeout=WAIT)
    assert mid == info.mid and int(code.value) == 0x87  # device-1 may not write alice/#
    info = device.publish("devices/device-1/ok", b"allowed", qos=1)
    mid, code = device.acked.get(timeout=WAIT)
    assert mid == info.mid and int(code.value) in (0, 0x10)


def test_mtls_client_without_a_certificate_is_refused(mtls_broker, pki) -> None:
    with socket.create_connection(("127.0.0.1", mtls_broker.port_of("tls")), timeout=WAIT) as raw:
        local = raw.getsockname()[1]
        try:  # TLS 1.3: the client may finish its side before the server says no
            sock = pki.client_context().wrap_socket(raw, server_hostname="127.0.0.1")
            sock.sendall(mqtt_connect_bytes("no-cert"))
            answer = read_to_end(sock)
        except (ssl.SSLError, ConnectionResetError):
            answer = b""
    assert not answer  # no CONNACK
    wait_log(mtls_broker, f"TLS handshake failed listener=tls peer=127.0.0.1:{local} ",
             "client certificate required, none sent")


def test_mtls_certificate_from_another_ca_is_refused(mtls_broker, pki, other_pki) -> None:
    context = pki.client_context(other_pki.client("device-1"))  # right CN, wrong issuer
    with socket.create_connection(("127.0.0.1", mtls_broker.port_of("tls")), timeout=WAIT) as raw:
        local = raw.getsockname()[1]
        try:
            sock = context.wrap_socket(raw, server_hostname="127.0.0.1")
            sock.sendall(mqtt_connect_bytes("forged"))
            answer = read_to_end(sock)
        except (ssl.SSLError, ConnectionResetError):
            answer = b""
    assert not answer
    wait_log(mtls_broker, f"TLS handshake failed listener=tls peer=127.0.0.1:{local} ",
             "CERTIFICATE_VERIFY_FAILED")


def test_optional_client_certificates_fall_back_to_passwords(tmp_path, pki,
                                                             client_factory) -> None:
    config = tls_section(pki, cafile=True, cert_username=True)  # certificates optional
    broker = start_broker(tmp_path, config + auth_section(tmp_path), "optional")
    try:
        port = broker.port_of("tls")
        alice = tls_client(client_factory, pki, 5, "alice-1")
        alice.paho.username_pw_set("alice", "wonderland")
        alice.connect(port)
        alice.subscribe("alice/#", qos=1)
        device = tls_client(client_factory, pki, 5, "dev1", pki.client("device-1"))
        device.connect(port)
        nobody = tls_client(client_factory, pki, 5, "nobody")
        _, reason, _ = nobody.connect(port, expect_success=False)
        assert int(reason.value) == 0x87  # no certificate, no user name: anonymous is off
        wrong = tls_client(client_factory, pki, 5, "wrong")
        wrong.paho.username_pw_set("alice", "guess")
        _, reason, _ = wrong.connect(port, expect_success=False)
        assert int(reason.value) == 0x86
        alice.publish("alice/x", b"by password", qos=1)
        assert alice.expect().payload == b"by password"
    finally:
        broker.stop()


# ---------------------------------------------------------------------------- reload on SIGHUP


def served_certificate(port: int, context: ssl.SSLContext) -> bytes:
    sock, _ = handshake(port, context)
    with sock:
        return sock.getpeercert(binary_form=True)


def install(pki: PKI, cert: Path, key: Path) -> None:
    """Put ``pki``'s server certificate where the broker reads it (atomically, as ops do)."""
    for source, target in ((pki.cert_file, cert), (pki.key_file, key)):
        tmp = target.with_suffix(".tmp")
        shutil.copyfile(source, tmp)
        tmp.replace(target)


def test_sighup_reload_serves_the_new_certificate_and_keeps_connections(
        tmp_path, pki, other_pki, client_factory) -> None:
    cert, key = tmp_path / "live.crt", tmp_path / "live.key"
    install(pki, cert, key)
    broker = start_broker(tmp_path, f'[tls]\nenabled = true\nport = 0\ncertfile = "{cert}"\n'
                                    f'keyfile = "{key}"\n', "reload")
    try:
        port = broker.port_of("tls")
        old = tls_client(client_factory, pki, 5, "old")
        old.connect(port)
        old.subscribe("reload/#", qos=1)
        install(other_pki, cert, key)
        broker.proc.send_signal(signal.SIGHUP)
        wait_log(broker, "tls certificate reloaded")
        new_der = ssl.PEM_cert_to_DER_cert(other_pki.cert_file.read_text())
        assert served_certificate(port, other_pki.client_context()) == new_der
        with pytest.raises(ssl.SSLCertVerificationError):  # the old CA no longer fits
            handshake(port, pki.client_context())[0].close()
        new = tls_client(client_factory, other_pki, 5, "new")
        new.connect(port)
        new.publish("reload/a", b"after reload", qos=1)
        assert old.expect().payload == b"after reload"  # the old connection still works
        new.subscribe("back/#", qos=1)
        old.publish("back/b", b"old to new", qos=1)
        assert new.expect().payload == b"old to new"
    finally:
        broker.stop()


def test_a_bad_reload_keeps_the_current_certificate(tmp_path, pki, client_factory) -> None:
    cert, key = tmp_path / "live.crt", tmp_path / "live.key"
    install(pki, cert, key)
    broker = start_broker(tmp_path, f'[tls]\nenabled = true\nport = 0\ncertfile = "{cert}"\n'
                                    f'keyfile = "{key}"\n', "badreload")
    try:
        cert.write_text("not a certificate\n")
        broker.proc.send_signal(signal.SIGHUP)
        wait_log(broker, "tls reload failed, keeping the current certificate",
                 "tls.certfile: no PEM certificate")
        served = served_certificate(broker.port_of("tls"), pki.client_context())
        assert served == ssl.PEM_cert_to_DER_cert(pki.cert_file.read_text())
        client = tls_client(client_factory, pki, 5, "still-fine")
        client.connect(broker.port_of("tls"))
        assert broker.proc.poll() is None
    finally:
        broker.stop()


# ---------------------------------------------------------------------------- bad configuration


def serve(tmp_path: Path, config: str) -> subprocess.CompletedProcess[str]:
    """Run ``meshmq serve`` with ``config``; it is expected to refuse to start."""
    path = tmp_path / "bad.toml"
    path.write_text(config)
    return subprocess.run(
        [sys.executable, "-m", "meshmq", "serve", "--config", str(path), "--bind", "127.0.0.1",
         "--port", "0", "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=60,
    )


def bad_key(pki: PKI, tmp_path: Path) -> dict[str, str]:
    """Files that are wrong in the ways operators get them wrong."""
    other = make_pki(tmp_path / "mismatch")
    encrypted = tmp_path / "encrypted.key"
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pki.key_file.read_bytes(), None)
    encrypted.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret")))
    unreadable = tmp_path / "unreadable.key"
    unreadable.write_bytes(pki.key_file.read_bytes())
    unreadable.chmod(0)
    return {"mismatch": str(other.key_file), "encrypted": str(encrypted),
            "unreadable": str(unreadable), "cert_as_key": str(pki.cert_file)}


@pytest.mark.parametrize(("case", "message"), [
    ("missing_cert", "tls.certfile: cannot read '{missing}': No such file or directory"),
    ("mismatch", "tls.keyfile: the private key does not match the certificate in tls.certfile"),
    ("encrypted", "tls.keyfile: the private key is encrypted; give an unencrypted key"),
    ("unreadable", "tls.keyfile: cannot read '{unreadable}': Permission denied"),
    ("cert_as_key", "tls.keyfile: no PEM private key in '{cert_as_key}'"),
    ("bad_ca", "tls.cafile: no PEM certificate in '{key}'"),
    ("no_certfile", "tls.certfile: required when tls.enabled or wss.enabled is true"),
    ("no_cafile", "tls.cafile: required when tls.require_client_cert is true"),
])
def test_bad_tls_configuration_stops_with_one_line(tmp_path, pki, case, message) -> None:
    files = bad_key(pki, tmp_path)
    if case == "unreadable" and os.access(files["unreadable"], os.R_OK):
        pytest.skip("this user reads mode-000 files (root)")
    missing = str(tmp_path / "missing.crt")
    section = {
        "missing_cert": f'certfile = "{missing}"\n',
        "bad_ca": f'certfile = "{pki.cert_file}"\nkeyfile = "{pki.key_file}"\n'
                  f'cafile = "{pki.key_file}"\n',
        "no_certfile": "",
        "no_cafile": f'certfile = "{pki.cert_file}"\nkeyfile = "{pki.key_file}"\n'
                     "require_client_cert = true\n",
    }.get(case, f'certfile = "{pki.cert_file}"\nkeyfile = "{files.get(case)}"\n')
    result = serve(tmp_path, "[tls]\nenabled = true\nport = 0\n" + section)
    expected = message.format(missing=missing, key=pki.key_file, **files)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line or "error:" in line]
    assert len(errors) == 1 and errors[0].endswith(expected), result.stderr


# ---------------------------------------------------------------------------- mosquitto clients

mosquitto = pytest.mark.skipif(
    shutil.which("mosquitto_pub") is None or shutil.which("mosquitto_sub") is None,
    reason="mosquitto clients not installed",
)


def mosquitto_tls_args(pki: PKI, port: int, cert: tuple[Path, Path] | None = None) -> list[str]:
    args = ["-h", "127.0.0.1", "-p", str(port), "--cafile", str(pki.ca_file)]
    if cert is not None:
        args += ["--cert", str(cert[0]), "--key", str(cert[1])]
    return args


@mosquitto
@pytest.mark.interop
@pytest.mark.parametrize("version", ["mqttv311", "mqttv5"])
def test_mosquitto_clients_over_tls(tls_broker, pki, client_factory, version) -> None:
    port = tls_broker.port_of("tls")
    listener = client_factory(f"paho-{version}", 5)
    listener.connect(tls_broker.port)
    listener.subscribe(f"mosq/{version}/pub", qos=1)
    published = subprocess.run(
        ["mosquitto_pub", *mosquitto_tls_args(pki, port), "-V", version, "-q", "1",
         "-t", f"mosq/{version}/pub", "-m", "over TLS"],
        capture_output=True, text=True, timeout=WAIT)
    assert published.returncode == 0, published.stderr
    assert listener.expect().payload == b"over TLS"

    sub = subprocess.Popen(
        ["mosquitto_sub", *mosquitto_tls_args(pki, port), "-V", version, "-q", "1",
         "-i", f"mosq-sub-{version}", "-t", f"mosq/{version}/sub", "-C", "1", "-W", "10"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_log(tls_broker, f"subscribed client_id=mosq-sub-{version}")
        listener.publish(f"mosq/{version}/sub", b"to mosquitto_sub", qos=1)
        out, err = sub.communicate(timeout=WAIT)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    assert sub.returncode == 0, err
    assert out.strip() == "to mosquitto_sub"


@mosquitto
@pytest.mark.interop
def test_mosquitto_pub_with_a_client_certificate(mtls_broker, pki, client_factory) -> None:
    port = mtls_broker.port_of("tls")
    reader = tls_client(client_factory, pki, 5, "dev1-reader", pki.client("device-1"))
    reader.connect(port)
    reader.subscribe("devices/device-1/#", qos=1)
    cert = pki.client("device-1")
    published = subprocess.run(
        ["mosquitto_pub", *mosquitto_tls_args(pki, port, cert), "-V", "mqttv5", "-q", "1",
         "-t", "devices/device-1/mosq", "-m", "signed"],
        capture_output=True, text=True, timeout=WAIT)
    assert published.returncode == 0, published.stderr
    assert reader.expect().payload == b"signed"
    refused = subprocess.run(  # no client certificate: the handshake fails
        ["mosquitto_pub", *mosquitto_tls_args(pki, port), "-V", "mqttv5", "-q", "1",
         "-t", "devices/device-1/mosq", "-m", "unsigned"],
        capture_output=True, text=True, timeout=WAIT)
    assert refused.returncode != 0
    reader.expect_none(timeout=0.3)


def test_sighup_takes_certificate_files_newly_named_in_the_config(tmp_path, pki,
                                                                  other_pki) -> None:
    """tls.certfile and tls.keyfile changed in the file: later handshakes use the new pair;
    a pair that does not load is refused and the running one stays."""
    tls = '[tls]\nenabled = true\nport = 0\ncertfile = "{}"\nkeyfile = "{}"\n'
    broker = start_broker(tmp_path, tls.format(pki.cert_file, pki.key_file), "renamed")
    config = broker.log_path.parent / "meshmq.toml"
    try:
        port = broker.port_of("tls")
        broken = tmp_path / "broken.crt"
        broken.write_text("not a certificate\n")
        config.write_text(tls.format(broken, other_pki.key_file))
        broker.proc.send_signal(signal.SIGHUP)
        wait_log(broker, "configuration not reloaded, keeping the running one",
                 "tls.certfile: no PEM certificate")
        assert served_certificate(port, pki.client_context()) == \
            ssl.PEM_cert_to_DER_cert(pki.cert_file.read_text())
        config.write_text(tls.format(other_pki.cert_file, other_pki.key_file))
        broker.proc.send_signal(signal.SIGHUP)
        wait_log(broker, "configuration changed", "key=tls.certfile")
        wait_log(broker, "tls certificate reloaded", str(other_pki.cert_file))
        assert served_certificate(port, other_pki.client_context()) == \
            ssl.PEM_cert_to_DER_cert(other_pki.cert_file.read_text())
    finally:
        broker.stop()
