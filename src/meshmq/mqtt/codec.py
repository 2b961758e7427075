"""Encode and decode MQTT 3.1.1 / 5.0 packets; plain functions over ``bytes``.

Theory of operation
-------------------
Decoding works on one complete frame at a time: ``parse_fixed_header`` finds the frame in a
buffer (raising ``InsufficientData`` while it is incomplete) and ``decode_packet`` turns the
frame body ``data[pos:end]`` into a packet object. Every decoder reads with explicit bounds, so
a field that runs past ``end`` is a ``MalformedPacket``, never an ``IndexError``; any other
surprise inside a decoder is converted to ``MalformedPacket`` by ``decode_packet``, so the only
exception a peer can provoke is a ``RemoteProtocolError``.

Decoders check what the bytes alone can tell (reserved bits, lengths, UTF-8, property rules,
packet ids, reason codes allowed for the packet type). Rules that need connection state or
configuration (topic aliases, receive maximum, topic name/filter syntax, ``$share`` options)
belong to ``connection.py``.

Encoders trust their input except for sizes the wire cannot carry (``LocalProtocolError``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from functools import partial
from typing import Any, Final

from meshmq.mqtt.errors import (
    InsufficientData,
    LocalProtocolError,
    MalformedPacket,
    RemoteProtocolError,
)
from meshmq.mqtt.packets import (
    MQTT_5,
    MQTT_31,
    MQTT_311,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    PacketType,
    Pingreq,
    Pingresp,
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
from meshmq.mqtt.properties import (
    PROPERTY_TABLE,
    PacketKind,
    Properties,
    PropertyId,
    WireType,
    get_property,
)
from meshmq.mqtt.reason_codes import ReasonCode

MAX_REMAINING_LENGTH: Final = 268_435_455
MAX_VARINT: Final = 268_435_455

_U16: Final = struct.Struct(">H")
_U32: Final = struct.Struct(">I")
_pack_u16: Final = _U16.pack
_pack_u32: Final = _U32.pack
_ACK_FRAME: Final = struct.Struct(">BBH")  # first byte, remaining length 2, packet id
_PUBLISH_HEAD: Final = struct.Struct(">BBH")  # first byte, one-byte remaining length, topic length

# Enum members as plain module constants: attribute access on an Enum class costs several
# times a global lookup on CPython 3.11, and these are read once or more per packet.
_PUBLISH: Final = int(PacketType.PUBLISH)
_PUBREL: Final = int(PacketType.PUBREL)
_UTF8_PAIR: Final = WireType.UTF8_PAIR
_VARINT: Final = WireType.VARINT

# Reason codes each packet type may carry (spec 3.x.2.1 tables).
_PUBACK_CODES: Final = frozenset({0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99})
_PUBREL_CODES: Final = frozenset({0x00, 0x92})
_SUBACK_CODES: Final = frozenset(
    {0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2})
_SUBACK_CODES_311: Final = frozenset({0x00, 0x01, 0x02, 0x80})
_SUBACK_CODES_31: Final = frozenset({0x00, 0x01, 0x02})  # 3.1 grants a QoS; it cannot refuse
_UNSUBACK_CODES: Final = frozenset({0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91})
_DISCONNECT_CODES: Final = frozenset(
    {0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90, 0x93, 0x94,
     0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2}
)
_AUTH_CODES: Final = frozenset({0x00, 0x18, 0x19})
_CONNACK_CODES: Final = frozenset(
    {0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90, 0x95,
     0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F}
)

# Public names for the connection, which must never send a code its packet cannot carry.
CONNACK_REASON_CODES = _CONNACK_CODES
DISCONNECT_REASON_CODES = _DISCONNECT_CODES


# --------------------------------------------------------------------------- primitives


def encode_varint(value: int) -> bytes:
    """Encode a Variable Byte Integer (spec 1.5.5)."""
    if value < 128:
        if value < 0:
            raise LocalProtocolError(f"varint must not be negative: {value}")
        return bytes((value,))
    if value > MAX_VARINT:
        raise LocalProtocolError(f"varint too large: {value}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """Return (value, next position); at most four bytes (MQTT-1.5.5-1)."""
    value = 0
    shift = 0
    for i in range(4):
        if pos + i >= end:
            raise MalformedPacket("variable byte integer runs past the packet")
        byte = data[pos + i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos + i + 1
        shift += 7
    raise MalformedPacket("variable byte integer longer than 4 bytes")


def encode_utf8(text: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > 65535:
        raise LocalProtocolError("UTF-8 string longer than 65535 bytes")
    return _pack_u16(len(raw)) + raw


def encode_binary(raw: bytes) -> bytes:
    if len(raw) > 65535:
        raise LocalProtocolError("binary data longer than 65535 bytes")
    return _pack_u16(len(raw)) + raw


def decode_u16(data: bytes, pos: int, end: int) -> tuple[int, int]:
    if pos + 2 > end:
        raise MalformedPacket("two-byte integer runs past the packet")
    return (data[pos] << 8) | data[pos + 1], pos + 2


def decode_u32(data: bytes, pos: int, end: int) -> tuple[int, int]:
    if pos + 4 > end:
        raise MalformedPacket("four-byte integer runs past the packet")
    return _U32.unpack_from(data, pos)[0], pos + 4


def decode_binary(data: bytes, pos: int, end: int) -> tuple[bytes, int]:
    if pos + 2 > end:
        raise MalformedPacket("length prefix runs past the packet")
    stop = pos + 2 + ((data[pos] << 8) | data[pos + 1])
    if stop > end:
        raise MalformedPacket("string or binary data runs past the packet")
    return bytes(data[pos + 2 : stop]), stop


def decode_utf8(data: bytes, pos: int, end: int) -> tuple[str, int]:
    """Decode a UTF-8 Encoded String (spec 1.5.4): well-formed, no surrogates, no U+0000."""
    if pos + 2 > end:  # (``decode_binary``'s checks, inline: a CONNECT has a few strings)
        raise MalformedPacket("length prefix runs past the packet")
    stop = pos + 2 + ((data[pos] << 8) | data[pos + 1])
    if stop > end:
        raise MalformedPacket("string or binary data runs past the packet")
    try:  # strict: rejects surrogates and overlong forms (MQTT-1.5.4-1)
        text = str(data[pos + 2 : stop], "utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedPacket(f"invalid UTF-8 string: {exc.reason}") from None
    if "\x00" in text:
        raise MalformedPacket("UTF-8 string contains U+0000")  # MQTT-1.5.4-2
    return text, stop


# --------------------------------------------------------------------------- properties


def encode_properties(props: Properties) -> bytes:
    """Encode a property block, length prefix included (one 0 byte when empty)."""
    if not props:
        return b"\x00"
    body = bytearray()
    value: Any  # what each value is follows from its wire type (PROPERTY_TABLE)
    for pid, value in props.items():
        wire = PROPERTY_TABLE[pid][0]
        if wire is _UTF8_PAIR:
            for name, val in value:
                body.append(pid)
                body += encode_utf8(name)
                body += encode_utf8(val)
        elif wire is _VARINT:
            for val in value if isinstance(value, list) else (value,):
                body.append(pid)
                body += encode_varint(val)
        else:
            body.append(pid)
            body += _ENCODE_SCALAR[wire](value)
    return encode_varint(len(body)) + body


def _encode_byte(value: int) -> bytes:
    return bytes((value,))


_ENCODE_SCALAR: Final[dict[WireType, Callable[[Any], bytes]]] = {
    WireType.BYTE: _encode_byte,
    WireType.TWO_BYTE: _pack_u16,
    WireType.FOUR_BYTE: _pack_u32,
    WireType.UTF8: encode_utf8,
    WireType.BINARY: encode_binary,
}


def _decode_byte(data: bytes, pos: int, end: int) -> tuple[int, int]:
    if pos >= end:
        raise MalformedPacket("byte runs past the packet")
    return data[pos], pos + 1


_DECODE_NUMBER: Final[dict[WireType, Callable[[bytes, int, int], tuple[int, int]]]] = {
    WireType.BYTE: _decode_byte,
    WireType.TWO_BYTE: decode_u16,
    WireType.FOUR_BYTE: decode_u32,
    WireType.VARINT: decode_varint,
}
_ScalarDecoder = Callable[[bytes, int, int], tuple[int | str | bytes, int]]
_DECODE_SCALAR: Final[dict[WireType, _ScalarDecoder]] = {
    **_DECODE_NUMBER,
    WireType.UTF8: decode_utf8,
    WireType.BINARY: decode_binary,
}


# Reason code for a property value out of its range, where the spec names one other than 0x82:
# Topic Alias 0 is 0x94 Topic Alias invalid (MQTT-3.3.2-8, spec 3.3.2.3.4 and 4.13.1).
_OUT_OF_BOUNDS: Final[dict[int, ReasonCode]] = {
    PropertyId.TOPIC_ALIAS: ReasonCode.TOPIC_ALIAS_INVALID}


def with_topic_alias(block: bytes, alias: int) -> bytes:
    """The encoded property block ``block`` (length prefix included) with a Topic Alias
    property in front: an outgoing PUBLISH's block without decoding and re-encoding it."""
    length = block[0]
    if length < 125:  # one length byte before and after: the usual block (often empty)
        return bytes((length + 3, _TOPIC_ALIAS, alias >> 8, alias & 0xFF)) + block[1:]
    length, pos = decode_varint(block, 0, len(block))
    return b"".join((encode_varint(length + 3), bytes((_TOPIC_ALIAS,)), _pack_u16(alias),
                     block[pos:]))


