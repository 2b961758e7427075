"""An application message as the broker holds it: one object however many receivers.

A ``Message`` is immutable once routed. Every delivery shares its payload; deliveries that need
no per-receiver fields (QoS 0, no subscription identifier, no alias, no expiry countdown) also
share one encoded frame per (protocol version, retain flag), built on first use. The 5.0
property block is encoded once per message, and only if a 5.0 receiver (or the log) needs it.
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
        "_frame",
        "_frame_key",
        "_frames",
        "_position_pending",
        "_properties",
        "_props_v5",
        "expires_at",
        "payload",
        "position",
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
            expiry = properties.get(_EXPIRY)
            if expiry is not None:
                self.expires_at = now + expiry  # type: ignore[operator]
        self._properties = properties
        self._frame = b""  # the first shared frame built, for ``_frame_key`` (-1: none yet)
        self._frame_key = -1
        self._frames: dict[int, bytes] | None = None  # any further variants
        self._props_v5: bytes | None = None
        self.position: tuple[int, int] | None = None  # (partition, offset) once in the log
        self._position_pending = False  # position set, user properties not built yet

    @property
    def properties(self) -> Properties:
        """The 5.0 properties as published, plus the log position once it is known."""
        if self._position_pending:
            self._position_pending = False
            partition, offset = self.position  # type: ignore[misc]
            props = self._properties
            pairs = list(props.get(PropertyId.USER_PROPERTY, ()))  # type: ignore[arg-type]
            pairs += [(PARTITION_PROPERTY, str(partition)), (OFFSET_PROPERTY, str(offset))]
            self._properties = {**props, PropertyId.USER_PROPERTY: pairs}
        return self._properties

    def set_position(self, partition: int, offset: int) -> None:
        """Record where the log stored this message; 5.0 receivers see it as user properties
        (built on first use: a 3.1.1-only fan-out never pays for them)."""
        self.position = (partition, offset)
        self._position_pending = True
        self._props_v5 = None
        self._frame_key = -1
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

    def wire_properties(self, now: float) -> bytes:
        """The 5.0 property block to forward this message with: as published (without the
        log position user properties, which travel separately), expiry counted down."""
        props = self._properties
        if self.position is not None and not self._position_pending:
            pairs = props[PropertyId.USER_PROPERTY][:-2]  # type: ignore[index]
            props = {k: v for k, v in props.items() if k != PropertyId.USER_PROPERTY}
            if pairs:
                props[PropertyId.USER_PROPERTY] = pairs
        if self.expires_at is not None:
            props = {**props, _EXPIRY: max(1, int(self.expires_at - now + 0.999))}
        return encode_properties(props) if props else b"\x00"

    def encoded_properties(self) -> bytes:
        """The 5.0 property block of this message as published (cached)."""
        props = self._props_v5
        if props is None:
            props = self._props_v5 = encode_properties(self.properties)
        return props

    def __repr__(self) -> str:
        return f"Message({self.topic!r}, {len(self.payload)} B, qos={self.qos})"
