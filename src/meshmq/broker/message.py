"""An application message as the broker holds it: one object however many receivers.

A ``Message`` is immutable once routed. Every delivery shares its payload; deliveries that need
no per-receiver fields (QoS 0, no subscription identifier, no alias, no expiry countdown) also
share one encoded frame per (protocol version, retain flag), built on first use.
"""

from __future__ import annotations

from meshmq.mqtt.codec import encode_properties, encode_publish
from meshmq.mqtt.packets import MQTT_5, Will
from meshmq.mqtt.properties import Properties, PropertyId

_EXPIRY = PropertyId.MESSAGE_EXPIRY_INTERVAL

# User properties that tell an MQTT 5 receiver where a persisted message sits in the commit log
# (docs/replay.md): enough to resume from there later, on this broker or another.
PARTITION_PROPERTY = "meshmq-partition"
OFFSET_PROPERTY = "meshmq-offset"


class Message:
    """A published application message (topic, payload, QoS, retain flag, 5.0 properties)."""

    __slots__ = (
        "_frames",
        "_props_v5",
        "expires_at",
        "payload",
        "position",
        "properties",
        "qos",
        "retain",
        "sender",
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
        self.properties = properties or {}
        self.sender = sender
        expiry = self.properties.get(_EXPIRY)
        self.expires_at: float | None = None if expiry is None else now + expiry  # type: ignore[operator]
        self._frames: dict[tuple[int, bool], bytes] | None = None
        self._props_v5: bytes | None = None
        self.position: tuple[int, int] | None = None  # (partition, offset) once in the log

    def set_position(self, partition: int, offset: int) -> None:
        """Record where the log stored this message; 5.0 receivers see it as user properties."""
        self.position = (partition, offset)
        pairs = list(self.properties.get(PropertyId.USER_PROPERTY, ()))  # type: ignore[arg-type]
        pairs += [(PARTITION_PROPERTY, str(partition)), (OFFSET_PROPERTY, str(offset))]
        self.properties = {**self.properties, PropertyId.USER_PROPERTY: pairs}
        self._props_v5 = None
        self._frames = None

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

    def properties_for(self, now: float, subscription_ids: list[int] | None) -> Properties:
        """Properties for one delivery: remaining expiry (MQTT-3.3.2-6) and subscription ids."""
        props = dict(self.properties)
        if self.expires_at is not None:
            props[_EXPIRY] = max(0, int(self.expires_at - now + 0.999))
        if subscription_ids:
            props[PropertyId.SUBSCRIPTION_IDENTIFIER] = subscription_ids
        return props

    def shared_frame(self, version: int, retain: bool) -> bytes:
        """The QoS 0 frame every plain receiver of this version and retain flag can share."""
        frames = self._frames
        if frames is None:
            frames = self._frames = {}
        key = (version, retain)
        frame = frames.get(key)
        if frame is None:
            props = self.encoded_properties() if version == MQTT_5 else None
            frame = encode_publish(self.topic_bytes, self.payload, 0, retain, False, None, props)
            frames[key] = frame
        return frame

    def encoded_properties(self) -> bytes:
        """The 5.0 property block of this message as published (cached)."""
        props = self._props_v5
        if props is None:
            props = self._props_v5 = encode_properties(self.properties)
        return props

    @property
    def size(self) -> int:
        """Approximate memory charged to a queue holding this message."""
        return len(self.payload) + len(self.topic_bytes) + 64

    def __repr__(self) -> str:
        return f"Message({self.topic!r}, {len(self.payload)} B, qos={self.qos})"
