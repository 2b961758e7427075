"""MQTT over WebSocket (ws) and WebSocket over TLS (wss) with real clients.

paho-mqtt (``transport="websockets"``) for the MQTT side, the ``websockets`` library's own
client for the WebSocket details (frames, subprotocol, paths, close codes).
"""

from __future__ import annotations

import socket
import ssl
import time

import pytest
from tlscerts import PKI, make_pki, tls_section
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from conftest import WAIT, BrokerProcess, start_broker, wait_for
from meshmq.auth.passwords import hash_password, write_password_file
from meshmq.mqtt.codec import decode_packet, encode_packet, parse_fixed_header
from meshmq.mqtt.errors import InsufficientData
from meshmq.mqtt.packets import (
    Connack,
    Connect,
    Packet,
    Puback,
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
)


def wait_log(broker: BrokerProcess, *parts: str) -> str:
    def line() -> str | None:
        return next((text for text in broker.log().splitlines()
                     if all(part in text for part in parts)), None)

    return wait_for(line, what=f"a log line with {parts}")


def ws_client(client_factory, version: int = 5, client_id: str = "", path: str = "/mqtt",
              pki: PKI | None = None, cert=None):
    client = client_factory(client_id, version, transport="websockets")
    client.paho.ws_set_options(path=path)
    if pki is not None:
        client.paho.tls_set_context(pki.client_context(cert))
    return client


class WSStream:
    """MQTT packets over a ``websockets`` client connection, frame boundaries ignored."""

    def __init__(self, ws: ClientConnection, version: int = 5) -> None:
        self.ws = ws
        self.version = version
        self.buffer = b""

    def send(self, *packets: Packet) -> None:
        self.ws.send(b"".join(encode_packet(p, self.version) for p in packets))

    def recv(self) -> Packet:
        while True:
            try:
                first, start, stop = parse_fixed_header(self.buffer, 0, len(self.buffer))
            except InsufficientData:
                message = self.ws.recv(timeout=WAIT)
                assert isinstance(message, bytes), "MQTT must come in binary frames"
                self.buffer += message
                continue
            data, self.buffer = self.buffer[:stop], self.buffer[stop:]
            return decode_packet(first, data, start, stop, self.version)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def ws_broker(tmp_path_factory: pytest.TempPathFactory, pki: PKI):
    config = (tls_section(pki, listen=False)
              + "[ws]\nenabled = true\nport = 0\n[wss]\nenabled = true\nport = 0\n"
              + "[mqtt]\nconnect_timeout = 1.0\n")
    broker = start_broker(tmp_path_factory.mktemp("ws"), config, "ws")
    yield broker
    broker.stop()


def test_port_file_and_listening_line_cover_every_listener(ws_broker) -> None:
    assert set(ws_broker.ports) == {"tcp", "ws", "wss"}
    assert ws_broker.ports["tcp"] == ws_broker.port
    ws, wss = ws_broker.port_of("ws"), ws_broker.port_of("wss")
    wait_log(ws_broker, f"listening bind=127.0.0.1 port={ws_broker.port} "
                        f"ws=127.0.0.1:{ws}/mqtt wss=127.0.0.1:{wss}/mqtt ")


@pytest.mark.parametrize("version", [4, 5])
def test_paho_over_websocket_talks_to_tcp_clients(ws_broker, client_factory, version) -> None:
    web = ws_client(client_factory, version, f"web-{version}")
    web.connect(ws_broker.port_of("ws"))
    plain = client_factory(f"tcp-{version}", version)
    plain.connect(ws_broker.port)
    web.subscribe(f"ws/{version}/in", qos=1)
    plain.subscribe(f"ws/{version}/out", qos=2)
    plain.publish(f"ws/{version}/in", b"to the browser", qos=1)
    assert web.expect().payload == b"to the browser"
    web.publish(f"ws/{version}/out", b"from the browser", qos=2)
    assert plain.expect().payload == b"from the browser"


@pytest.mark.parametrize("version", [4, 5])
def test_paho_over_secure_websocket(ws_broker, pki, client_factory, version) -> None:
    web = ws_client(client_factory, version, f"wss-{version}", pki=pki)
    web.connect(ws_broker.port_of("wss"))
    web.subscribe(f"wss/{version}", qos=1)
    plain = client_factory(f"tcp-wss-{version}", version)
    plain.connect(ws_broker.port)
    plain.publish(f"wss/{version}", b"x" * 300_000, qos=1)  # larger than one TLS record
    assert web.expect().payload == b"x" * 300_000
    web.publish(f"wss/{version}", b"echo", qos=1)
    assert web.expect().payload == b"echo"


def test_mqtt_is_a_byte_stream_across_frames(ws_broker) -> None:
    with connect(f"ws://127.0.0.1:{ws_broker.port_of('ws')}/mqtt", subprotocols=["mqtt"],
                 open_timeout=WAIT) as ws:
        assert ws.subprotocol == "mqtt"
        stream = WSStream(ws)
        connect_bytes = encode_packet(Connect("frames"), 5)
        ws.send([connect_bytes[:3], connect_bytes[3:7], connect_bytes[7:]])  # one fragmented msg
        assert isinstance(stream.recv(), Connack)
        stream.send(  # two packets in one frame
            Subscribe(1, [("frames/t", SubscriptionOptions(qos=1))]),
            Publish("frames/t", b"both in one frame", qos=1, packet_id=2),
        )
        got = [stream.recv() for _ in range(3)]
        assert {type(p) for p in got} == {Suback, Puback, Publish}
        assert next(p for p in got if isinstance(p, Publish)).payload == b"both in one frame"
        publish = encode_packet(Publish("frames/t", b"split", qos=0), 5)
        ws.send(publish[:2])  # one packet split over two messages
        ws.send(publish[2:])
        received = stream.recv()
        assert isinstance(received, Publish) and received.payload == b"split"
        pong = ws.ping(b"are you there")
        assert pong.wait(WAIT)


