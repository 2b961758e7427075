"""The connect and disconnect log lines (``server.log_connections``), read from the log of a
real broker process (JSON lines, so each field is read as the broker wrote it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import BrokerProcess, start_broker, wait_for
from meshmq.mqtt.packets import Connect
from meshmq.mqtt.reason_codes import ReasonCode
from rawclient import RawClient

JSON_LOG = '[server]\nlog_format = "json"\n'


def records(broker: BrokerProcess) -> list[dict[str, Any]]:
    lines = broker.log().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def wait_record(broker: BrokerProcess, msg: str, client_id: str, peer: str) -> dict[str, Any]:
    """The broker's ``msg`` line about ``client_id`` connected from ``peer``."""
    def find() -> dict[str, Any] | None:
        return next((r for r in records(broker) if r["msg"] == msg
                     and r.get("client_id") == client_id and r.get("peer") == peer), None)

    return wait_for(find, what=f"{msg!r} for {client_id} from {peer}")


def peer_of(raw: RawClient) -> str:
    host, port = raw.sock.getsockname()[:2]
    return f"{host}:{port}"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    broker = start_broker(tmp_path_factory.mktemp("connlog"), JSON_LOG, "connlog")
    yield broker
    broker.stop()


@pytest.mark.parametrize(("version", "protocol", "reason"), [
    (4, "3.1.1", "DISCONNECT"),
    (5, "5.0", "DISCONNECT 0x00 normal disconnection"),
])
def test_connect_and_disconnect_are_logged_at_info(broker, raw_factory, version: int,
                                                   protocol: str, reason: str) -> None:
    raw = raw_factory(broker.port, version)
    client_id = f"log-normal-{version}"
    raw.connect(client_id, keep_alive=30)
    peer = peer_of(raw)
    connected = wait_record(broker, "client connected", client_id, peer)
    assert (connected["level"], connected["protocol"], connected["keep_alive"]) == (
        "info", protocol, 30)
    raw.disconnect()
    disconnected = wait_record(broker, "client disconnected", client_id, peer)
    assert (disconnected["level"], disconnected["protocol"], disconnected["reason"]) == (
        "info", protocol, reason)


def test_a_5_reason_code_is_named(broker, raw_factory) -> None:
    raw = raw_factory(broker.port)
    raw.connect("log-with-will")
    peer = peer_of(raw)
    raw.disconnect(ReasonCode.DISCONNECT_WITH_WILL_MESSAGE)
    record = wait_record(broker, "client disconnected", "log-with-will", peer)
    assert record["reason"] == "DISCONNECT 0x04 disconnect with will message"


def test_a_socket_closed_without_disconnect(broker, raw_factory) -> None:
    raw = raw_factory(broker.port, 4)
    raw.connect("log-vanished")
    peer = peer_of(raw)
    raw.close()
    record = wait_record(broker, "client disconnected", "log-vanished", peer)
    assert record["reason"] == "socket closed by the client"


def test_keep_alive_timeout(broker, raw_factory) -> None:
    raw = raw_factory(broker.port)
    raw.connect("log-silent", keep_alive=1)
    peer = peer_of(raw)
    assert raw.closed(), "the broker kept a silent client past 1.5 x its keep alive"
    record = wait_record(broker, "client disconnected", "log-silent", peer)
    assert record["reason"] == "keep-alive timeout"


def test_taken_over(broker, raw_factory) -> None:
    first = raw_factory(broker.port)
    first.connect("log-twice")
    second = raw_factory(broker.port)
    second.connect("log-twice")
    record = wait_record(broker, "client disconnected", "log-twice", peer_of(first))
    assert record["reason"] == "taken over"
    peer = peer_of(second)
    second.disconnect()
    record = wait_record(broker, "client disconnected", "log-twice", peer)
    assert record["reason"] == "DISCONNECT 0x00 normal disconnection"


def test_protocol_error(broker, raw_factory) -> None:
    raw = raw_factory(broker.port)
    raw.connect("log-rude")
    peer = peer_of(raw)
    raw.send(Connect("log-rude", 5))  # MQTT-3.1.0-2: a second CONNECT is a protocol error
    assert raw.closed()
    record = wait_record(broker, "client disconnected", "log-rude", peer)
    assert record["reason"] == "protocol error 0x82: second CONNECT"


def test_server_shutting_down(tmp_path: Path, raw_factory) -> None:
    broker = start_broker(tmp_path, JSON_LOG)
    try:
        raw = raw_factory(broker.port)
        raw.connect("log-to-the-end")
        peer = peer_of(raw)
    finally:
        assert broker.stop() == 0
    record = wait_record(broker, "client disconnected", "log-to-the-end", peer)
    assert record["reason"] == "server shutting down"


def test_turned_off_they_are_debug_lines(tmp_path: Path, raw_factory) -> None:
    broker = start_broker(tmp_path, JSON_LOG + "log_connections = false\n")
    try:
        raw = raw_factory(broker.port)
        raw.connect("log-quiet")
        peer = peer_of(raw)
        raw.disconnect()
        for msg in ("client connected", "client disconnected"):
            assert wait_record(broker, msg, "log-quiet", peer)["level"] == "debug"
    finally:
        broker.stop()
