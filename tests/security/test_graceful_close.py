"""A client still sending when the broker closes on it must still read why
(broker/transport/linger.py).

The broker answers a protocol violation with DISCONNECT and closes. A client with PUBRELs in
flight keeps sending meanwhile; closing a socket that holds unread input makes the kernel reset
the connection, and the reset throws away whatever the client had not read yet: the DISCONNECT
and its reason code. Each test makes that deterministic: the client reads through a small
receive window and has a backlog of deliveries ahead of the DISCONNECT, and it sends its
violation followed by more packets. Over TCP, TLS, WebSocket and WebSocket over TLS it must
read every delivery, then the DISCONNECT 0x93, then the end of the stream.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator

import pytest
from tlscerts import PKI, make_pki, tls_section
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from conftest import WAIT, BrokerProcess, start_broker, wait_for
from meshmq.broker.transport.linger import LINGER_BYTES, LINGER_SECONDS
from meshmq.mqtt.codec import decode_packet, encode_packet, parse_fixed_header
from meshmq.mqtt.errors import InsufficientData
from meshmq.mqtt.packets import (
    Connack,
    Connect,
    Disconnect,
    Packet,
    Publish,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
)
from meshmq.mqtt.reason_codes import ReasonCode
from rawclient import RawClient

SMALL_WINDOW = 16_384  # the client's receive buffer, so that deliveries wait at the broker
FILL = 100  # deliveries ahead of the DISCONNECT, 10 kB each: far more than that window
# Bytes the client sends after its violation: more than the broker reads at once, so some are
# unread when it closes, and less than LINGER_BYTES.
TAIL = 600_000


class Pipe:
    """MQTT 5.0 packets to and from the broker over one transport, read until it ends."""

    def __init__(self) -> None:
        self.buffer = b""

    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def chunk(self) -> bytes:
        """The next bytes from the broker; b"" once the stream ended (EOF or reset)."""
        raise NotImplementedError

    def packet(self) -> Packet | None:
        """The next packet, or None if the stream ended first."""
        while True:
            try:
                first, start, stop = parse_fixed_header(self.buffer, 0, len(self.buffer))
            except InsufficientData:
                data = self.chunk()
                if not data:
                    return None
                self.buffer += data
                continue
            data, self.buffer = self.buffer[:stop], self.buffer[stop:]
            return decode_packet(first, data, start, stop, 5)

    def until_end(self) -> list[Packet]:
        packets = []
        while (packet := self.packet()) is not None:
            packets.append(packet)
        return packets

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Pipe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SocketPipe(Pipe):
    """TCP, or TLS when ``context`` is given."""

    def __init__(self, port: int, context: ssl.SSLContext | None = None) -> None:
        super().__init__()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_WINDOW)
        sock.settimeout(WAIT)
        sock.connect(("127.0.0.1", port))
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname="127.0.0.1")
        self.sock = sock

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (ConnectionResetError, BrokenPipeError, ssl.SSLError):
            pass  # the broker reset the connection: what it sent before is still to be read

    def chunk(self) -> bytes:
        try:
            return self.sock.recv(65536)
        except (ConnectionResetError, ssl.SSLError):
            return b""

    def close(self) -> None:
        self.sock.close()


class WebSocketPipe(Pipe):
    """MQTT over WebSocket (``ws``), or over TLS (``wss``) when ``context`` is given.

    ``max_queue=1``: the library's reading thread stops at one unread message, so the socket
    is not read ahead of ``chunk()`` (as with the other pipes).
    """

    def __init__(self, port: int, context: ssl.SSLContext | None = None) -> None:
        super().__init__()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_WINDOW)
        sock.settimeout(WAIT)
        sock.connect(("127.0.0.1", port))
        scheme = "ws" if context is None else "wss"
        self.ws = connect(f"{scheme}://127.0.0.1:{port}/mqtt", sock=sock, ssl=context,
                          subprotocols=["mqtt"], open_timeout=WAIT, max_queue=1,
                          **({"server_hostname": "127.0.0.1"} if context else {}))
        self.close_code: int | None = None

    def __enter__(self) -> Pipe:
        self.ws.__enter__()  # the library wants its connection used as a context manager
        return self

    def send(self, data: bytes) -> None:
        try:
            self.ws.send(data)
        except ConnectionClosed:
            pass  # the broker reset the connection: what it sent before is still to be read

    def chunk(self) -> bytes:
        try:
            message = self.ws.recv(timeout=WAIT)
        except ConnectionClosed as closed:
            self.close_code = closed.rcvd.code if closed.rcvd is not None else None
            return b""
        assert isinstance(message, bytes), "MQTT must come in binary frames"
        return message

    def close(self) -> None:
        self.ws.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory, pki: PKI) -> Iterator[BrokerProcess]:
    config = (tls_section(pki) + "[ws]\nenabled = true\nport = 0\n"
              "[wss]\nenabled = true\nport = 0\n[mqtt]\nreceive_maximum = 2\n")
    broker = start_broker(tmp_path_factory.mktemp("close"), config, "close")
    yield broker
    broker.stop()


def open_pipe(broker: BrokerProcess, pki: PKI, transport: str) -> Pipe:
    context = pki.client_context()
    if transport == "tcp":
        return SocketPipe(broker.port)
    if transport == "tls":
        return SocketPipe(broker.port_of("tls"), context)
    if transport == "ws":
        return WebSocketPipe(broker.port_of("ws"))
    return WebSocketPipe(broker.port_of("wss"), context)


def queue_deliveries(port: int, topic: str) -> None:
    """Have the broker deliver ``FILL`` messages on ``topic``; return once it routed them all
    (the QoS 1 barrier's PUBACK comes after the QoS 0 fill)."""
    with RawClient(port) as publisher:
        publisher.connect(f"filler-{topic.replace('/', '-')}")
        for index in range(FILL):
            publisher.publish(topic, b"%04d" % index + b"f" * 9996)
        publisher.publish(topic, b"barrier", qos=1)


def violation() -> bytes:
    """Three QoS 2 PUBLISHes against our receive maximum of 2: DISCONNECT 0x93 (MQTT-3.3.4-7)."""
    return b"".join(encode_packet(Publish("t/x", b"x", 2, packet_id=i), 5) for i in (1, 2, 3))


def tail() -> bytes:
    """What a busy client keeps sending: PUBRELs for its exchanges in flight, publishes."""
    data = b"".join(encode_packet(Pubrel(i), 5) for i in (1, 2))
    publish = encode_packet(Publish("t/y", b"y" * 10_000), 5)
    while len(data) < TAIL:
        data += publish
    return data


@pytest.mark.parametrize("transport", ["tcp", "tls", "ws", "wss"])
def test_client_still_sending_reads_the_disconnect(broker, pki, transport) -> None:
    """The client reads every queued delivery, then DISCONNECT 0x93, then the end of the
    stream, although it kept sending after its violation."""
    with open_pipe(broker, pki, transport) as pipe:
        pipe.send(encode_packet(Connect(f"sender-{transport}"), 5))
        assert isinstance(pipe.packet(), Connack)
        topic = f"fill/{transport}"
        pipe.send(encode_packet(Subscribe(1, [(topic, SubscriptionOptions(0))]), 5))
        assert isinstance(pipe.packet(), Suback)
        queue_deliveries(broker.port, topic)
        pipe.send(violation())  # a message of its own over WebSocket, and the tail after it
        pipe.send(tail())
        started = time.monotonic()
        packets = pipe.until_end()
        ended = time.monotonic() - started
    publishes = [p for p in packets if isinstance(p, Publish)]
    assert [p.payload[:4] for p in publishes[:FILL]] == [b"%04d" % i for i in range(FILL)]
    assert packets, "nothing read"
    assert isinstance(packets[-1], Disconnect), f"last of {len(packets)}: {packets[-1]!r}"
    assert packets[-1].reason_code == ReasonCode.RECEIVE_MAXIMUM_EXCEEDED
    assert ended < LINGER_SECONDS  # our FIN follows the DISCONNECT: no wait for the bound
    if isinstance(pipe, WebSocketPipe):
        assert pipe.close_code == 1000  # a close frame after the DISCONNECT


def test_client_that_keeps_sending_is_cut_off_within_the_linger_bound(broker) -> None:
    """After the DISCONNECT, a client that neither stops sending nor closes is disconnected
    once ``LINGER_SECONDS`` have passed (or ``LINGER_BYTES`` arrived), not kept forever."""
    with RawClient(broker.port) as raw:
        raw.connect("keeps-sending")
        raw.send_bytes(violation())
        assert raw.closed(), "no end of stream after the DISCONNECT"
        assert raw.packets()[-1] == Disconnect(ReasonCode.RECEIVE_MAXIMUM_EXCEEDED)
        started = time.monotonic()
        sent = [0]

        def cut_off() -> bool:  # polled every 10 ms: a trickle far below LINGER_BYTES
            try:
                raw.sock.sendall(b"\x00" * 1000)
            except OSError:  # the reset once the broker gave up on this client
                return True
            sent[0] += 1000
            return False

        wait_for(cut_off, timeout=LINGER_SECONDS + WAIT, what="the broker to drop the client")
        lingered = time.monotonic() - started
        assert LINGER_SECONDS / 2 < lingered < LINGER_SECONDS + 3  # it waited, then gave up
        assert sent[0] < LINGER_BYTES
