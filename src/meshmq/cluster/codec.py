"""The link protocol between routers: frames, their encoding, and a sans-I/O frame reader.

Theory of operation
-------------------
A link is a byte stream (a unix socket between workers of one node; later TCP between hosts).
Each frame is ``length (u32, big endian) | type (u8) | body``, where ``length`` counts the type
byte and the body and is at most ``MAX_FRAME``. Integers are big endian; a string is
``u16 length | UTF-8``; a byte string is ``u32 length | bytes``; a list is ``u32 count | items``.

The hot frame is ``FORWARD``: a publish routed by one router for the subscribers of another.
Its message body is encoded once per publish (``encode_message``) and shared by every peer it
goes to; only the short list of shared-subscription groups the receiver must serve differs per
peer. Every other frame is control traffic (routes, requests and their replies) and uses the
generic ``Writer``/``Reader``.

``FrameReader.feed()`` takes bytes as they arrive and returns complete ``(type, body)`` pairs;
a frame over ``MAX_FRAME``, an unknown type or a body that does not decode is a ``LinkError``:
the link is closed and re-established, never half-understood.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

MAX_FRAME = 512 * 1024 * 1024  # far above any MQTT packet (256 MB) plus its envelope

_HEADER = struct.Struct(">IB")
_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_MESSAGE_HEAD = struct.Struct(">BBH")  # flags, qos, topic length
_POSITION = struct.Struct(">IQ")

FLAG_RETAIN = 0x01
FLAG_POSITION = 0x02


class LinkError(Exception):
    """A peer sent bytes that are not the link protocol; the link is closed."""


class FrameType(IntEnum):
    HELLO = 1  # index, count, token, the leader's high watermark
    ROUTES = 2  # route changes: (added, group, filter)*
    FORWARD = 3  # a publish for the receiver's subscribers, and the shared groups it serves
    APPEND = 4  # request to the leader: persist and route this publish
    RETAIN = 5  # request to the leader: store this retained message
    REPLY = 6  # answer to APPEND or RETAIN
    QUERY_RETAINED = 7  # request to the leader: retained messages matching these filters
    RETAINED = 8  # answer to QUERY_RETAINED
    CLAIM = 9  # a client connected here: hand over (or end) its session
    CLAIMED = 10  # answer to CLAIM
    SYNC = 11  # request to the leader: your high watermark, after everything sent before
    SYNCED = 12  # answer to SYNC
    STATS = 13  # a worker's counters, for the leader's $SYS totals
    BARRIER = 14  # request: answer once everything sent before is applied (routes)
    BARRIER_DONE = 15  # answer to BARRIER (from the leader: its high watermark)
    DELIVER = 16  # a message for one session that moved to the receiver (cluster/moving.py)
    SETTLED = 17  # a session handed over to the sender is in place: drop its stand-in


KNOWN_TYPES = frozenset(int(t) for t in FrameType)


# ---------------------------------------------------------------------- generic encoding


class Writer:
    """Builds one frame body."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def u8(self, value: int) -> Writer:
        self.parts.append(_U8.pack(value))
        return self

    def u16(self, value: int) -> Writer:
        self.parts.append(_U16.pack(value))
        return self

    def u32(self, value: int) -> Writer:
        self.parts.append(_U32.pack(value))
        return self

    def u64(self, value: int) -> Writer:
        self.parts.append(_U64.pack(value))
        return self

    def text(self, value: str) -> Writer:
        data = value.encode("utf-8")
        self.parts.append(_U16.pack(len(data)))
        self.parts.append(data)
        return self

    def blob(self, value: bytes) -> Writer:
        self.parts.append(_U32.pack(len(value)))
        self.parts.append(value)
        return self

    def offsets(self, values: list[int]) -> Writer:
        self.u32(len(values))
        self.parts.append(struct.pack(f">{len(values)}Q", *values))
        return self

    def frame(self, frame_type: FrameType) -> bytes:
        body = b"".join(self.parts)
        return _HEADER.pack(len(body) + 1, frame_type) + body


class Reader:
    """Reads one frame body; any overrun or bad UTF-8 is a ``LinkError``."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data = data
        self.pos = pos

    def _take(self, size: int) -> int:
        start = self.pos
        end = start + size
        if end > len(self.data):
            raise LinkError("frame body ends early")
        self.pos = end
        return start

    def u8(self) -> int:
        return _U8.unpack_from(self.data, self._take(1))[0]

    def u16(self) -> int:
        return _U16.unpack_from(self.data, self._take(2))[0]

    def u32(self) -> int:
        return _U32.unpack_from(self.data, self._take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.data, self._take(8))[0]

    def text(self) -> str:
        size = self.u16()
        start = self._take(size)
        try:
            return self.data[start:start + size].decode("utf-8")
        except UnicodeDecodeError:
            raise LinkError("string is not UTF-8") from None

    def blob(self) -> bytes:
        size = self.u32()
        start = self._take(size)
        return self.data[start:start + size]

    def offsets(self) -> list[int]:
        count = self.u32()
        start = self._take(8 * count)
        return list(struct.unpack_from(f">{count}Q", self.data, start))

    def end(self) -> None:
        if self.pos != len(self.data):
            raise LinkError("trailing bytes after the frame body")


# ---------------------------------------------------------------------- messages


@dataclass(slots=True)
class WireMessage:
    """A publish as it crosses a link (the broker turns it into a ``Message``)."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    properties: bytes  # the 5.0 property block, length prefix included (b"\\x00": none)
    sender: str  # client id of the publisher ("" for none)
    position: tuple[int, int] | None = None  # (partition, offset) once in the commit log


