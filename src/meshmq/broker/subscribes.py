"""SUBSCRIBE and UNSUBSCRIBE: reason codes per filter, replay, retained messages, SUBACK.

Theory of operation
-------------------
Each filter of a SUBSCRIBE is checked (validity, length, shared-subscription rules, wildcard
availability, ACL, QoS cap, quota) and either refused with its reason code or installed in the
router at once. Then:

* a filter with a ``meshmq-replay`` request (docs/replay.md) reads history from the log
  instead of getting retained messages;
* the other plain filters with retain handling 0 (or 1 for a new subscription) get the
  matching retained messages (MQTT-3.3.1-9, -10, -11), looked up after the SUBACK, when every
  peer routes to the subscription; a retained publish routed between the install and the
  lookup reaches the subscriber once, live or as the copy (broker/retainwindow.py);
* the SUBACK waits until the subscriptions of a persistent session are journaled and every
  peer routes according to them (``Peers.barrier``: nothing to wait for on a single router),
  so that after a SUBACK a publish anywhere reaches the new subscription.

A filter on ``$service/`` is first offered to the services layer (``Services.subscribe``): a
service worker's offer is not a route, and its reason code is the layer's. The SUBACK still
waits for the barrier, so the offer has reached the service's dispatcher when it is sent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Protocol

from meshmq.broker.message import SERVICE_PREFIX
from meshmq.broker.replay import (
    REPLAY_PROPERTY,
    ReplayError,
    ReplayRequest,
    parse_replay,
    start_offsets,
)
from meshmq.broker.retainwindow import RetainedWindow
from meshmq.broker.session import Subscription
from meshmq.completions import after_both
from meshmq.mqtt.errors import RemoteProtocolError
from meshmq.mqtt.packets import Subscribe, Unsubscribe
from meshmq.mqtt.properties import PropertyId, get_property
from meshmq.mqtt.reason_codes import ReasonCode
from meshmq.mqtt.topics import has_wildcard, parse_shared_filter, validate_topic_filter

if TYPE_CHECKING:
    import asyncio

    from meshmq.auth.acl import AccessControl
    from meshmq.broker.client import ClientHandle
    from meshmq.broker.counters import Counters
    from meshmq.broker.interfaces import PartitionLog, Peers, RetainedMessages, Services
    from meshmq.broker.keeper import StateKeeper
    from meshmq.broker.message import Message
    from meshmq.broker.router import Router
    from meshmq.broker.session import Session
    from meshmq.config import BrokerConfig

log = logging.getLogger("meshmq.broker")

Retained = list[tuple[str, Subscription]]  # (plain filter, subscription) wanting retained


class SubscribeHost(Protocol):
    """What the subscription path needs from the broker it serves (broker.py)."""

    loop: asyncio.AbstractEventLoop
    router: Router
    config: BrokerConfig  # replaced by a reload: read it when needed, never keep it
    acl: AccessControl | None  # None: no ACL file
    persistence: PartitionLog | None  # the commit log, when it is on
    retained: RetainedMessages
    keeper: StateKeeper  # journals a persistent session's subscriptions
    services: Services  # request/reply: offers on $service/ filters
    counters: Counters

    @property
    def peers(self) -> Peers:
        """The node's other routers (``barrier``)."""

    def protocol_violation(self, client: ClientHandle, code: int, why: str) -> None:
        """Tell ``client`` (DISCONNECT with ``code``) and close it."""


