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
per-session order of QoS>0 messages is the order of ``deliver()`` calls (PUBACKs only free
slots; the broker calls ``refill()`` once after each batch of packets, so a read full of
PUBACKs costs one pump). Detached persistent
sessions queue QoS 1/2 (and QoS 0 if configured). The queue is bounded by count and bytes; on
overflow the configured policy drops the oldest or the newest entry and counts it.

On reconnect ``attach()`` resends every inflight PUBLISH with DUP set, and PUBREL for those
already at PUBREC, before anything new (MQTT-4.4.0-1), then pumps the queue.

Persisted messages (those with a log position) need no copies: when a persistent session goes
offline, or its queue overflows, it switches to a ``CatchUp`` cursor (broker/catchup.py) and
later reads what it missed from the commit log, in order, a chunk at a time as its queue drains.

Inbound QoS 2 uses "method B" (spec 4.3.3): the message is routed when the PUBLISH arrives and
its packet id is remembered until PUBREL, so a resent PUBLISH is acknowledged, not re-routed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

from meshmq.broker.catchup import CatchUp, LogReader
from meshmq.broker.message import Message
from meshmq.broker.retainwindow import RetainedWindow
from meshmq.broker.subscription import Subscription
from meshmq.mqtt.codec import encode_properties, encode_publish, with_topic_alias
from meshmq.mqtt.packets import MQTT_5, Will
from meshmq.mqtt.properties import PropertyId
from meshmq.mqtt.reason_codes import ReasonCode
from meshmq.mqtt.topics import parse_shared_filter, topic_matches
from meshmq.mypycattr import mypyc_attr

if TYPE_CHECKING:
    import asyncio

    from meshmq.config import SessionConfig
    from meshmq.mqtt.connection import ServerConnection

log: Final = logging.getLogger("meshmq.session")

# Shared stand-ins for per-session containers most sessions never fill (an idle connection's
# memory, docs/benchmarks.md "Connection storms"): replaced by a container of the session's
# own on first use (``_enqueue``, ``note_qos2``), never modified themselves.
NO_QUEUE: Final[deque[Any]] = deque(maxlen=0)  # maxlen 0: an append by mistake would drop, not leak
NO_IDS: Final[set[int]] = set()  # discarding from it is harmless; adding goes through note_qos2
NO_UNCERTAIN: Final[dict[int, bytes]] = {}  # popping from it is harmless; note_uncertain adds
NO_SUBSCRIPTIONS: Final[dict[str, Any]] = {}
NO_INFLIGHT: Final[dict[int, Any]] = {}


class ClientLink(Protocol):
    """What a session needs from the I/O layer of the connection it is attached to."""

    conn: ServerConnection
    log_positions: bool  # the client asked for log positions on delivery (docs/replay.md)

    @property
    def congested(self) -> bool: ...

    def wake(self) -> None:
        """Output was queued on ``conn``: flush it at the end of this loop turn."""


SharedKey = tuple[str, str]  # (share name, topic filter)


class QueueEntry(NamedTuple):
    """A message waiting in a session's queue for room in its inflight window."""

    message: Message
    qos: int
    retain: bool
    subscription_ids: list[int] | None
    group: SharedKey | None  # the shared group it came through
    dup: bool  # may have been sent before (a resend)

CATCHUP_QUEUE: Final = 1000  # a catch-up refills the queue up to this many messages


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


@dataclass(slots=True)
class LiveState:
    """What only a running session has, for a hand-over to another router
    (broker/snapshot.py): its unacknowledged and queued messages, packet ids, inbound QoS 2
    state and its catch-up's per-filter positions."""

    qos2_in: set[int]
    next_packet_id: int
    dropped: int
    inflight: list[tuple[int, Outbound]]
    queue: list[QueueEntry]
    catchup: dict[str, Any] | None  # {"filters": [[filter, start]], "dup_below", "lost"}
    uncertain: dict[int, bytes] = field(default_factory=dict)  # see ``Session.uncertain``


