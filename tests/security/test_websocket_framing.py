"""MQTT over WebSocket: the broker sends each MQTT control packet in a WebSocket frame of its own.

MQTT-6.0.0-2 lets a frame hold several packets, or part of one, but client libraries such as
Eclipse Paho C expect one packet per frame (as Mosquitto sends): given two in one frame, Paho C
leaves the second unread until more bytes arrive, and its acknowledgements stall. These tests
read frames as they were sent (the ``websockets`` sans-I/O client over a blocking socket, plain
or TLS), never a reassembled stream, and check that every binary frame is one whole packet.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from typing import Any

import pytest
from tlscerts import PKI, make_pki, tls_section
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from conftest import WAIT, BrokerProcess, start_broker
from meshmq.broker.transport.websocket import WebSocketLayer
from meshmq.mqtt.codec import decode_packet, encode_packet, parse_fixed_header
from meshmq.mqtt.errors import InsufficientData
from meshmq.mqtt.packets import (
    Connack,
    Connect,
    Packet,
    Pingreq,
    Pingresp,
    Puback,
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
)

# Payload sizes whose PUBLISH needs each WebSocket length form (RFC 6455 5.2): 7 bits, 16 bits
# (126 to 65,535 bytes) and 64 bits.
SIZES = [1, 200, 70_000]


def packet_sizes(data: bytes) -> list[int]:
    """The sizes of the whole MQTT packets ``data`` starts with; a trailing part of a packet
    counts as its length negated."""
    sizes = []
    pos = 0
    while pos < len(data):
        try:
            _, _, stop = parse_fixed_header(data, pos, len(data))
        except InsufficientData:
            sizes.append(pos - len(data))
            break
        sizes.append(stop - pos)
        pos = stop
    return sizes


class FrameClient:
    """A WebSocket client that keeps frame boundaries, speaking MQTT ``version``."""

    def __init__(self, port: int, version: int = 5,
                 context: ssl.SSLContext | None = None) -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname="127.0.0.1")
        self.sock = sock
        self.version = version
        scheme = "ws" if context is None else "wss"
        self.ws = ClientProtocol(parse_uri(f"{scheme}://127.0.0.1:{port}/mqtt"),
                                 subprotocols=[Subprotocol("mqtt")], max_size=None)
        self.frames: deque[Frame] = deque()
        self.response: Response | None = None
        self.ws.send_request(self.ws.connect())
        self._flush()
        while self.response is None:
            self._read()
        assert self.response.status_code == 101

    def _flush(self) -> None:
        for chunk in self.ws.data_to_send():
            if chunk:
                self.sock.sendall(chunk)

    def _read(self) -> None:
        data = self.sock.recv(1 << 20)
        assert data, "the broker closed the connection"
        self.ws.receive_data(data)
        for event in self.ws.events_received():
            if isinstance(event, Response):
                self.response = event
            elif event.opcode is not Opcode.PONG:
                self.frames.append(event)
        self._flush()

    def send(self, *packets: Packet) -> None:
        """All ``packets`` in one binary frame (allowed to a client: MQTT-6.0.0-2)."""
        self.ws.send_binary(b"".join(encode_packet(p, self.version) for p in packets))
        self._flush()

    def recv(self) -> Packet:
        """The next packet, which must be alone in a complete binary frame."""
        while not self.frames:
            self._read()
        frame = self.frames.popleft()
        assert frame.opcode is Opcode.BINARY and frame.fin, f"not one binary frame: {frame}"
        data = bytes(frame.data)
        sizes = packet_sizes(data)
        assert sizes == [len(data)], (
            f"a frame of {len(data)} bytes holds {len(sizes)} packets, of {sizes[:5]} bytes"
            f"{' ...' if len(sizes) > 5 else ''} (negative: part of one)")
        first, start, stop = parse_fixed_header(data, 0, len(data))
        return decode_packet(first, data, start, stop, self.version)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory, pki: PKI):
    config = (tls_section(pki, listen=False)
              + "[ws]\nenabled = true\nport = 0\n[wss]\nenabled = true\nport = 0\n")
    process = start_broker(tmp_path_factory.mktemp("ws-framing"), config, "ws-framing")
    yield process
    process.stop()


def ws_connect(broker: BrokerProcess, pki: PKI, listener: str, version: int,
               client_id: str) -> FrameClient:
    context = pki.client_context() if listener == "wss" else None
    client = FrameClient(broker.port_of(listener), version, context)
    client.send(Connect(client_id, version))
    connack = client.recv()
    assert isinstance(connack, Connack) and connack.reason_code == 0
    return client


def receive(client: FrameClient, count: int) -> list[Packet]:
    """``count`` packets, each checked to come in its own frame; QoS 1 deliveries acked."""
    got = []
    for _ in range(count):
        packet = client.recv()
        if isinstance(packet, Publish) and packet.qos == 1:
            assert packet.packet_id is not None
            client.send(Puback(packet.packet_id))
        got.append(packet)
    return got


@pytest.mark.parametrize("listener", ["ws", "wss"])
@pytest.mark.parametrize("version", [4, 5])
def test_own_qos1_publish_and_its_puback_come_in_separate_frames(broker, pki, listener,
                                                                 version) -> None:
    client = ws_connect(broker, pki, listener, version, f"echo-{listener}-{version}")
    try:
        topic = f"framing/echo/{listener}/{version}"
        client.send(Subscribe(1, [(topic, SubscriptionOptions(qos=1))]))
        assert isinstance(client.recv(), Suback)
        client.send(Publish(topic, b"hi", qos=1, packet_id=2))
        got = receive(client, 2)  # the delivery and the PUBACK, written in the same turn
        assert {type(p) for p in got} == {Publish, Puback}
        client.send(Pingreq())  # and a lone packet still comes alone
        assert isinstance(client.recv(), Pingresp)
    finally:
        client.close()


@pytest.mark.parametrize("listener", ["ws", "wss"])
def test_burst_from_the_client_itself_comes_one_packet_per_frame(broker, pki, listener) -> None:
    client = ws_connect(broker, pki, listener, 5, f"self-burst-{listener}")
    try:
        topic = f"framing/self/{listener}"
        client.send(Subscribe(1, [(topic, SubscriptionOptions(qos=1))]))
        assert isinstance(client.recv(), Suback)
        publishes = [Publish(topic, b"q1-%d-" % n + b"x" * size, qos=1, packet_id=10 + n)
                     for n, size in enumerate(SIZES * 10)]
        publishes += [Publish(topic, b"q0-%d-" % n + b"x" * size)
                      for n, size in enumerate(SIZES * 10)]
        client.send(*publishes)  # one frame: the answers are queued in one loop turn
        got = receive(client, 2 * len(publishes) - len(SIZES * 10))
        acked = sorted(p.packet_id for p in got if isinstance(p, Puback))
        assert acked == [p.packet_id for p in publishes if p.qos == 1]
        delivered = sorted(p.payload for p in got if isinstance(p, Publish))
        assert delivered == sorted(p.payload for p in publishes)
    finally:
        client.close()


@pytest.mark.parametrize("listener", ["ws", "wss"])
@pytest.mark.parametrize("version", [4, 5])
def test_burst_from_another_client_comes_one_packet_per_frame(broker, pki, listener,
                                                              version) -> None:
    client = ws_connect(broker, pki, listener, version, f"burst-{listener}-{version}")
    publisher = socket.create_connection(("127.0.0.1", broker.port), timeout=WAIT)
    try:
        topic = f"framing/fan/{listener}/{version}"
        client.send(Subscribe(1, [(topic, SubscriptionOptions(qos=1))]))
        assert isinstance(client.recv(), Suback)
        publisher.sendall(encode_packet(Connect(f"burst-pub-{listener}-{version}"), 5))
        qos1 = [Publish(topic, b"q1-%d-" % n + b"x" * size, qos=1, packet_id=1 + n)
                for n, size in enumerate(SIZES * 20)]
        qos0 = [Publish(topic, b"q0-%d" % n) for n in range(200)]  # shared QoS 0 frames
        # One write: the deliveries are queued for the subscriber within a loop turn or two.
        publisher.sendall(b"".join(encode_packet(p, 5) for p in qos0 + qos1))
        got = receive(client, len(qos0) + len(qos1))
        assert sorted(p.payload for p in got if isinstance(p, Publish)) \
            == sorted(p.payload for p in qos0 + qos1)
    finally:
        publisher.close()
        client.close()


class RecordingTransport(asyncio.Transport):
    """The socket below a ``WebSocketLayer``: records every write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default

    def is_closing(self) -> bool:
        return False


