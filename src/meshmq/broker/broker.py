"""The broker: acts on packets from connections; owns sessions, wills and session expiry.

Theory of operation
-------------------
The I/O layer feeds each connection's decoded packets to ``handle_events()`` in order, and
calls ``connection_lost()`` exactly once per connection. Everything here runs on the event loop
thread, one packet at a time; timers (will delay, session expiry) are loop callbacks.

Lifecycle of a session (spec 4.1, 3.1.2.11.2, 3.1.3.2.2):

* CONNECT with clean start ends any existing session first; otherwise the session resumes
  (``session present``) and its unacknowledged messages are resent.
* A second connection with a live client id takes the session over: the old connection gets
  DISCONNECT 0x8E and is treated as lost (its will follows the normal rules) before the new one
  attaches (MQTT-3.1.4-3).
* When a connection is lost without a normal DISCONNECT, its will is published after the will
  delay, or at once when the session ends first; a reconnect before then cancels it.
* A detached session ends when its expiry interval elapses (immediately for 0): its
  subscriptions are dropped and its unacknowledged shared-subscription messages go to another
  member of the group.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from meshmq.auth.acl import AccessControl, ACLFileError
from meshmq.broker.authn import Authenticator
from meshmq.broker.keeper import StateKeeper
from meshmq.broker.message import Message, PositionsRequestError, wants_positions
from meshmq.broker.persistence import Persistence
from meshmq.broker.ratelimit import ConnectRateLimiter
from meshmq.broker.replay import (
    REPLAY_PROPERTY,
    ReplayError,
    ReplayRequest,
    parse_replay,
    start_offsets,
)
from meshmq.broker.retainwindow import RetainedWindow
from meshmq.broker.router import Router
from meshmq.broker.session import Session, Subscription
from meshmq.broker.systopics import SysTopics
from meshmq.broker.workerside import WorkerSide
from meshmq.cluster.remotelog import Appended
from meshmq.logsetup import kv
from meshmq.mqtt.errors import RemoteProtocolError
from meshmq.mqtt.packets import (
    MQTT_5,
    Connect,
    Disconnect,
    Packet,
    PacketType,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Subscribe,
    Unsubscribe,
)
from meshmq.mqtt.properties import Properties, PropertyId
from meshmq.mqtt.reason_codes import ReasonCode
from meshmq.mqtt.topics import has_wildcard, parse_shared_filter, validate_topic_filter

if TYPE_CHECKING:
    from meshmq.broker.protocol import ClientProtocol
    from meshmq.cluster.mesh import Mesh
    from meshmq.cluster.spec import WorkerSpec
    from meshmq.config import BrokerConfig

log = logging.getLogger("meshmq.broker")

NEVER_EXPIRES = 0xFFFFFFFF
WORKER_PROPERTY = "meshmq-worker"  # CONNACK user property: the worker serving the connection
# Cyclic GC thresholds for a broker process. The defaults (700, 10, 10) ran a collection every
# ~70 routed messages, each walking the messages still queued or in flight: 15-25% of the CPU
# of a QoS 1 fan-in (docs/benchmarks.md). Routing creates no reference cycles (refcounting frees
# every message), so collections can be rare.
GC_THRESHOLDS = (50_000, 20, 100)


class Broker(WorkerSide):
    """Single-node broker logic, driven by the I/O layer on one event loop."""

    def __init__(
        self, config: BrokerConfig, loop: asyncio.AbstractEventLoop,
        worker: WorkerSpec | None = None,
    ) -> None:
        self.config = config
        self.loop = loop
        self.worker = worker  # None: a single-process node
        self.mesh: Mesh | None = None  # links to the other workers (workers > 1)
        self.sessions: dict[str, Session] = {}
        self.router = Router(self.sessions)
        self.authenticator = Authenticator(config.auth, loop)
        self.acl = AccessControl.from_file(config.auth.acl_file) if config.auth.acl_file else None
        self.persistence = (
            Persistence(config.log, config.server.data_dir, loop)
            if config.log.enabled and (worker is None or worker.is_leader) else None
        )
        self.clients: set[ClientProtocol] = set()
        self.keeper = StateKeeper(self)
        self.sys_topics = SysTopics(self, config.mqtt.sys_interval)
        self.connect_limiter = ConnectRateLimiter.from_config(config.limits, loop.time())
        self.shutting_down = False
        # connects and disconnects (server.log_connections)
        self._connection_log_level = logging.INFO if config.server.log_connections \
            else logging.DEBUG
        self.input_pauses: set[str] = set()  # node-wide reasons to read no client (pause_input)
        self.counters = {
            "connects": 0, "rejected": 0, "protocol_errors": 0, "wills": 0, "acl_denied": 0,
            "refused_publishes": 0, "throttled": 0, "rate_disconnects": 0,
            "subscription_quota": 0, "log_failures": 0,
        }
        self._dirty: list[ClientProtocol] = []
        self._handlers: dict[int, Callable[[ClientProtocol, Any], None]] = {
            PacketType.CONNECT: self.on_connect,
            PacketType.PUBLISH: self.on_publish,
            PacketType.PUBACK: self.on_puback,
            PacketType.PUBREC: self.on_pubrec,
            PacketType.PUBREL: self.on_pubrel,
            PacketType.PUBCOMP: self.on_pubcomp,
            PacketType.SUBSCRIBE: self.on_subscribe,
            PacketType.UNSUBSCRIBE: self.on_unsubscribe,
            PacketType.DISCONNECT: self.on_disconnect,
        }

    def start(self) -> None:
        """Restore the stored sessions and retained messages; then tune the GC."""
        self.keeper.restore()
        self.sys_topics.start()
        tune_gc()

    def pause_input(self, reason: str, paused: bool) -> None:
        """Stop (or resume) reading every client connection, new ones included."""
        if paused:
            self.input_pauses.add(reason)
        else:
            self.input_pauses.discard(reason)
        for client in self.clients:
            client.pause_input(reason, paused)

    def now(self) -> float:
        return self.loop.time()

    # ------------------------------------------------------------------ output batching

    def schedule_flush(self, client: ClientProtocol) -> None:
        """Write ``client``'s queued output once, after the current loop turn's work."""
        if not self._dirty:
            self.loop.call_soon(self._flush_dirty)
        self._dirty.append(client)

    def _flush_dirty(self) -> None:
        dirty = self._dirty
        self._dirty = []
        for client in dirty:
            client.flush()

    # ------------------------------------------------------------------ dispatch

    def handle_events(self, client: ClientProtocol, events: list[Packet]) -> None:
        handlers = self._handlers
        for index, packet in enumerate(events):
            if client.rejected:
                return
            if client.held is not None:  # CONNECT is being authenticated: later packets wait
                client.held.extend(events[index:])
                return
            handlers[packet.type](client, packet)
        session = client.session
        if session is not None and session.slots_freed:  # PUBACKs: refill the window once
            session.refill(self.loop.time())

    def on_connect(self, client: ClientProtocol, packet: Connect) -> None:
        address = client.peer.rsplit(":", 1)[0]  # "host:port", IPv6 hosts included
        if not self.connect_limiter.allow(address, self.loop.time()):
            # Before any password check, so a connect storm costs no argon2 work.
            return self._reject(client, ReasonCode.CONNECTION_RATE_EXCEEDED, "connect rate")
        if PropertyId.AUTHENTICATION_METHOD in packet.properties:
            # Enhanced authentication hook point (spec 4.12): no method is offered yet.
            return self._reject(client, ReasonCode.BAD_AUTHENTICATION_METHOD, "auth method")
        code = self.authenticator.check(
            packet, lambda code: self._authenticated(client, packet, code, resume=True)
        )
        if code is None:
            client.hold()
        else:
            self._authenticated(client, packet, code, resume=False)

    def _authenticated(
        self, client: ClientProtocol, packet: Connect, code: int, resume: bool
    ) -> None:
        if client.gone:
            return
        if code:
            self._reject(client, code, "authentication")
            client.close()
        elif (self.mesh is not None and self.mesh.links and packet.client_id
              and self._connect_refusal(packet, client.conn.version == MQTT_5) is None):
            # Another worker may hold this client's session: take it over first.
            if client.held is None:
                client.hold()
            self.mesh.claim(packet.client_id or "", packet.clean_start,
                            partial(self._claimed, client, packet))
            return
        else:
            self._accept_connect(client, packet)
        if resume:
            client.release()

    def _accept_connect(self, client: ClientProtocol, packet: Connect) -> None:
        conn = client.conn
        cfg = self.config.mqtt
        v5 = conn.version == MQTT_5
        client_id = packet.client_id
        assigned = None
        refusal = self._connect_refusal(packet, v5)
        if refusal is not None:
            return self._reject(client, ReasonCode.CLIENT_IDENTIFIER_NOT_VALID, refusal)
        try:  # log positions on delivery only if this CONNECT asks (docs/replay.md)
            client.log_positions = v5 and wants_positions(packet.properties)
        except PositionsRequestError as error:
            return self._reject(client, ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR, str(error))
        if not client_id:
            client_id = assigned = f"auto-{uuid.uuid4().hex}"  # MQTT-3.1.3-6
        keep_alive = packet.keep_alive
        if keep_alive > cfg.max_keepalive or (keep_alive == 0 and cfg.max_keepalive < 65535):
            keep_alive = cfg.max_keepalive  # returned as Server Keep Alive (MQTT-3.2.2-21)
        expiry = self._session_expiry(packet, v5)
        now = self.now()
        existing = self.sessions.get(client_id)
        if existing is not None and existing.client is not None:
            self._take_over(existing.client)
            existing = self.sessions.get(client_id)
        if existing is not None and packet.clean_start:
            self._end_session(existing, now)
            existing = None
        session_present = existing is not None
        session = existing or self._new_session(client_id)
        self._cancel_timers(session)
        session.expiry_interval = expiry
        session.will = packet.will
        session.username = packet.username
        if self.acl is not None:
            session.may_receive = partial(self.acl.can_receive, packet.username, client_id)
        client.session = session
        client.client_id = client_id
        conn.outgoing_alias_maximum = cfg.broker_topic_aliases
        props = self._connack_properties(packet, assigned, keep_alive, expiry) if v5 else None
        conn.send_connack(0, session_present, props)
        self.counters["connects"] += 1
        client.connected(keep_alive)
        log.log(self._connection_log_level, "client connected", extra=kv(
            client_id=client_id, peer=client.peer, protocol=_protocol_name(conn.version),
            clean=packet.clean_start, present=session_present, keep_alive=keep_alive))
        self.keeper.connected(session)
        session.attach(client, now)

    def _connect_refusal(self, packet: Connect, v5: bool) -> str | None:
        """Why a CONNECT that passed authentication is refused (0x85 / 3.1.1 code 2)."""
        if v5:
            return None
        if not packet.client_id and not packet.clean_start:
            return "empty id"
        max_keepalive = self.config.mqtt.max_keepalive
        if packet.keep_alive > max_keepalive or (packet.keep_alive == 0 and max_keepalive < 65535):
            return "keep alive above maximum"  # 3.1.1 cannot be told less: refuse, as Mosquitto
        return None

    def _session_expiry(self, packet: Connect, v5: bool) -> int:
        if v5:
            requested = packet.properties.get(PropertyId.SESSION_EXPIRY_INTERVAL, 0)
        else:
            requested = 0 if packet.clean_start else NEVER_EXPIRES
        return min(requested, self.config.session.max_session_expiry)  # type: ignore[type-var]

    def _connack_properties(
        self, packet: Connect, assigned: str | None, keep_alive: int, expiry: int
    ) -> Properties:
        cfg = self.config.mqtt
        props: Properties = {
            PropertyId.RECEIVE_MAXIMUM: cfg.receive_maximum,
            PropertyId.MAXIMUM_PACKET_SIZE: cfg.max_packet_size,
            PropertyId.TOPIC_ALIAS_MAXIMUM: cfg.topic_alias_maximum,
        }
        if assigned is not None:
            props[PropertyId.ASSIGNED_CLIENT_IDENTIFIER] = assigned
        if self.worker is not None:  # which worker serves this connection (docs/workers.md)
            props[PropertyId.USER_PROPERTY] = [(WORKER_PROPERTY, str(self.worker.index))]
        if keep_alive != packet.keep_alive:
            props[PropertyId.SERVER_KEEP_ALIVE] = keep_alive  # MQTT-3.2.2-21
        if expiry != packet.properties.get(PropertyId.SESSION_EXPIRY_INTERVAL, 0):
            props[PropertyId.SESSION_EXPIRY_INTERVAL] = expiry
        if cfg.max_qos < 2:
            props[PropertyId.MAXIMUM_QOS] = cfg.max_qos
        for pid, enabled in (
            (PropertyId.RETAIN_AVAILABLE, cfg.retain_available),
            (PropertyId.WILDCARD_SUBSCRIPTION_AVAILABLE, cfg.wildcard_subscriptions),
            (PropertyId.SUBSCRIPTION_IDENTIFIER_AVAILABLE, cfg.subscription_identifiers),
            (PropertyId.SHARED_SUBSCRIPTION_AVAILABLE, cfg.shared_subscriptions),
        ):
            if not enabled:
                props[pid] = 0
        return props

    def _reject(self, client: ClientProtocol, code: int, why: str) -> None:
        self.counters["rejected"] += 1
        log.info("connection refused peer=%s reason=0x%02X why=%r", client.peer, code, why)
        client.rejected = True
        client.conn.send_connack(code)

    def _new_session(self, client_id: str) -> Session:
        session = Session(client_id, self.config.session)
        session.persistence = self.persistence
        self.sessions[client_id] = session
        return session

    def restore_session(
        self, client_id: str, expiry: int, username: str | None, will: Any,
        subscriptions: dict[str, Subscription], cursor: list[int] | None,
        detached_at: int | None,
    ) -> None:
        """Rebuild a stored session at start-up, offline, resuming from its log cursor.

        A session that was connected when the broker stopped is offline from now: its will
        and expiry run as for a lost connection. Messages from its cursor up to the end of the
        log as found now may have reached it before: they come again with DUP set.
        """
        session = self._new_session(client_id)
        session.expiry_interval = expiry
        session.username = username
        if self.acl is not None:
            session.may_receive = partial(self.acl.can_receive, username, client_id)
        for topic_filter, subscription in subscriptions.items():
            self.router.subscribe(session, topic_filter, subscription)
        persistence = self.persistence
        if persistence is not None and cursor is not None and len(cursor) == len(
            persistence.high_watermark
        ):
            session.follow_log()
            catchup = session.catchup
            if catchup is not None:
                for entry in catchup.filters:
                    entry.start = list(cursor)
                catchup.dup_below = list(persistence.high_watermark)
        now_ms = int(time.time() * 1000)
        session.detached_at = detached_at if detached_at is not None else now_ms
        offline = (now_ms - session.detached_at) / 1000
        if will is not None:
            delay = will.properties.get(PropertyId.WILL_DELAY_INTERVAL, 0)
            remaining = max(0.0, min(delay, expiry) - offline)
            session.will = will
            session.will_handle = self.loop.call_later(remaining, self._publish_will, session, will)
        if expiry != NEVER_EXPIRES:
            remaining = expiry - offline
            if remaining <= 0:
                self._end_session(session, self.now())
            else:
                session.expiry_handle = self.loop.call_later(remaining, self._expire, session)

    def reload_auth(self) -> None:
        """SIGHUP: re-read the password and ACL files. A file that fails to load is logged
        and the rules in force stay; connected clients keep their sessions."""
        auth = self.config.auth
        if auth.password_file:
            self.authenticator.reload(auth.password_file)
        if auth.acl_file and self.acl is not None:
            try:
                acl = AccessControl.from_file(auth.acl_file)
            except ACLFileError as error:
                log.error("ACL file not reloaded, keeping the previous rules: %s", error)
                return
            self.acl = acl
            for session in self.sessions.values():
                session.may_receive = partial(acl.can_receive, session.username,
                                              session.client_id)
            log.info("ACL file reloaded")

    def close(self) -> None:
        """After ``shutdown()``: finish the log's queued appends, then store the state."""
        if self.persistence is not None:
            self.persistence.close()
        self.keeper.close()

    def _take_over(self, old: ClientProtocol) -> None:
        old.close_reason = "taken over"
        old.conn.send_disconnect(ReasonCode.SESSION_TAKEN_OVER)
        old.close()
        self.connection_lost(old)

    # ------------------------------------------------------------------ publish

    def on_publish(self, client: ClientProtocol, packet: Publish) -> None:
        session = client.session
        conn = client.conn
        qos = packet.qos
        if qos == 2 and packet.packet_id in session.qos2_in:
            if packet.packet_id not in session.qos2_pending:
                conn.send_pubrec(packet.packet_id)  # resend of a message already routed
            return  # (a pending one is acknowledged when its append completes)
        acl = self.acl
        if acl is not None and not acl.can_publish(session.username, session.client_id,
                                                   packet.topic):
            return self._publish_denied(client, packet)
        now = self.loop.time()
        message = Message(
            packet.topic, packet.payload, qos, packet.retain, packet.properties,
            session.client_id, now,
        )
        persistence = self.persistence
        if persistence is not None and persistence.wants(packet.topic, qos):
            return self._persist(client, packet, message)
        self._route_and_ack(client, packet, message, now)

    def _route_and_ack(
        self, client: ClientProtocol, packet: Publish, message: Message, now: float
    ) -> None:
        receivers = self.router.publish(message, now)
        qos = packet.qos
        if message.retain:  # the retained store changed: acknowledge once that is on disk
            self._keep_retained(message, partial(
                self._acknowledge, client, packet, receivers
            ) if qos else None)
            return
        if qos:
            self._acknowledge(client, packet, receivers)

    def _acknowledge(self, client: ClientProtocol, packet: Publish, receivers: int) -> None:
        if client.gone:
            return  # the publisher resends (DUP) on its next connection
        conn = client.conn
        code = 0 if receivers or conn.version != MQTT_5 else ReasonCode.NO_MATCHING_SUBSCRIBERS
        if packet.qos == 1:
            conn.send_puback(packet.packet_id, code)
        else:
            client.session.qos2_in.add(packet.packet_id)
            conn.send_pubrec(packet.packet_id, code)
        client.wake()

    def _persist(self, client: ClientProtocol, packet: Publish, message: Message) -> None:
        """Append to the commit log; route and acknowledge only once durable."""
        session = client.session
        if packet.qos == 2:
            session.qos2_in.add(packet.packet_id)
            session.qos2_pending.add(packet.packet_id)

        def durable(outcome: object) -> None:
            session.qos2_pending.discard(packet.packet_id)
            if isinstance(outcome, BaseException):
                return self._persist_failed(client, packet, outcome)
            if isinstance(outcome, Appended):  # workers: the leader stored and routed it
                if session.client is client and not client.gone:
                    self._acknowledge(client, packet, outcome.receivers)
                return
            partition, offset = outcome  # type: ignore[misc]
            message.set_position(partition, offset)
            self.persistence.routed(partition, offset)  # type: ignore[union-attr]
            attached = session.client is client and not client.gone
            if attached:
                self._route_and_ack(client, packet, message, self.loop.time())
                client.wake()
            else:  # the publisher left: route anyway (it is durable), its resend acks itself
                self.router.publish(message, self.loop.time())

        if not self.persistence.append(message, session.client_id, durable):  # type: ignore[union-attr]
            session.qos2_pending.discard(packet.packet_id)
            session.qos2_in.discard(packet.packet_id)
            self._refuse_publish(client, packet, ReasonCode.QUOTA_EXCEEDED, "log queue full")

    def _persist_failed(
        self, client: ClientProtocol, packet: Publish, error: BaseException
    ) -> None:
        failures = self.counters["log_failures"] = self.counters["log_failures"] + 1
        if failures == 1 or failures % 1000 == 0:  # one line per outage, not one per publish
            log.error("commit log append failed topic=%r error=%r failures=%d", packet.topic,
                      str(error), failures)
        client.session.qos2_in.discard(packet.packet_id)
        if not client.gone:
            code = getattr(error, "reason_code", ReasonCode.UNSPECIFIED_ERROR)
            self._refuse_publish(client, packet, code, "log failure")
            client.wake()

    def _refuse_publish(self, client: ClientProtocol, packet: Publish, code: int, why: str) -> None:
        """5.0: a negative PUBACK/PUBREC; 3.1.1 cannot say no, so the connection is closed."""
        self.counters["refused_publishes"] += 1
        if client.conn.version != MQTT_5:
            return self.protocol_violation(client, code, why)
        if packet.qos == 1:
            client.conn.send_puback(packet.packet_id, code)
        elif packet.qos == 2:
            client.conn.send_pubrec(packet.packet_id, code)

    def _publish_denied(self, client: ClientProtocol, packet: Publish) -> None:
        """5.0: acknowledge with 0x87; 3.1.1 has no way to say no: acknowledge and drop."""
        self.counters["acl_denied"] += 1
        log.info("publish denied client_id=%s topic=%r", client.client_id, packet.topic)
        conn = client.conn
        code = ReasonCode.NOT_AUTHORIZED if conn.version == MQTT_5 else 0
        if packet.qos == 1:
            conn.send_puback(packet.packet_id, code)
        elif packet.qos == 2:
            conn.send_pubrec(packet.packet_id, code)
            if not code:
                client.session.qos2_in.add(packet.packet_id)

    def on_puback(self, client: ClientProtocol, packet: Puback) -> None:
        client.session.on_puback(packet.packet_id)  # handle_events refills after the batch

    def on_pubrec(self, client: ClientProtocol, packet: Pubrec) -> None:
        client.session.on_pubrec(packet.packet_id, packet.reason_code, self.loop.time())

    def on_pubrel(self, client: ClientProtocol, packet: Pubrel) -> None:
        known = packet.packet_id in client.session.qos2_in
        client.session.qos2_in.discard(packet.packet_id)
        client.conn.send_pubcomp(
            packet.packet_id, 0 if known else ReasonCode.PACKET_IDENTIFIER_NOT_FOUND
        )

    def on_pubcomp(self, client: ClientProtocol, packet: Pubcomp) -> None:
        client.session.on_pubcomp(packet.packet_id, self.loop.time())

    # ------------------------------------------------------------------ subscriptions

    def on_subscribe(self, client: ClientProtocol, packet: Subscribe) -> None:
        cfg = self.config.mqtt
        session = client.session
        ids = packet.properties.get(PropertyId.SUBSCRIPTION_IDENTIFIER)
        sub_id = ids[0] if ids else None  # type: ignore[index]
        if sub_id is not None and not cfg.subscription_identifiers:
            return self.protocol_violation(
                client, ReasonCode.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED, "subscription id"
            )
        codes: list[int] = []
        retained: list[tuple[str, Subscription]] = []
        replayed: list[str] = []
        try:
            request, replay = self._replay_request(packet)
        except ReplayError as error:
            log.info("replay refused client_id=%s why=%r", session.client_id, str(error))
            refused = ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
            client.conn.send_suback(packet.packet_id, [refused] * len(packet.subscriptions))
            return
        for topic_filter, options in packet.subscriptions:
            try:
                validate_topic_filter(topic_filter, cfg.max_topic_levels)
            except RemoteProtocolError:
                codes.append(ReasonCode.TOPIC_FILTER_INVALID)
                continue
            if _too_long(topic_filter, self.config.limits.max_topic_bytes):
                codes.append(ReasonCode.TOPIC_FILTER_INVALID)
                continue
            group, plain = parse_shared_filter(topic_filter)
            if group is not None:
                if options.no_local:
                    return self.protocol_violation(  # MQTT-3.8.3-4
                        client, ReasonCode.PROTOCOL_ERROR, "no local on a shared subscription"
                    )
                if not cfg.shared_subscriptions:
                    codes.append(ReasonCode.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED)
                    continue
            if not cfg.wildcard_subscriptions and has_wildcard(plain):
                codes.append(ReasonCode.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED)
                continue
            if self.acl is not None and not self.acl.can_subscribe(
                session.username, session.client_id, plain
            ):
                self.counters["acl_denied"] += 1
                log.info("subscribe denied client_id=%s filter=%r", session.client_id, plain)
                codes.append(ReasonCode.NOT_AUTHORIZED)
                continue
            if options.qos > cfg.max_qos:
                options = replace(options, qos=cfg.max_qos)
            if self._subscription_quota_full(session, topic_filter):
                codes.append(ReasonCode.QUOTA_EXCEEDED)  # 3.1.1: 0x80 (send_suback maps it)
                continue
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

        if replayed and request is not None and not self.persistence.routes_locally:  # type: ignore[union-attr]
            self._sync_replay(session, request, replayed)

        self._open_retained(session, retained)  # live retained publishes from now on

        def stored() -> None:  # SUBACK once a persistent session's subscriptions are on disk
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

        filters = [f for f, _ in packet.subscriptions]
        if self.mesh is not None and self.mesh.links and any(
                code < 0x80 for code in codes):  # and the peers route to it (mesh.barrier)
            stored = _after_both(stored, partial(self.keeper.subscriptions, session, filters),
                                 self.mesh.barrier)
            stored()
            return
        self.keeper.subscriptions(session, filters, stored)

    def _replay_request(self, packet: Subscribe) -> tuple[ReplayRequest | None, list[int] | None]:
        """Start offsets asked for with the ``meshmq-replay`` user property (docs/replay.md)."""
        pairs = packet.properties.get(PropertyId.USER_PROPERTY) or ()
        values = [value for name, value in pairs if name == REPLAY_PROPERTY]  # type: ignore[misc]
        if not values:
            return None, None
        request = parse_replay(values[-1])
        if request.kind == "latest":
            return None, None
        if self.persistence is None:
            raise ReplayError("replay needs the commit log (log.enabled = true)")
        return request, start_offsets(request, self.persistence)

    def _subscription_quota_full(self, session: Session, topic_filter: str) -> bool:
        """True if ``topic_filter`` would be one filter more than ``limits.max_subscriptions``."""
        limit = self.config.limits.max_subscriptions
        if not limit or topic_filter in session.subscriptions or len(session.subscriptions) < limit:
            return False
        self.counters["subscription_quota"] += 1
        log.info("subscription refused, quota full client_id=%s filter=%r max=%d",
                 session.client_id, topic_filter, limit)
        return True

    @staticmethod
    def _open_retained(session: Session, retained: list[tuple[str, Subscription]]) -> None:
        """Subscriptions asking for retained messages are installed: open the session's
        window on live retained publishes until their lookup is answered."""
        if not retained:
            return
        window = session.retained_window
        if window is None:
            window = session.retained_window = RetainedWindow()
        window.open(plain for plain, _ in retained)

    def _send_retained(self, session: Session, retained: list[tuple[str, Subscription]]) -> None:
        """Look the retained messages up (here, or at the leader with workers): after the
        SUBACK, so that every peer routes to the new subscription and a retained publish
        stored after the lookup reaches it live."""
        if self.router.keeps_retained:
            found = [self.retained_matching(plain) for plain, _ in retained]
            self._retained_answered(session, retained, found)
            return

        def answer(found: list[list[Message]]) -> None:
            self._retained_answered(session, retained, found)
            if session.client is not None:
                session.client.wake()

        self.mesh.query_retained([plain for plain, _ in retained], answer)  # type: ignore[union-attr]

    def _retained_answered(self, session: Session, retained: list[tuple[str, Subscription]],
                           found: list[list[Message]] | None) -> None:
        """Deliver the copies no live publish overtook (None: nobody to deliver them to), then
        close the window once nothing sent before them can still arrive."""
        window = session.retained_window
        assert window is not None
        copies = window.copies(found or [[] for _ in retained])
        if found is not None and (session.client is not None or session.expiry_interval):
            self._deliver_retained(session, retained, copies)

        def settled() -> None:
            if window.close() and session.retained_window is window:
                session.retained_window = None

        if self.mesh is not None and self.mesh.links and any(copies):
            self.mesh.barrier(settled)  # a live duplicate from a peer lands before its answer
        else:
            settled()

    def _deliver_retained(self, session: Session, retained: list[tuple[str, Subscription]],
                          found: list[list[Message]]) -> None:
        now = self.loop.time()
        for (_, subscription), messages in zip(retained, found, strict=True):
            ids = None if subscription.subscription_id is None else [subscription.subscription_id]
            for message in messages:
                qos = min(message.qos, subscription.options.qos)
                # MQTT-3.3.1-8: retain flag set; a copy, as it is not a live log record
                session.deliver_copy(message.unpositioned(), qos, ids, now)

    def on_unsubscribe(self, client: ClientProtocol, packet: Unsubscribe) -> None:
        codes = []
        for topic_filter in packet.topic_filters:
            try:
                validate_topic_filter(topic_filter, self.config.mqtt.max_topic_levels)
            except RemoteProtocolError:
                codes.append(ReasonCode.TOPIC_FILTER_INVALID)
                continue
            removed = self.router.unsubscribe(client.session, topic_filter)
            client.session.forget_filter(topic_filter)
            codes.append(ReasonCode.SUCCESS if removed else ReasonCode.NO_SUBSCRIPTION_EXISTED)

        def stored() -> None:
            if not client.gone:
                client.conn.send_unsuback(packet.packet_id, codes)
                client.wake()

        self.keeper.subscriptions(client.session, list(packet.topic_filters), stored)

    # ------------------------------------------------------------------ disconnects

    def on_disconnect(self, client: ClientProtocol, packet: Disconnect) -> None:
        client.close_reason = _disconnect_reason(packet, client.conn.version)
        session = client.session
        if session is None:
            return
        expiry = packet.properties.get(PropertyId.SESSION_EXPIRY_INTERVAL)
        if expiry is not None:
            session.expiry_interval = min(expiry, self.config.session.max_session_expiry)  # type: ignore[type-var]
        if packet.reason_code != ReasonCode.DISCONNECT_WITH_WILL_MESSAGE:
            session.will = None  # MQTT-3.1.2-10: a normal DISCONNECT discards the will

    def protocol_violation(self, client: ClientProtocol, code: int, why: str) -> None:
        """A rule checked above the codec was broken: tell the client and close."""
        self.counters["protocol_errors"] += 1
        log.info("protocol error client_id=%s reason=0x%02X why=%r", client.client_id, code, why)
        client.close_reason = f"protocol error 0x{code:02X}: {why}"
        client.rejected = True
        client.conn.send_disconnect(code)
        client.close()

    def connection_lost(self, client: ClientProtocol) -> None:
        """The connection is gone (or taken over): detach, schedule will and expiry."""
        self.clients.discard(client)
        session = client.session
        if session is None or session.client is not client:
            return  # never connected, or already lost (taken over): logged then
        log.log(self._connection_log_level, "client disconnected", extra=kv(
            client_id=session.client_id, peer=client.peer,
            protocol=_protocol_name(client.conn.version), reason=client.close_reason))
        session.detach()
        if self.shutting_down:
            return  # wills are not sent on a clean broker shutdown; sessions are kept
        will = session.will
        session.will = None
        now = self.loop.time()
        if will is not None:
            delay = will.properties.get(PropertyId.WILL_DELAY_INTERVAL, 0)
            if delay and session.expiry_interval:
                session.will_handle = self.loop.call_later(
                    min(delay, session.expiry_interval), self._publish_will, session, will  # type: ignore[type-var]
                )
                session.will = will  # still pending: a reconnect cancels it
            else:
                self._publish_will(session, will)
        if session.expiry_interval == 0:
            self._end_session(session, now)
            return
        self._start_expiry(session)
        self.keeper.detached(session)

    def _start_expiry(self, session: Session) -> None:
        if session.expiry_interval != NEVER_EXPIRES:
            session.expiry_handle = self.loop.call_later(
                session.expiry_interval, self._expire, session
            )

    def _publish_will(self, session: Session, will: Any) -> None:
        session.will_handle = None
        session.will = None
        self.counters["wills"] += 1
        now = self.loop.time()
        message = Message.from_will(will, session.client_id, now)
        persistence = self.persistence
        if persistence is not None and persistence.wants(message.topic, message.qos):
            def durable(outcome: object) -> None:  # like any publish: in the log, then routed
                if isinstance(outcome, Appended):
                    return  # workers: the leader stored and routed it
                if not isinstance(outcome, BaseException):
                    message.set_position(*outcome)  # type: ignore[misc]
                    persistence.routed(*outcome)  # type: ignore[misc]
                self._route_will(message)

            if persistence.append(message, session.client_id, durable):
                return
            log.warning("will not persisted, log queue full client_id=%s", session.client_id)
        self._route_will(message)

    def _route_will(self, message: Message) -> None:
        self.router.publish(message, self.loop.time())
        if message.retain:
            self._keep_retained(message, None)

    def _expire(self, session: Session) -> None:
        session.expiry_handle = None
        if session.client is None and self.sessions.get(session.client_id) is session:
            log.debug("session expired client_id=%s", session.client_id)
            self._end_session(session, self.loop.time())

    def _end_session(self, session: Session, now: float) -> None:
        if session.will_handle is not None:  # the session ends first: will goes now
            self._cancel_timers(session)
            if session.will is not None:
                self._publish_will(session, session.will)
        self._cancel_timers(session)
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
            self.keeper.ended(session)
        self.router.drop_session(session, now)

    @staticmethod
    def _cancel_timers(session: Session) -> None:
        for name in ("will_handle", "expiry_handle"):
            handle = getattr(session, name)
            if handle is not None:
                handle.cancel()  # type: ignore[attr-defined]
                setattr(session, name, None)

    def shutdown(self) -> None:
        """Close every connection for a clean stop: DISCONNECT 0x8B, no wills."""
        self.shutting_down = True
        self.sys_topics.stop()
        if self.mesh is not None:
            self.mesh.close()
        self.authenticator.close()
        for client in list(self.clients):
            client.close_reason = "server shutting down"
            client.conn.send_disconnect(ReasonCode.SERVER_SHUTTING_DOWN)
            client.close()

    def statistics(self) -> dict[str, Any]:
        return {
            "clients": len(self.clients),
            "sessions": len(self.sessions),
            **self.router.statistics(),
            **self.counters,
        }


