"""MQTT control packets as plain data (spec chapter 3).

One class per packet type; fields carry decoded values only, never bytes of the frame. Reason
codes default to success; ``properties`` is always a dict (empty for 3.1.1 peers). The codec in
``codec.py`` turns these into bytes and back for a given protocol version. Each class's ``type``
is a class attribute typed with its one value, so that ``packet.type is PacketType.X`` tells
the type checker which class a ``Packet`` is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar, Final, Literal

from meshmq.mqtt.properties import Properties

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


@dataclass(slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Connect:
    client_id: str
    protocol_level: int = MQTT_5
    clean_start: bool = True
    keep_alive: int = 60
    username: str | None = None
    password: bytes | None = None
    will: Will | None = None
    properties: Properties = field(default_factory=dict)
    protocol_name: str = "MQTT"
    type: ClassVar[Literal[PacketType.CONNECT]] = PacketType.CONNECT


@dataclass(slots=True)
class Connack:
    session_present: bool = False
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)
    type: ClassVar[Literal[PacketType.CONNACK]] = PacketType.CONNACK


@dataclass(slots=True)
class Publish:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None
    properties: Properties = field(default_factory=dict)
    type: ClassVar[Literal[PacketType.PUBLISH]] = PacketType.PUBLISH


@dataclass(slots=True)
class Puback:
    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)
    type: ClassVar[Literal[PacketType.PUBACK]] = PacketType.PUBACK


@dataclass(slots=True)
class Pubrec:
    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)
    type: ClassVar[Literal[PacketType.PUBREC]] = PacketType.PUBREC


@dataclass(slots=True)
class Pubrel:
    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)
    type: ClassVar[Literal[PacketType.PUBREL]] = PacketType.PUBREL


@dataclass(slots=True)
class Pubcomp:
    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)
    type: ClassVar[Literal[PacketType.PUBCOMP]] = PacketType.PUBCOMP


@dataclass(slots=True, frozen=True)
class SubscriptionOptions:
    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass(slots=True)
class Subscribe:
    packet_id: int
    subscriptions: list[tuple[str, SubscriptionOptions]]
    properties: Properties = field(default_factory=dict)
    type: ClassVar[Literal[PacketType.SUBSCRIBE]] = PacketType.SUBSCRIBE


@dataclass(slots=True)
class Suback:
    packet_id: int
    reason_codes: list[int]
    properties: Properties = field(default_factory=dict)
    type: ClassVar[Literal[PacketType.SUBACK]] = PacketType.SUBACK


@dataclass(slots=True)
class Unsubscribe:
    packet_id: int
    topic_filters: list[str]
    properties: Properties = field(default_factory=dict)
    type: ClassVar[Literal[PacketType.UNSUBSCRIBE]] = PacketType.UNSUBSCRIBE


@dataclass(slots=True)
class Unsuback:
    packet_id: int
    reason_codes: list[int] = field(default_factory=list)  # empty for 3.1.1
    properties: Properties = field(default_factory=dict)
    type: ClassVar[Literal[PacketType.UNSUBACK]] = PacketType.UNSUBACK


@dataclass(slots=True)
class Pingreq:
    type: ClassVar[Literal[PacketType.PINGREQ]] = PacketType.PINGREQ


@dataclass(slots=True)
class Pingresp:
    type: ClassVar[Literal[PacketType.PINGRESP]] = PacketType.PINGRESP


@dataclass(slots=True)
class Disconnect:
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)
    type: ClassVar[Literal[PacketType.DISCONNECT]] = PacketType.DISCONNECT


@dataclass(slots=True)
class Auth:
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)
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
