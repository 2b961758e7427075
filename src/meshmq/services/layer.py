"""The services layer of one worker process: the core's ``Services`` (broker/interfaces.py).

Theory of operation
-------------------
Every worker process has one ``ServicesLayer``; it plays up to three parts:

* **The caller's side** (``request``): a publish on ``$service/NAME`` is checked (topic, a
  reply topic, the ACL: write on ``$service/NAME`` to call, read on the reply topic since the
  broker may publish an error reply there) and appended to the commit log through the core's
  own path (``Publishes.persist``: the PUBACK means durable; an unknown outcome closes the
  connection so that the caller resends, recognised by its message id). The partition is that
  of ``$service/NAME``, whoever leads it.
* **The dispatcher** of the services whose partition this process leads: the core hands it
  each stored request (``stored``); a ``Dispatcher`` per service (services/dispatcher.py)
  decides, and this layer does what it says: deliveries (here, or to the process holding the
  service worker's connection), records (appended to the same partition: the assignment
  without waiting, the completion before anything reaches the caller), replies routed to the
  caller with the router (wherever the caller is connected), and one loop timer for every
  deadline. At start-up it first replays its partitions from their checkpoints
  (services/recovery.py), and only then handles its peers' frames.
* **The desk** of the service workers connected here (services/desk.py): their offers (a
  SUBSCRIBE, ``subscribe``) go to their service's dispatcher, the requests it sends them are
  delivered to their sessions, and their replies, recognised by (Response Topic, Correlation
  Data) or by request id (``reply``), go to the dispatcher; the reply is acknowledged to the
  service worker only once the dispatcher has answered (its completion durable). A reply whose
  dispatcher cannot be reached is kept and sent again when its link is back: the holder of a
  reply is the service worker until acknowledged, then the desk until answered.

Other processes are reached through ``ServiceLinks`` (cluster/servicelinks.py over the mesh;
``LocalLinks`` for a single process, which has none), and they reach this layer through the
``on_*`` methods. When a process comes (back) on a link, each side states every offer it has
for the other's services, with the requests each worker holds (``on_link_up`` / ``on_sync``):
that is how a restarted dispatcher learns which recovered attempts still run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from meshmq.broker.interfaces import Refused, Stored
from meshmq.broker.message import SERVICE_PREFIX, Message
from meshmq.log.partitioner import Partitioner
from meshmq.mqtt.packets import MQTT_5
from meshmq.mqtt.reason_codes import ReasonCode
from meshmq.services import envelope
from meshmq.services.desk import Desk, Expectation, LocalOffer
from meshmq.services.dispatcher import (
    Commit,
    Deliver,
    Dispatcher,
    Holding,
    Note,
    Request,
    Respond,
    Verdict,
    WorkerKey,
)
from meshmq.services.records import STATE_CLIENT, assign_record, done_record, request_from
from meshmq.services.recovery import CHECKPOINT_INTERVAL, Checkpoints, replay
from meshmq.services.settings import Catalogue

if TYPE_CHECKING:
    import asyncio

    from meshmq.auth.acl import AccessControl
    from meshmq.broker.client import ClientHandle
    from meshmq.broker.counters import Counters
    from meshmq.broker.interfaces import AppendOutcome, PartitionLog
    from meshmq.broker.publishes import Publishes
    from meshmq.broker.router import Router
    from meshmq.config import BrokerConfig
    from meshmq.mqtt.packets import Publish, SubscriptionOptions
    from meshmq.mqtt.properties import Properties
    from meshmq.services.records import Replayed

log = logging.getLogger("meshmq.services")

REFUSED = "refused"  # a verdict beside Verdict's: the completion could not be recorded
Answer = Callable[[str | None], None]  # a verdict (Verdict value or REFUSED); None: no answer
SyncEntry = tuple[str, str, int, int, Holding]  # service, client id, serial, capacity, holding


class ServicesHost(Protocol):
    """What the services layer needs from the broker it serves (broker.py)."""

    loop: asyncio.AbstractEventLoop
    config: BrokerConfig  # replaced by a reload: read it when needed, never keep it
    acl: AccessControl | None  # None: no ACL file
    persistence: PartitionLog | None  # the commit log, when it is on
    router: Router
    counters: Counters

    @property
    def publishes(self) -> Publishes:
        """Persists requests; acknowledges, refuses or publishes what the layer took."""


class ServiceLinks(Protocol):
    """The node's other worker processes, as the services layer reaches them."""

    me: int  # this process's index

    def leader_of(self, partition: int) -> int:
        """The process that leads ``partition`` (and dispatches its services)."""

    def linked(self, process: int) -> bool: ...

    def send_offer(self, process: int, service: str, client_id: str, serial: int,
                   capacity: int) -> bool:
        """An offer (capacity 0: withdrawn) to its dispatcher; False: not linked."""

    def send_sync(self, process: int, offers: list[SyncEntry]) -> bool:
        """Every offer this process has for ``process``'s services, with their holdings."""

    def send_request(self, process: int, service: str, client_id: str, serial: int,
                     request_id: str, retry: int, dup: bool, message: Message) -> bool:
        """An attempt for a service worker connected to ``process``; False: not linked."""

    def send_reply(self, process: int, service: str, request_id: str, client_id: str,
                   retry: int, message: Message, expected: tuple[str, bytes | None] | None,
                   answer: Answer) -> bool:
        """A reply for its dispatcher; ``answer`` later (None: the link dropped or no answer
        came in time). False (and no answer): not linked."""


