"""The one codec for a session's state, on disk and in a hand-over, and for stored messages.

A ``SessionSnapshot`` is what survives a session's connection: expiry, user name, will,
subscriptions, when it went offline and its cursor into the commit log. The state store keeps
it as a JSON record (``record()`` / ``from_record()``, a line of the journal or an entry of the
snapshot file, state/store.py). A session handed to another worker (cluster/directory.py)
is the same record plus its *live* state, what only a running session has: unacknowledged and
queued messages, packet ids, inbound QoS 2 state and its catch-up's per-filter positions
(``encode()`` / ``decode()``: the messages as their one body, broker/wire.py, then the record
as JSON). Retained messages are stored as that same body (``message_to_json``).

Everything read here comes from a file or a peer: ``decode`` and ``from_record`` check types
and raise ``SnapshotError`` on anything malformed, before anything is installed.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from dataclasses import dataclass
from typing import Any

from meshmq.broker.message import Message
from meshmq.broker.session import LiveState, Outbound, QueueEntry, Session, Subscription
from meshmq.broker.wire import Reader, WireError, Writer, decode_message, encode_message
from meshmq.mqtt.codec import decode_properties, encode_properties
from meshmq.mqtt.errors import MQTTError
from meshmq.mqtt.packets import SubscriptionOptions, Will
from meshmq.mqtt.properties import PacketKind, PropertyId, get_property


class SnapshotError(ValueError):
    """A stored or handed-over session (or message) that does not decode."""


def wall_ms() -> int:
    return int(time.time() * 1000)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


# ---------------------------------------------------------------------- fields


def will_to_json(will: Will | None) -> dict[str, Any] | None:
    if will is None:
        return None
    return {"topic": will.topic, "payload": _b64(will.payload), "qos": will.qos,
            "retain": will.retain, "properties": _b64(encode_properties(will.properties))}


def will_from_json(data: dict[str, Any] | None) -> Will | None:
    if data is None:
        return None
    block = _unb64(data["properties"])
    props, _ = decode_properties(block, 0, len(block), PacketKind.WILL)
    return Will(str(data["topic"]), _unb64(data["payload"]), int(data["qos"]),
                bool(data["retain"]), props)


def options_to_json(subscription: Subscription) -> list[Any]:
    o = subscription.options
    return [o.qos, o.no_local, o.retain_as_published, o.retain_handling,
            subscription.subscription_id]


def options_from_json(data: list[Any]) -> Subscription:
    qos, no_local, rap, handling, sub_id = data
    return Subscription(SubscriptionOptions(int(qos), bool(no_local), bool(rap), int(handling)),
                        None if sub_id is None else int(sub_id))


def message_to_json(message: Message, now: float) -> dict[str, Any]:
    """A stored message (a retained one): its body, and when it was stored (its expiry
    interval counts down from then)."""
    return {"body": _b64(encode_message(message, now)), "stored_at": wall_ms()}


def message_from_json(topic: str, data: dict[str, Any], now: float) -> Message | None:
    """``message_to_json`` read back; None if it expired while stored. Also reads the record
    of meshmq versions before the one body (separate fields). ``SnapshotError`` if malformed."""
    try:
        if "body" not in data:
            return _legacy_message(topic, data, now)
        return _stored_message(data, now)
    except (ValueError, KeyError, TypeError, AttributeError, WireError, MQTTError) as error:
        raise SnapshotError(f"bad stored message {topic!r}: {error!r}") from None


def _stored_message(data: dict[str, Any], now: float) -> Message | None:
    message = decode_message(_unb64(data["body"]), now)
    expiry = get_property(message.properties, PropertyId.MESSAGE_EXPIRY_INTERVAL)
    if expiry is None:
        return message
    remaining = expiry - (wall_ms() - int(data["stored_at"])) // 1000
    if remaining <= 0:
        return None
    properties = {**message.properties, PropertyId.MESSAGE_EXPIRY_INTERVAL: remaining}
    kept = Message(message.topic, message.payload, message.qos, message.retain, properties,
                   message.sender, now)
    kept.position = message.position
    return kept


def _legacy_message(topic: str, data: dict[str, Any], now: float) -> Message | None:
    block = _unb64(data["properties"])
    props, _ = decode_properties(block, 0, len(block), PacketKind.PUBLISH)
    payload = _unb64(data["payload"])  # every field read before expiry is looked at
    qos, sender = int(data["qos"]), data["sender"]
    expiry = data.get("expiry")
    if expiry is not None:
        remaining = expiry - (wall_ms() - data["stored_at"]) // 1000
        if remaining <= 0:
            return None
        props[PropertyId.MESSAGE_EXPIRY_INTERVAL] = remaining
    message = Message(topic, payload, qos, True, props, sender, now)
    if data.get("position"):
        message.position = (int(data["position"][0]), int(data["position"][1]))
    return message


# ---------------------------------------------------------------------- sessions


@dataclass(slots=True)
class SessionSnapshot:
    """A session's state (``live``: only in a hand-over)."""

    client_id: str
    expiry: int
    username: str | None
    will: Will | None
    detached_at: int | None
    subscriptions: dict[str, Subscription]
    cursor: list[int] | None
    live: LiveState | None = None

    @classmethod
    def of(cls, session: Session, live: bool = False) -> SessionSnapshot:
        return cls(session.client_id, session.expiry_interval, session.username, session.will,
                   session.detached_at, dict(session.subscriptions), session.log_cursor(),
                   session.live_state() if live else None)

    # ------------------------------------------------------------------ the state store

    def record(self) -> dict[str, Any]:
        """The JSON record the state store keeps (no live state)."""
        return {
            "expiry": self.expiry, "username": self.username,
            "will": will_to_json(self.will), "detached_at": self.detached_at,
            "cursor": self.cursor,
            "subs": {f: options_to_json(s) for f, s in self.subscriptions.items()},
        }

    @classmethod
    def from_record(cls, client_id: str, record: dict[str, Any]) -> SessionSnapshot:
        try:
            username = record.get("username")
            cursor = record.get("cursor")
            detached_at = record.get("detached_at")
            return cls(
                client_id, int(record.get("expiry", 0)),
                None if username is None else str(username),
                will_from_json(record.get("will")), None if detached_at is None else int(
                    detached_at),
                {str(f): options_from_json(o) for f, o in record.get("subs", {}).items()},
                None if cursor is None else [int(o) for o in cursor])
        except (ValueError, KeyError, TypeError, AttributeError, binascii.Error,
                WireError, MQTTError) as error:  # MQTTError: a will's property block
            raise SnapshotError(f"bad session record {client_id!r}: {error!r}") from None

    # ------------------------------------------------------------------ a hand-over

    def encode(self, now: float, positioned: bool = True) -> bytes:
        """The whole snapshot, live state included, as bytes for ``decode`` elsewhere
        (``positioned=False``: the messages without their places in this node's log, for
        another node, cluster/nodesessions.py)."""
        messages: list[bytes] = []

        def ref(message: Message) -> int:
            messages.append(encode_message(message, now, positioned))
            return len(messages) - 1

        head = {"client_id": self.client_id, **self.record()}
        live = self.live
        if live is not None:
            head["live"] = {
                "qos2_in": sorted(live.qos2_in), "next_packet_id": live.next_packet_id,
                "dropped": live.dropped,
                "inflight": [[packet_id, ref(o.message), o.qos, o.retain, o.subscription_ids,
                              o.group, o.released] for packet_id, o in live.inflight],
                "queue": [[ref(e.message), e.qos, e.retain, e.subscription_ids, e.group, e.dup]
                          for e in live.queue],
                "catchup": live.catchup,
            }
            if live.uncertain:  # absent in hand-overs from before it existed
                head["live"]["uncertain"] = {str(packet_id): _b64(message_id)
                                             for packet_id, message_id in live.uncertain.items()}
        writer = Writer().u32(len(messages))
        for body in messages:
            writer.blob(body)
        return writer.blob(json.dumps(head, separators=(",", ":")).encode("utf-8")).bytes()

    @classmethod
    def decode(cls, data: bytes, now: float) -> SessionSnapshot:
        """``encode``'s bytes read back and checked in full; ``SnapshotError`` if malformed."""
        try:
            reader = Reader(data)
            messages = [decode_message(reader.blob(), now) for _ in range(reader.u32())]
            head = json.loads(reader.blob())
            reader.end()
            snapshot = cls.from_record(str(head["client_id"]), head)
            live = head.get("live")
            if live is not None:
                snapshot.live = _live_from_json(live, messages)
            return snapshot
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError,
                WireError) as error:  # RecursionError: JSON nested too deep
            raise SnapshotError(f"bad session hand-over: {error!r}") from None