_TOPIC_ALIAS: Final = int(PropertyId.TOPIC_ALIAS)
_SUBSCRIPTION_IDENTIFIER: Final = int(PropertyId.SUBSCRIPTION_IDENTIFIER)


def decode_properties(
    data: bytes, pos: int, end: int, kind: PacketKind
) -> tuple[Properties, int]:
    """Decode a property block; return (properties, position after it)."""
    length, pos = decode_varint(data, pos, end)
    if length == 0:
        return {}, pos
    stop = pos + length
    if stop > end:
        raise MalformedPacket("property length runs past the packet")
    props: Properties = {}
    pairs: list[tuple[str, str]] | None = None  # the USER_PROPERTY list, once there is one
    ids: list[int] | None = None  # the SUBSCRIPTION_IDENTIFIER list, once there is one
    while pos < stop:
        pid, pos = decode_varint(data, pos, stop)
        entry = PROPERTY_TABLE.get(pid)
        if entry is None:
            raise MalformedPacket(f"unknown property identifier 0x{pid:02X}")
        wire, kinds, bounds = entry
        if kind not in kinds:
            raise MalformedPacket(f"property 0x{pid:02X} is not allowed in {kind.name}")
        if wire is _UTF8_PAIR:  # USER_PROPERTY, the one pair property (it may repeat)
            name, pos = decode_utf8(data, pos, stop)
            val, pos = decode_utf8(data, pos, stop)
            if pairs is None:
                pairs = props[pid] = []
            pairs.append((name, val))
            continue
        if bounds is None:
            value, pos = _DECODE_SCALAR[wire](data, pos, stop)
        else:  # a number with a range
            number, pos = _DECODE_NUMBER[wire](data, pos, stop)
            if not bounds[0] <= number <= bounds[1]:
                raise RemoteProtocolError(f"property 0x{pid:02X} has invalid value {number!r}",
                                          _OUT_OF_BOUNDS.get(pid, ReasonCode.PROTOCOL_ERROR))
            if pid == _SUBSCRIPTION_IDENTIFIER:  # the one repeatable scalar (REPEATABLE)
                if ids is None:
                    ids = props[pid] = []
                ids.append(number)
                continue
            value = number
        if pid in props:
            raise RemoteProtocolError(f"property 0x{pid:02X} appears more than once")
        props[pid] = value
    return props, pos


