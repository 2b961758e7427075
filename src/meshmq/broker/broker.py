"""The broker: one router's worth of MQTT, driven by the I/O layer on one event loop.

Theory of operation
-------------------
The I/O layer (broker/transport/) feeds each connection's decoded packets to
``handle_events()`` in order, and calls ``connection_lost()`` exactly once per connection; the
core knows a connection only as a ``ClientHandle`` (client.py). Everything here runs on the
event loop thread, one packet at a time; timers (will delay, session expiry) are loop callbacks.

``Broker`` owns the state (sessions, the router, the keeper, the counters) and hands each
packet to the part that handles it, each a small object of its own: ``Connects`` (CONNECT),
``Publishes`` (PUBLISH and its acknowledgements), ``Subscribes`` (SUBSCRIBE, UNSUBSCRIBE) and
``Lifecycle`` (sessions coming and going: take-over, DISCONNECT, wills, expiry). Each is given
the broker as a narrow Protocol of its own, naming the few things it uses (``PublishHost``,
``SubscribeHost``, ``ConnectHost``, ``LifecycleHost``; ``KeeperHost`` and ``SysHost`` for the
keeper and ``$SYS``): none of them imports this module, and a test builds one with fakes.

What lies beyond this router it reaches only through the interfaces of broker/interfaces.py:
``peers`` (the node's other routers), ``persistence`` (the commit log's partitions),
``retained`` (retained messages), ``directory`` (where sessions are) and ``statistics``
(``$SYS`` totals). A new broker has the single-process versions (broker/local.py); a worker of
a node of several is given the cluster's (``use``, from cluster/workers.py). Request/reply
(``services``: the ``$service/`` topics and replies) is a layer above the core given to it by
the composition root (``use_services``, node/server.py); without it those topics are ordinary.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from meshmq.auth.acl import AccessControl, ACLFileError
from meshmq.broker.authn import Authenticator, ConnectAuthenticator
from meshmq.broker.catchup import CatchUp, index_restored
from meshmq.broker.client import ClientHandle, protocol_violation
from meshmq.broker.connects import Connects
from meshmq.broker.counters import Counters
from meshmq.broker.deadlines import KeepAliveWheel, WheelTimer
from meshmq.broker.keeper import StateKeeper
from meshmq.broker.lifecycle import Lifecycle
from meshmq.broker.local import LocalDirectory, LocalRetained, LocalStatistics, NoServices
from meshmq.broker.message import Message
from meshmq.broker.persistence import Persistence
from meshmq.broker.publishes import Publishes
from meshmq.broker.ratelimit import ConnectRateLimiter
from meshmq.broker.retained import RetainedStore
from meshmq.broker.router import Router
from meshmq.broker.session import Session
from meshmq.broker.snapshot import SessionSnapshot
from meshmq.broker.subscribes import Subscribes
from meshmq.broker.systopics import SysTopics
from meshmq.mqtt.packets import Packet, PacketType
from meshmq.mqtt.reason_codes import ReasonCode

if TYPE_CHECKING:
    from meshmq.broker.interfaces import (
        BrokerEvents,
        NodeStatistics,
        PartitionLog,
        Peers,
        RetainedMessages,
        Services,
        SessionDirectory,
    )
    from meshmq.config import BrokerConfig

log = logging.getLogger("meshmq.broker")

# Cyclic GC thresholds for a broker process. The defaults (700, 10, 10) ran a collection every
# ~70 routed messages, each walking the messages still queued or in flight: 15-25% of the CPU
# of a QoS 1 fan-in (docs/benchmarks.md). Routing creates no reference cycles (refcounting frees
# every message), so collections can be rare.
GC_THRESHOLDS = (50_000, 20, 100)


class Broker:
    """One router's broker logic (see the module docstring).

    ``index`` and ``count``: this router among the node's workers (None: a single-process
    node). ``open_log``: open the commit log here (False when the cluster provides it)."""

    def __init__(
        self, config: BrokerConfig, loop: asyncio.AbstractEventLoop,
        index: int | None = None, count: int = 1, open_log: bool = True,
    ) -> None:
        self.config = config
        self.loop = loop
        self.index = index
        self.sessions: dict[str, Session] = {}
        self.router = Router(self.sessions)
        self.authenticator: ConnectAuthenticator = Authenticator(config.auth, loop)
        self.acl = AccessControl.from_file(config.auth.acl_file) if config.auth.acl_file else None
        self.persistence: PartitionLog | None = None
        if config.log.enabled and open_log:
            self.persistence = persistence = Persistence(config.log, config.server.data_dir, loop)
            persistence.after_completions = self.flush_output
        # Every connection, in a dict used as a set: an entry costs about half a set's.
        self.clients: dict[ClientHandle, None] = {}
        self.keeper = StateKeeper(self, index or 0, count)
        self.retained_store: RetainedStore[Message] = RetainedStore()
        self.local_retained = LocalRetained(self.retained_store, self.keeper, loop.time)
        self.retained: RetainedMessages = self.local_retained
        self.directory: SessionDirectory = LocalDirectory()
        self.statistics_sink: NodeStatistics = LocalStatistics()
        self.events: BrokerEvents | None = None  # webhooks (node/webhooks.py), when configured
        self.services: Services = NoServices()  # request/reply (services/), when wired
        self.sys_topics = SysTopics(self, config.mqtt.sys_interval)
        self.connect_limiter = ConnectRateLimiter.from_config(config.limits, loop.time())
        self.shutting_down = False
        self.input_pauses: set[str] = set()  # node-wide reasons to read no client (pause_input)
        # Every connection's CONNECT deadline and keep-alive check: one wheel, one loop timer.
        self.deadlines: KeepAliveWheel[ClientHandle] = KeepAliveWheel()
        self._deadline_timer = WheelTimer(self.deadlines, loop, self._deadlines_due)
        self.counters = Counters()
        self.lifecycle = Lifecycle(self)
        self.connects = Connects(self)
        self.publishes = Publishes(self)
        self.subscribes = Subscribes(self)
        self._dirty: list[ClientHandle] = []
        self._current: ClientHandle | None = None  # whose packets are being handled
        self._handlers: dict[int, Callable[[ClientHandle, Any], None]] = {
            PacketType.CONNECT: self.connects.on_connect,
            PacketType.PUBLISH: self.publishes.on_publish,
            PacketType.PUBACK: self.publishes.on_puback,
            PacketType.PUBREC: self.publishes.on_pubrec,
            PacketType.PUBREL: self.publishes.on_pubrel,
            PacketType.PUBCOMP: self.publishes.on_pubcomp,
            PacketType.SUBSCRIBE: self.subscribes.on_subscribe,
            PacketType.UNSUBSCRIBE: self.subscribes.on_unsubscribe,
            PacketType.DISCONNECT: self.lifecycle.on_disconnect,
        }

    @property
    def peers(self) -> Peers:
        return self.router.peers

    def use(self, peers: Peers, persistence: PartitionLog | None, retained: RetainedMessages,
            directory: SessionDirectory, statistics: NodeStatistics) -> None:
        """The node's other routers provide these (cluster/workers.py); before ``start``."""
        self.router.peers = peers
        self.persistence = persistence
        self.retained = retained
        self.directory = directory
        self.statistics_sink = statistics

    def use_services(self, services: Services) -> None:
        """The services layer (services/) owns the ``$service/`` topics; before ``start``."""
        self.services = services

    def start(self) -> None:
        """Restore the stored sessions and retained messages; then tune the GC."""
        self.keeper.restore()
        self._index_catchups()
        self.sys_topics.start()
        tune_gc()

    def _index_catchups(self) -> None:
        """Restored sessions resume from their log cursors: list, in one read of the log,
        the records each of them needs (catchup.py, "The index")."""
        persistence = self.persistence
        catchups = [s.catchup for s in self.sessions.values() if s.catchup is not None]
        if persistence is None or not catchups:
            return
        sessions, match = self.sessions, self.router.subscriptions.match

        def candidates(topic: str) -> Iterator[CatchUp]:
            for _, entries in match(topic):
                for client_id in entries:
                    catchup = sessions[client_id].catchup
                    if catchup is not None:
                        yield catchup

        started = time.monotonic()
        read = index_restored(catchups, persistence, candidates)
        log.info("catch-ups indexed sessions=%d records=%d seconds=%.3f", len(catchups), read,
                 time.monotonic() - started)

    def restore_session(self, snapshot: SessionSnapshot) -> None:
        self.lifecycle.restore_session(snapshot)

    def now(self) -> float:
        return self.loop.time()

    # ------------------------------------------------------------------ input and output

    def pause_input(self, reason: str, paused: bool) -> None:
        """Stop (or resume) reading every client connection, new ones included."""
        if paused:
            self.input_pauses.add(reason)
        else:
            self.input_pauses.discard(reason)
        for client in self.clients:
            client.pause_input(reason, paused)

    def pause_publisher(self, reason: str, until: Callable[[Callable[[], None]], None]) -> None:
        """Stop reading the client whose packets are being handled until ``until`` calls back
        (a peer it publishes to is slow: cluster/mesh.py)."""
        client = self._current
        if client is None or client.gone:
            return
        client.pause_input(reason, True)
        until(partial(client.pause_input, reason, False))

    def schedule_flush(self, client: ClientHandle) -> None:
        """Write ``client``'s queued output once, after the current loop turn's work."""
        if not self._dirty:
            self.loop.call_soon(self._flush_dirty)
        self._dirty.append(client)

    def _flush_dirty(self) -> None:
        dirty = self._dirty
        self._dirty = []
        for client in dirty:
            client.flush()

    def flush_output(self) -> None:
        """Write the queued output now, not after this loop turn (the commit log's
        completions: the acks and deliveries of a turn just made durable)."""
        if self._dirty:
            self._flush_dirty()

    # ------------------------------------------------------------------ deadlines

    def await_connect(self, client: ClientHandle) -> None:
        """A new connection: it has ``mqtt.connect_timeout`` seconds to send CONNECT."""
        if self.deadlines.await_connect(client, self.loop.time(),
                                        self.config.mqtt.connect_timeout):
            self._deadline_timer.arm()  # (a slot that already held something is armed for)

    def watch_keep_alive(self, client: ClientHandle) -> None:
        """CONNACK sent: check ``client`` for silence (``keep_alive_limit``; 0 = never)."""
        if client.keep_alive_limit:
            if self.deadlines.watch(client):
                self._deadline_timer.arm()
        else:
            self.deadlines.discard(client)

    def forget_deadline(self, client: ClientHandle) -> None:
        self.deadlines.discard(client)

    def _deadlines_due(self, now: float) -> None:
        # While we read no client at all (pause_input), their silence is ours, not theirs.
        for client in self.deadlines.expired(now, excused=bool(self.input_pauses)):
            client.deadline_passed()

    def handle_events(self, client: ClientHandle, events: list[Packet]) -> None:
        handlers = self._handlers
        self._current = client
        for index, packet in enumerate(events):
            if client.rejected:
                break
            if client.held is not None:  # CONNECT is being authenticated: later packets wait
                client.held.extend(events[index:])
                break
            handlers[packet.type](client, packet)
        self._current = None
        session = client.session
        if session is not None and session.slots_freed:  # PUBACKs: refill the window once
            session.refill(self.loop.time())

    def connection_lost(self, client: ClientHandle) -> None:
        self.lifecycle.connection_lost(client)

    def protocol_violation(self, client: ClientHandle, code: int, why: str) -> None:
        """A rule checked above the codec was broken: tell the client and close."""
        protocol_violation(client, self.counters, code, why)

    # ------------------------------------------------------------------ operations

    def reconfigure(self, config: BrokerConfig) -> None:
        """SIGHUP: take a configuration whose changes node/reload.py found safe to apply now
        (limits, auth, log and a few CONNECT settings); call ``reload_auth`` next."""
        old, self.config = self.config, config
        if config.limits != old.limits:
            limiter = ConnectRateLimiter.from_config(config.limits, self.loop.time())
            limiter.refused = self.connect_limiter.refused
            self.connect_limiter = limiter
        self.lifecycle.connection_log_level = (
            logging.INFO if config.server.log_connections else logging.DEBUG)

    def reload_auth(self) -> None:
        """SIGHUP: re-read the password and ACL files (or read those ``auth`` now names). A
        file that fails to load is logged and the rules in force stay; connected clients keep
        their sessions."""
        auth = self.config.auth
        self.authenticator.reload(auth)
        if not auth.acl_file:
            if self.acl is not None:
                log.info("ACL file no longer used: no ACLs")
            self._use_acl(None)
            return
        try:
            acl = AccessControl.from_file(auth.acl_file)
        except ACLFileError as error:
            log.error("ACL file not reloaded, keeping the previous rules: %s", error)
            return
        self._use_acl(acl)
        log.info("ACL file reloaded")

    def _use_acl(self, acl: AccessControl | None) -> None:
        self.acl = acl
        for session in self.sessions.values():
            session.may_receive = (None if acl is None else
                                   partial(acl.can_receive, session.username, session.client_id))

    def shutdown(self) -> None:
        """Close every connection for a clean stop: DISCONNECT 0x8B, no wills."""
        self.shutting_down = True
        self.sys_topics.stop()
        self._deadline_timer.close()
        self.authenticator.close()
        for client in list(self.clients):
            client.close_reason = "server shutting down"
            client.conn.send_disconnect(ReasonCode.SERVER_SHUTTING_DOWN)
            client.close()

    def close(self) -> None:
        """After ``shutdown()``: finish the log's queued appends, then store the state."""
        if self.persistence is not None:
            self.persistence.close()
        self.keeper.close()

    def statistics(self) -> dict[str, Any]:
        return {
            "clients": len(self.clients),
            "sessions": len(self.sessions),
            "retained": self.retained.count(),
            **self.router.statistics(),
            **self.counters.as_dict(),
        }


def tune_gc() -> None:
    """Set ``GC_THRESHOLDS`` and freeze what start-up built (modules, configuration, restored
    sessions), so that collections never walk it again. Process-wide: the broker owns it."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
