"""What crosses a link besides routes: messages, and whole sessions on a takeover.

A ``Message`` becomes a ``WireMessage`` with its properties as published (the log position
travels as two integers, not as user properties) and its expiry counted down to now. A session
handed to another worker (``CLAIM``) is a JSON document (subscriptions, packet ids, the log
cursor of its catch-up) plus its unacknowledged and queued messages, so that the new worker
resends exactly what the old one would have: inflight messages with DUP, then the queue, then
whatever its cursor has not read yet.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshmq.broker.catchup import CatchUp
from meshmq.broker.keeper import options_from_json, options_to_json
from meshmq.broker.message import Message
from meshmq.broker.session import Outbound, QueueEntry, Session, Subscription
from meshmq.cluster.codec import (
    LinkError,
    Reader,
    WireMessage,
    decode_message,
    encode_message_fields,
    messages_blob,
)
from meshmq.mqtt.codec import decode_properties
from meshmq.mqtt.properties import PacketKind, Properties

if TYPE_CHECKING:
    from meshmq.broker.broker import Broker


def to_wire(message: Message, now: float, positioned: bool = True) -> WireMessage:
    return WireMessage(
        message.topic, message.payload, message.qos, message.retain,
        message.wire_properties(now), message.sender or "",
        message.position if positioned else None,
    )


def message_body(message: Message, now: float, positioned: bool = True) -> bytes:
    """``encode_message(to_wire(message, now, positioned))`` without the intermediate object
    (every message a worker sends is encoded here)."""
    sender = message.sender
    return encode_message_fields(
        message.topic_bytes, message.payload, message.qos, message.retain,
        message.wire_properties(now), sender.encode("utf-8") if sender else b"",
        message.position if positioned else None)


def from_wire(wire: WireMessage, now: float) -> Message:
    properties: Properties = {}
    block = wire.properties
    if block != b"\x00":
        try:
            properties, end = decode_properties(block, 0, len(block), PacketKind.PUBLISH)
        except Exception as error:  # a codec error: the peer is not speaking the protocol
            raise LinkError(f"bad message properties: {error}") from None
        if end != len(block):
            raise LinkError("bad message properties: trailing bytes")
    message = Message(wire.topic, wire.payload, wire.qos, wire.retain, properties,
                      wire.sender or None, now)
    if wire.position is not None:
        message.set_position(*wire.position)
    return message


# ---------------------------------------------------------------------- sessions


def export_session(session: Session, now: float) -> bytes:
    """``session`` as bytes for ``read_session`` + ``install_session`` on another worker."""
    messages: list[bytes] = []

    def ref(message: Message) -> int:
        messages.append(message_body(message, now))
        return len(messages) - 1

    catchup = session.catchup
    document: dict[str, Any] = {
        "client_id": session.client_id,
        "expiry": session.expiry_interval,
        "username": session.username,
        "subs": {f: options_to_json(s) for f, s in session.subscriptions.items()},
        "qos2_in": sorted(session.qos2_in),
        "next_packet_id": session._next_packet_id,
        "dropped": session.dropped,
        "detached_at": session.detached_at,
        "inflight": [
            [packet_id, ref(out.message), out.qos, out.retain, out.subscription_ids,
             out.group, out.released]
            for packet_id, out in session.inflight.items()
        ],
        "queue": [
            [ref(message), qos, retain, ids, group, dup]
            for message, qos, retain, ids, group, dup in session.queue
        ],
        "catchup": None if catchup is None else {
            "filters": [[f.topic_filter, f.start] for f in catchup.filters],
            "dup_below": catchup.dup_below,
            "lost": catchup.lost,
        },
    }
    head = json.dumps(document, separators=(",", ":")).encode("utf-8")
    return b"".join(messages_blob(messages).blob(head).parts)


@dataclass(slots=True)
class SessionDocument:
    """A handed-over session, read and checked in full before anything is installed."""

    client_id: str
    expiry: int
    username: str | None
    subscriptions: dict[str, Subscription]
    qos2_in: set[int]
    next_packet_id: int
    dropped: int
    detached_at: int | None
    inflight: list[tuple[int, Outbound]]
    queue: list[QueueEntry]
    catchup: dict[str, Any] | None


def read_session(data: bytes, now: float) -> SessionDocument:
    """Parse ``export_session``'s bytes; anything malformed is a ``LinkError``."""
    reader = Reader(data)
    messages = [from_wire(decode_message(reader.blob()), now) for _ in range(reader.u32())]
    try:
        document = json.loads(reader.blob())
        reader.end()
        inflight = []
        for packet_id, index, qos, retain, ids, group, released in document["inflight"]:
            outbound = Outbound(messages[index], int(qos), bool(retain), _ids(ids), _key(group))
            outbound.released = bool(released)
            inflight.append((int(packet_id), outbound))
        queue: list[QueueEntry] = [
            (messages[index], int(qos), bool(retain), _ids(ids), _key(group), bool(dup))
            for index, qos, retain, ids, group, dup in document["queue"]
        ]
        catchup = document["catchup"]
        if catchup is not None:
            for topic_filter, start in catchup["filters"]:
                if not isinstance(topic_filter, str) or not all(
                        isinstance(o, int) for o in start):
                    raise ValueError("bad catch-up filter")
        username = document["username"]
        return SessionDocument(
            str(document["client_id"]), int(document["expiry"]),
            None if username is None else str(username),
            {str(f): options_from_json(o) for f, o in document["subs"].items()},
            {int(i) for i in document["qos2_in"]}, int(document["next_packet_id"]),
            int(document["dropped"]), document["detached_at"], inflight, queue, catchup,
        )
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise LinkError(f"bad session document: {error!r}") from None


def install_session(broker: Broker, document: SessionDocument) -> Session:
    """Rebuild a handed-over session here (detached: the caller attaches it)."""
    session = broker._new_session(document.client_id)
    session.expiry_interval = document.expiry
    session.username = document.username
    session.qos2_in = document.qos2_in
    session._next_packet_id = document.next_packet_id
    session.dropped = document.dropped
    session.detached_at = document.detached_at
    for topic_filter, subscription in document.subscriptions.items():
        broker.router.subscribe(session, topic_filter, subscription)
    session.inflight = dict(document.inflight)
    session.queue = deque(document.queue)
    session.queued_bytes = sum(entry[0].size for entry in session.queue)
    catchup = document.catchup
    if catchup is not None and session.persistence is not None:
        session.catchup = CatchUp(session.persistence)
        for topic_filter, start in catchup["filters"]:
            session.catchup.add(topic_filter, None, start)
        session.catchup.dup_below = catchup["dup_below"]
        session.catchup.lost = catchup["lost"]
    return session


def _ids(ids: list[int] | None) -> list[int] | None:
    return None if ids is None else [int(i) for i in ids]


def _key(group: list[str] | None) -> tuple[str, str] | None:
    return None if group is None else (group[0], group[1])