# --------------------------------------------------------------------------- framing


def parse_fixed_header(data: bytes | bytearray, pos: int, end: int) -> tuple[int, int, int]:
    """Locate one frame: return (first byte, body start, body end).

    Raises ``InsufficientData`` when the fixed header or body is incomplete; the caller keeps
    the bytes and tries again with more. ``MalformedPacket`` for a bad length encoding.
    """
    if end - pos < 2:
        raise InsufficientData
    first = data[pos]
    byte = data[pos + 1]
    if byte < 128:  # fast path: one length byte
        start = pos + 2
        stop = start + byte
    else:
        length = byte & 0x7F
        shift = 7
        i = pos + 2
        while True:
            if i >= end:
                raise InsufficientData
            byte = data[i]
            length |= (byte & 0x7F) << shift
            i += 1
            if not byte & 0x80:
                break
            shift += 7
            if shift > 21:
                raise MalformedPacket("remaining length longer than 4 bytes")
        start = i
        stop = start + length
    if stop > end:
        raise InsufficientData
    return first, start, stop


def frame_length_hint(data: bytes, pos: int, end: int) -> int | None:
    """Remaining length announced by a frame header, once the header is complete."""
    length = 0
    shift = 0
    for i in range(pos + 1, min(pos + 5, end)):
        byte = data[i]
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return length
        shift += 7
    if end - pos >= 5:
        raise MalformedPacket("remaining length longer than 4 bytes")
    return None


def _frame(first: int, body: bytes | bytearray) -> bytes:
    n = len(body)
    if n < 128:
        return bytes((first, n)) + body
    return bytes((first,)) + encode_varint(n) + body