class Subscribes:
    """The subscription path of one broker (see the module docstring)."""

    def __init__(self, broker: SubscribeHost) -> None:
        self.broker = broker
        self.loop = broker.loop
        self.router = broker.router

    def on_subscribe(self, client: ClientHandle, packet: Subscribe) -> None:
        broker = self.broker
        cfg = broker.config.mqtt
        session = client.session
        assert session is not None  # handlers run after CONNECT set it
        ids = get_property(packet.properties, PropertyId.SUBSCRIPTION_IDENTIFIER)
        sub_id = ids[0] if ids else None
        if sub_id is not None and not cfg.subscription_identifiers:
            return broker.protocol_violation(
                client, ReasonCode.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED, "subscription id"
            )
        codes: list[int] = []
        retained: Retained = []
        replayed: list[str] = []
        try:
            request, replay = self._replay_request(packet)
        except ReplayError as error:
            log.info("replay refused client_id=%s why=%r", session.client_id, str(error))
            refused = ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
            client.conn.send_suback(packet.packet_id, [refused] * len(packet.subscriptions))
            return
        offers: list[str] = []
        for topic_filter, options in packet.subscriptions:
            if topic_filter.startswith(SERVICE_PREFIX):
                offered = broker.services.subscribe(client, topic_filter, options, sub_id,
                                                    packet.properties)
                if offered is not None:  # a service worker's offer, not a route
                    codes.append(offered)
                    offers.append(topic_filter)
                    continue
            code = self._check(client, session, topic_filter, options.no_local)
            if code is None:
                return  # a protocol violation: the connection is closed
            if code:
                codes.append(code)
                continue
            group, plain = parse_shared_filter(topic_filter)
            if options.qos > cfg.max_qos:
                options = replace(options, qos=cfg.max_qos)
            subscription = Subscription(options, sub_id)
            existed = self.router.subscribe(session, topic_filter, subscription)
            codes.append(options.qos)
            if replay is not None and group is None:
                session.replay(topic_filter, replay)  # history instead of retained messages
                replayed.append(topic_filter)
                continue
            handling = options.retain_handling
            if group is None and (handling == 0 or (handling == 1 and not existed)):
                retained.append((plain, subscription))  # MQTT-3.3.1-9, -10, -11
        log.debug("subscribed client_id=%s filters=%s codes=%s", session.client_id,
                  [f for f, _ in packet.subscriptions], codes)
        if replayed and request is not None:
            self._sync_replay(session, request, replayed)
        self._open_retained(session, retained)  # live retained publishes from now on

        def stored() -> None:  # SUBACK once journaled and routed to from everywhere
            if client.gone:
                if retained:
                    self._retained_answered(session, retained, None)
                return
            client.conn.send_suback(packet.packet_id, codes)
            if retained:
                self._send_retained(session, retained)
            if replay is not None:
                session.pump(self.loop.time())
            client.wake()

        filters = [f for f, _ in packet.subscriptions if f not in offers]
        journaled = partial(broker.keeper.subscriptions, session, filters)
        if any(code < 0x80 for code in codes):
            after_both(stored, journaled, broker.peers.barrier)()
        else:
            journaled(stored)

    def _check(self, client: ClientHandle, session: Session, topic_filter: str,
               no_local: bool) -> int | None:
        """0 if ``topic_filter`` may be subscribed to, else its SUBACK reason code (None: a
        protocol violation closed the connection)."""
        broker = self.broker
        cfg = broker.config.mqtt
        try:
            validate_topic_filter(topic_filter, cfg.max_topic_levels)
        except RemoteProtocolError:
            return ReasonCode.TOPIC_FILTER_INVALID
        if _too_long(topic_filter, broker.config.limits.max_topic_bytes):
            return ReasonCode.TOPIC_FILTER_INVALID
        group, plain = parse_shared_filter(topic_filter)
        if group is not None:
            if no_local:
                broker.protocol_violation(  # MQTT-3.8.3-4
                    client, ReasonCode.PROTOCOL_ERROR, "no local on a shared subscription")
                return None
            if not cfg.shared_subscriptions:
                return ReasonCode.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED
        if not cfg.wildcard_subscriptions and has_wildcard(plain):
            return ReasonCode.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED
        acl = broker.acl
        if acl is not None and not acl.can_subscribe(session.username, session.client_id, plain):
            broker.counters.acl_denied += 1
            log.info("subscribe denied client_id=%s filter=%r", session.client_id, plain)
            return ReasonCode.NOT_AUTHORIZED
        if self._quota_full(session, topic_filter):
            return ReasonCode.QUOTA_EXCEEDED  # 3.1.1: 0x80 (send_suback maps it)
        return 0

    def _replay_request(self, packet: Subscribe) -> tuple[ReplayRequest | None, list[int] | None]:
        """Start offsets asked for with the ``meshmq-replay`` user property (docs/replay.md)."""
        pairs = get_property(packet.properties, PropertyId.USER_PROPERTY) or ()
        values = [value for name, value in pairs if name == REPLAY_PROPERTY]
        if not values:
            return None, None
        request = parse_replay(values[-1])
        if request.kind == "latest":
            return None, None
        persistence = self.broker.persistence
        if persistence is None:
            raise ReplayError("replay needs the commit log (log.enabled = true)")
        return request, start_offsets(request, persistence)

    def _quota_full(self, session: Session, topic_filter: str) -> bool:
        """True if ``topic_filter`` would be one filter more than ``limits.max_subscriptions``."""
        limit = self.broker.config.limits.max_subscriptions
        if not limit or topic_filter in session.subscriptions or len(session.subscriptions) < limit:
            return False
        self.broker.counters.subscription_quota += 1
        log.info("subscription refused, quota full client_id=%s filter=%r max=%d",
                 session.client_id, topic_filter, limit)
        return True

    # ------------------------------------------------------------------ log positions

    def sync_catchup(self, session: Session, then: Callable[[], None] | None = None,
                     timestamp_ms: int | None = None) -> None:
        """A session's log cursor reads up to the high watermark as of after its routes are in
        place (a session handed over: records routed while its routes moved went to no router
        live). Until the log answers the cursor reads nothing; ``then`` runs before it reads
        again."""
        catchup = session.catchup
        persistence = self.broker.persistence
        if catchup is None or persistence is None:
            return
        catchup.syncing += 1
        waiting = [True]

        def synced() -> None:
            catchup.syncing -= 1
            if then is not None:
                then()
            if not waiting[0]:  # answered later: nothing else will pump it
                session.pump(self.loop.time())

        persistence.sync(synced, timestamp_ms)
        waiting[0] = False

    def _sync_replay(self, session: Session, request: ReplayRequest, filters: list[str]) -> None:
        """History ends where the leaders' high watermarks are once the new routes are in
        place. Until then the replay covers everything (live messages on these filters wait
        for it) and reads nothing; then its start offsets are computed again."""
        if session.catchup is None:
            return
        entries = [e for e in session.catchup.filters if e.topic_filter in filters]
        for entry in entries:
            entry.restart([0] * len(entry.start))
        persistence = self.broker.persistence
        assert persistence is not None

        def restart() -> None:
            try:
                start = start_offsets(request, persistence)
            except ReplayError:  # checked at SUBSCRIBE; the log cannot shrink its partitions
                start = list(persistence.high_watermark)
            for entry in entries:
                entry.restart(start)

        self.sync_catchup(session, restart, request.timestamp_ms
                          if request.kind == "timestamp" else None)

    # ------------------------------------------------------------------ retained messages

    @staticmethod
    def _open_retained(session: Session, retained: Retained) -> None:
        """Subscriptions asking for retained messages are installed: open the session's
        window on live retained publishes until their lookup is answered."""
        if not retained:
            return
        window = session.retained_window
        if window is None:
            window = session.retained_window = RetainedWindow()
        window.open(plain for plain, _ in retained)

    def _send_retained(self, session: Session, retained: Retained) -> None:
        """Look the retained messages up: after the SUBACK, so that every peer routes to the
        new subscription and a retained publish stored after the lookup reaches it live."""
        def answer(found: list[list[Message]]) -> None:
            self._retained_answered(session, retained, found)
            if session.client is not None:
                session.client.wake()

        self.broker.retained.query([plain for plain, _ in retained], answer)

    def _retained_answered(self, session: Session, retained: Retained,
                           found: list[list[Message]] | None) -> None:
        """Deliver the copies no live publish overtook (None: nobody to deliver them to), then
        close the window once nothing sent before them can still arrive."""
        window = session.retained_window
        assert window is not None
        copies = window.copies(found or [[] for _ in retained])
        if found is not None and (session.client is not None or session.expiry_interval):
            now = self.loop.time()
            for (_, subscription), messages in zip(retained, copies, strict=True):
                ids = None if subscription.subscription_id is None else [
                    subscription.subscription_id]
                for message in messages:
                    qos = min(message.qos, subscription.options.qos)
                    # MQTT-3.3.1-8: retain flag set; a copy, as it is not a live log record
                    session.deliver_copy(message.unpositioned(), qos, ids, now)

        def settled() -> None:
            if window.close() and session.retained_window is window:
                session.retained_window = None

        if any(copies):  # a live duplicate from a peer lands before its barrier answer
            self.broker.peers.barrier(settled)
        else:
            settled()

    # ------------------------------------------------------------------ unsubscribe

    def on_unsubscribe(self, client: ClientHandle, packet: Unsubscribe) -> None:
        session = client.session
        assert session is not None  # handlers run after CONNECT set it
        codes: list[int] = []
        services = self.broker.services
        routes: list[str] = []  # the filters that are not offers: journaled
        for topic_filter in packet.topic_filters:
            if topic_filter.startswith(SERVICE_PREFIX):
                withdrawn = services.unsubscribe(client, topic_filter)
                if withdrawn is not None:  # an offer ends
                    codes.append(ReasonCode.SUCCESS if withdrawn
                                 else ReasonCode.NO_SUBSCRIPTION_EXISTED)
                    continue
            routes.append(topic_filter)
            try:
                validate_topic_filter(topic_filter, self.broker.config.mqtt.max_topic_levels)
            except RemoteProtocolError:
                codes.append(ReasonCode.TOPIC_FILTER_INVALID)
                continue
            removed = self.router.unsubscribe(session, topic_filter)
            session.forget_filter(topic_filter)
            codes.append(ReasonCode.SUCCESS if removed else ReasonCode.NO_SUBSCRIPTION_EXISTED)

        def stored() -> None:
            if not client.gone:
                client.conn.send_unsuback(packet.packet_id, codes)
                client.wake()

        self.broker.keeper.subscriptions(session, routes, stored)


def _too_long(topic_filter: str, limit: int) -> bool:
    """True if ``topic_filter`` is over ``limit`` UTF-8 bytes (``limits.max_topic_bytes``)."""
    return len(topic_filter) > limit // 4 and len(topic_filter.encode("utf-8")) > limit
