"""A small blocking raw-socket MQTT client for byte-level broker tests.

Built on meshmq's own codec, so a test can send exactly the packets (or bytes) it wants, in the
order it wants, and see every packet the broker sends back, unacknowledged. Every wait is
bounded by a socket timeout; nothing sleeps for a fixed time.

    raw = RawClient(broker.port)
    connack = raw.connect("c1", properties={PropertyId.RECEIVE_MAXIMUM: 2})
    raw.subscribe("a/#", qos=1)
    publish = raw.recv_type(Publish)
"""

from __future__ import annotations

import socket
import time
from typing import TypeVar

from meshmq.mqtt.codec import decode_packet, encode_packet, parse_fixed_header
from meshmq.mqtt.errors import InsufficientData
from meshmq.mqtt.packets import (
    Connack,
    Connect,
    Disconnect,
    Packet,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    Will,
)
from meshmq.mqtt.properties import Properties

DEFAULT_TIMEOUT = 10.0

P = TypeVar("P")


class ConnectionClosed(Exception):
    """The broker closed the connection before the expected packet arrived."""


class RawClient:
    """One TCP connection speaking MQTT ``version`` (3 = 3.1, 4 = 3.1.1, 5 = 5.0) by hand."""

    def __init__(self, port: int, version: int = 5, host: str = "127.0.0.1",
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        self.version = version
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()
        self._eof = False
        self._next_id = 1

    # ------------------------------------------------------------------ low level

    def send(self, packet: Packet) -> None:
        """Encode ``packet`` for this connection's version and write it."""
        self.send_bytes(encode_packet(packet, self.version))

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _read_some(self, deadline: float) -> bool:
        """Read once, waiting at most until ``deadline``; False on timeout. Sets EOF."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self.sock.settimeout(remaining)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            return False
        except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
            chunk = b""
        if not chunk:
            self._eof = True
            return True
        self._buf += chunk
        return True

    def _pop_packet(self) -> Packet | None:
        """Decode one complete frame from the buffer, or None if there is none yet."""
        try:
            first, start, stop = parse_fixed_header(self._buf, 0, len(self._buf))
        except InsufficientData:
            return None
        data = bytes(self._buf[:stop])
        del self._buf[:stop]
        return decode_packet(first, data, start, stop, self.version)

    def recv(self, timeout: float = DEFAULT_TIMEOUT) -> Packet:
        """The next packet from the broker; raises TimeoutError or ConnectionClosed."""
        deadline = time.monotonic() + timeout
        while True:
            packet = self._pop_packet()
            if packet is not None:
                return packet
            if self._eof:
                raise ConnectionClosed(f"connection closed ({len(self._buf)} stray bytes)")
            if not self._read_some(deadline):
                raise TimeoutError(f"no packet from the broker within {timeout} s")

    def recv_type(self, cls: type[P], timeout: float = DEFAULT_TIMEOUT) -> P:
        """The next packet, asserting it is a ``cls``."""
        packet = self.recv(timeout)
        assert isinstance(packet, cls), f"expected {cls.__name__}, got {packet!r}"
        return packet

    def recv_nothing(self, timeout: float = 0.5, allow_close: bool = False) -> None:
        """Assert that no packet arrives within ``timeout`` and (unless ``allow_close``) that
        the connection stays open."""
        try:
            packet = self.recv(timeout)
        except TimeoutError:
            return
        except ConnectionClosed:
            if allow_close:
                return
            raise AssertionError("the broker closed the connection") from None
        raise AssertionError(f"unexpected packet {packet!r}")

    def closed(self, timeout: float = DEFAULT_TIMEOUT) -> bool:
        """Wait until the broker closes the socket; True if it did within ``timeout``.

        Bytes received meanwhile stay buffered, so ``recv()``/``packets()`` can still return
        e.g. the DISCONNECT sent before the close.
        """
        deadline = time.monotonic() + timeout
        while not self._eof:
            if not self._read_some(deadline):
                return False
        return True

    def packets(self) -> list[Packet]:
        """Every complete packet buffered so far (use after ``closed()``)."""
        result = []
        while (packet := self._pop_packet()) is not None:
            result.append(packet)
        return result

    def close(self) -> None:
        """Close the socket abruptly, without DISCONNECT (an "abnormal" close for wills)."""
        try:
            self.sock.close()
        except OSError:
            pass

    def abort(self) -> None:
        """Reset the connection (RST instead of FIN)."""
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
        except OSError:
            pass
        self.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ conveniences

    def next_packet_id(self) -> int:
        packet_id = self._next_id
        self._next_id = packet_id % 65535 + 1
        return packet_id

    def connect(self, client_id: str, clean_start: bool = True,
                properties: Properties | None = None, will: Will | None = None,
                keep_alive: int = 60, username: str | None = None,
                password: bytes | None = None, timeout: float = DEFAULT_TIMEOUT) -> Connack:
        """Send CONNECT and return the CONNACK (whatever its reason code)."""
        name = "MQIsdp" if self.version == 3 else "MQTT"  # 3.1 has its own protocol name
        self.send(Connect(client_id, self.version, clean_start, keep_alive, username, password,
                          will, dict(properties or {}), name))
        return self.recv_type(Connack, timeout)

    def subscribe(self, topic_filter: str | list[tuple[str, SubscriptionOptions]],
                  qos: int = 0, properties: Properties | None = None,
                  timeout: float = DEFAULT_TIMEOUT, **options: object) -> Suback:
        """SUBSCRIBE and return the SUBACK (``options``: no_local, retain_handling, ...)."""
        if isinstance(topic_filter, str):
            subs = [(topic_filter, SubscriptionOptions(qos, **options))]  # type: ignore[arg-type]
        else:
            subs = topic_filter
        packet_id = self.next_packet_id()
        self.send(Subscribe(packet_id, subs, dict(properties or {})))
        suback = self.recv_type(Suback, timeout)
        assert suback.packet_id == packet_id
        return suback

    def unsubscribe(self, *filters: str, timeout: float = DEFAULT_TIMEOUT) -> Unsuback:
        packet_id = self.next_packet_id()
        self.send(Unsubscribe(packet_id, list(filters)))
        unsuback = self.recv_type(Unsuback, timeout)
        assert unsuback.packet_id == packet_id
        return unsuback

    def publish(self, topic: str, payload: bytes = b"", qos: int = 0, retain: bool = False,
                properties: Properties | None = None, packet_id: int | None = None,
                dup: bool = False, wait_ack: bool = True,
                timeout: float = DEFAULT_TIMEOUT) -> Packet | None:
        """PUBLISH; for QoS 1/2 with ``wait_ack`` complete the handshake and return the last ack."""
        if qos and packet_id is None:
            packet_id = self.next_packet_id()
        self.send(Publish(topic, payload, qos, retain, dup, packet_id if qos else None,
                          dict(properties or {})))
        if not qos or not wait_ack:
            return None
        if qos == 1:
            return self.recv_type(Puback, timeout)
        pubrec = self.recv_type(Pubrec, timeout)
        assert pubrec.packet_id == packet_id
        self.send(Pubrel(packet_id))  # type: ignore[arg-type]
        return self.recv_type(Pubcomp, timeout)

    def ack(self, publish: Publish) -> None:
        """Acknowledge a received PUBLISH (PUBACK, or PUBREC/PUBREL/PUBCOMP for QoS 2)."""
        if publish.qos == 1:
            self.send(Puback(publish.packet_id))  # type: ignore[arg-type]
        elif publish.qos == 2:
            self.send(Pubrec(publish.packet_id))  # type: ignore[arg-type]
            pubrel = self.recv_type(Pubrel)
            assert pubrel.packet_id == publish.packet_id
            self.send(Pubcomp(publish.packet_id))  # type: ignore[arg-type]

    def disconnect(self, reason_code: int = 0, properties: Properties | None = None) -> None:
        """Send DISCONNECT, then close the socket."""
        try:
            self.send(Disconnect(reason_code, dict(properties or {})))
        finally:
            self.close()


__all__ = ["DEFAULT_TIMEOUT", "ConnectionClosed", "RawClient"]