# --------------------------------------------------------------------------- decoders


def _need_packet_id(data: bytes, pos: int, end: int) -> tuple[int, int]:
    packet_id, pos = decode_u16(data, pos, end)
    if packet_id == 0:
        raise MalformedPacket("packet identifier must not be 0")  # MQTT-2.2.1-3
    return packet_id, pos


def _expect_end(pos: int, end: int, what: str) -> None:
    if pos != end:
        raise MalformedPacket(f"{what} has {end - pos} unexpected trailing bytes")


# The protocols spoken: (name, level). MQTT 3.1 is IBM's V3.1 ("MQIsdp", level 3), still sent by
# older devices; 3.1.1 (OASIS) and 5.0 call themselves "MQTT".
PROTOCOLS: Final = frozenset({("MQIsdp", MQTT_31), ("MQTT", MQTT_311), ("MQTT", MQTT_5)})


_MQTT_NAME: Final = b"\x00\x04MQTT"  # how the variable header of a 3.1.1 or 5.0 CONNECT begins


def _unsupported_level(name: str, level: int) -> RemoteProtocolError:
    return RemoteProtocolError(  # MQTT-3.1.2-2: CONNACK 0x84 (3.x: 0x01), then close
        f"unsupported protocol level {level} for {name!r}",
        ReasonCode.UNSUPPORTED_PROTOCOL_VERSION,
    )


def decode_connect(data: bytes, pos: int, end: int, version: int = 0) -> Connect:
    """Decode a CONNECT body (``version`` is ignored: a CONNECT states its own)."""
    if end - pos >= 10 and data[pos : pos + 6] == _MQTT_NAME:
        # The usual start, read in place: name, level, flags and keep alive (10 bytes).
        name = "MQTT"
        level = data[pos + 6]
        if level != MQTT_311 and level != MQTT_5:
            raise _unsupported_level(name, level)
        flags = data[pos + 7]
        keep_alive = (data[pos + 8] << 8) | data[pos + 9]
        pos += 10
    else:
        name, pos = decode_utf8(data, pos, end)
        level, pos = _decode_byte(data, pos, end)
        if name not in ("MQTT", "MQIsdp"):
            raise MalformedPacket(f"unknown protocol name {name!r}")  # MQTT-3.1.2-1
        if (name, level) not in PROTOCOLS:
            raise _unsupported_level(name, level)
        flags, pos = _decode_byte(data, pos, end)
        keep_alive, pos = decode_u16(data, pos, end)
    if flags & 0x01:
        raise MalformedPacket("CONNECT reserved flag is set")  # MQTT-3.1.2-3
    will_flag = bool(flags & 0x04)
    will_qos = (flags >> 3) & 0x03
    will_retain = bool(flags & 0x20)
    if will_qos == 3:
        raise MalformedPacket("will QoS 3")  # MQTT-3.1.2-12
    if not will_flag and (will_qos or will_retain):
        raise MalformedPacket("will QoS or retain set without will flag")  # MQTT-3.1.2-11,13
    has_password = bool(flags & 0x40)
    has_username = bool(flags & 0x80)
    if level != MQTT_5 and has_password and not has_username:
        raise MalformedPacket("password flag set without user name flag")  # MQTT-3.1.2-22
    props: Properties = {}
    if level == MQTT_5:
        if pos < end and data[pos] == 0:  # no properties: most CONNECTs
            pos += 1
        else:
            props, pos = decode_properties(data, pos, end, PacketKind.CONNECT)
    client_id, pos = decode_utf8(data, pos, end)
    will = None
    if will_flag:
        will_props: Properties = {}
        if level == MQTT_5:
            will_props, pos = decode_properties(data, pos, end, PacketKind.WILL)
        will_topic, pos = decode_utf8(data, pos, end)
        will_payload, pos = decode_binary(data, pos, end)
        will = Will(will_topic, will_payload, will_qos, will_retain, will_props)
    username = password = None
    if has_username:
        username, pos = decode_utf8(data, pos, end)
    if has_password:
        password, pos = decode_binary(data, pos, end)
    _expect_end(pos, end, "CONNECT")
    return Connect(
        client_id, level, bool(flags & 0x02), keep_alive, username, password, will, props, name
    )


