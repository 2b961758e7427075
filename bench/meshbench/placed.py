"""A minimal MQTT 5.0 client for the workers benchmark: it can choose its worker.

A meshmq node with several workers tells a 5.0 client which worker serves it in the CONNACK
user property ``meshmq-worker``. ``connect_placed`` connects, reads it, and disconnects and
connects again (the kernel picks the worker by a hash of the addresses, so a new source port is
a new draw) until the connection lands on the worker it wants.
"""

from __future__ import annotations

import os
import socket
import struct

from meshbench import BenchError

PLACE_ATTEMPTS = 64
WORKER_PROPERTY = b"meshmq-worker"


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value % 128, value // 128
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _frame(first: int, body: bytes) -> bytes:
    return bytes([first]) + _varint(len(body)) + body


def _string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack(">H", len(data)) + data


def connect_packet(client_id: str) -> bytes:
    # protocol name, level 5, clean start, keep alive 600 s, no properties, client id
    return _frame(0x10, _string("MQTT") + b"\x05\x02\x02\x58\x00" + _string(client_id))


def subscribe_packet(topic_filter: str, qos: int = 0) -> bytes:
    # packet id 1, no properties, the filter and its options (the maximum QoS)
    return _frame(0x82, b"\x00\x01\x00" + _string(topic_filter) + bytes([qos]))


def publish_packet(topic: str, payload: bytes, qos: int = 0, packet_id: int = 0) -> bytes:
    """A PUBLISH with no properties; at QoS 1 the packet id sits just before the property
    length byte, 3 bytes before the payload."""
    if not qos:
        return _frame(0x30, _string(topic) + b"\x00" + payload)
    return _frame(0x30 | qos << 1, _string(topic) + struct.pack(">H", packet_id) + b"\x00"
                  + payload)


def read_varint(data: bytes, at: int) -> tuple[int, int]:
    value, mult = 0, 1
    while True:
        if at >= len(data):
            raise ValueError("truncated variable byte integer")
        byte = data[at]
        at += 1
        value += (byte & 0x7F) * mult
        mult *= 128
        if byte < 0x80:
            return value, at


def connack_worker(body: bytes) -> int | None:
    """The ``meshmq-worker`` user property of a CONNACK body (None: absent); raises
    ``ValueError`` for a refused or malformed CONNACK."""
    if len(body) < 3 or body[1] != 0:
        raise ValueError(f"CONNACK refused: {body[:2].hex()}")
    length, at = read_varint(body, 2)
    end = at + length
    fixed = {0x01: 1, 0x24: 1, 0x25: 1, 0x28: 1, 0x29: 1, 0x2A: 1, 0x13: 2, 0x21: 2, 0x22: 2,
             0x11: 4, 0x27: 4}
    while at < end:
        prop = body[at]
        at += 1
        if prop in fixed:
            at += fixed[prop]
        elif prop in (0x12, 0x15, 0x16, 0x1A, 0x1C, 0x1F):  # strings and binary data
            at += 2 + struct.unpack_from(">H", body, at)[0]
        elif prop == 0x26:  # user property: two strings
            klen = struct.unpack_from(">H", body, at)[0]
            key = body[at + 2:at + 2 + klen]
            at += 2 + klen
            vlen = struct.unpack_from(">H", body, at)[0]
            value = body[at + 2:at + 2 + vlen]
            at += 2 + vlen
            if key == WORKER_PROPERTY:
                return int(value)
        else:
            raise ValueError(f"unexpected CONNACK property 0x{prop:02x}")
    return None


def recv_packet(sock: socket.socket, pending: bytearray) -> tuple[int, bytes]:
    """One whole packet from a blocking socket (``pending`` keeps what came after it)."""
    while True:
        if len(pending) >= 2:
            try:
                length, at = read_varint(bytes(pending[:5]), 1)
            except ValueError:
                length, at = -1, 0
            if length >= 0 and len(pending) >= at + length:
                first, body = pending[0], bytes(pending[at:at + length])
                del pending[:at + length]
                return first, body
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("the broker closed the connection")
        pending += data


def connect_placed(port: int, name: str, want: int | None) -> tuple[socket.socket, int | None,
                                                                   int, bytearray]:
    """A connected MQTT 5.0 client on worker ``want`` (any worker when None). Returns the
    socket, the worker it is on, the attempts it took and bytes read past the CONNACK."""
    for attempt in range(1, PLACE_ATTEMPTS + 1):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        pending = bytearray()
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(connect_packet(f"lk{os.getpid()}-{name}-{attempt}"))
            first, body = recv_packet(sock, pending)
            if first >> 4 != 2:
                raise BenchError(f"expected a CONNACK, got packet type {first >> 4}")
            worker = connack_worker(body)
        except ValueError as exc:
            sock.close()
            raise BenchError(str(exc)) from None
        except BaseException:
            sock.close()
            raise
        if want is None or worker == want:
            return sock, worker, attempt, pending
        sock.sendall(b"\xe0\x00")  # DISCONNECT, normal: try again for another worker
        sock.close()
    raise BenchError(f"no connection landed on worker {want} in {PLACE_ATTEMPTS} attempts")
