"""CONNECT: admission, authentication, the session's claim, and CONNACK.

Theory of operation
-------------------
A CONNECT goes through, in order: the connect rate limit (before any password check, so a
storm costs no argon2 work), enhanced authentication (none offered yet), authentication
(maybe off the loop: the connection is held meanwhile), the refusals that need the packet
(3.1.1 and 3.1 rules), and then the session. If the node has other routers, the session
directory (broker/interfaces.py) may have to take the client's session over from another one
first (``claim``): the connection stays held until the session has arrived, and, if it has
subscriptions, until every peer routes them here (a barrier), so that the CONNACK means the
same as on one broker. A connection whose session is taken again meanwhile by a newer one
elsewhere is closed (``supersede``).
"""

from __future__ import annotations

import logging
import uuid
from functools import partial
from typing import TYPE_CHECKING, Protocol

from meshmq.broker.client import ClientHandle, is_handle
from meshmq.broker.lifecycle import NEVER_EXPIRES, Lifecycle, cancel_timers, protocol_name
from meshmq.broker.message import PositionsRequestError, wants_positions
from meshmq.logsetup import kv
from meshmq.memo import remember
from meshmq.mqtt.codec import encode_properties
from meshmq.mqtt.packets import MQTT_5, Connect
from meshmq.mqtt.properties import Properties, PropertyId, get_property
from meshmq.mqtt.reason_codes import ReasonCode

if TYPE_CHECKING:
    import asyncio

    from meshmq.broker.authn import ConnectAuthenticator
    from meshmq.broker.counters import Counters
    from meshmq.broker.interfaces import BrokerEvents, Peers, SessionDirectory
    from meshmq.broker.keeper import StateKeeper
    from meshmq.broker.ratelimit import ConnectRateLimiter
    from meshmq.broker.session import Session
    from meshmq.broker.subscribes import Subscribes
    from meshmq.config import BrokerConfig, MQTTConfig

log = logging.getLogger("meshmq.broker")

WORKER_PROPERTY = "meshmq-worker"  # CONNACK user property: the worker serving the connection


class ConnectHost(Protocol):
    """What the CONNECT path needs from the broker it serves (broker.py)."""

    loop: asyncio.AbstractEventLoop
    sessions: dict[str, Session]  # every session here, by client id
    config: BrokerConfig  # replaced by a reload: read it when needed, never keep it
    index: int | None  # this worker among the node's (None: a single process)
    connect_limiter: ConnectRateLimiter  # replaced by a reload
    authenticator: ConnectAuthenticator  # (the TLS listeners wrap it: transport/certauth.py)
    directory: SessionDirectory  # where the node's sessions are
    keeper: StateKeeper
    events: BrokerEvents | None  # webhooks, when configured
    counters: Counters

    @property
    def peers(self) -> Peers:
        """The node's other routers (``barrier``)."""

    @property
    def lifecycle(self) -> Lifecycle:
        """Sessions made, taken over and ended."""

    @property
    def subscribes(self) -> Subscribes:
        """Catch-ups of adopted sessions (``sync_catchup``)."""