def decode_connack(data: bytes, pos: int, end: int, version: int) -> Connack:
    ack_flags, pos = _decode_byte(data, pos, end)
    if ack_flags & 0xFE:
        raise MalformedPacket("CONNACK reserved flags are set")  # MQTT-3.2.2-1
    code, pos = _decode_byte(data, pos, end)
    props: Properties = {}
    if version == MQTT_5:
        if code not in _CONNACK_CODES:
            raise MalformedPacket(f"invalid CONNACK reason code 0x{code:02X}")
        props, pos = decode_properties(data, pos, end, PacketKind.CONNACK)
    elif code > 5:
        raise MalformedPacket(f"invalid CONNACK return code {code}")
    _expect_end(pos, end, "CONNACK")
    return Connack(bool(ack_flags & 1), code, props)


def decode_publish(data: bytes, pos: int, end: int, flags: int, version: int) -> Publish:
    qos = (flags >> 1) & 0x03
    if qos == 3:
        raise MalformedPacket("PUBLISH with QoS 3")  # MQTT-3.3.1-4
    if qos == 0 and flags & 0x08:
        raise MalformedPacket("DUP set on a QoS 0 PUBLISH")  # MQTT-3.3.1-2
    topic, pos = decode_utf8(data, pos, end)
    packet_id = None
    if qos:
        packet_id, pos = _need_packet_id(data, pos, end)
    props: Properties = {}
    if version == MQTT_5:
        if pos < end and data[pos] == 0:
            pos += 1
        else:
            props, pos = decode_properties(data, pos, end, PacketKind.PUBLISH)
    return Publish(topic, data[pos:end], qos, bool(flags & 1), bool(flags & 8), packet_id, props)


_AckClass = type[Puback] | type[Pubrec] | type[Pubrel] | type[Pubcomp]
_ACK_CLASSES: Final[dict[int, tuple[_AckClass, frozenset[int], PacketKind]]] = {
    PacketType.PUBACK: (Puback, _PUBACK_CODES, PacketKind.PUBACK),
    PacketType.PUBREC: (Pubrec, _PUBACK_CODES, PacketKind.PUBREC),
    PacketType.PUBREL: (Pubrel, _PUBREL_CODES, PacketKind.PUBREL),
    PacketType.PUBCOMP: (Pubcomp, _PUBREL_CODES, PacketKind.PUBCOMP),
}


def _decode_ack(ptype: int, data: bytes, pos: int, end: int, version: int) -> Packet:
    cls, codes, kind = _ACK_CLASSES[ptype]
    packet_id, pos = _need_packet_id(data, pos, end)
    code = 0
    props: Properties = {}
    if version == MQTT_5 and pos < end:
        code, pos = _decode_byte(data, pos, end)
        if code not in codes:
            raise MalformedPacket(f"invalid {cls.__name__.upper()} reason code 0x{code:02X}")
        if pos < end:
            props, pos = decode_properties(data, pos, end, kind)
    _expect_end(pos, end, cls.__name__.upper())
    return cls(packet_id, code, props)


def decode_subscribe(data: bytes, pos: int, end: int, version: int) -> Subscribe:
    packet_id, pos = _need_packet_id(data, pos, end)
    props: Properties = {}
    if version == MQTT_5:
        props, pos = decode_properties(data, pos, end, PacketKind.SUBSCRIBE)
        if len(get_property(props, PropertyId.SUBSCRIPTION_IDENTIFIER) or ()) > 1:
            raise RemoteProtocolError("more than one subscription identifier")
    subscriptions: list[tuple[str, SubscriptionOptions]] = []
    while pos < end:
        topic_filter, pos = decode_utf8(data, pos, end)
        options, pos = _decode_byte(data, pos, end)
        subscriptions.append((topic_filter, _decode_subscription_options(options, version)))
    if not subscriptions:
        raise RemoteProtocolError("SUBSCRIBE without topic filters")  # MQTT-3.8.3-2
    return Subscribe(packet_id, subscriptions, props)


def _decode_subscription_options(options: int, version: int) -> SubscriptionOptions:
    qos = options & 0x03
    if qos == 3:
        raise MalformedPacket("subscription requests QoS 3")
    if version != MQTT_5:
        if options & 0xFC:
            raise MalformedPacket("reserved subscription option bits are set")  # MQTT-3-8.3-4
        return SubscriptionOptions(qos)
    if options & 0xC0:
        raise MalformedPacket("reserved subscription option bits are set")  # MQTT-3.8.3-5
    retain_handling = (options >> 4) & 0x03
    if retain_handling == 3:
        raise MalformedPacket("retain handling 3")
    return SubscriptionOptions(qos, bool(options & 0x04), bool(options & 0x08), retain_handling)


