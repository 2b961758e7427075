"""A client session: what survives between connections, and the outbound QoS machinery.

Theory of operation
-------------------
The router calls ``deliver()`` with a shared ``Message`` and the QoS/retain/subscription ids it
resolved for this session. While a client is attached:

* QoS 0 goes straight to the connection's output, or into the queue while the connection is
  congested (so a slow reader loses its oldest QoS 0 messages, counted, once the queue is full);
* QoS 1/2 take a packet id and an ``inflight`` slot if the window (the client's Receive
  Maximum, capped by ``max_inflight_messages``) has room and the connection is not congested;
  otherwise they wait in ``queue``.

Acknowledgements free slots and ``pump()`` refills the window from the queue in order, so the
per-session order of QoS>0 messages is the order of ``deliver()`` calls. Detached persistent
sessions queue QoS 1/2 (and QoS 0 if configured). The queue is bounded by count and bytes; on
overflow the configured policy drops the oldest or the newest entry and counts it.

On reconnect ``attach()`` resends every inflight PUBLISH with DUP set, and PUBREL for those
already at PUBREC, before anything new (MQTT-4.4.0-1), then pumps the queue.

Inbound QoS 2 uses "method B" (spec 4.3.3): the message is routed when the PUBLISH arrives and
its packet id is remembered until PUBREL, so a resent PUBLISH is acknowledged, not re-routed.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from meshmq.broker.message import Message
from meshmq.mqtt.codec import encode_properties, encode_publish
from meshmq.mqtt.packets import MQTT_5, SubscriptionOptions, Will
from meshmq.mqtt.properties import PropertyId
from meshmq.mqtt.reason_codes import ReasonCode

if TYPE_CHECKING:
    from meshmq.config import SessionConfig
    from meshmq.mqtt.connection import ServerConnection

log = logging.getLogger("meshmq.session")


class ClientLink(Protocol):
    """What a session needs from the I/O layer of the connection it is attached to."""

    conn: ServerConnection

    @property
    def congested(self) -> bool: ...

    def wake(self) -> None:
        """Output was queued on ``conn``: flush it at the end of this loop turn."""


SharedKey = tuple[str, str]  # (share name, topic filter)
QueueEntry = tuple[Message, int, bool, "list[int] | None", "SharedKey | None"]


@dataclass(slots=True, frozen=True)
class Subscription:
    options: SubscriptionOptions
    subscription_id: int | None = None


class Outbound:
    """A QoS 1/2 message sent to the client and not yet fully acknowledged."""

    __slots__ = ("group", "message", "qos", "released", "retain", "sent", "subscription_ids")

    def __init__(
        self, message: Message, qos: int, retain: bool, subscription_ids: list[int] | None,
        group: SharedKey | None,
    ) -> None:
        self.group = group
        self.message = message
        self.qos = qos
        self.retain = retain
        self.subscription_ids = subscription_ids
        self.released = False  # PUBREC received, PUBREL sent, waiting for PUBCOMP
        self.sent = True  # False while waiting to be resent on a new connection


class Session:
    """State of one client id, attached to at most one connection at a time."""

    __slots__ = (
        "_next_packet_id",
        "_unsent",
        "client",
        "client_id",
        "dropped",
        "expiry_handle",
        "expiry_interval",
        "inflight",
        "limits",
        "may_receive",
        "qos2_in",
        "qos2_pending",
        "queue",
        "queued_bytes",
        "subscriptions",
        "username",
        "will",
        "will_handle",
    )

    def __init__(self, client_id: str, limits: SessionConfig) -> None:
        self.client_id = client_id
        self.limits = limits
        self.client: ClientLink | None = None
        self.expiry_interval = 0
        self.subscriptions: dict[str, Subscription] = {}
        self.inflight: dict[int, Outbound] = {}
        self.queue: deque[QueueEntry] = deque()
        self.queued_bytes = 0
        self.qos2_in: set[int] = set()
        self.qos2_pending: set[int] = set()  # QoS 2 ids whose log append is not durable yet
        self.dropped = 0
        self.will: Will | None = None
        self.will_handle: object | None = None
        self.expiry_handle: object | None = None
        self._next_packet_id = 1
        self.username: str | None = None
        self.may_receive: Callable[[str], bool] | None = None  # ACL read check, when ACLs are on
        self._unsent = 0  # inflight PUBLISHes not yet resent on the current connection

    # ------------------------------------------------------------------ delivery

    def deliver(
        self, message: Message, qos: int, retain: bool, subscription_ids: list[int] | None,
        now: float, group: SharedKey | None = None,
    ) -> None:
        """Send or queue one message for this session (``group``: via that shared group)."""
        if self.may_receive is not None and not self.may_receive(message.topic):
            return  # ACL: this client may not read that topic
        client = self.client
        if client is None:
            if qos or self.limits.queue_qos0:
                self._enqueue((message, qos, retain, subscription_ids, group))
            return
        if not qos:
            if client.congested:  # wait in the bounded queue; its policy drops when full
                self._enqueue((message, 0, retain, subscription_ids, group))
            else:
                self._send(client, message, 0, retain, subscription_ids, None, False, now)
            return
        if self.queue or client.congested or len(self.inflight) >= self._window(client):
            self._enqueue((message, qos, retain, subscription_ids, group))
            return
        self._send_inflight(client, message, qos, retain, subscription_ids, now, group)

    def _window(self, client: ClientLink) -> int:
        return min(client.conn.client_receive_maximum, self.limits.max_inflight_messages)

    def _send_inflight(
        self, client: ClientLink, message: Message, qos: int, retain: bool,
        subscription_ids: list[int] | None, now: float, group: SharedKey | None,
    ) -> None:
        packet_id = self._allocate_packet_id()
        self.inflight[packet_id] = Outbound(message, qos, retain, subscription_ids, group)
        if not self._send(client, message, qos, retain, subscription_ids, packet_id, False, now):
            del self.inflight[packet_id]  # too large for the client: behave as delivered

    def _send(
        self, client: ClientLink, message: Message, qos: int, retain: bool,
        subscription_ids: list[int] | None, packet_id: int | None, dup: bool, now: float,
    ) -> bool:
        conn = client.conn
        version = conn.version
        alias = conn.outgoing_alias(message.topic) if conn.outgoing_alias_maximum else None
        if not qos and not subscription_ids and message.expires_at is None and alias is None:
            frame = message.shared_frame(version, retain)
        else:
            props = None
            topic = message.topic_bytes
            if version == MQTT_5:
                if subscription_ids or message.expires_at is not None or alias is not None:
                    extra = message.properties_for(now, subscription_ids)
                    if alias is not None:
                        extra[PropertyId.TOPIC_ALIAS] = alias[0]
                        if alias[1]:
                            topic = b""
                    props = encode_properties(extra)
                else:
                    props = message.encoded_properties()
            frame = encode_publish(topic, message.payload, qos, retain, dup, packet_id, props)
        sent = conn.send_frame(frame)
        if not sent and alias is not None and not alias[1]:
            conn.forget_alias(message.topic)  # the client never saw this alias defined
        client.wake()
        return sent

    def _allocate_packet_id(self) -> int:
        packet_id = self._next_packet_id
        inflight = self.inflight
        while packet_id in inflight:
            packet_id = packet_id % 65535 + 1
        self._next_packet_id = packet_id % 65535 + 1
        return packet_id

    def _enqueue(self, entry: QueueEntry) -> None:
        limits = self.limits
        size = entry[0].size
        if size > limits.max_queued_bytes:
            self._count_drop("message larger than the whole queue")
            return
        queue = self.queue
        while queue and (
            len(queue) >= limits.max_queued_messages
            or self.queued_bytes + size > limits.max_queued_bytes
        ):
            if limits.queue_drop_policy == "drop_newest":
                self._count_drop("queue full, newest message dropped")
                return
            self.queued_bytes -= queue.popleft()[0].size
            self._count_drop("queue full, oldest message dropped")
        queue.append(entry)
        self.queued_bytes += size

    def _count_drop(self, why: str) -> None:
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 10_000 == 0:
            log.warning(
                "messages dropped client_id=%s dropped=%d reason=%r", self.client_id,
                self.dropped, why,
            )

    def pump(self, now: float) -> None:
        """Move queued messages into the window while the client can take them."""
        client = self.client
        if client is None:
            return
        window = self._window(client)
        if self._unsent:
            self._resend(client, window, now)
            if self._unsent:
                return
        queue = self.queue
        while queue and not client.congested:
            message, qos, retain, subscription_ids, group = queue[0]
            if qos and len(self.inflight) >= window:
                return
            queue.popleft()
            self.queued_bytes -= message.size
            if message.expired(now):
                continue  # MQTT-3.3.2-5
            if qos:
                self._send_inflight(client, message, qos, retain, subscription_ids, now, group)
            else:
                self._send(client, message, 0, retain, subscription_ids, None, False, now)

    # ------------------------------------------------------------------ acknowledgements

    def on_puback(self, packet_id: int, now: float) -> None:
        outbound = self.inflight.get(packet_id)
        if outbound is not None and outbound.qos == 1:
            del self.inflight[packet_id]
            self.pump(now)

    def on_pubrec(self, packet_id: int, reason_code: int, now: float) -> None:
        client = self.client
        outbound = self.inflight.get(packet_id)
        if outbound is None or outbound.qos != 2:
            if client is not None:
                client.conn.send_pubrel(packet_id, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND)
                client.wake()
            return
        if reason_code >= 0x80:
            del self.inflight[packet_id]  # the receiver refused it: the exchange is over
            self.pump(now)
            return
        outbound.released = True
        if client is not None:
            client.conn.send_pubrel(packet_id)
            client.wake()

    def on_pubcomp(self, packet_id: int, now: float) -> None:
        outbound = self.inflight.get(packet_id)
        if outbound is not None and outbound.released:
            del self.inflight[packet_id]
            self.pump(now)

    # ------------------------------------------------------------------ connection changes

    def attach(self, client: ClientLink, now: float) -> None:
        """Bind a new connection; resend unacknowledged messages (MQTT-4.4.0-1), then pump.

        PUBRELs go out at once; unacknowledged PUBLISHes are resent with DUP, in order, as the
        new connection's Receive Maximum allows (MQTT-4.9.0-2), before anything queued.
        """
        self.client = client
        for packet_id, outbound in self.inflight.items():
            outbound.sent = outbound.released
            if outbound.released:
                client.conn.send_pubrel(packet_id)
        self._unsent = sum(not outbound.sent for outbound in self.inflight.values())
        client.wake()
        self.pump(now)

    def _resend(self, client: ClientLink, window: int, now: float) -> None:
        in_window = len(self.inflight) - self._unsent
        for packet_id, outbound in list(self.inflight.items()):
            if in_window >= window or client.congested:
                return
            if outbound.sent:
                continue
            outbound.sent = True
            self._unsent -= 1
            if self._send(
                client, outbound.message, outbound.qos, outbound.retain,
                outbound.subscription_ids, packet_id, True, now,
            ):
                in_window += 1
            else:
                del self.inflight[packet_id]  # too large for this client: as if delivered

    def detach(self) -> None:
        self.client = None

    def take_shared(self) -> list[tuple[SharedKey, Message, int]]:
        """Remove and return the unacknowledged messages that came through shared groups.

        Called when the session ends, so the router can give them to another member.
        """
        taken = [
            (out.group, out.message, out.qos) for out in self.inflight.values()
            if out.group is not None and not out.released
        ]
        taken += [(entry[4], entry[0], entry[1]) for entry in self.queue if entry[4] is not None]
        self.inflight.clear()
        self._unsent = 0
        self.queue.clear()
        self.queued_bytes = 0
        return taken  # type: ignore[return-value]

    def statistics(self) -> dict[str, int]:
        return {
            "subscriptions": len(self.subscriptions),
            "inflight": len(self.inflight),
            "queued": len(self.queue),
            "queued_bytes": self.queued_bytes,
            "dropped": self.dropped,
        }