class MQTTSide(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport


def test_one_write_below_holds_a_frame_per_packet() -> None:
    """Framing each packet must not cost a socket write each: what the MQTT side writes at
    once goes below at once, as one frame per packet."""
    async def run() -> None:
        mqtt_side = MQTTSide()
        layer = WebSocketLayer("ws", "/mqtt", lambda: mqtt_side, 1 << 20, WAIT)
        below = RecordingTransport()
        layer.connection_made(below)
        client = ClientProtocol(parse_uri("ws://127.0.0.1/mqtt"),
                                subprotocols=[Subprotocol("mqtt")])
        client.send_request(client.connect())
        layer.data_received(b"".join(client.data_to_send()))
        client.receive_data(below.writes.pop())  # the 101
        assert isinstance(client.events_received()[0], Response)
        packets = [encode_packet(Publish("t", b"x" * size), 5) for size in SIZES]
        packets.append(encode_packet(Puback(7), 5))
        layer.write(b"".join(packets))
        layer.writelines([packets[0], packets[1]])
        assert len(below.writes) == 2
        for write, expected in zip(below.writes, [packets, packets[:2]], strict=True):
            client.receive_data(write)
            frames = client.events_received()
            assert [bytes(f.data) for f in frames if isinstance(f, Frame)] == expected
        layer.connection_lost(None)

    asyncio.run(run())