def decode_suback(data: bytes, pos: int, end: int, version: int) -> Suback:
    packet_id, pos = _need_packet_id(data, pos, end)
    props: Properties = {}
    allowed = _SUBACK_CODES_31 if version == MQTT_31 else _SUBACK_CODES_311
    if version == MQTT_5:
        props, pos = decode_properties(data, pos, end, PacketKind.SUBACK)
        allowed = _SUBACK_CODES
    codes = list(data[pos:end])
    if not codes or any(code not in allowed for code in codes):
        raise MalformedPacket("SUBACK reason codes missing or invalid")
    return Suback(packet_id, codes, props)


def decode_unsubscribe(data: bytes, pos: int, end: int, version: int) -> Unsubscribe:
    packet_id, pos = _need_packet_id(data, pos, end)
    props: Properties = {}
    if version == MQTT_5:
        props, pos = decode_properties(data, pos, end, PacketKind.UNSUBSCRIBE)
    filters: list[str] = []
    while pos < end:
        topic_filter, pos = decode_utf8(data, pos, end)
        filters.append(topic_filter)
    if not filters:
        raise RemoteProtocolError("UNSUBSCRIBE without topic filters")  # MQTT-3.10.3-2
    return Unsubscribe(packet_id, filters, props)


def decode_unsuback(data: bytes, pos: int, end: int, version: int) -> Unsuback:
    packet_id, pos = _need_packet_id(data, pos, end)
    if version != MQTT_5:
        _expect_end(pos, end, "UNSUBACK")
        return Unsuback(packet_id)
    props, pos = decode_properties(data, pos, end, PacketKind.UNSUBACK)
    codes = list(data[pos:end])
    if not codes or any(code not in _UNSUBACK_CODES for code in codes):
        raise MalformedPacket("UNSUBACK reason codes missing or invalid")
    return Unsuback(packet_id, codes, props)


def _decode_reason_and_props(
    data: bytes, pos: int, end: int, kind: PacketKind, codes: frozenset[int]
) -> tuple[int, Properties]:
    if pos == end:
        return 0, {}
    code, pos = _decode_byte(data, pos, end)
    if code not in codes:
        raise MalformedPacket(f"invalid {kind.name} reason code 0x{code:02X}")
    props: Properties = {}
    if pos < end:
        props, pos = decode_properties(data, pos, end, kind)
    _expect_end(pos, end, kind.name)
    return code, props


def decode_disconnect(data: bytes, pos: int, end: int, version: int) -> Disconnect:
    if version != MQTT_5:
        _expect_end(pos, end, "DISCONNECT")
        return Disconnect()
    return Disconnect(
        *_decode_reason_and_props(data, pos, end, PacketKind.DISCONNECT, _DISCONNECT_CODES)
    )


def decode_auth(data: bytes, pos: int, end: int, version: int) -> Auth:
    if version != MQTT_5:
        raise MalformedPacket("AUTH is not a 3.1/3.1.1 packet")
    return Auth(*_decode_reason_and_props(data, pos, end, PacketKind.AUTH, _AUTH_CODES))


def _decode_empty(cls: type[Pingreq] | type[Pingresp], pos: int, end: int) -> Packet:
    _expect_end(pos, end, cls.__name__.upper())
    return cls()


# Required fixed-header flag nibble per packet type (MQTT-2.1.3-1); PUBLISH is free-form.
_REQUIRED_FLAGS: Final[dict[int, int]] = {
    PacketType.CONNECT: 0, PacketType.CONNACK: 0, PacketType.PUBACK: 0, PacketType.PUBREC: 0,
    PacketType.PUBREL: 2, PacketType.PUBCOMP: 0, PacketType.SUBSCRIBE: 2, PacketType.SUBACK: 0,
    PacketType.UNSUBSCRIBE: 2, PacketType.UNSUBACK: 0, PacketType.PINGREQ: 0,
    PacketType.PINGRESP: 0, PacketType.DISCONNECT: 0, PacketType.AUTH: 0,
}


_DUP_ALLOWED_31: Final = frozenset(
    {PacketType.PUBREL, PacketType.SUBSCRIBE, PacketType.UNSUBSCRIBE})


