"""MQTT control packets as plain data (spec chapter 3).

One class per packet type; fields carry decoded values only, never bytes of the frame. Reason
codes default to success; ``properties`` is always a dict (empty for 3.1.1 peers). The codec in
``codec.py`` turns these into bytes and back for a given protocol version. Each class's ``type``
is a class attribute typed with its one value, so that ``packet.type is PacketType.X`` tells
the type checker which class a ``Packet`` is.

The packets are plain classes with ``__slots__``, not dataclasses: this module is compiled
(mypyc, docs/architecture.md, "The compiled hot path"), and a compiled dataclass is made through
the Python ``__init__`` that ``dataclasses`` generates, at several times the cost of a native
constructor, for a PUBLISH and its acknowledgement per message. ``_Fields`` gives them a
dataclass's equality and repr (by ``FIELDS``); the constructors keep a dataclass's positional
order, keywords and defaults. ``Will`` and ``SubscriptionOptions`` stay dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar, Final, Literal

from meshmq.mqtt.properties import Properties
from meshmq.mypycattr import mypyc_attr

MQTT_31: Final = 3  # protocol name "MQIsdp" (IBM's MQTT V3.1 specification)
MQTT_311: Final = 4
MQTT_5: Final = 5


class PacketType(IntEnum):
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
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14
    AUTH = 15


@mypyc_attr(allow_interpreted_subclasses=True)  # (Connect's base: see Connect)
class _Fields:
    """A packet's equality and repr, a dataclass's, by the names in ``FIELDS``."""

    __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(
            getattr(self, name) == getattr(other, name) for name in self.FIELDS)

    def __repr__(self) -> str:
        values = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.FIELDS)
        return f"{type(self).__name__}({values})"


@dataclass(slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class SubscriptionOptions:
    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@mypyc_attr(allow_interpreted_subclasses=True)  # broker/transport/certauth.py
class Connect(_Fields):
    FIELDS: ClassVar[tuple[str, ...]] = (
        "client_id", "protocol_level", "clean_start", "keep_alive", "username", "password", "will",
        "properties", "protocol_name")
    __slots__ = FIELDS
    type: ClassVar[Literal[PacketType.CONNECT]] = PacketType.CONNECT

    def __init__(self, client_id: str, protocol_level: int = MQTT_5, clean_start: bool = True,
                 keep_alive: int = 60, username: str | None = None, password: bytes | None = None,
                 will: Will | None = None, properties: Properties | None = None,
                 protocol_name: str = "MQTT") -> None:
        self.client_id = client_id
        self.protocol_level = protocol_level
        self.clean_start = clean_start
        self.keep_alive = keep_alive
        self.username = username
        self.password = password
        self.will = will
        self.properties: Properties = {} if properties is None else properties
        self.protocol_name = protocol_name


class Connack(_Fields):
    FIELDS: ClassVar[tuple[str, ...]] = ("session_present", "reason_code", "properties")
    __slots__ = FIELDS
    type: ClassVar[Literal[PacketType.CONNACK]] = PacketType.CONNACK

    def __init__(self, session_present: bool = False, reason_code: int = 0,
                 properties: Properties | None = None) -> None:
        self.session_present = session_present
        self.reason_code = reason_code
        self.properties: Properties = {} if properties is None else properties


class Publish(_Fields):
    FIELDS: ClassVar[tuple[str, ...]] = (
        "topic", "payload", "qos", "retain", "dup", "packet_id", "properties")
    __slots__ = FIELDS
    type: ClassVar[Literal[PacketType.PUBLISH]] = PacketType.PUBLISH

    def __init__(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
                 dup: bool = False, packet_id: int | None = None,
                 properties: Properties | None = None) -> None:
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.dup = dup
        self.packet_id = packet_id
        self.properties: Properties = {} if properties is None else properties


class _Ack(_Fields):
    """PUBACK, PUBREC, PUBREL and PUBCOMP: a packet id, a reason code, properties."""

    FIELDS: ClassVar[tuple[str, ...]] = ("packet_id", "reason_code", "properties")
    __slots__ = FIELDS

    def __init__(self, packet_id: int, reason_code: int = 0,
                 properties: Properties | None = None) -> None:
        self.packet_id = packet_id
        self.reason_code = reason_code
        self.properties: Properties = {} if properties is None else properties


class Puback(_Ack):
    __slots__ = ()
    type: ClassVar[Literal[PacketType.PUBACK]] = PacketType.PUBACK


class Pubrec(_Ack):
    __slots__ = ()
    type: ClassVar[Literal[PacketType.PUBREC]] = PacketType.PUBREC


class Pubrel(_Ack):
    __slots__ = ()
    type: ClassVar[Literal[PacketType.PUBREL]] = PacketType.PUBREL


class Pubcomp(_Ack):
    __slots__ = ()
    type: ClassVar[Literal[PacketType.PUBCOMP]] = PacketType.PUBCOMP


class Subscribe(_Fields):
    FIELDS: ClassVar[tuple[str, ...]] = ("packet_id", "subscriptions", "properties")
    __slots__ = FIELDS
    type: ClassVar[Literal[PacketType.SUBSCRIBE]] = PacketType.SUBSCRIBE

    def __init__(self, packet_id: int, subscriptions: list[tuple[str, SubscriptionOptions]],
                 properties: Properties | None = None) -> None:
        self.packet_id = packet_id
        self.subscriptions = subscriptions
        self.properties: Properties = {} if properties is None else properties


class Suback(_Fields):
    FIELDS: ClassVar[tuple[str, ...]] = ("packet_id", "reason_codes", "properties")
    __slots__ = FIELDS
    type: ClassVar[Literal[PacketType.SUBACK]] = PacketType.SUBACK

    def __init__(self, packet_id: int, reason_codes: list[int],
                 properties: Properties | None = None) -> None:
        self.packet_id = packet_id
        self.reason_codes = reason_codes
        self.properties: Properties = {} if properties is None else properties


class Unsubscribe(_Fields):
    FIELDS: ClassVar[tuple[str, ...]] = ("packet_id", "topic_filters", "properties")
    __slots__ = FIELDS
    type: ClassVar[Literal[PacketType.UNSUBSCRIBE]] = PacketType.UNSUBSCRIBE

    def __init__(self, packet_id: int, topic_filters: list[str],
                 properties: Properties | None = None) -> None:
        self.packet_id = packet_id
        self.topic_filters = topic_filters
        self.properties: Properties = {} if properties is None else properties


class Unsuback(_Fields):
    FIELDS: ClassVar[tuple[str, ...]] = ("packet_id", "reason_codes", "properties")
    __slots__ = FIELDS
    type: ClassVar[Literal[PacketType.UNSUBACK]] = PacketType.UNSUBACK

    def __init__(self, packet_id: int, reason_codes: list[int] | None = None,
                 properties: Properties | None = None) -> None:
        self.packet_id = packet_id
        self.reason_codes: list[int] = [] if reason_codes is None else reason_codes
        self.properties: Properties = {} if properties is None else properties


class Pingreq(_Fields):
    FIELDS: ClassVar[tuple[str, ...]] = ()
    __slots__ = FIELDS
    type: ClassVar[Literal[PacketType.PINGREQ]] = PacketType.PINGREQ


class Pingresp(_Fields):
    FIELDS: ClassVar[tuple[str, ...]] = ()
    __slots__ = FIELDS
    type: ClassVar[Literal[PacketType.PINGRESP]] = PacketType.PINGRESP


class _Reasoned(_Fields):
    """DISCONNECT and AUTH: a reason code, properties."""

    FIELDS: ClassVar[tuple[str, ...]] = ("reason_code", "properties")
    __slots__ = FIELDS

    def __init__(self, reason_code: int = 0, properties: Properties | None = None) -> None:
        self.reason_code = reason_code
        self.properties: Properties = {} if properties is None else properties


class Disconnect(_Reasoned):
    __slots__ = ()
    type: ClassVar[Literal[PacketType.DISCONNECT]] = PacketType.DISCONNECT


class Auth(_Reasoned):
    __slots__ = ()
    type: ClassVar[Literal[PacketType.AUTH]] = PacketType.AUTH


Packet = (
    Connect | Connack | Publish | Puback | Pubrec | Pubrel | Pubcomp | Subscribe | Suback
    | Unsubscribe | Unsuback | Pingreq | Pingresp | Disconnect | Auth
)
# Every packet but the two PINGs carries properties (an empty dict before 5.0).
PacketWithProperties = (
    Connect | Connack | Publish | Puback | Pubrec | Pubrel | Pubcomp | Subscribe | Suback
    | Unsubscribe | Unsuback | Disconnect | Auth
)