def _live_from_json(live: dict[str, Any], messages: list[Message]) -> LiveState:
    inflight = []
    for packet_id, index, qos, retain, ids, group, released in live["inflight"]:
        outbound = Outbound(_message(messages, index), int(qos), bool(retain), _ids(ids),
                            _key(group))
        outbound.released = bool(released)
        inflight.append((int(packet_id), outbound))
    queue = [QueueEntry(_message(messages, index), int(qos), bool(retain), _ids(ids),
                        _key(group), bool(dup))
             for index, qos, retain, ids, group, dup in live["queue"]]
    catchup = live["catchup"]
    if catchup is not None:
        for topic_filter, start in catchup["filters"]:
            if not isinstance(topic_filter, str) or not all(isinstance(o, int) for o in start):
                raise ValueError("bad catch-up filter")
    uncertain = {int(packet_id): _unb64(message_id)
                 for packet_id, message_id in live.get("uncertain", {}).items()}
    if not all(len(message_id) == 16 for message_id in uncertain.values()):
        raise ValueError("bad message id of an uncertain publish")
    return LiveState({int(i) for i in live["qos2_in"]}, int(live["next_packet_id"]),
                     int(live["dropped"]), inflight, queue, catchup, uncertain)


def _message(messages: list[Message], index: int) -> Message:
    if type(index) is not int or not 0 <= index < len(messages):  # -1 would be the last one
        raise ValueError(f"no message {index!r} in the hand-over")
    return messages[index]


def _ids(ids: list[int] | None) -> list[int] | None:
    return None if ids is None else [int(i) for i in ids]


def _key(group: list[str] | None) -> tuple[str, str] | None:
    return None if group is None else (str(group[0]), str(group[1]))