class Connects:
    """The CONNECT path of one broker (see the module docstring)."""

    def __init__(self, broker: ConnectHost) -> None:
        self.broker = broker
        self.loop = broker.loop
        self.pending: dict[str, ClientHandle] = {}  # client id -> connection waiting a claim
        # Encoded CONNACK property blocks by (Server Keep Alive, Session Expiry Interval) sent,
        # for the configuration they were made with (``_connack_block``).
        self._blocks: dict[tuple[int | None, int | None], bytes] = {}
        self._blocks_config: MQTTConfig | None = None

    def on_connect(self, client: ClientHandle, packet: Connect) -> None:
        broker = self.broker
        limiter = broker.connect_limiter
        # "host:port", IPv6 hosts included: the host, when limits per address are on
        address = client.peer.rsplit(":", 1)[0] if limiter.per_address else ""
        if not limiter.allow(address, self.loop.time()):
            # Before any password check, so a connect storm costs no argon2 work.
            return self.reject(client, ReasonCode.CONNECTION_RATE_EXCEEDED, "connect rate")
        if PropertyId.AUTHENTICATION_METHOD in packet.properties:
            # Enhanced authentication hook point (spec 4.12): no method is offered yet.
            return self.reject(client, ReasonCode.BAD_AUTHENTICATION_METHOD, "auth method")
        code = broker.authenticator.check(
            packet, lambda code: self._authenticated(client, packet, code, resume=True)
        )
        if code is None:
            client.hold()
        else:
            self._authenticated(client, packet, code, resume=False)

    def _authenticated(
        self, client: ClientHandle, packet: Connect, code: int, resume: bool
    ) -> None:
        if client.gone:
            return
        if code:
            self.reject(client, code, "authentication")
            client.close()
        elif packet.client_id and not (directory := self.broker.directory).alone \
                and self._refusal(packet, client.conn.version == MQTT_5) is None \
                and directory.claim(packet.client_id, packet.clean_start,
                                    partial(self._claimed, client, packet)):
            # Another router may hold this client's session: it comes here first.
            if client.held is None:
                client.hold()
            old = self.pending.get(packet.client_id)
            if old is not None and old is not client:
                self._supersede(old)
            self.pending[packet.client_id] = client
            return
        else:
            self.accept(client, packet, claimed=False)
        if resume:
            client.release()

    def _claimed(self, client: ClientHandle, packet: Connect, adopted: list[Session]) -> None:
        """The session directory answered: adopt what came, then connect."""
        client_id = packet.client_id
        if self.pending.get(client_id) is client:
            del self.pending[client_id]
        broker = self.broker
        for session in adopted:
            broker.subscribes.sync_catchup(session)
            session.connecting = not client.gone  # QoS 0 waits for the CONNACK, as on one broker
        broker.directory.settled(client_id, adopted)
        if not client.gone and any(session.subscriptions for session in adopted):
            # CONNACK once every peer routes the moved subscriptions here.
            broker.peers.barrier(partial(self._connect_claimed, client, packet, adopted))
            return
        self._connect_claimed(client, packet, adopted)

    def _connect_claimed(self, client: ClientHandle, packet: Connect,
                         adopted: list[Session]) -> None:
        if client.gone:  # the new connection went away meanwhile: what it adopted waits here
            for session in adopted:
                session.connecting = False
                if session.client is None and session.expiry_handle is None \
                        and self.broker.sessions.get(session.client_id) is session:
                    self.broker.lifecycle.start_expiry(session)
                    self.broker.keeper.detached(session)
            return
        self.accept(client, packet, claimed=True)
        client.release()

    def supersede(self, client_id: str) -> None:
        """A newer connection elsewhere took this client's session while ours waited for it."""
        client = self.pending.pop(client_id, None)
        if client is not None:
            self._supersede(client)

    def _supersede(self, client: ClientHandle) -> None:
        log.info("connection superseded by a newer one for the same client id client_id=%s "
                 "peer=%s", client.client_id or "-", client.peer)
        client.close_reason = "superseded before CONNACK"
        client.rejected = True
        client.close()

    # ------------------------------------------------------------------ accepting

    def accept(self, client: ClientHandle, packet: Connect, claimed: bool) -> None:
        """Connect ``client`` to its session (resumed or new) and send CONNACK. ``claimed``:
        the session directory has this router down as the session's holder already."""
        broker = self.broker
        conn = client.conn
        cfg = broker.config.mqtt
        v5 = conn.version == MQTT_5
        client_id = packet.client_id
        assigned = None
        refusal = self._refusal(packet, v5)
        if refusal is not None:
            return self.reject(client, ReasonCode.CLIENT_IDENTIFIER_NOT_VALID, refusal)
        try:  # log positions on delivery only if this CONNECT asks (docs/replay.md)
            client.log_positions = v5 and wants_positions(packet.properties)
        except PositionsRequestError as error:
            return self.reject(client, ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR, str(error))
        if not client_id:
            client_id = assigned = f"auto-{uuid.uuid4().hex}"  # MQTT-3.1.3-6
        keep_alive = packet.keep_alive
        if keep_alive > cfg.max_keepalive or (keep_alive == 0 and cfg.max_keepalive < 65535):
            keep_alive = cfg.max_keepalive  # returned as Server Keep Alive (MQTT-3.2.2-21)
        expiry = self._session_expiry(packet, v5)
        now = self.loop.time()
        lifecycle = broker.lifecycle
        existing = broker.sessions.get(client_id)
        if existing is not None and is_handle(existing.client):
            lifecycle.take_over(existing.client)
            existing = broker.sessions.get(client_id)
        registered = claimed  # a claim registered this router as the session's holder
        if existing is not None and packet.clean_start:
            lifecycle.end_session(existing, now)  # (unregisters it)
            existing = None
            registered = False
        session_present = existing is not None
        session = existing
        if session is None:
            session = lifecycle.new_session(client_id)
            if not registered:
                broker.directory.created(session)
        cancel_timers(session)
        session.expiry_interval = expiry
        session.will = packet.will
        lifecycle.set_user(session, packet.username)
        client.session = session
        client.client_id = client_id
        conn.outgoing_alias_maximum = cfg.broker_topic_aliases
        block = self._connack_block(packet, assigned, keep_alive, expiry) if v5 else None
        conn.send_connack(0, session_present, block)
        broker.counters.connects += 1
        client.connected(keep_alive)
        level = lifecycle.connection_log_level
        if log.isEnabledFor(level):  # (the fields cost more than the check, per CONNECT)
            log.log(level, "client connected", extra=kv(
                client_id=client_id, peer=client.peer, protocol=protocol_name(conn.version),
                clean=packet.clean_start, present=session_present, keep_alive=keep_alive))
        events = broker.events
        if events is not None:
            events.client_connected(client_id, packet.username, client.peer,
                                    protocol_name(conn.version), packet.clean_start,
                                    session_present, keep_alive)
        broker.keeper.connected(session)
        session.attach(client, now)

    def _refusal(self, packet: Connect, v5: bool) -> str | None:
        """Why a CONNECT that passed authentication is refused (0x85 / 3.1.1 code 2)."""
        if v5:
            return None
        if not packet.client_id and not packet.clean_start:
            return "empty id"
        max_keepalive = self.broker.config.mqtt.max_keepalive
        if packet.keep_alive > max_keepalive or (packet.keep_alive == 0 and max_keepalive < 65535):
            return "keep alive above maximum"  # 3.1.1 cannot be told less: refuse, as Mosquitto
        return None

    def _session_expiry(self, packet: Connect, v5: bool) -> int:
        if v5:
            requested = get_property(packet.properties, PropertyId.SESSION_EXPIRY_INTERVAL, 0)
        else:
            requested = 0 if packet.clean_start else NEVER_EXPIRES
        return min(requested, self.broker.config.session.max_session_expiry)

    def _connack_block(
        self, packet: Connect, assigned: str | None, keep_alive: int, expiry: int
    ) -> bytes:
        """The 5.0 CONNACK's properties, encoded. CONNECTs that get the same answers share one
        block, encoded once per configuration (an assigned client id is never kept)."""
        server_keep_alive = keep_alive if keep_alive != packet.keep_alive else None
        requested = get_property(packet.properties, PropertyId.SESSION_EXPIRY_INTERVAL, 0)
        session_expiry = expiry if expiry != requested else None
        cfg = self.broker.config.mqtt
        if assigned is not None:
            return encode_properties(
                self._connack_properties(cfg, assigned, server_keep_alive, session_expiry))
        if cfg is not self._blocks_config:  # (a reload may change what CONNACK says)
            self._blocks_config = cfg
            self._blocks.clear()
        key = (server_keep_alive, session_expiry)
        block = self._blocks.get(key)
        if block is None:
            block = remember(self._blocks, key, encode_properties(
                self._connack_properties(cfg, None, server_keep_alive, session_expiry)))
        return block

    def _connack_properties(
        self, cfg: MQTTConfig, assigned: str | None, server_keep_alive: int | None,
        session_expiry: int | None,
    ) -> Properties:
        props: Properties = {
            PropertyId.RECEIVE_MAXIMUM: cfg.receive_maximum,
            PropertyId.MAXIMUM_PACKET_SIZE: cfg.max_packet_size,
            PropertyId.TOPIC_ALIAS_MAXIMUM: cfg.topic_alias_maximum,
        }
        if assigned is not None:
            props[PropertyId.ASSIGNED_CLIENT_IDENTIFIER] = assigned
        if self.broker.index is not None:  # which worker serves it (docs/workers.md)
            props[PropertyId.USER_PROPERTY] = [(WORKER_PROPERTY, str(self.broker.index))]
        if server_keep_alive is not None:
            props[PropertyId.SERVER_KEEP_ALIVE] = server_keep_alive  # MQTT-3.2.2-21
        if session_expiry is not None:
            props[PropertyId.SESSION_EXPIRY_INTERVAL] = session_expiry
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

    def reject(self, client: ClientHandle, code: int, why: str) -> None:
        broker = self.broker
        broker.counters.rejected += 1
        log.info("connection refused peer=%s reason=0x%02X why=%r", client.peer, code, why)
        client.rejected = True
        client.conn.send_connack(code)
