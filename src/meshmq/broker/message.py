"""An application message as the broker holds it: one object however many receivers.

A ``Message`` is immutable once routed. ``properties`` are the 5.0 properties exactly as
published, and stay so: user properties reach subscribers unaltered, in order (MQTT-3.3.2-17,
-18), and the log, the state store and the mesh keep them as published. Where the commit log
stored the message is ``position``, never mixed into ``properties``; only a receiver that asked
for it (``meshmq-positions`` on its CONNECT, docs/replay.md) gets it, as two more user
properties after the publisher's.

Every delivery shares its payload; deliveries that need no per-receiver fields (QoS 0, no
subscription identifier, no alias, no expiry countdown, no log position) also share one encoded
frame per (protocol version, retain flag), built on first use; receivers that asked for log
positions share another. The 5.0 property block is encoded once per message, only if a 5.0
receiver (or the log) needs it; the block with the log position, once per message too, only if
a receiver asked for positions.
"""

from __future__ import annotations

from typing import Final

from meshmq.mqtt.codec import encode_properties, encode_publish
from meshmq.mqtt.packets import MQTT_5, Will
from meshmq.mqtt.properties import Properties, PropertyId, get_property

_EXPIRY: Final = PropertyId.MESSAGE_EXPIRY_INTERVAL
_USER: Final = PropertyId.USER_PROPERTY
_POSITIONED_KEYS: Final = (32, 33)  # ``_frames`` keys of the positioned frames (retain 0, 1)

# User properties that tell an MQTT 5 receiver where a persisted message sits in the commit log
# (docs/replay.md): enough to resume from there later, on this broker or another. Sent only to
# a client whose CONNECT carried the user property ``meshmq-positions`` = ``true``.
PARTITION_PROPERTY: Final = "meshmq-partition"
OFFSET_PROPERTY: Final = "meshmq-offset"
POSITIONS_PROPERTY: Final = "meshmq-positions"
SYS_PREFIX = "$SYS/"  # the broker's own topics: not client traffic, not client retained messages
SERVICE_PREFIX = "$service/"  # request/reply topics: they belong to the services layer (Services)


class PositionsRequestError(ValueError):
    """A CONNECT's ``meshmq-positions`` user property is neither ``true`` nor ``false``."""


def wants_positions(connect_properties: Properties) -> bool:
    """Whether a CONNECT asked for log positions on delivery (the last ``meshmq-positions``
    user property wins); ``PositionsRequestError`` for a value other than true/false."""
    if _USER not in connect_properties:
        return False
    pairs = get_property(connect_properties, _USER) or ()
    values = [value for name, value in pairs if name == POSITIONS_PROPERTY]
    if not values or values[-1] == "false":
        return False
    if values[-1] == "true":
        return True
    raise PositionsRequestError(
        f"{POSITIONS_PROPERTY} must be 'true' or 'false', got {values[-1]!r}")