def encode_message(message: WireMessage) -> bytes:
    """The message body: flags, qos, topic, [position], sender, properties, payload."""
    return encode_message_fields(
        message.topic.encode("utf-8"), message.payload, message.qos, message.retain,
        message.properties, message.sender.encode("utf-8"), message.position)


def encode_message_fields(topic: bytes, payload: bytes, qos: int, retain: bool,
                          properties: bytes, sender: bytes,
                          position: tuple[int, int] | None) -> bytes:
    """``encode_message`` from already encoded fields (the FORWARD hot path)."""
    if position is None:
        return b"".join((
            _MESSAGE_HEAD.pack(FLAG_RETAIN if retain else 0, qos, len(topic)), topic,
            _U16.pack(len(sender)), sender, _U32.pack(len(properties)), properties, payload))
    return b"".join((
        _MESSAGE_HEAD.pack((FLAG_RETAIN if retain else 0) | FLAG_POSITION, qos, len(topic)),
        topic, _POSITION.pack(*position), _U16.pack(len(sender)), sender,
        _U32.pack(len(properties)), properties, payload))


def decode_message(data: bytes, pos: int = 0) -> WireMessage:
    """The inverse of ``encode_message`` over ``data[pos:]`` (the payload runs to the end)."""
    reader = Reader(data, pos)
    flags = reader.u8()
    qos = reader.u8()
    if qos > 2 or flags & ~(FLAG_RETAIN | FLAG_POSITION):
        raise LinkError("bad message flags")
    size = reader.u16()
    start = reader._take(size)
    try:
        topic = data[start:start + size].decode("utf-8")
    except UnicodeDecodeError:
        raise LinkError("topic is not UTF-8") from None
    position = None
    if flags & FLAG_POSITION:
        position = _POSITION.unpack_from(data, reader._take(_POSITION.size))
        position = (position[0], position[1])
    sender = reader.text()
    properties = reader.blob()
    return WireMessage(topic, data[reader.pos:], qos, bool(flags & FLAG_RETAIN), properties,
                       sender, position)


def forward_frame(groups: list[tuple[str, str]], body: bytes) -> bytes:
    """FORWARD: the groups (name, filter) the receiver serves, then the message body."""
    if not groups:
        return _HEADER.pack(len(body) + 5, FrameType.FORWARD) + b"\x00\x00\x00\x00" + body
    writer = Writer().u32(len(groups))
    for name, topic_filter in groups:
        writer.text(name).text(topic_filter)
    head = b"".join(writer.parts)
    return _HEADER.pack(len(head) + len(body) + 1, FrameType.FORWARD) + head + body


def parse_forward(body: bytes) -> tuple[list[tuple[str, str]], WireMessage]:
    if body[:4] == b"\x00\x00\x00\x00":  # no groups: the hot case, read in one go
        return [], _decode_message_fast(body, 4)
    reader = Reader(body)
    groups = [(reader.text(), reader.text()) for _ in range(reader.u32())]
    return groups, decode_message(body, reader.pos)


_FAST_HEAD = struct.Struct(">BBH")


def _decode_message_fast(data: bytes, pos: int) -> WireMessage:
    """``decode_message`` without a ``Reader`` (same checks, fewer calls)."""
    try:
        flags, qos, size = _FAST_HEAD.unpack_from(data, pos)
        if qos > 2 or flags & ~(FLAG_RETAIN | FLAG_POSITION):
            raise LinkError("bad message flags")
        pos += 4
        end = pos + size
        topic = data[pos:end].decode("utf-8")
        position = None
        if flags & FLAG_POSITION:
            position = _POSITION.unpack_from(data, end)
            end += 12
        size = _U16.unpack_from(data, end)[0]
        pos = end + 2
        end = pos + size
        sender = data[pos:end].decode("utf-8")
        size = _U32.unpack_from(data, end)[0]
        pos = end + 4
        end = pos + size
        if end > len(data):
            raise LinkError("frame body ends early")
        properties = data[pos:end]
    except struct.error:
        raise LinkError("frame body ends early") from None
    except UnicodeDecodeError:
        raise LinkError("string is not UTF-8") from None
    return WireMessage(topic, data[end:], qos, bool(flags & FLAG_RETAIN), properties, sender,
                       position and (position[0], position[1]))


def messages_blob(bodies: list[bytes]) -> Writer:
    """A list of encoded messages, each as a byte string."""
    writer = Writer().u32(len(bodies))
    for body in bodies:
        writer.blob(body)
    return writer


def read_messages(reader: Reader) -> list[WireMessage]:
    return [decode_message(reader.blob()) for _ in range(reader.u32())]


# ---------------------------------------------------------------------- the stream


class FrameReader:
    """Splits a byte stream into ``(type, body)`` frames (sans-I/O)."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buffer = self._buffer
        if buffer:
            buffer += data
            source: bytes | bytearray = buffer
        else:
            source = data  # the common case: slice the bytes as they came, one copy per frame
        frames = []
        pos = 0
        size = len(source)
        unpack = _HEADER.unpack_from
        known = KNOWN_TYPES
        while size - pos >= 5:
            length, frame_type = unpack(source, pos)
            if length < 1 or length > MAX_FRAME:
                raise LinkError(f"frame length {length} out of range")
            if frame_type not in known:
                raise LinkError(f"unknown frame type {frame_type}")
            end = pos + 4 + length
            if end > size:
                break
            frames.append((frame_type, bytes(source[pos + 5:end])))
            pos = end
        if source is buffer:
            if pos:
                del buffer[:pos]
        elif pos < size:
            buffer += data[pos:]
        return frames
