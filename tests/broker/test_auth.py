"""Password authentication: argon2id password file, anonymous rules, `meshmq passwd`."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import start_broker, wait_for
from meshmq.mqtt.codec import encode_packet
from meshmq.mqtt.packets import Connack, Connect, Publish


def passwd(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshmq", "passwd", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "passwords"
    for user, password in (("alice", "wonderland"), ("bob", "builder")):
        added = passwd("add", str(path), user, "--password-stdin", stdin=password + "\n")
        assert added.returncode == 0, added.stderr
    return path


@pytest.fixture
def secured(tmp_path: Path, password_file: Path):
    broker = start_broker(tmp_path, f'[auth]\npassword_file = "{password_file}"\n', "secured")
    yield broker
    broker.stop()


def test_passwd_add_ls_rm(tmp_path: Path, password_file: Path) -> None:
    assert passwd("ls", str(password_file)).stdout.split() == ["alice", "bob"]
    lines = password_file.read_text().splitlines()
    assert all(line.split(":", 1)[1].startswith("$argon2id$") for line in lines)
    assert "wonderland" not in password_file.read_text()
    assert password_file.stat().st_mode & 0o077 == 0
    assert passwd("rm", str(password_file), "bob").returncode == 0
    assert passwd("ls", str(password_file)).stdout.split() == ["alice"]
    missing = passwd("rm", str(password_file), "carol")
    assert missing.returncode == 1 and "carol" in missing.stderr


@pytest.mark.parametrize("version", [4, 5])
def test_good_password_connects(secured, client_factory, version: int) -> None:
    client = client_factory("alice-device", version)
    client.paho.username_pw_set("alice", "wonderland")
    client.connect(secured.port)
    client.subscribe("a/b", qos=1)
    client.publish("a/b", b"hi", qos=1)
    assert client.expect().payload == b"hi"


@pytest.mark.parametrize(("version", "code"), [(4, 4), (5, 0x86)])
@pytest.mark.parametrize(("user", "password"), [("alice", "wrong"), ("mallory", "wonderland")])
def test_bad_password_or_unknown_user_is_refused(secured, raw_factory, version: int, code: int,
                                                 user: str, password: str) -> None:
    raw = raw_factory(secured.port, version)
    connack = raw.connect("x", username=user, password=password.encode())
    assert connack.reason_code == code
    assert raw.closed()


@pytest.mark.parametrize(("version", "code"), [(4, 5), (5, 0x87)])
def test_anonymous_refused_when_password_file_configured(secured, raw_factory, version: int,
                                                        code: int) -> None:
    raw = raw_factory(secured.port, version)
    assert raw.connect("anon").reason_code == code
    assert raw.closed()


def test_packets_pipelined_behind_a_bad_connect_are_not_routed(secured, raw_factory,
                                                             client_factory) -> None:
    watcher = client_factory("watcher", 5)
    watcher.paho.username_pw_set("bob", "builder")
    watcher.connect(secured.port)
    watcher.subscribe("pipe/#", qos=1)
    raw = raw_factory(secured.port, 5)
    raw.send_bytes(encode_packet(Connect("sneaky", 5, username="alice", password=b"nope"), 5)
                   + encode_packet(Publish("pipe/evil", b"x", 1, packet_id=1), 5))
    assert raw.recv_type(Connack).reason_code == 0x86
    good = raw_factory(secured.port, 5)
    good.send_bytes(encode_packet(Connect("ok", 5, username="alice", password=b"wonderland"), 5)
                    + encode_packet(Publish("pipe/good", b"y", 1, packet_id=1), 5))
    assert good.recv_type(Connack).reason_code == 0
    message = watcher.expect()
    assert (message.topic, message.payload) == ("pipe/good", b"y")
    watcher.expect_none(0.3)


def test_anonymous_allowed_alongside_passwords_when_configured(tmp_path, password_file,
                                                               raw_factory) -> None:
    config = f'[auth]\npassword_file = "{password_file}"\nanonymous = "allow"\n'
    broker = start_broker(tmp_path, config, "mixed")
    try:
        assert raw_factory(broker.port, 5).connect("anon").reason_code == 0
        bad = raw_factory(broker.port, 5).connect("x", username="alice", password=b"bad")
        assert bad.reason_code == 0x86
    finally:
        broker.stop()


def test_malformed_password_file_stops_the_broker_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad-passwords"
    path.write_text("alice:$argon2id$ok\nthis line is wrong\n")
    config = tmp_path / "meshmq.toml"
    config.write_text(f'[auth]\npassword_file = "{path}"\n')
    result = subprocess.run(
        [sys.executable, "-m", "meshmq", "serve", "--config", str(config), "--port", "0",
         "--bind", "127.0.0.1", "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert f"{path}:2" in result.stderr


def test_anonymous_beyond_loopback_warns_loudly(tmp_path: Path) -> None:
    broker = start_broker(tmp_path, "", "open", bind="0.0.0.0")
    try:
        wait_for(lambda: "ANONYMOUS ACCESS IS ON" in broker.log(), what="the warning")
    finally:
        broker.stop()


def test_sighup_reloads_the_password_file(secured, password_file: Path, raw_factory) -> None:
    """A user added while the broker runs can connect after SIGHUP; a removed one cannot."""
    added = passwd("add", str(password_file), "carol", "--password-stdin", stdin="c4r0l\n")
    assert added.returncode == 0, added.stderr
    assert passwd("rm", str(password_file), "bob").returncode == 0
    secured.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "password file reloaded users=2" in secured.log(), what="the reload")
    carol = raw_factory(secured.port, 5)
    assert carol.connect("carol", username="carol", password=b"c4r0l").reason_code == 0
    bob = raw_factory(secured.port, 5)
    assert bob.connect("bob", username="bob", password=b"builder").reason_code == 0x86