class LocalLinks:
    """A single process: it leads every partition and has no other process to reach."""

    me = 0

    def leader_of(self, partition: int) -> int:
        return 0

    def linked(self, process: int) -> bool:
        return False

    def send_offer(self, process: int, service: str, client_id: str, serial: int,
                   capacity: int) -> bool:
        return False

    def send_sync(self, process: int, offers: list[SyncEntry]) -> bool:
        return False

    def send_request(self, process: int, service: str, client_id: str, serial: int,
                     request_id: str, retry: int, dup: bool, message: Message) -> bool:
        return False

    def send_reply(self, process: int, service: str, request_id: str, client_id: str,
                   retry: int, message: Message, expected: tuple[str, bytes | None] | None,
                   answer: Answer) -> bool:
        return False


@dataclass(eq=False, slots=True)
class PendingReply:
    """A service worker's reply on its way to the dispatcher, unacknowledged until answered."""

    client: ClientHandle
    packet: Publish
    message: Message
    service: str  # "" when recognised by request id only
    request_id: str
    dispatcher: int
    worker: str  # the client id the attempt was delivered to
    retry: int
    expected: tuple[str, bytes | None] | None  # to check (recognised by request id only)
    expectation: Expectation | None


class ServicesLayer:
    """One worker process's services (see the module docstring)."""

    def __init__(self, host: ServicesHost, catalogue: Catalogue, links: ServiceLinks,
                 data_dir: str) -> None:
        self.host = host
        self.loop = host.loop
        self.catalogue = catalogue
        self.links = links
        self.me = links.me
        settings = host.config.log
        self.partitioner = Partitioner(settings.partitions,
                                       None if settings.key_level < 0 else settings.key_level)
        self.desk = Desk()
        self.dispatchers: dict[str, Dispatcher] = {}
        self.checkpoints = Checkpoints(data_dir)
        # Read by the core on every publish: true while a reply may come here (a service
        # worker connected here, or an expectation), kept up to date by ``_watch``.
        self.expecting = False
        self.ready = False  # recovered: peers' frames are handled (before: kept in order)
        self._early: list[Callable[[], None]] = []
        # accepted replies, answered once their completion is durable
        self._answers: dict[str, list[Callable[[str], None]]] = {}
        self._unsent: dict[int, list[PendingReply]] = {}  # replies waiting for a link
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._checkpointer: asyncio.TimerHandle | None = None
        self.counters = {"requests_refused": 0, "denied": 0, "unrouted": 0}

    # ------------------------------------------------------------------ placement

    def partition_of(self, service: str) -> int:
        return self.partitioner.partition_for(envelope.service_topic(service))

    def dispatcher_process(self, service: str) -> int:
        return self.links.leader_of(self.partition_of(service))

    def _dispatcher(self, service: str) -> Dispatcher:
        dispatcher = self.dispatchers.get(service)
        if dispatcher is None:
            dispatcher = self.dispatchers[service] = Dispatcher(
                service, self.catalogue.settings_for(service), self.me)
        return dispatcher

    # ------------------------------------------------------------------ start and stop

    def start(self) -> None:
        """Rebuild the dispatchers of the partitions led here from their checkpoints (after
        the broker restored its state, before it serves clients)."""
        persistence = self.host.persistence
        if persistence is not None:
            self._recover(persistence)
        self.ready = True
        early, self._early = self._early, []
        for event in early:
            event()
        self._checkpointer = self.loop.call_later(CHECKPOINT_INTERVAL, self._checkpoint)

    def _recover(self, persistence: PartitionLog) -> None:
        now, wall = self.loop.time(), time.time()
        started = time.monotonic()
        read = 0

        def each(replayed: Replayed) -> None:
            dispatcher = self._dispatcher(replayed.service)
            if replayed.request is not None:
                dispatcher.arrive(replayed.request, now, recovering=True)
                return
            state = replayed.state
            assert state is not None
            if state.kind == "assign" and state.worker is not None:
                dispatcher.recover_assign(state.request_id, state.retry, state.worker)
            elif state.reply is not None:
                completer = None if state.worker is None else (state.worker, state.retry)
                age = max(0.0, wall - replayed.timestamp_ms / 1000)
                dispatcher.recover_completion(state.request_id, state.reply, state.error,
                                              completer, age, now)

        for partition in self.checkpoints.partitions():
            if self.links.leader_of(partition) != self.me:
                continue
            start = self.checkpoints.read(partition)
            if start is None:
                continue
            read += replay(persistence, partition, start, persistence.high_watermark[partition],
                           now, each)
        for dispatcher in self.dispatchers.values():
            dispatcher.recovered(now)
            self._run(dispatcher)
        if self.dispatchers:
            pending = sum(d.gauges()["in_flight"] for d in self.dispatchers.values())
            log.info("services recovered services=%d in_flight=%d records=%d seconds=%.3f",
                     len(self.dispatchers), pending, read, time.monotonic() - started)

    def close(self) -> None:
        """Stop the timers and write the checkpoints once more."""
        for handle in (self._timer, self._checkpointer):
            if handle is not None:
                handle.cancel()
        self._timer = self._checkpointer = None
        if self.host.persistence is not None:
            self._write_checkpoints()

    # ------------------------------------------------------------------ the caller's side

    def request(self, client: ClientHandle, packet: Publish) -> bool:
        parsed = envelope.parse_publish(packet.topic)
        if parsed.kind == "reply":
            return self._reply_by_topic(client, packet, parsed.service, parsed.rest)
        session = client.session
        assert session is not None  # handlers run after CONNECT set it
        publishes = self.host.publishes
        if parsed.kind == "invalid":
            return self._refuse(client, packet, ReasonCode.TOPIC_NAME_INVALID, parsed.problem)
        reply_topic = parsed.rest or envelope.reply_topic_of(packet.properties) or ""
        if not reply_topic:
            return self._refuse(client, packet, ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR,
                                "a request needs a Response Topic (or the topic envelope)")
        if reply_topic.startswith(SERVICE_PREFIX):
            return self._refuse(client, packet, ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR,
                                "a Response Topic cannot be a service topic")
        correlation = (reply_topic.encode() if parsed.rest
                       else envelope.correlation_of(packet.properties))
        if self.host.persistence is None:
            self._error_now(reply_topic, correlation, bool(parsed.rest), envelope.UNAVAILABLE)
            return self._refuse(client, packet, ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR,
                                "services need the commit log (log.enabled = true)")
        acl = self.host.acl
        username, client_id = session.username, session.client_id
        if acl is not None:
            may_read = acl.can_receive(username, client_id, reply_topic)
            if not acl.can_publish(username, client_id, envelope.service_topic(parsed.service)):
                self.counters["denied"] += 1
                log.info("service call denied client_id=%s service=%s", client_id,
                         parsed.service)
                if may_read:
                    self._error_now(reply_topic, correlation, bool(parsed.rest),
                                    envelope.NOT_AUTHORIZED)
                publishes.denied(client, packet)
                return True
            if not may_read:
                self.counters["denied"] += 1
                log.info("service call denied: the caller may not read its reply topic "
                         "client_id=%s reply_topic=%r", client_id, reply_topic)
                publishes.denied(client, packet)
                return True
        stored = Message(envelope.service_topic(parsed.service), packet.payload, packet.qos,
                         False, envelope.stored_request(packet.properties, parsed.rest),
                         client_id, self.loop.time())
        publishes.persist(client, packet, stored)
        return True

    def _refuse(self, client: ClientHandle, packet: Publish, code: int, why: str) -> bool:
        self.counters["requests_refused"] += 1
        log.info("service request refused client_id=%s topic=%r: %s", client.client_id,
                 packet.topic, why)
        self.host.publishes.refuse(client, packet, code, why)
        return True

    def _error_now(self, reply_topic: str, correlation: bytes | None, topic_envelope: bool,
                   kind: str) -> None:
        """An error reply for a request that was never stored (no request id)."""
        topic = f"{reply_topic}/{envelope.ERROR_LEVEL}" if topic_envelope else reply_topic
        self.host.router.publish(Message(topic, kind.encode(), 1, False, envelope.error_properties(
            correlation, None, kind)), self.loop.time())

    # ------------------------------------------------------------------ the dispatcher

    def stored(self, message: Message) -> bool:
        position = message.position
        now = self.loop.time()
        if position is None:  # only a stored request can be dispatched (a will is not)
            self.counters["unrouted"] += 1
            log.warning("a publish to %r that was not stored as a request is dropped",
                        message.topic)
            return True
        partition, offset = position
        service = message.topic[len(SERVICE_PREFIX):]
        request = request_from(message, service, partition, offset, now)
        if request is None:
            log.warning("a stored request without a Response Topic is dropped id=%s",
                        envelope.request_id(partition, offset))
            return True
        if partition not in self.checkpoints.written:  # before its first PUBACK
            self.checkpoints.write(partition, offset)
        dispatcher = self._dispatcher(service)
        dispatcher.arrive(request, now)
        self._run(dispatcher)
        return True

    def _run(self, dispatcher: Dispatcher) -> None:
        """Carry out what ``dispatcher`` asks for, until it asks for nothing more."""
        while dispatcher.actions:
            actions, dispatcher.actions = dispatcher.actions, []
            for action in actions:
                if isinstance(action, Deliver):
                    self._deliver(dispatcher, action)
                elif isinstance(action, Note):
                    self._append(assign_record(action.request), None)
                elif isinstance(action, Commit):
                    self._commit(dispatcher, action.request)
                elif isinstance(action, Respond):
                    self._respond(action.request)
        self._arm()

    def _deliver(self, dispatcher: Dispatcher, action: Deliver) -> None:
        request = action.request
        now = self.loop.time()
        message = Message(request.message.topic, request.message.payload, 1, False,
                          envelope.delivered_request(request.message.properties, request.id,
                                                     request.caller, action.retry, action.dup),
                          request.caller, now)
        process, client_id = action.worker
        if process == self.me:
            self._deliver_here(self.me, dispatcher.service, client_id, action.serial,
                               request.id, action.retry, action.dup, message)
        elif not self.links.send_request(process, dispatcher.service, client_id, action.serial,
                                         request.id, action.retry, action.dup, message):
            dispatcher.process_down(process, now)

    def _append(self, record: Message, done: Callable[[AppendOutcome], None] | None) -> None:
        """Append a state record to its service's partition (led here)."""
        persistence = self.host.persistence
        assert persistence is not None  # a dispatcher exists only with the log
        if persistence.append(record, STATE_CLIENT, done or self._noted):
            return
        log.warning("services: log queue full, a state record is not written")
        if done is not None:
            self.loop.call_soon(done, Refused(ReasonCode.QUOTA_EXCEEDED, "log queue full"))

    def _noted(self, outcome: AppendOutcome) -> None:
        if isinstance(outcome, Stored):
            persistence = self.host.persistence
            assert persistence is not None
            persistence.routed(outcome.partition, outcome.offset)

    def _commit(self, dispatcher: Dispatcher, request: Request) -> None:
        def durable(outcome: AppendOutcome) -> None:
            stored = isinstance(outcome, Stored)
            if stored:
                self._noted(outcome)
            else:
                log.error("services: a completion was not recorded, the request goes on "
                          "id=%s: %s", request.id, getattr(outcome, "why", outcome))
                for answer in self._answers.pop(request.id, []):
                    answer(REFUSED)
            dispatcher.committed(request.id, self.loop.time(), stored)
            self._run(dispatcher)

        self._append(done_record(request, self.loop.time()), durable)

    def _respond(self, request: Request) -> None:
        """The reply (or error reply) goes to the caller, wherever it is connected."""
        reply = request.reply
        assert reply is not None
        self.host.router.publish(reply, self.loop.time())
        for answer in self._answers.pop(request.id, []):
            answer(Verdict.ACCEPTED.value)

    # ------------------------------------------------------------------ time

    def _arm(self) -> None:
        deadlines = [d for d in (x.next_deadline() for x in self.dispatchers.values())
                     if d is not None]
        if not deadlines:
            return
        when = min(deadlines)
        if when >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self.loop.call_at(when, self._expire)

    def _expire(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        now = self.loop.time()
        for dispatcher in list(self.dispatchers.values()):
            dispatcher.expire(now)
            self._run(dispatcher)
        self.desk.sweep(now)
        self._watch()
        self._arm()

    def _checkpoint(self) -> None:
        self._checkpointer = self.loop.call_later(CHECKPOINT_INTERVAL, self._checkpoint)
        self.desk.sweep(self.loop.time())
        self._watch()
        try:
            self._write_checkpoints()
        except OSError as error:  # a full disk: the older checkpoint stays (safe)
            log.error("services checkpoint not written: %s", error)

    def _write_checkpoints(self) -> None:
        persistence = self.host.persistence
        if persistence is None:  # the log is off: no dispatcher, nothing to checkpoint
            return
        lowest: dict[int, int] = {}
        for service, dispatcher in self.dispatchers.items():
            partition = self.partition_of(service)
            for request in dispatcher.requests.values():
                if request.offset < lowest.get(partition, request.offset + 1):
                    lowest[partition] = request.offset
        for partition in list(self.checkpoints.written):
            if self.links.leader_of(partition) == self.me:
                self.checkpoints.write(partition, lowest.get(
                    partition, persistence.high_watermark[partition]))

    # ------------------------------------------------------------------ offers

    def subscribe(self, client: ClientHandle, topic_filter: str, options: SubscriptionOptions,
                  subscription_id: int | None, properties: Properties) -> int | None:
        parsed = envelope.parse_filter(topic_filter)
        session = client.session
        assert session is not None  # handlers run after CONNECT set it
        if parsed.kind == "invalid":
            log.info("service offer refused client_id=%s: %s", client.client_id, parsed.problem)
            return ReasonCode.TOPIC_FILTER_INVALID
        if self.host.persistence is None:
            log.info("service offer refused client_id=%s: services need the commit log",
                     client.client_id)
            return ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
        topic_envelope = client.conn.version != MQTT_5
        acl = self.host.acl
        checked = envelope.service_topic(parsed.service) + ("/#" if topic_envelope else "")
        if acl is not None and not acl.can_subscribe(session.username, session.client_id,
                                                     checked):
            self.host.counters.acl_denied += 1
            log.info("service offer denied client_id=%s service=%s", client.client_id,
                     parsed.service)
            return ReasonCode.NOT_AUTHORIZED
        try:
            credit = envelope.parse_credit(properties)
        except ValueError as error:
            log.info("service offer refused client_id=%s: %s", client.client_id, error)
            return ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
        granted = min(options.qos, 1, self.host.config.mqtt.max_qos)
        capacity = min(client.conn.client_receive_maximum,
                       session.limits.max_inflight_messages)
        if credit is not None:
            capacity = min(capacity, credit)
        offer, _ = self.desk.add(parsed.service, client, capacity, granted, subscription_id,
                                 topic_envelope)
        self._watch()
        log.debug("service offered client_id=%s service=%s credit=%d", client.client_id,
                  parsed.service, capacity)
        self._announce(offer, capacity)
        return granted

    def unsubscribe(self, client: ClientHandle, topic_filter: str) -> bool | None:
        parsed = envelope.parse_filter(topic_filter)
        if parsed.kind != "offer":
            return False
        offer = self.desk.find(parsed.service, client)
        if offer is None:
            return False
        self.desk.remove(offer)
        self._watch()
        self._announce(offer, 0)
        return True

    def connection_lost(self, client: ClientHandle) -> None:
        ended = self.desk.ended(client)
        if ended:
            self._watch()
        for offer in ended:
            self._announce(offer, 0)

    def _watch(self) -> None:
        """Publishes here are offered to ``reply`` while a service worker is connected here
        (its reply may come after it reconnected: recognised by its request id) or a reply
        is expected; otherwise the core pays one attribute test per publish."""
        self.expecting = bool(self.desk.offers) or self.desk.expecting

    def _announce(self, offer: LocalOffer, capacity: int) -> None:
        """Tell ``offer``'s dispatcher (capacity 0: withdrawn). A dispatcher not linked now
        hears of it in the next sync."""
        process = self.dispatcher_process(offer.service)
        if process == self.me:
            dispatcher = self._dispatcher(offer.service)
            dispatcher.offer((self.me, offer.client_id), offer.serial, capacity,
                             self.loop.time())
            self._run(dispatcher)
        else:
            self.links.send_offer(process, offer.service, offer.client_id, offer.serial,
                                  capacity)

    # ------------------------------------------------------------------ the desk

    def _deliver_here(self, dispatcher: int, service: str, client_id: str, serial: int,
                      request_id: str, retry: int, dup: bool, message: Message) -> None:
        """An attempt for a service worker connected here (a stale one is dropped: its
        dispatcher hears of the withdrawal, or did already)."""
        offer = self.desk.offers.get((service, client_id))
        if offer is None or offer.serial != serial or offer.client.gone:
            return
        session = offer.client.session
        if session is None:
            return
        now = self.loop.time()
        properties = message.properties
        expectation = Expectation(request_id, service, dispatcher, client_id, retry,
                                  envelope.reply_topic_of(properties) or "",
                                  envelope.correlation_of(properties), now)
        if offer.topic_envelope:
            message = Message(
                envelope.delivered_topic_envelope(service, request_id, retry, dup,
                                                  message.sender or ""),
                message.payload, 1, False, None, message.sender, now)
        offer.holding[request_id] = retry
        self.desk.expect(expectation, now)
        self._watch()
        ids = None if offer.subscription_id is None else [offer.subscription_id]
        session.deliver(message, offer.qos, False, ids, now)

    def reply(self, client: ClientHandle, packet: Publish, message: Message) -> bool:
        properties = packet.properties
        correlation = envelope.correlation_of(properties) if properties else None
        expectation = self.desk.expected.get((packet.topic, correlation))
        if expectation is not None:
            self._send_reply(PendingReply(
                client, packet, message, expectation.service, expectation.request_id,
                expectation.dispatcher, expectation.worker, expectation.retry, None,
                expectation))
            return True
        if not properties:
            return False
        request_id = envelope.user_value(properties, envelope.REQUEST_ID)
        where = None if request_id is None else envelope.parse_request_id(request_id)
        if request_id is None or where is None:
            return False
        retry = envelope.user_value(properties, envelope.RETRY) or "-1"
        self._send_reply(PendingReply(
            client, packet, message, "", request_id, self.links.leader_of(where[0]),
            client.client_id, int(retry) if retry.isdigit() else -1,
            (packet.topic, correlation), None))
        return True

    def _reply_by_topic(self, client: ClientHandle, packet: Publish, service: str,
                        request_id: str) -> bool:
        """``$service/NAME/reply/ID``: a reply that names its request (topic envelope). Request
        ids are log positions, easy to guess: with an ACL, only a client that may offer NAME
        (read on ``$service/NAME`` or ``$service/NAME/#``) may reply this way."""
        where = envelope.parse_request_id(request_id)
        assert where is not None  # parse_publish checked it
        acl, session = self.host.acl, client.session
        if acl is not None and session is not None:
            offer = envelope.service_topic(service)
            if not (acl.can_subscribe(session.username, session.client_id, offer)
                    or acl.can_subscribe(session.username, session.client_id, offer + "/#")):
                self.counters["denied"] += 1
                log.info("service reply denied client_id=%s service=%s", client.client_id,
                         service)
                self.host.publishes.denied(client, packet)
                return True
        expectation = self.desk.by_id.get(request_id)
        message = Message(packet.topic, packet.payload, packet.qos, False, packet.properties,
                          client.client_id, self.loop.time())
        if expectation is not None:
            pending = PendingReply(client, packet, message, expectation.service, request_id,
                                   expectation.dispatcher, expectation.worker,
                                   expectation.retry, None, expectation)
        else:
            pending = PendingReply(client, packet, message, service, request_id,
                                   self.links.leader_of(where[0]), client.client_id, -1, None,
                                   None)
        self._send_reply(pending)
        return True

    def _send_reply(self, pending: PendingReply) -> None:
        answer = partial(self._replied, pending)
        if pending.dispatcher == self.me:
            self._reply_here(self.me, pending.service, pending.request_id, pending.worker,
                             pending.retry, pending.message, pending.expected, answer)
        elif not self.links.send_reply(pending.dispatcher, pending.service, pending.request_id,
                                       pending.worker, pending.retry, pending.message,
                                       pending.expected, answer):
            self._unsent.setdefault(pending.dispatcher, []).append(pending)

    def _replied(self, pending: PendingReply, verdict: str | None) -> None:
        """The dispatcher's answer about a reply taken here."""
        if verdict is None:  # no answer: send it again once its dispatcher can be reached
            if self.links.linked(pending.dispatcher):
                self._send_reply(pending)
            else:
                self._unsent.setdefault(pending.dispatcher, []).append(pending)
            return
        if pending.expectation is not None:
            self.desk.answered(pending.expectation)
            self._watch()
        client, packet = pending.client, pending.packet
        publishes = self.host.publishes
        if verdict in (Verdict.ACCEPTED.value, Verdict.ROUTED.value):
            if packet.qos:
                publishes.acknowledge(client, packet, 1)
        elif verdict == Verdict.LATE.value or (
                verdict == Verdict.UNKNOWN.value and pending.expected is None):
            if verdict == Verdict.UNKNOWN.value:  # (the dispatcher counted the other case)
                self.desk.count_late(pending.service)
            if packet.qos:
                publishes.acknowledge(client, packet, 1)  # taken, and dropped
        elif verdict == REFUSED:
            if not client.gone:
                publishes.refuse(client, packet, ReasonCode.UNSPECIFIED_ERROR,
                                 "the reply could not be recorded")
                client.wake()
        else:  # not a reply after all (recognised by a request id that is not its own)
            publishes.publish_message(client, packet, pending.message, self.loop.time())

    def _reply_here(self, process: int, service: str, request_id: str, worker: str,
                    retry: int, message: Message, expected: tuple[str, bytes | None] | None,
                    answer: Callable[[str], None]) -> None:
        """A reply for a dispatcher of this process (from a worker on ``process``)."""
        dispatcher = self.dispatchers.get(service) if service else self._find(request_id)
        if dispatcher is None:
            answer(Verdict.UNKNOWN.value)
            return
        key: WorkerKey = (process, worker)
        verdict = dispatcher.reply(request_id, key, retry, message, self.loop.time(),
                                   expected)
        if verdict is Verdict.ACCEPTED:
            self._answers.setdefault(request_id, []).append(answer)
        else:
            answer(verdict.value)
        self._run(dispatcher)

    def _find(self, request_id: str) -> Dispatcher | None:
        for dispatcher in self.dispatchers.values():
            if request_id in dispatcher.requests:
                return dispatcher
        return None

    # ------------------------------------------------------------------ other processes

    def _when_ready(self, event: Callable[[], None]) -> bool:
        """Before recovery is over, peers' events wait (in order)."""
        if self.ready:
            return False
        self._early.append(event)
        return True

    def on_link_up(self, process: int) -> None:
        if self._when_ready(partial(self.on_link_up, process)):
            return
        offers = [offer for offer in self.desk.offers.values()
                  if self.dispatcher_process(offer.service) == process]
        self.links.send_sync(process, [
            (offer.service, offer.client_id, offer.serial, offer.capacity,
             list(offer.holding.items())) for offer in offers])
        for pending in self._unsent.pop(process, []):
            self._send_reply(pending)

    def on_link_down(self, process: int) -> None:
        if self._when_ready(partial(self.on_link_down, process)):
            return
        now = self.loop.time()
        for dispatcher in list(self.dispatchers.values()):
            dispatcher.process_down(process, now)
            self._run(dispatcher)

    def on_sync(self, process: int, offers: list[SyncEntry]) -> None:
        if self._when_ready(partial(self.on_sync, process, offers)):
            return
        now = self.loop.time()
        by_service: dict[str, list[tuple[str, int, int, Holding]]] = {}
        for service, client_id, serial, capacity, holding in offers:
            by_service.setdefault(service, []).append((client_id, serial, capacity, holding))
        for service in set(self.dispatchers) | set(by_service):
            dispatcher = self._dispatcher(service)
            dispatcher.sync(process, by_service.get(service, []), now)
            self._run(dispatcher)

    def on_offer(self, process: int, service: str, client_id: str, serial: int,
                 capacity: int) -> None:
        if self._when_ready(partial(self.on_offer, process, service, client_id, serial,
                                    capacity)):
            return
        dispatcher = self._dispatcher(service)
        dispatcher.offer((process, client_id), serial, capacity, self.loop.time())
        self._run(dispatcher)

    def on_request(self, process: int, service: str, client_id: str, serial: int,
                   request_id: str, retry: int, dup: bool, message: Message) -> None:
        self._deliver_here(process, service, client_id, serial, request_id, retry, dup,
                           message)

    def on_reply(self, process: int, service: str, request_id: str, client_id: str, retry: int,
                 message: Message, expected: tuple[str, bytes | None] | None,
                 answer: Callable[[str], None]) -> None:
        if self._when_ready(partial(self.on_reply, process, service, request_id, client_id,
                                    retry, message, expected, answer)):
            return
        self._reply_here(process, service, request_id, client_id, retry, message, expected,
                         answer)

    # ------------------------------------------------------------------ figures

    def statistics(self) -> dict[str, Any]:
        """Per service: the dispatcher's figures (where it runs) and the late replies dropped
        here; then this process's own counters."""
        services: dict[str, Any] = {}
        for service, dispatcher in self.dispatchers.items():
            services[service] = {**dispatcher.stats.as_dict(), **dispatcher.gauges()}
        for service, late in self.desk.late_replies.items():
            entry = services.setdefault(service, {})
            entry["late_replies"] = entry.get("late_replies", 0) + late
        offers: dict[str, int] = {}
        for offer in self.desk.offers.values():
            offers[offer.service] = offers.get(offer.service, 0) + 1
        return {"services": services, "offers_here": offers, **self.counters}