def _protocol_name(version: int) -> str:
    return "5.0" if version == MQTT_5 else "3.1.1"


def _disconnect_reason(packet: Disconnect, version: int) -> str:
    """A client's DISCONNECT as a log reason: 'DISCONNECT 0x00 normal disconnection'."""
    if version != MQTT_5:
        return "DISCONNECT"  # 3.1.1 carries no reason code
    code = packet.reason_code
    name = "normal disconnection" if code == ReasonCode.SUCCESS else \
        ReasonCode(code).name.lower().replace("_", " ")  # the codec admits only known codes
    return f"DISCONNECT 0x{code:02X} {name}"


def tune_gc() -> None:
    """Set ``GC_THRESHOLDS`` and freeze what start-up built (modules, configuration, restored
    sessions), so that collections never walk it again. Process-wide: the broker owns it."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _after_both(done: Callable[[], None], first: Callable[[Callable[[], None]], None],
                second: Callable[[Callable[[], None]], None]) -> Callable[[], None]:
    """A call that starts ``first`` and ``second`` (each takes a completion) and runs
    ``done`` once both have completed."""
    def start() -> None:
        waiting = [2]

        def one_done() -> None:
            waiting[0] -= 1
            if waiting[0] == 0:
                done()

        first(one_done)
        second(one_done)
    return start


def _too_long(topic_filter: str, limit: int) -> bool:
    """True if ``topic_filter`` is over ``limit`` UTF-8 bytes (``limits.max_topic_bytes``)."""
    return len(topic_filter) > limit // 4 and len(topic_filter.encode("utf-8")) > limit
