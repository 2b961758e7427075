"""MQTT 5.0 properties (spec section 2.2.2): identifiers, wire types, where each may appear.

A property set is a plain ``dict[int, PropertyValue]`` keyed by ``PropertyId``: scalar
properties map to their value (an ``int``, ``str`` or ``bytes``, as ``PROPERTY_TABLE`` says),
``USER_PROPERTY`` maps to a list of ``(name, value)`` string pairs and
``SUBSCRIPTION_IDENTIFIER`` to a list of ints (it may repeat in a PUBLISH sent by the server).
Plain dicts keep the hot path cheap and make "forward untouched" a matter of passing one along.

Read a property with ``get_property(props, PropertyId.X[, default])``: the type checker then
knows the value's type from the key (``int | None`` for ``MESSAGE_EXPIRY_INTERVAL``, a list of
pairs for ``USER_PROPERTY``...). At run time it *is* ``dict.get``, so it costs what
``props.get`` costs; the types it promises hold because the codec decodes each property with
its wire type (the key groups below are checked against ``PROPERTY_TABLE`` by the tests).
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING, Literal, overload


class PropertyId(IntEnum):
    PAYLOAD_FORMAT_INDICATOR = 0x01
    MESSAGE_EXPIRY_INTERVAL = 0x02
    CONTENT_TYPE = 0x03
    RESPONSE_TOPIC = 0x08
    CORRELATION_DATA = 0x09
    SUBSCRIPTION_IDENTIFIER = 0x0B
    SESSION_EXPIRY_INTERVAL = 0x11
    ASSIGNED_CLIENT_IDENTIFIER = 0x12
    SERVER_KEEP_ALIVE = 0x13
    AUTHENTICATION_METHOD = 0x15
    AUTHENTICATION_DATA = 0x16
    REQUEST_PROBLEM_INFORMATION = 0x17
    WILL_DELAY_INTERVAL = 0x18
    REQUEST_RESPONSE_INFORMATION = 0x19
    RESPONSE_INFORMATION = 0x1A
    SERVER_REFERENCE = 0x1C
    REASON_STRING = 0x1F
    RECEIVE_MAXIMUM = 0x21
    TOPIC_ALIAS_MAXIMUM = 0x22
    TOPIC_ALIAS = 0x23
    MAXIMUM_QOS = 0x24
    RETAIN_AVAILABLE = 0x25
    USER_PROPERTY = 0x26
    MAXIMUM_PACKET_SIZE = 0x27
    WILDCARD_SUBSCRIPTION_AVAILABLE = 0x28
    SUBSCRIPTION_IDENTIFIER_AVAILABLE = 0x29
    SHARED_SUBSCRIPTION_AVAILABLE = 0x2A


PropertyValue = int | str | bytes | list[int] | list[tuple[str, str]]
Properties = dict[int, PropertyValue]

# The properties of each value type (their wire types in PROPERTY_TABLE below).
IntProperty = Literal[
    PropertyId.PAYLOAD_FORMAT_INDICATOR,
    PropertyId.MESSAGE_EXPIRY_INTERVAL,
    PropertyId.SESSION_EXPIRY_INTERVAL,
    PropertyId.SERVER_KEEP_ALIVE,
    PropertyId.REQUEST_PROBLEM_INFORMATION,
    PropertyId.WILL_DELAY_INTERVAL,
    PropertyId.REQUEST_RESPONSE_INFORMATION,
    PropertyId.RECEIVE_MAXIMUM,
    PropertyId.TOPIC_ALIAS_MAXIMUM,
    PropertyId.TOPIC_ALIAS,
    PropertyId.MAXIMUM_QOS,
    PropertyId.RETAIN_AVAILABLE,
    PropertyId.MAXIMUM_PACKET_SIZE,
    PropertyId.WILDCARD_SUBSCRIPTION_AVAILABLE,
    PropertyId.SUBSCRIPTION_IDENTIFIER_AVAILABLE,
    PropertyId.SHARED_SUBSCRIPTION_AVAILABLE,
]
StrProperty = Literal[
    PropertyId.CONTENT_TYPE,
    PropertyId.RESPONSE_TOPIC,
    PropertyId.ASSIGNED_CLIENT_IDENTIFIER,
    PropertyId.AUTHENTICATION_METHOD,
    PropertyId.RESPONSE_INFORMATION,
    PropertyId.SERVER_REFERENCE,
    PropertyId.REASON_STRING,
]
BytesProperty = Literal[PropertyId.CORRELATION_DATA, PropertyId.AUTHENTICATION_DATA]
UserProperty = Literal[PropertyId.USER_PROPERTY]
SubscriptionIdentifier = Literal[PropertyId.SUBSCRIPTION_IDENTIFIER]

if TYPE_CHECKING:  # the typed view of dict.get and dict.pop; these bodies never run

    @overload
    def get_property(props: Properties, key: IntProperty, /) -> int | None: ...
    @overload
    def get_property(props: Properties, key: IntProperty, default: int, /) -> int: ...
    @overload
    def get_property(props: Properties, key: StrProperty, /) -> str | None: ...
    @overload
    def get_property(props: Properties, key: BytesProperty, /) -> bytes | None: ...
    @overload
    def get_property(
        props: Properties, key: UserProperty, /) -> list[tuple[str, str]] | None: ...
    @overload
    def get_property(props: Properties, key: SubscriptionIdentifier, /) -> list[int] | None: ...
    def get_property(props: Properties, key: int, default: object = None, /) -> object:
        return props.get(key, default)

    def pop_property(props: Properties, key: IntProperty, default: None, /) -> int | None:
        value = props.pop(key, default)
        return value if isinstance(value, int) else None

else:
    get_property = dict.get
    pop_property = dict.pop


class WireType(IntEnum):
    BYTE = 1
    TWO_BYTE = 2
    FOUR_BYTE = 4
    VARINT = 5
    UTF8 = 6
    BINARY = 7
    UTF8_PAIR = 8


class PacketKind(IntEnum):
    """Where a property may appear; WILL is the will-properties block of CONNECT."""

    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    DISCONNECT = 14
    AUTH = 15
    WILL = 16


_P = PacketKind
_ACKS = (_P.PUBACK, _P.PUBREC, _P.PUBREL, _P.PUBCOMP, _P.SUBACK, _P.UNSUBACK)
_ALL = (*_P.__members__.values(),)

# id -> (wire type, packet kinds where allowed, (min, max) for numeric values or None)
PROPERTY_TABLE: dict[int, tuple[WireType, frozenset[int], tuple[int, int] | None]] = {
    PropertyId.PAYLOAD_FORMAT_INDICATOR: (WireType.BYTE, frozenset({_P.PUBLISH, _P.WILL}), (0, 1)),
    PropertyId.MESSAGE_EXPIRY_INTERVAL: (
        WireType.FOUR_BYTE, frozenset({_P.PUBLISH, _P.WILL}), None),
    PropertyId.CONTENT_TYPE: (WireType.UTF8, frozenset({_P.PUBLISH, _P.WILL}), None),
    PropertyId.RESPONSE_TOPIC: (WireType.UTF8, frozenset({_P.PUBLISH, _P.WILL}), None),
    PropertyId.CORRELATION_DATA: (WireType.BINARY, frozenset({_P.PUBLISH, _P.WILL}), None),
    PropertyId.SUBSCRIPTION_IDENTIFIER: (
        WireType.VARINT, frozenset({_P.PUBLISH, _P.SUBSCRIBE}), (1, 268_435_455)),
    PropertyId.SESSION_EXPIRY_INTERVAL: (
        WireType.FOUR_BYTE, frozenset({_P.CONNECT, _P.CONNACK, _P.DISCONNECT}), None),
    PropertyId.ASSIGNED_CLIENT_IDENTIFIER: (WireType.UTF8, frozenset({_P.CONNACK}), None),
    PropertyId.SERVER_KEEP_ALIVE: (WireType.TWO_BYTE, frozenset({_P.CONNACK}), None),
    PropertyId.AUTHENTICATION_METHOD: (
        WireType.UTF8, frozenset({_P.CONNECT, _P.CONNACK, _P.AUTH}), None),
    PropertyId.AUTHENTICATION_DATA: (
        WireType.BINARY, frozenset({_P.CONNECT, _P.CONNACK, _P.AUTH}), None),
    PropertyId.REQUEST_PROBLEM_INFORMATION: (WireType.BYTE, frozenset({_P.CONNECT}), (0, 1)),
    PropertyId.WILL_DELAY_INTERVAL: (WireType.FOUR_BYTE, frozenset({_P.WILL}), None),
    PropertyId.REQUEST_RESPONSE_INFORMATION: (WireType.BYTE, frozenset({_P.CONNECT}), (0, 1)),
    PropertyId.RESPONSE_INFORMATION: (WireType.UTF8, frozenset({_P.CONNACK}), None),
    PropertyId.SERVER_REFERENCE: (WireType.UTF8, frozenset({_P.CONNACK, _P.DISCONNECT}), None),
    PropertyId.REASON_STRING: (
        WireType.UTF8, frozenset({_P.CONNACK, *_ACKS, _P.DISCONNECT, _P.AUTH}), None),
    PropertyId.RECEIVE_MAXIMUM: (
        WireType.TWO_BYTE, frozenset({_P.CONNECT, _P.CONNACK}), (1, 65535)),
    PropertyId.TOPIC_ALIAS_MAXIMUM: (WireType.TWO_BYTE, frozenset({_P.CONNECT, _P.CONNACK}), None),
    PropertyId.TOPIC_ALIAS: (WireType.TWO_BYTE, frozenset({_P.PUBLISH}), (1, 65535)),
    PropertyId.MAXIMUM_QOS: (WireType.BYTE, frozenset({_P.CONNACK}), (0, 1)),
    PropertyId.RETAIN_AVAILABLE: (WireType.BYTE, frozenset({_P.CONNACK}), (0, 1)),
    PropertyId.USER_PROPERTY: (WireType.UTF8_PAIR, frozenset(_ALL), None),
    PropertyId.MAXIMUM_PACKET_SIZE: (
        WireType.FOUR_BYTE, frozenset({_P.CONNECT, _P.CONNACK}), (1, 268_435_460)),
    PropertyId.WILDCARD_SUBSCRIPTION_AVAILABLE: (WireType.BYTE, frozenset({_P.CONNACK}), (0, 1)),
    PropertyId.SUBSCRIPTION_IDENTIFIER_AVAILABLE: (WireType.BYTE, frozenset({_P.CONNACK}), (0, 1)),
    PropertyId.SHARED_SUBSCRIPTION_AVAILABLE: (WireType.BYTE, frozenset({_P.CONNACK}), (0, 1)),
}

# Properties that may appear more than once; every other duplicate is a Protocol Error.
REPEATABLE = frozenset({PropertyId.USER_PROPERTY, PropertyId.SUBSCRIPTION_IDENTIFIER})
