"""The one byte form of a ``Message`` outside an MQTT packet, and the primitives it is built of.

A message crosses a link between routers, is handed over inside a moved session, and is kept
as a retained message in the state store, always as this *body*::

    u8 flags (0x01 retain, 0x02 position) | u8 qos | u16 topic length | topic (UTF-8)
    [u32 partition | u64 offset]           (flag 0x02: where the commit log stored it)
    u16 sender length | sender (UTF-8)     (the publisher's client id, "" for none)
    u32 properties length | the 5.0 property block as published (b"\\x00": none)
    payload                                (to the end)

Integers are big endian. The property block is the publisher's, exactly (user properties in
order, MQTT-3.3.2-17/-18); a message expiry interval in it is the time left when the body was
made (MQTT-3.3.2-6), so whoever decodes it counts down from then.

``Writer`` and ``Reader`` build and read the fixed fields of bodies and of link frames
(cluster/codec.py): a string is ``u16 length | UTF-8``, a byte string ``u32 length | bytes``.
``Reader`` raises ``WireError`` on anything that does not decode: a peer's bytes are never
half-understood.
"""

from __future__ import annotations

import struct
from typing import Self

from meshmq.broker.message import Message
from meshmq.mqtt.codec import decode_properties
from meshmq.mqtt.properties import PacketKind, Properties

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_HEAD = struct.Struct(">BBH")  # flags, qos, topic length
_POSITION = struct.Struct(">IQ")

FLAG_RETAIN = 0x01
FLAG_POSITION = 0x02
NO_PROPERTIES = b"\x00"


class WireError(Exception):
    """Bytes that are not what they claim to be (a malformed body or frame)."""


class Writer:
    """Builds one body from fixed fields."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def u8(self, value: int) -> Self:
        self.parts.append(_U8.pack(value))
        return self

    def u16(self, value: int) -> Self:
        self.parts.append(_U16.pack(value))
        return self

    def u32(self, value: int) -> Self:
        self.parts.append(_U32.pack(value))
        return self

    def u64(self, value: int) -> Self:
        self.parts.append(_U64.pack(value))
        return self

    def text(self, value: str) -> Self:
        data = value.encode("utf-8")
        self.parts.append(_U16.pack(len(data)))
        self.parts.append(data)
        return self

    def blob(self, value: bytes) -> Self:
        self.parts.append(_U32.pack(len(value)))
        self.parts.append(value)
        return self

    def offsets(self, values: list[int]) -> Self:
        self.u32(len(values))
        self.parts.append(struct.pack(f">{len(values)}Q", *values))
        return self

    def bytes(self) -> bytes:
        return b"".join(self.parts)


class Reader:
    """Reads fixed fields from ``data``; any overrun or bad UTF-8 is a ``WireError``."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data = data
        self.pos = pos

    def take(self, size: int) -> int:
        """Skip ``size`` bytes; return where they start."""
        start = self.pos
        end = start + size
        if end > len(self.data):
            raise WireError("body ends early")
        self.pos = end
        return start

    def u8(self) -> int:
        return _U8.unpack_from(self.data, self.take(1))[0]

    def u16(self) -> int:
        return _U16.unpack_from(self.data, self.take(2))[0]

    def u32(self) -> int:
        return _U32.unpack_from(self.data, self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.data, self.take(8))[0]

    def text(self) -> str:
        size = self.u16()
        start = self.take(size)
        try:
            return self.data[start:start + size].decode("utf-8")
        except UnicodeDecodeError:
            raise WireError("string is not UTF-8") from None

    def blob(self) -> bytes:
        size = self.u32()
        start = self.take(size)
        return self.data[start:start + size]

    def offsets(self) -> list[int]:
        count = self.u32()
        start = self.take(8 * count)
        return list(struct.unpack_from(f">{count}Q", self.data, start))

    def end(self) -> None:
        if self.pos != len(self.data):
            raise WireError("trailing bytes after the body")


# ---------------------------------------------------------------------- messages


def encode_message(message: Message, now: float, positioned: bool = True) -> bytes:
    """``message``'s body (see the module docstring); ``positioned=False`` leaves out where
    the log stored it (a retained copy is not a live log record)."""
    topic = message.topic_bytes
    sender = message.sender.encode("utf-8") if message.sender else b""
    properties = message.wire_properties(now)
    flags = FLAG_RETAIN if message.retain else 0
    position = message.position if positioned else None
    if position is None:
        return b"".join((_HEAD.pack(flags, message.qos, len(topic)), topic,
                         _U16.pack(len(sender)), sender, _U32.pack(len(properties)),
                         properties, message.payload))
    return b"".join((_HEAD.pack(flags | FLAG_POSITION, message.qos, len(topic)), topic,
                     _POSITION.pack(*position), _U16.pack(len(sender)), sender,
                     _U32.pack(len(properties)), properties, message.payload))


def decode_message(data: bytes, now: float, pos: int = 0) -> Message:
    """The ``Message`` in the body at ``data[pos:]`` (its payload runs to the end); an expiry
    in it counts down from ``now``. ``WireError`` if it does not decode."""
    try:
        flags, qos, size = _HEAD.unpack_from(data, pos)
        if qos > 2 or flags & ~(FLAG_RETAIN | FLAG_POSITION):
            raise WireError("bad message flags")
        pos += 4
        end = pos + size
        if end > len(data):
            raise WireError("body ends early")
        topic = data[pos:end].decode("utf-8")
        position = None
        if flags & FLAG_POSITION:
            partition, offset = _POSITION.unpack_from(data, end)
            position = (partition, offset)
            end += 12
        size = _U16.unpack_from(data, end)[0]
        pos = end + 2
        end = pos + size
        sender = data[pos:end].decode("utf-8")
        size = _U32.unpack_from(data, end)[0]
        pos = end + 4
        end = pos + size
        if end > len(data):
            raise WireError("body ends early")
        block = data[pos:end]
    except struct.error:
        raise WireError("body ends early") from None
    except UnicodeDecodeError:
        raise WireError("string is not UTF-8") from None
    message = Message(topic, data[end:], qos, bool(flags & FLAG_RETAIN),
                      _properties(block), sender or None, now)
    if position is not None:
        message.set_position(*position)
    return message


def _properties(block: bytes) -> Properties:
    if block == NO_PROPERTIES:
        return {}
    try:
        properties, end = decode_properties(block, 0, len(block), PacketKind.PUBLISH)
    except Exception as error:  # a codec error: the bytes are not a property block
        raise WireError(f"bad message properties: {error}") from None
    if end != len(block):
        raise WireError("bad message properties: trailing bytes")
    return properties
