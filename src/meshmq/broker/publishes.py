"""PUBLISH and its acknowledgements: into the log when persisted, routed, acknowledged.

Theory of operation
-------------------
A publish on a persisted topic at QoS 1/2 is appended to the commit log first
(``PartitionLog.append``, broker/interfaces.py) and only routed and acknowledged once the
outcome says it is durable:

* ``Stored``: in a partition this router leads; it gets its position, the partition's high
  watermark passes it, and it is routed here (and forwarded to the peers with a match);
* ``StoredElsewhere``: the partition's leader (another router of the node) stored and routed
  it; only the acknowledgement is left to do here;
* ``Refused``: 5.0 gets a PUBACK/PUBREC with the reason code; 3.1.1 cannot be told no, so its
  connection is closed and it resends.
* ``Unknown``: the leader may have stored and routed it, or not (the link to it dropped, or
  no answer came in time). That is never reported as a failure: the connection is closed
  (5.0: DISCONNECT 0x80 first), so the client resends with DUP on its next connection, and
  the session remembers the attempt's message id (``Session.note_uncertain``) so that the
  resend carries it and the leader, if it did store the first attempt, answers with that
  instead of storing it twice (cluster/partitions.py). QoS 2 forgets the packet id, so the
  resend is appended, not taken for a message already routed.

So a PUBACK means as durable as ``log.fsync`` promises, and subscribers never see a message
the log does not hold. Other publishes are routed at once. A retained publish is stored as
retained (``RetainedMessages.keep``) after routing, and acknowledged once that is durable.
Inbound QoS 2 uses "method B" (spec 4.3.3): routed at PUBLISH, its packet id remembered until
PUBREL, so a resent PUBLISH is acknowledged, not routed again.

Request/reply (``Services``, broker/interfaces.py): a publish on a ``$service/`` topic goes to
the services layer before any other check (it persists and acknowledges requests with
``persist``); a stored ``$service/`` message is handed to it instead of being routed
(``_route_message``); and while replies are awaited on this router (``services.expecting``)
every publish that passed the ACL is offered to it as a possible reply. Otherwise the cost is
one prefix test and one attribute test per publish.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Final, Protocol

from meshmq.broker.interfaces import (
    AppendOutcome,
    PartitionLog,
    Refused,
    Stored,
    StoredElsewhere,
    Unknown,
)
from meshmq.broker.message import SERVICE_PREFIX, Message
from meshmq.mqtt.packets import MQTT_5, Puback, Pubcomp, Publish, Pubrec, Pubrel
from meshmq.mqtt.reason_codes import ReasonCode

if TYPE_CHECKING:
    import asyncio

    from meshmq.auth.acl import AccessControl
    from meshmq.broker.client import ClientHandle
    from meshmq.broker.counters import Counters
    from meshmq.broker.interfaces import BrokerEvents, RetainedMessages, Services
    from meshmq.broker.router import Router

log: Final = logging.getLogger("meshmq.broker")


class PublishHost(Protocol):
    """What the publish path needs from the broker it serves (broker.py)."""

    loop: asyncio.AbstractEventLoop
    router: Router
    acl: AccessControl | None  # None: no ACL file
    events: BrokerEvents | None  # webhooks, when configured
    persistence: PartitionLog | None  # the commit log, when it is on
    retained: RetainedMessages
    services: Services  # request/reply: the $service/ topics and replies
    counters: Counters

    def protocol_violation(self, client: ClientHandle, code: int, why: str) -> None:
        """Tell ``client`` (DISCONNECT with ``code``) and close it."""


class Publishes:
    """The publish path of one broker (see the module docstring)."""

    def __init__(self, broker: PublishHost) -> None:
        self.broker = broker
        self.loop = broker.loop
        self.router = broker.router

    def on_publish(self, client: ClientHandle, packet: Publish) -> None:
        session = client.session
        assert session is not None  # handlers run after CONNECT set it
        conn = client.conn
        qos = packet.qos
        if qos == 2 and packet.packet_id in session.qos2_in:
            if packet.packet_id not in session.qos2_pending:
                conn.send_pubrec(packet.packet_id)  # resend of a message already routed
            return  # (a pending one is acknowledged when its append completes)
        broker = self.broker
        services = broker.services
        if packet.topic.startswith(SERVICE_PREFIX) and services.request(client, packet):
            return  # a request (or a reply by its topic): the services layer answers it
        acl = broker.acl
        if acl is not None and not acl.can_publish(session.username, session.client_id,
                                                   packet.topic):
            return self.denied(client, packet)
        now = self.loop.time()
        message = Message(
            packet.topic, packet.payload, qos, packet.retain, packet.properties,
            session.client_id, now,
        )
        if services.expecting and services.reply(client, packet, message):
            return  # a reply: acknowledged once its request is complete
        self.publish_message(client, packet, message, now)

    def publish_message(self, client: ClientHandle, packet: Publish, message: Message,
                        now: float) -> None:
        """A publish that passed its checks: into the log if persisted, routed, acknowledged
        (also what the services layer does with a publish that turned out not to be a reply)."""
        broker = self.broker
        events = broker.events
        if events is not None:
            session = client.session
            events.published(message, None if session is None else session.username)
        persistence = broker.persistence
        if persistence is not None and persistence.wants(packet.topic, packet.qos):
            return self._persist(client, packet, message, persistence)
        self._route_and_ack(client, packet, message, now)

    def persist(self, client: ClientHandle, packet: Publish, message: Message) -> None:
        """Append ``message`` (built for ``packet``) to the log whatever ``log.persist_filters``
        says, then acknowledge ``packet`` as for any persisted publish (the services layer's
        requests: their dispatcher gets them as they are routed, ``Services.stored``)."""
        persistence = self.broker.persistence
        assert persistence is not None  # the services layer refuses requests without a log
        self._persist(client, packet, message, persistence)

    def _route_message(self, message: Message, now: float) -> int:
        """Route ``message``; a stored ``$service/`` one goes to the services layer instead
        (a request for its dispatcher, which this router is: it leads its partition)."""
        if message.topic.startswith(SERVICE_PREFIX) and self.broker.services.stored(message):
            return 1
        return self.router.publish(message, now)

    def _route_and_ack(
        self, client: ClientHandle, packet: Publish, message: Message, now: float
    ) -> None:
        receivers = self._route_message(message, now)
        qos = packet.qos
        if message.retain:  # the retained store changes: acknowledge once that is on disk
            self.broker.retained.keep(message, partial(
                self._retained_kept, client, packet, receivers) if qos else None)
            return
        if qos:
            self.acknowledge(client, packet, receivers)

    def _retained_kept(self, client: ClientHandle, packet: Publish, receivers: int,
                       failure: Refused | Unknown | None) -> None:
        """A retained publish was routed; its store answered: acknowledged only if stored
        (a store that is down refuses it; one that did not answer is an unknown outcome)."""
        if failure is None:
            return self.acknowledge(client, packet, receivers)
        if isinstance(failure, Unknown):
            return self._outcome_unknown(client, packet, failure)
        session = client.session
        assert session is not None  # handlers run after CONNECT set it
        log.warning("retained message not stored client_id=%s topic=%r: %s",
                    client.client_id, packet.topic, failure.why)
        if not client.gone and session.client is client:
            self.refuse(client, packet, failure.reason_code, "retained message not stored")
            client.wake()

    def acknowledge(self, client: ClientHandle, packet: Publish, receivers: int) -> None:
        if client.gone:
            return  # the publisher resends (DUP) on its next connection
        conn = client.conn
        code = 0 if receivers or conn.version != MQTT_5 else ReasonCode.NO_MATCHING_SUBSCRIBERS
        packet_id = packet.packet_id
        assert packet_id is not None  # only QoS 1 and 2 are acknowledged; both have one
        if packet.qos == 1:
            conn.send_puback(packet_id, code)
        else:
            session = client.session
            assert session is not None  # handlers run after CONNECT set it
            session.note_qos2(packet_id)
            conn.send_pubrec(packet_id, code)
        client.wake()

    def _persist(self, client: ClientHandle, packet: Publish, message: Message,
                 persistence: PartitionLog) -> None:
        """Append to the commit log; route and acknowledge only once durable."""
        session = client.session
        assert session is not None  # handlers run after CONNECT set it
        packet_id = packet.packet_id
        if packet.qos == 2 and packet_id is not None:
            session.note_qos2(packet_id, pending=True)

        def durable(outcome: AppendOutcome) -> None:
            session.qos2_durable(packet.packet_id)
            attached = session.client is client and not client.gone
            if isinstance(outcome, Refused):
                return self._persist_failed(client, packet, outcome)
            if isinstance(outcome, Unknown):
                return self._outcome_unknown(client, packet, outcome)
            if isinstance(outcome, StoredElsewhere):  # its leader stored and routed it
                receivers = outcome.receivers + self._deliver_here(message, outcome)
                if attached:
                    self.acknowledge(client, packet, receivers)
                return
            self._stored(persistence, message, outcome)
            if attached:
                self._route_and_ack(client, packet, message, self.loop.time())
                client.wake()
            else:  # the publisher left: route anyway (it is durable), its resend acks itself
                self._route_message(message, self.loop.time())

        message_id = session.take_uncertain(packet_id, packet.dup) if (
            session.uncertain and packet_id is not None) else None
        if not persistence.append(message, session.client_id, durable, message_id):
            session.qos2_durable(packet.packet_id)
            session.release_qos2(packet.packet_id)
            self.refuse(client, packet, ReasonCode.QUOTA_EXCEEDED, "log queue full")

    def _outcome_unknown(self, client: ClientHandle, packet: Publish,
                         outcome: Unknown) -> None:
        """Perhaps stored: neither acknowledge nor refuse. The client resends on its next
        connection (with DUP) and the resend carries this attempt's message id."""
        counters = self.broker.counters
        counters.unknown_outcomes += 1
        unknown = counters.unknown_outcomes
        if unknown == 1 or unknown % 1000 == 0:  # one line per outage, not one per publish
            log.warning("publish outcome unknown, closing the connection so that the client "
                        "resends client_id=%s topic=%r why=%r count=%d", client.client_id,
                        packet.topic, outcome.why, unknown)
        session = client.session
        assert session is not None  # handlers run after CONNECT set it
        packet_id = packet.packet_id
        if packet_id is not None:
            session.release_qos2(packet_id)  # its resend must be stored, not re-acked
            if outcome.message_id is not None:
                session.note_uncertain(packet_id, outcome.message_id)
        if not client.gone and session.client is client:
            client.close_reason = f"publish outcome unknown: {outcome.why}"
            client.conn.send_disconnect(ReasonCode.UNSPECIFIED_ERROR)  # 5.0 only
            client.close()

    def _stored(self, persistence: PartitionLog, message: Message, outcome: Stored) -> None:
        message.set_position(outcome.partition, outcome.offset)
        persistence.routed(outcome.partition, outcome.offset)

    def _deliver_here(self, message: Message, outcome: StoredElsewhere) -> int:
        """Stored by its leader, which left our own subscribers to us (we have the message):
        deliver it here, as if forwarded, at the point of the leader's order it was stored."""
        if outcome.local is None:
            return 0
        message.set_position(outcome.partition, outcome.offset)
        return self.router.deliver_forwarded(message, outcome.local, self.loop.time())

    def route_stored(self, message: Message, outcome: Stored,
                     done: Callable[[int], None]) -> None:
        """A message stored here for another router's publisher (the partition is led here):
        route it, store it as retained if flagged, then ``done(receivers)``."""
        persistence = self.broker.persistence
        assert persistence is not None  # it was stored by this router's log
        self._stored(persistence, message, outcome)
        receivers = self._route_message(message, self.loop.time())
        if message.retain:  # (stored here: this router owns the topic, cluster/leaders.py)
            self.broker.retained.keep(message, lambda failure: done(receivers))
        else:
            done(receivers)

    def append_for(self, message: Message, client_id: str, message_id: bytes | None,
                   done: Callable[[AppendOutcome, int], None]) -> bool:
        """A publish made elsewhere (another node's client) for a partition led here: append
        it, route it once durable as a publish here would be, then ``done(outcome,
        receivers)``. False: the log's queue is full (nothing was done)."""
        persistence = self.broker.persistence
        assert persistence is not None  # (asked only of a node with the log on)

        def durable(outcome: AppendOutcome) -> None:
            if isinstance(outcome, Stored):
                self.route_stored(message, outcome, lambda receivers: done(outcome, receivers))
            elif isinstance(outcome, StoredElsewhere):  # by this node's leader of it
                done(outcome, outcome.receivers + self._deliver_here(message, outcome))
            else:
                done(outcome, 0)

        return persistence.append(message, client_id, durable, message_id)

    def publish_unacknowledged(self, message: Message, client_id: str) -> None:
        """A message nobody waits an acknowledgement for (a will): like any publish, in the
        log first when persisted, then routed (and kept as retained if flagged)."""
        persistence = self.broker.persistence
        if persistence is not None and persistence.wants(message.topic, message.qos):
            def durable(outcome: AppendOutcome) -> None:
                if isinstance(outcome, StoredElsewhere):
                    self._deliver_here(message, outcome)  # the leader routed it elsewhere
                    return
                if isinstance(outcome, Unknown):  # perhaps routed by the leader already
                    log.warning("will perhaps not persisted client_id=%s: %s", client_id,
                                outcome.why)
                    return
                if isinstance(outcome, Stored):
                    self._stored(persistence, message, outcome)
                else:
                    log.warning("will not persisted client_id=%s: %s", client_id, outcome.why)
                self._route(message)

            if persistence.append(message, client_id, durable):
                return
            log.warning("will not persisted, log queue full client_id=%s", client_id)
        self._route(message)

    def _route(self, message: Message) -> None:
        self._route_message(message, self.loop.time())
        if message.retain:
            self.broker.retained.keep(message, None)

    def _persist_failed(self, client: ClientHandle, packet: Publish, outcome: Refused) -> None:
        counters = self.broker.counters
        counters.log_failures += 1
        failures = counters.log_failures
        if failures == 1 or failures % 1000 == 0:  # one line per outage, not one per publish
            log.error("commit log append failed topic=%r error=%r failures=%d", packet.topic,
                      outcome.why, failures)
        session = client.session
        assert session is not None  # handlers run after CONNECT set it
        session.release_qos2(packet.packet_id)
        if not client.gone:
            self.refuse(client, packet, outcome.reason_code, "log failure")
            client.wake()

    def refuse(self, client: ClientHandle, packet: Publish, code: int, why: str) -> None:
        """5.0: a negative PUBACK/PUBREC; 3.1.1 cannot say no, so the connection is closed."""
        self.broker.counters.refused_publishes += 1
        if client.conn.version != MQTT_5:
            return self.broker.protocol_violation(client, code, why)
        packet_id = packet.packet_id
        if packet_id is None:  # QoS 0: nothing to answer
            return None
        if packet.qos == 1:
            client.conn.send_puback(packet_id, code)
        else:
            client.conn.send_pubrec(packet_id, code)

    def denied(self, client: ClientHandle, packet: Publish) -> None:
        """5.0: acknowledge with 0x87; 3.1.1 has no way to say no: acknowledge and drop."""
        self.broker.counters.acl_denied += 1
        log.info("publish denied client_id=%s topic=%r", client.client_id, packet.topic)
        conn = client.conn
        code = ReasonCode.NOT_AUTHORIZED if conn.version == MQTT_5 else 0
        packet_id = packet.packet_id
        if packet_id is None:  # QoS 0: nothing to answer
            return
        if packet.qos == 1:
            conn.send_puback(packet_id, code)
        else:
            conn.send_pubrec(packet_id, code)
            if not code:
                session = client.session
                assert session is not None  # handlers run after CONNECT set it
                session.note_qos2(packet_id)

    # ------------------------------------------------------------------ acknowledgements in

    def on_puback(self, client: ClientHandle, packet: Puback) -> None:
        session = client.session
        assert session is not None  # handlers run after CONNECT set it
        session.on_puback(packet.packet_id)  # handle_events refills after the batch

    def on_pubrec(self, client: ClientHandle, packet: Pubrec) -> None:
        session = client.session
        assert session is not None  # handlers run after CONNECT set it
        session.on_pubrec(packet.packet_id, packet.reason_code, self.loop.time())

    def on_pubrel(self, client: ClientHandle, packet: Pubrel) -> None:
        session = client.session
        assert session is not None  # handlers run after CONNECT set it
        known = session.release_qos2(packet.packet_id)
        client.conn.send_pubcomp(
            packet.packet_id, 0 if known else ReasonCode.PACKET_IDENTIFIER_NOT_FOUND
        )

    def on_pubcomp(self, client: ClientHandle, packet: Pubcomp) -> None:
        session = client.session
        assert session is not None  # handlers run after CONNECT set it
        session.on_pubcomp(packet.packet_id, self.loop.time())