class Message:
    """A published application message (topic, payload, QoS, retain flag, 5.0 properties)."""

    __slots__ = (
        "_frame",
        "_frame_key",
        "_frames",
        "_props_positioned",
        "_props_v5",
        "expires_at",
        "payload",
        "position",
        "properties",
        "qos",
        "retain",
        "sender",
        "size",
        "topic",
        "topic_bytes",
    )

    def __init__(
        self,
        topic: str,
        payload: bytes,
        qos: int = 0,
        retain: bool = False,
        properties: Properties | None = None,
        sender: str | None = None,
        now: float = 0.0,
    ) -> None:
        self.topic = topic
        self.topic_bytes = topic.encode("utf-8")
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.sender = sender
        # Approximate memory charged to a queue holding this message (read per enqueue and
        # per dequeue, so computed once).
        self.size = len(payload) + len(self.topic_bytes) + 64
        self.expires_at: float | None = None
        if properties is None:
            properties = {}
        elif properties:
            expiry = get_property(properties, _EXPIRY)
            if expiry is not None:
                self.expires_at = now + expiry
        self.properties = properties  # as published: never changed
        self._frame = b""  # the first shared frame built, for ``_frame_key`` (-1: none yet)
        self._frame_key = -1
        self._frames: dict[int, bytes] | None = None  # any further variants
        self._props_v5: bytes | None = None
        self._props_positioned: bytes | None = None
        self.position: tuple[int, int] | None = None  # (partition, offset) once in the log

    def set_position(self, partition: int, offset: int) -> None:
        """Record where the log stored this message (before it is routed)."""
        self.position = (partition, offset)
        self._props_positioned = None
        if self._frames is not None:
            for key in _POSITIONED_KEYS:
                self._frames.pop(key, None)

    @classmethod
    def from_will(cls, will: Will, sender: str, now: float) -> Message:
        props = {k: v for k, v in will.properties.items() if k != PropertyId.WILL_DELAY_INTERVAL}
        return cls(will.topic, will.payload, will.qos, will.retain, props, sender, now)

    def unpositioned(self) -> Message:
        """A copy for a retained delivery: same payload, but not a live log record."""
        copy = Message(self.topic, self.payload, self.qos, self.retain, self.properties,
                       self.sender)
        copy.expires_at = self.expires_at
        return copy

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def positioned_properties(self) -> Properties:
        """The properties as published plus the log position user properties (for a client
        that asked for them; the same as ``properties`` while the message has no position)."""
        position = self.position
        if position is None:
            return self.properties
        pairs = list(get_property(self.properties, _USER) or ())
        pairs += [(PARTITION_PROPERTY, str(position[0])), (OFFSET_PROPERTY, str(position[1]))]
        return {**self.properties, _USER: pairs}

    def properties_for(self, now: float, subscription_ids: list[int] | None,
                       positioned: bool = False) -> Properties:
        """Properties for one delivery: remaining expiry (MQTT-3.3.2-6), subscription ids, and
        the log position if the receiver asked for it."""
        props = dict(self.positioned_properties() if positioned else self.properties)
        if self.expires_at is not None:
            props[_EXPIRY] = max(0, int(self.expires_at - now + 0.999))
        if subscription_ids:
            props[PropertyId.SUBSCRIPTION_IDENTIFIER] = subscription_ids
        return props

    def shared_frame(self, version: int, retain: bool) -> bytes:
        """The QoS 0 frame every plain receiver of this version and retain flag can share."""
        key = version + version + retain  # (version, retain) without a tuple per delivery
        if key == self._frame_key:
            return self._frame
        frames = self._frames
        frame = None if frames is None else frames.get(key)
        if frame is None:
            props = self.encoded_properties() if version == MQTT_5 else None
            frame = encode_publish(self.topic_bytes, self.payload, 0, retain, False, None, props)
            if self._frame_key < 0:  # usually the only variant: no dict for it
                self._frame_key = key
                self._frame = frame
            elif frames is None:
                self._frames = {key: frame}
            else:
                frames[key] = frame
        return frame

    def positioned_frame(self, retain: bool) -> bytes:
        """The QoS 0 5.0 frame with the log position, shared by the plain receivers that asked
        for positions (built on first use, kept with the other variants)."""
        key = _POSITIONED_KEYS[retain]
        frames = self._frames
        frame = None if frames is None else frames.get(key)
        if frame is None:
            frame = encode_publish(self.topic_bytes, self.payload, 0, retain, False, None,
                                   self.encoded_positioned_properties())
            if frames is None:
                self._frames = {key: frame}
            else:
                frames[key] = frame
        return frame

    def wire_properties(self, now: float) -> bytes:
        """The 5.0 property block to forward this message with: as published (the log
        position travels separately), expiry counted down."""
        props = self.properties
        if self.expires_at is not None:
            props = {**props, _EXPIRY: max(1, int(self.expires_at - now + 0.999))}
        return encode_properties(props) if props else b"\x00"

    def encoded_properties(self) -> bytes:
        """The 5.0 property block of this message as published (cached)."""
        props = self._props_v5
        if props is None:
            props = self._props_v5 = encode_properties(self.properties)
        return props

    def encoded_positioned_properties(self) -> bytes:
        """``positioned_properties()`` as a 5.0 property block (cached)."""
        props = self._props_positioned
        if props is None:
            props = self._props_positioned = encode_properties(self.positioned_properties())
        return props

    def __repr__(self) -> str:
        return f"Message({self.topic!r}, {len(self.payload)} B, qos={self.qos})"