@mypyc_attr(allow_interpreted_subclasses=True)  # cluster/moving.py: MovedSession
class Session:
    """State of one client id, attached to at most one connection at a time."""

    __slots__ = (
        "_next_packet_id",
        "_unsent",
        "catchup",
        "client",
        "client_id",
        "connecting",
        "detached_at",
        "dropped",
        "expiry_handle",
        "expiry_interval",
        "inflight",
        "limits",
        "may_receive",
        "persistence",
        "qos2_in",
        "qos2_pending",
        "queue",
        "queued_bytes",
        "read_tail",
        "retained_window",
        "slots_freed",
        "subscriptions",
        "uncertain",
        "username",
        "will",
        "will_handle",
    )

    def __init__(self, client_id: str, limits: SessionConfig) -> None:
        self.client_id = client_id
        self.limits = limits
        self.client: ClientLink | None = None
        self.expiry_interval = 0
        self.subscriptions: dict[str, Subscription] = NO_SUBSCRIPTIONS  # add_subscription
        self.inflight: dict[int, Outbound] = NO_INFLIGHT  # its own from the first QoS 1/2 out
        self.queue: deque[QueueEntry] = NO_QUEUE  # a deque of its own from the first entry
        self.queued_bytes = 0
        # Shared empty sets until the first QoS 2 PUBLISH (``note_qos2``): most sessions never
        # see one, and an empty set costs 216 bytes (docs/benchmarks.md, connection storms).
        self.qos2_in: set[int] = NO_IDS
        self.qos2_pending: set[int] = NO_IDS  # QoS 2 ids whose log append is not durable yet
        # packet id -> message id of an inbound publish whose append had an unknown outcome
        # (broker/publishes.py): its resend (DUP) carries that id, so that the partition's
        # leader recognises it if it stored the first attempt. A shared empty dict until then.
        self.uncertain: dict[int, bytes] = NO_UNCERTAIN
        self.dropped = 0
        self.slots_freed = False  # on_puback freed a slot since the last refill()
        self.will: Will | None = None
        self.will_handle: asyncio.TimerHandle | None = None
        self.expiry_handle: asyncio.TimerHandle | None = None
        self._next_packet_id = 1
        self.username: str | None = None
        self.may_receive: Callable[[str], bool] | None = None  # ACL read check, when ACLs are on
        self._unsent = 0  # inflight PUBLISHes not yet resent on the current connection
        self.persistence: LogReader | None = None  # the commit log, when it is on
        self.catchup: CatchUp | None = None  # reading persisted messages from the log
        self.read_tail: CatchUp | None = None  # the last catch-up finished (read_already)
        self.detached_at: int | None = None  # wall clock ms when it went offline
        self.retained_window: RetainedWindow | None = None  # retained lookups in progress
        self.connecting = False  # a connection is being accepted for it: QoS 0 waits too

    def add_subscription(self, topic_filter: str, subscription: Subscription) -> bool:
        """Add or replace the subscription to ``topic_filter``; True if it replaced one."""
        if self.subscriptions is NO_SUBSCRIPTIONS:
            self.subscriptions = {}
        existed = topic_filter in self.subscriptions
        self.subscriptions[topic_filter] = subscription
        return existed

    # ------------------------------------------------------------------ inbound QoS 2

    def note_qos2(self, packet_id: int, pending: bool = False) -> None:
        """Remember an inbound QoS 2 packet id until its PUBREL (``pending``: its log append
        is not durable yet, ``qos2_durable`` says when it is)."""
        if self.qos2_in is NO_IDS:
            self.qos2_in = set()
        self.qos2_in.add(packet_id)
        if pending:
            if self.qos2_pending is NO_IDS:
                self.qos2_pending = set()
            self.qos2_pending.add(packet_id)

    def note_uncertain(self, packet_id: int, message_id: bytes) -> None:
        """The append of inbound ``packet_id`` had an unknown outcome (``Unknown``)."""
        if self.uncertain is NO_UNCERTAIN:
            self.uncertain = {}
        self.uncertain[packet_id] = message_id

    def take_uncertain(self, packet_id: int, dup: bool) -> bytes | None:
        """The message id to append inbound ``packet_id`` with: that of its first attempt if
        this PUBLISH resends one whose outcome was unknown (``dup``), else None (a new
        message: a stale entry for that packet id goes)."""
        message_id = self.uncertain.pop(packet_id, None)
        return message_id if dup else None

    def qos2_durable(self, packet_id: int | None) -> None:
        if packet_id is not None:
            self.qos2_pending.discard(packet_id)

    def release_qos2(self, packet_id: int | None) -> bool:
        """Forget an inbound QoS 2 packet id (PUBREL, or its PUBLISH failed); True if known."""
        if packet_id is None or packet_id not in self.qos2_in:
            return False
        self.qos2_in.discard(packet_id)
        return True

    # ------------------------------------------------------------------ delivery

    def deliver(
        self, message: Message, qos: int, retain: bool, subscription_ids: list[int] | None,
        now: float, group: SharedKey | None = None,
    ) -> None:
        """Send or queue one message for this session (``group``: via that shared group)."""
        if self.may_receive is not None and not self.may_receive(message.topic):
            return  # ACL: this client may not read that topic
        if message.retain and self.retained_window is not None \
                and self.retained_window.live(message):
            return  # already delivered as a retained copy (retainwindow.py)
        catchup = self.catchup
        if catchup is not None and group is None and message.position is not None:
            if catchup.covers(message.topic, message.position):
                if self.client is not None and not self.queue:
                    self.pump(now)  # idle: let the catch-up read it now
                return  # the catch-up reads it from the log, in order
            if catchup.read_before(message.topic, *message.position):
                return  # a late copy of one it read already (read_already)
        tail = self.read_tail
        if tail is not None and group is None and message.position is not None:
            if tail.read_already(message.topic, message.position):
                return  # a late copy of one the last catch-up read from the log
            if tail.tail_passed:
                self.read_tail = None
        if catchup is None and not qos and not subscription_ids and message.expires_at is None:
            client = self.client
            if client is not None:  # the plain QoS 0 delivery, inlined (the fan-out hot path)
                conn = client.conn
                if conn.outgoing_aliases is None and not client.congested and (
                        message.position is None or not client.log_positions):
                    conn.send_frame(message.shared_frame(conn.version, retain))
                    client.wake()
                    return
        self._deliver(message, qos, retain, subscription_ids, now, group, False)

    def deliver_copy(self, message: Message, qos: int, subscription_ids: list[int] | None,
                     now: float) -> None:
        """Send or queue a retained copy for a new subscription (MQTT-3.3.1-8: retain set)."""
        if self.may_receive is not None and not self.may_receive(message.topic):
            return
        self._deliver(message, qos, True, subscription_ids, now, None, False)

    def _deliver(
        self, message: Message, qos: int, retain: bool, subscription_ids: list[int] | None,
        now: float, group: SharedKey | None, dup: bool,
    ) -> None:
        client = self.client
        if client is None:
            if qos or self.limits.queue_qos0 or self.connecting:
                self._enqueue(QueueEntry(message, qos, retain, subscription_ids, group, dup))
            return
        if not qos:
            if client.congested:  # wait in the bounded queue; its policy drops when full
                self._enqueue(QueueEntry(message, 0, retain, subscription_ids, group, dup))
            else:
                self._send(client, message, 0, retain, subscription_ids, None, False, now)
            return
        if self.queue or client.congested or len(self.inflight) >= self._window(client):
            self._enqueue(QueueEntry(message, qos, retain, subscription_ids, group, dup))
            return
        self._send_inflight(client, message, qos, retain, subscription_ids, now, group, dup)

    def _window(self, client: ClientLink) -> int:
        receive_maximum = client.conn.client_receive_maximum
        limit = self.limits.max_inflight_messages
        return receive_maximum if receive_maximum < limit else limit

    def _send_inflight(
        self, client: ClientLink, message: Message, qos: int, retain: bool,
        subscription_ids: list[int] | None, now: float, group: SharedKey | None, dup: bool,
    ) -> None:
        packet_id = self._allocate_packet_id()
        if self.inflight is NO_INFLIGHT:
            self.inflight = {}
        self.inflight[packet_id] = Outbound(message, qos, retain, subscription_ids, group)
        if not self._send(client, message, qos, retain, subscription_ids, packet_id, dup, now):
            del self.inflight[packet_id]  # too large for the client: behave as delivered

    def _send(
        self, client: ClientLink, message: Message, qos: int, retain: bool,
        subscription_ids: list[int] | None, packet_id: int | None, dup: bool, now: float,
    ) -> bool:
        conn = client.conn
        aliases = conn.outgoing_aliases  # None unless a 5.0 client allows aliases
        alias = 0 if aliases is None else aliases.lookup(message.topic)
        positioned = client.log_positions and message.position is not None
        if not qos and not subscription_ids and message.expires_at is None and not alias:
            frame = (message.positioned_frame(retain) if positioned
                     else message.shared_frame(conn.version, retain))
        else:
            frame = self._encode(message, qos, retain, subscription_ids, packet_id, dup, now,
                                 conn.version, alias, positioned)
        sent = conn.send_frame(frame)
        if not sent and alias < 0 and aliases is not None:  # (an alias implies aliases)
            aliases.not_sent(-alias)  # the client never saw it
        client.wake()
        return sent

    @staticmethod
    def _encode(
        message: Message, qos: int, retain: bool, subscription_ids: list[int] | None,
        packet_id: int | None, dup: bool, now: float, version: int, alias: int,
        positioned: bool,
    ) -> bytes:
        """The PUBLISH frame of one delivery. ``alias``: > 0 known to the client (empty
        topic), < 0 sent with the topic to define it, 0 none (``OutgoingAliases.lookup``);
        ``positioned``: with the log position user properties (docs/replay.md)."""
        if version != MQTT_5:
            return encode_publish(message.topic_bytes, message.payload, qos, retain, dup,
                                  packet_id, None)
        if subscription_ids or message.expires_at is not None:
            props = message.properties_for(now, subscription_ids, positioned)
            if alias:
                props[PropertyId.TOPIC_ALIAS] = abs(alias)
            block = encode_properties(props)
        else:
            block = (message.encoded_positioned_properties() if positioned
                     else message.encoded_properties())
            if alias:
                block = with_topic_alias(block, abs(alias))
        topic = b"" if alias > 0 else message.topic_bytes  # spec 3.3.2.3.4
        return encode_publish(topic, message.payload, qos, retain, dup, packet_id, block)

    def _allocate_packet_id(self) -> int:
        packet_id = self._next_packet_id
        inflight = self.inflight
        while packet_id in inflight:
            packet_id = packet_id % 65535 + 1
        self._next_packet_id = packet_id % 65535 + 1
        return packet_id

    def _enqueue(self, entry: QueueEntry) -> None:
        limits = self.limits
        size = entry.message.size
        if size > limits.max_queued_bytes:
            self._count_drop("message larger than the whole queue")
            return
        queue = self.queue
        full = queue and (
            len(queue) >= limits.max_queued_messages
            or self.queued_bytes + size > limits.max_queued_bytes
        )
        if full and self._fall_back_to_log(entry.message, entry.group):
            return
        while queue and (
            len(queue) >= limits.max_queued_messages
            or self.queued_bytes + size > limits.max_queued_bytes
        ):
            if limits.queue_drop_policy == "drop_newest":
                self._count_drop("queue full, newest message dropped")
                return
            self.queued_bytes -= queue.popleft().message.size
            self._count_drop("queue full, oldest message dropped")
        if queue is NO_QUEUE:
            queue = self.queue = deque()
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
        if client is None or not (self.queue or self._unsent or self.catchup is not None):
            return  # nothing waits: the common case after an acknowledgement
        window = self._window(client)
        if self._unsent:
            self._resend(client, window, now)
            if self._unsent:
                return
        if self._drain_queue(client, window, now) and self.catchup is not None:
            self._catch_up(client, window, now)

    def _drain_queue(self, client: ClientLink, window: int, now: float) -> bool:
        """Send queued messages while the window allows; True if the queue emptied."""
        queue = self.queue
        inflight = self.inflight
        while queue:
            if client.congested:
                return False
            message, qos, retain, subscription_ids, group, dup = queue[0]
            if qos and len(inflight) >= window:
                return False
            queue.popleft()
            self.queued_bytes -= message.size
            expires_at = message.expires_at
            if expires_at is not None and now >= expires_at:
                continue  # MQTT-3.3.2-5
            if qos:
                self._send_inflight(
                    client, message, qos, retain, subscription_ids, now, group, dup
                )
            else:
                self._send(client, message, 0, retain, subscription_ids, None, False, now)
        return not client.congested

    # ------------------------------------------------------------------ the log cursor

    def _catch_up(self, client: ClientLink, window: int, now: float) -> None:
        """Feed the window from the log while there is room; go live when caught up."""
        catchup = self.catchup
        while catchup is not None:
            before = catchup.cursor()
            catchup.step(
                CATCHUP_QUEUE, self.subscriptions, partial(self._deliver_replayed, now), now
            )
            if catchup.finished:
                self.catchup = None
                self.read_tail = catchup
                if catchup.lost:
                    log.warning("catch-up finished with records lost to retention "
                                "client_id=%s lost=%d", self.client_id, catchup.lost)
                return
            if not self._drain_queue(client, window, now) or catchup.cursor() == before:
                return  # wait for acknowledgements (pump() calls again) or for new records

    def _deliver_replayed(
        self, now: float, message: Message, subscription: Subscription, dup: bool
    ) -> bool:
        options = subscription.options
        if options.no_local and message.sender == self.client_id:
            return True  # MQTT-3.8.3-3
        limits = self.limits
        if self.queue and (len(self.queue) >= min(CATCHUP_QUEUE, limits.max_queued_messages)
                           or self.queued_bytes + message.size > limits.max_queued_bytes):
            return False  # no room now: read it again when the queue drains
        ids = None if subscription.subscription_id is None else [subscription.subscription_id]
        qos = min(options.qos, message.qos)
        retain = message.retain and options.retain_as_published
        self._deliver(message, qos, retain, ids, now, None, dup)
        return True

    def follow_log(self, topic_filters: list[str] | None = None) -> None:
        """Stop taking copies of persisted messages on these filters (default: all plain
        subscriptions) and read them from the log from now on."""
        persistence = self.persistence
        if persistence is None:
            return
        catchup = self.catchup
        if catchup is None:
            catchup = self.catchup = CatchUp(persistence)
        present = {f.topic_filter for f in catchup.filters}
        filters = topic_filters if topic_filters is not None else plain_filters(self)
        for topic_filter in filters:
            if topic_filter not in present:
                catchup.add(topic_filter, None, list(persistence.high_watermark))

    def replay(self, topic_filter: str, start: list[int]) -> None:
        """Deliver ``topic_filter``'s persisted messages from ``start`` (per partition) on."""
        persistence = self.persistence
        if persistence is None:
            return
        if self.catchup is None:
            self.catchup = CatchUp(persistence)
        self.catchup.add(topic_filter, None, start)

    def forget_filter(self, topic_filter: str) -> None:
        catchup = self.catchup
        if catchup is not None:
            catchup.filters = [f for f in catchup.filters if f.topic_filter != topic_filter]
            if not catchup.filters:
                self.catchup = None

    def _fall_back_to_log(self, message: Message, group: SharedKey | None) -> bool:
        """The queue is full: if ``message`` is persisted, follow the log instead of dropping."""
        position = message.position
        if position is None or group is not None or self.persistence is None:
            return False
        self.follow_log()
        catchup = self.catchup
        assert catchup is not None
        partition, offset = position
        for f in catchup.filters:
            if topic_matches(f.topic_filter, message.topic):
                f.start[partition] = min(f.start[partition], offset)
        catchup.read_in_full_below(partition, offset + 1)
        return catchup.covers(message.topic, position)

    def log_cursor(self) -> list[int] | None:
        """Per partition, the first offset this session may still need (None: no log)."""
        persistence = self.persistence
        if persistence is None:
            return None
        cursor = self.catchup.cursor() if self.catchup is not None else list(
            persistence.high_watermark
        )
        pending = [out.message for out in self.inflight.values() if out.group is None]
        pending += [entry.message for entry in self.queue if entry.group is None]
        for message in pending:
            position = message.position
            if position is not None and position[1] < cursor[position[0]]:
                cursor[position[0]] = position[1]
        return cursor

    # ------------------------------------------------------------------ acknowledgements

    def on_puback(self, packet_id: int) -> None:
        """Free the inflight slot of an acknowledged QoS 1 message; the caller then calls
        ``refill()`` once for a whole batch of acknowledgements."""
        outbound = self.inflight.get(packet_id)
        if outbound is not None and outbound.qos == 1:
            del self.inflight[packet_id]
            self.slots_freed = True

    def refill(self, now: float) -> None:
        """Acknowledgements freed inflight slots: pump the queue into them, once per batch
        (one pass for a read full of PUBACKs, not one per PUBACK)."""
        if self.slots_freed:
            self.slots_freed = False
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
        new connection's Receive Maximum allows (MQTT-4.9.0-2), before anything queued. The
        caller (the CONNECT path) writes the connection's output right after, CONNACK first.
        """
        self.client = client
        self.detached_at = None
        self.connecting = False
        for packet_id, outbound in self.inflight.items():
            outbound.sent = outbound.released
            if outbound.released:
                client.conn.send_pubrel(packet_id)
        self._unsent = (sum(not outbound.sent for outbound in self.inflight.values())
                        if self.inflight else 0)
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
        self.detached_at = int(time.time() * 1000)
        if self.expiry_interval:
            self.follow_log()  # offline: read what is missed from the log, not copies

    def take_shared(self) -> list[tuple[SharedKey, Message, int]]:
        """Remove and return the unacknowledged messages that came through shared groups.

        Called when the session ends, so the router can give them to another member.
        """
        taken = [
            (out.group, out.message, out.qos) for out in self.inflight.values()
            if out.group is not None and not out.released
        ]
        taken += [(entry.group, entry.message, entry.qos) for entry in self.queue
                  if entry.group is not None]
        self.catchup = None
        self.inflight.clear()
        self._unsent = 0
        self.queue.clear()
        self.queued_bytes = 0
        return taken

    def live_state(self) -> LiveState:
        """This session's running state, to hand it over (``restore_live`` elsewhere)."""
        catchup = self.catchup
        return LiveState(
            set(self.qos2_in), self._next_packet_id, self.dropped, list(self.inflight.items()),
            list(self.queue), None if catchup is None else {
                "filters": [[f.topic_filter, f.start] for f in catchup.filters],
                "dup_below": catchup.dup_below, "lost": catchup.lost}, dict(self.uncertain))

    def restore_live(self, live: LiveState) -> None:
        """Take over a running state from another router (the session is detached)."""
        self.qos2_in = live.qos2_in
        if live.uncertain:
            self.uncertain = dict(live.uncertain)
        self._next_packet_id = live.next_packet_id
        self.dropped = live.dropped
        self.inflight = dict(live.inflight)
        self.queue = deque(live.queue) if live.queue else NO_QUEUE
        self.queued_bytes = sum(entry.message.size for entry in self.queue)
        catchup = live.catchup
        if catchup is not None and self.persistence is not None:
            self.catchup = CatchUp(self.persistence)
            for topic_filter, start in catchup["filters"]:
                self.catchup.add(topic_filter, None, start)
            self.catchup.dup_below = catchup["dup_below"]
            self.catchup.lost = catchup["lost"]

    def statistics(self) -> dict[str, int]:
        return {
            "subscriptions": len(self.subscriptions),
            "inflight": len(self.inflight),
            "queued": len(self.queue),
            "queued_bytes": self.queued_bytes,
            "dropped": self.dropped,
        }


def plain_filters(session: Session) -> list[str]:
    """The session's non-shared subscription filters (shared groups are not replayed)."""
    return [f for f in session.subscriptions if parse_shared_filter(f)[0] is None]