def test_wrong_path_gets_404(ws_broker) -> None:
    with pytest.raises(InvalidStatus) as info:
        connect(f"ws://127.0.0.1:{ws_broker.port_of('ws')}/elsewhere", subprotocols=["mqtt"],
                open_timeout=WAIT)
    assert info.value.response.status_code == 404
    wait_log(ws_broker, "websocket handshake refused listener=ws", "status=404",
             "path '/elsewhere' is not '/mqtt'")


def test_missing_mqtt_subprotocol_gets_400(ws_broker) -> None:
    with pytest.raises(InvalidStatus) as info:
        connect(f"ws://127.0.0.1:{ws_broker.port_of('ws')}/mqtt", open_timeout=WAIT)
    assert info.value.response.status_code == 400
    wait_log(ws_broker, "websocket handshake refused listener=ws", "status=400", "subprotocol")


def test_text_frame_closes_with_1003(ws_broker) -> None:
    with connect(f"ws://127.0.0.1:{ws_broker.port_of('ws')}/mqtt", subprotocols=["mqtt"],
                 open_timeout=WAIT) as ws:
        stream = WSStream(ws)
        stream.send(Connect("texter"))
        assert isinstance(stream.recv(), Connack)
        ws.send("MQTT as text")  # MQTT-6.0.0-1
        with pytest.raises(ConnectionClosed) as info:
            ws.recv(timeout=WAIT)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1003
    wait_log(ws_broker, "websocket text frame refused listener=ws")


def test_mqtt_refusals_arrive_over_websocket(ws_broker) -> None:
    with connect(f"ws://127.0.0.1:{ws_broker.port_of('ws')}/mqtt", subprotocols=["mqtt"],
                 open_timeout=WAIT) as ws:
        stream = WSStream(ws)
        stream.send(Connect("bad-method", properties={0x15: "SCRAM-SHA-1"}))
        connack = stream.recv()
        assert isinstance(connack, Connack) and connack.reason_code == 0x8C
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=WAIT)


def test_silent_socket_is_closed_after_the_deadline(ws_broker) -> None:
    with socket.create_connection(("127.0.0.1", ws_broker.port_of("ws")), timeout=WAIT) as sock:
        local = sock.getsockname()[1]
        started = time.monotonic()
        assert sock.recv(100) == b""  # closed by the broker, not by this timeout
        assert time.monotonic() - started < WAIT
    wait_log(ws_broker, f"no websocket handshake in time listener=ws peer=127.0.0.1:{local}")


def test_tls_client_to_the_ws_port_is_closed_and_logged(ws_broker, pki) -> None:
    sock = socket.create_connection(("127.0.0.1", ws_broker.port_of("ws")), timeout=WAIT)
    local = sock.getsockname()[1]
    with pytest.raises(OSError):
        pki.client_context().wrap_socket(sock, server_hostname="127.0.0.1")
    sock.close()
    wait_log(ws_broker, f"TLS handshake on a plain port listener=ws peer=127.0.0.1:{local}:")


def test_plain_websocket_to_the_wss_port_is_closed_and_logged(ws_broker) -> None:
    with pytest.raises((OSError, InvalidHandshake)):  # the broker answers no HTTP
        connect(f"ws://127.0.0.1:{ws_broker.port_of('wss')}/mqtt", subprotocols=["mqtt"],
                open_timeout=WAIT)
    wait_log(ws_broker, "TLS handshake failed listener=wss", "not a TLS client: first byte 0x47")


def test_secure_websocket_with_client_certificate_identity(tmp_path, pki, client_factory) -> None:
    passwords = tmp_path / "passwords"
    write_password_file(passwords, {"alice": hash_password("wonderland")})
    acl = tmp_path / "acl"
    acl.write_text("user:sensor-7 readwrite sensors/sensor-7/#\n")
    config = (tls_section(pki, listen=False, cafile=True, require_client_cert=True,
                          cert_username=True)
              + "[wss]\nenabled = true\nport = 0\n"
              + f'[auth]\npassword_file = "{passwords}"\nanonymous = "deny"\n'
                f'acl_file = "{acl}"\n')
    broker = start_broker(tmp_path, config, "wss-mtls")
    try:
        sensor = ws_client(client_factory, 5, "sensor-7", pki=pki, cert=pki.client("sensor-7"))
        sensor.connect(broker.port_of("wss"))
        assert [c.value for c in sensor.subscribe("sensors/sensor-7/#", qos=1)] == [1]
        assert [c.value for c in sensor.subscribe("sensors/#", qos=1)] == [0x87]
        sensor.publish("sensors/sensor-7/temp", b"21.5", qos=1)
        assert sensor.expect().payload == b"21.5"
        anonymous = ws_client(client_factory, 5, "no-cert", pki=pki)
        with pytest.raises((OSError, ssl.SSLError)):
            anonymous.connect(broker.port_of("wss"))
        wait_log(broker, "TLS handshake failed listener=wss",
                 "client certificate required, none sent")
    finally:
        broker.stop()