def decode_packet(first: int, data: bytes, pos: int, end: int, version: int) -> Packet:
    """Decode the frame body ``data[pos:end]`` whose first header byte is ``first``.

    ``version`` is the connection's protocol level (ignored for CONNECT, which states its own).
    Raises only ``RemoteProtocolError`` (usually ``MalformedPacket``).
    """
    ptype = first >> 4
    flags = first & 0x0F
    try:
        if ptype == _PUBLISH:
            return decode_publish(data, pos, end, flags, version)
        required = _REQUIRED_FLAGS.get(ptype)
        if required is None:
            raise MalformedPacket(f"reserved packet type {ptype}")
        if flags != required and not (
            version == MQTT_31 and flags == 0x0A and ptype in _DUP_ALLOWED_31
        ):  # MQTT 3.1 (section 2.1) sets DUP on a resent PUBREL, SUBSCRIBE or UNSUBSCRIBE
            raise MalformedPacket(f"invalid fixed header flags for packet type {ptype}")
        return _DECODERS[ptype](data, pos, end, version)
    except RemoteProtocolError:
        raise
    except Exception as exc:  # a bounds slip must still be a protocol error, never a crash
        raise MalformedPacket(f"undecodable packet type {ptype}: {exc!r}") from None


_DECODERS: Final[dict[int, Callable[[bytes, int, int, int], Packet]]] = {
    PacketType.CONNECT: decode_connect,
    PacketType.CONNACK: decode_connack,
    PacketType.PUBACK: partial(_decode_ack, PacketType.PUBACK),
    PacketType.PUBREC: partial(_decode_ack, PacketType.PUBREC),
    PacketType.PUBREL: partial(_decode_ack, PacketType.PUBREL),
    PacketType.PUBCOMP: partial(_decode_ack, PacketType.PUBCOMP),
    PacketType.SUBSCRIBE: decode_subscribe,
    PacketType.SUBACK: decode_suback,
    PacketType.UNSUBSCRIBE: decode_unsubscribe,
    PacketType.UNSUBACK: decode_unsuback,
    PacketType.PINGREQ: lambda d, p, e, v: _decode_empty(Pingreq, p, e),
    PacketType.PINGRESP: lambda d, p, e, v: _decode_empty(Pingresp, p, e),
    PacketType.DISCONNECT: decode_disconnect,
    PacketType.AUTH: decode_auth,
}


# --------------------------------------------------------------------------- encoders


def encode_publish(
    topic: bytes,
    payload: bytes,
    qos: int,
    retain: bool,
    dup: bool,
    packet_id: int | None,
    properties: bytes | None,
) -> bytes:
    """Encode a PUBLISH from pre-encoded parts.

    ``topic`` is the UTF-8 topic (may be empty when a topic alias is used); ``properties`` is
    an encoded property block for 5.0 (``b"\\x00"`` when empty) or ``None`` for 3.1.1.
    """
    first = 0x30 | (qos << 1) | (8 if dup else 0) | (1 if retain else 0)
    middle = _pack_u16(packet_id) if qos else b""
    if properties is not None:
        middle += properties
    topic_length = len(topic)
    length = 2 + topic_length + len(middle) + len(payload)
    if length < 128:  # the fixed header and the topic length in one pack
        head = _PUBLISH_HEAD.pack(first, length, topic_length)
    else:
        head = bytes((first,)) + encode_varint(length) + _pack_u16(topic_length)
    return b"".join((head, topic, middle, payload))


def _encode_publish_packet(packet: Publish, version: int) -> bytes:
    props = encode_properties(packet.properties) if version == MQTT_5 else None
    return encode_publish(
        packet.topic.encode("utf-8"), packet.payload, packet.qos, packet.retain, packet.dup,
        packet.packet_id, props,
    )


def _encode_connect(packet: Connect, version: int) -> bytes:
    level = packet.protocol_level
    flags = 0x02 if packet.clean_start else 0
    will = packet.will
    if will is not None:
        flags |= 0x04 | (will.qos << 3) | (0x20 if will.retain else 0)
    if packet.username is not None:
        flags |= 0x80
    if packet.password is not None:
        flags |= 0x40
    body = bytearray(encode_utf8(packet.protocol_name))
    body.append(level)
    body.append(flags)
    body += _pack_u16(packet.keep_alive)
    if level == MQTT_5:
        body += encode_properties(packet.properties)
    body += encode_utf8(packet.client_id)
    if will is not None:
        if level == MQTT_5:
            body += encode_properties(will.properties)
        body += encode_utf8(will.topic)
        body += encode_binary(will.payload)
    if packet.username is not None:
        body += encode_utf8(packet.username)
    if packet.password is not None:
        body += encode_binary(packet.password)
    return _frame(0x10, body)


def _encode_connack(packet: Connack, version: int) -> bytes:
    if version == MQTT_5:
        return encode_connack_5(packet.session_present, packet.reason_code,
                                encode_properties(packet.properties))
    return _frame(0x20, bytes((1 if packet.session_present else 0, packet.reason_code)))


def encode_connack_5(session_present: bool, reason_code: int, properties: bytes) -> bytes:
    """A 5.0 CONNACK around a property block already encoded (``encode_properties``)."""
    return _frame(0x20, bytes((1 if session_present else 0, reason_code)) + properties)


def _encode_ack(packet: Puback | Pubrec | Pubrel | Pubcomp, version: int) -> bytes:
    ptype = packet.type
    first = (ptype << 4) | (2 if ptype == _PUBREL else 0)
    if version == MQTT_5 and (packet.reason_code or packet.properties):
        body = _pack_u16(packet.packet_id) + bytes((packet.reason_code,))
        if packet.properties:
            body += encode_properties(packet.properties)
        return _frame(first, body)
    return _ACK_FRAME.pack(first, 2, packet.packet_id)


def encode_ack(first: int, packet_id: int) -> bytes:
    """The 4-byte PUBACK/PUBREC/PUBREL/PUBCOMP of 3.1.1, and of 5.0 with reason code 0 and no
    properties: ``first`` is the fixed header byte (0x40, 0x50, 0x62 or 0x70)."""
    return _ACK_FRAME.pack(first, 2, packet_id)


def _encode_subscribe(packet: Subscribe, version: int) -> bytes:
    body = bytearray(_pack_u16(packet.packet_id))
    if version == MQTT_5:
        body += encode_properties(packet.properties)
    for topic_filter, opts in packet.subscriptions:
        body += encode_utf8(topic_filter)
        options = opts.qos
        if version == MQTT_5:
            options |= (
                (4 if opts.no_local else 0) | (8 if opts.retain_as_published else 0)
                | (opts.retain_handling << 4)
            )
        body.append(options)
    return _frame(0x82, body)


def _encode_suback(packet: Suback | Unsuback, version: int) -> bytes:
    body = bytearray(_pack_u16(packet.packet_id))
    if version == MQTT_5:
        body += encode_properties(packet.properties)
        body += bytes(packet.reason_codes)
    elif packet.type == PacketType.SUBACK:
        body += bytes(packet.reason_codes)
    return _frame(packet.type << 4, body)


def _encode_unsubscribe(packet: Unsubscribe, version: int) -> bytes:
    body = bytearray(_pack_u16(packet.packet_id))
    if version == MQTT_5:
        body += encode_properties(packet.properties)
    for topic_filter in packet.topic_filters:
        body += encode_utf8(topic_filter)
    return _frame(0xA2, body)


def _encode_reason_packet(packet: Disconnect | Auth, version: int) -> bytes:
    first = packet.type << 4
    if version != MQTT_5 or (packet.reason_code == 0 and not packet.properties):
        return bytes((first, 0))
    body = bytes((packet.reason_code,))
    if packet.properties:
        body += encode_properties(packet.properties)
    return _frame(first, body)


# Each encoder takes the packet class of its key (Any: a dict cannot say so per key).
_ENCODERS: Final[dict[int, Callable[[Any, int], bytes]]] = {
    PacketType.CONNECT: _encode_connect,
    PacketType.CONNACK: _encode_connack,
    PacketType.PUBLISH: _encode_publish_packet,
    PacketType.PUBACK: _encode_ack,
    PacketType.PUBREC: _encode_ack,
    PacketType.PUBREL: _encode_ack,
    PacketType.PUBCOMP: _encode_ack,
    PacketType.SUBSCRIBE: _encode_subscribe,
    PacketType.SUBACK: _encode_suback,
    PacketType.UNSUBSCRIBE: _encode_unsubscribe,
    PacketType.UNSUBACK: _encode_suback,
    PacketType.PINGREQ: lambda p, v: b"\xc0\x00",
    PacketType.PINGRESP: lambda p, v: b"\xd0\x00",
    PacketType.DISCONNECT: _encode_reason_packet,
    PacketType.AUTH: _encode_reason_packet,
}


def encode_packet(packet: Packet, version: int) -> bytes:
    """Encode ``packet`` for a peer speaking protocol level ``version`` (4 or 5)."""
    frame = _ENCODERS[packet.type](packet, version)
    if len(frame) > MAX_REMAINING_LENGTH + 5:
        raise LocalProtocolError("packet too large for MQTT")
    return frame


def decode_frames(data: bytes, version: int) -> list[Packet]:
    """Decode every complete frame in ``data`` (a convenience for tests and tools)."""
    packets: list[Packet] = []
    pos, end = 0, len(data)
    while pos < end:
        first, start, stop = parse_fixed_header(data, pos, end)
        packets.append(decode_packet(first, data, start, stop, version))
        pos = stop
    return packets
