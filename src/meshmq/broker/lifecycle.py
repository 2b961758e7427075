"""Sessions from birth to end: creation, restore, take-over, disconnect, wills and expiry.

Theory of operation
-------------------
Lifecycle of a session (spec 4.1, 3.1.2.11.2, 3.1.3.2.2):

* CONNECT with clean start ends any existing session first; otherwise the session resumes
  (``session present``) and its unacknowledged messages are resent (broker/connects.py).
* A second connection with a live client id takes the session over: the old connection gets
  DISCONNECT 0x8E and is treated as lost (its will follows the normal rules) before the new one
  attaches (MQTT-3.1.4-3).
* When a connection is lost without a normal DISCONNECT, its will is published after the will
  delay, or at once when the session ends first; a reconnect before then cancels it.
* A detached session ends when its expiry interval elapses (immediately for 0): its
  subscriptions are dropped and its unacknowledged shared-subscription messages go to another
  member of the group.

A session can also leave for another router of the node (``release_session``: its client
disconnected with 0x8E, its timers cancelled; its routes stay until the session directory's
stand-in goes) and arrive from one (``adopt_sessions``). Both ends speak ``SessionSnapshot``
(broker/snapshot.py), the codec the state store uses too.
"""

from __future__ import annotations

import logging
import sys
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from meshmq.broker.client import ClientHandle, is_handle
from meshmq.broker.message import Message
from meshmq.broker.session import Session
from meshmq.broker.snapshot import SessionSnapshot, SnapshotError
from meshmq.broker.wire import decode_message, encode_message
from meshmq.logsetup import kv
from meshmq.mqtt.packets import MQTT_5, Disconnect
from meshmq.mqtt.properties import PropertyId, get_property
from meshmq.mqtt.reason_codes import ReasonCode

if TYPE_CHECKING:
    import asyncio

    from meshmq.auth.acl import AccessControl
    from meshmq.broker.counters import Counters
    from meshmq.broker.interfaces import BrokerEvents, PartitionLog, Services, SessionDirectory
    from meshmq.broker.keeper import StateKeeper
    from meshmq.broker.publishes import Publishes
    from meshmq.broker.router import Router
    from meshmq.config import BrokerConfig

log = logging.getLogger("meshmq.broker")

NEVER_EXPIRES = 0xFFFFFFFF


class PendingConnects(Protocol):
    """The CONNECTs waiting for a session from elsewhere (connects.py)."""

    def supersede(self, client_id: str) -> None:
        """A newer connection elsewhere took ``client_id``'s session: close ours."""


class LifecycleHost(Protocol):
    """What the sessions' lifecycle needs from the broker it serves (broker.py)."""

    loop: asyncio.AbstractEventLoop
    sessions: dict[str, Session]  # every session here, by client id
    clients: dict[ClientHandle, None]  # every connection
    config: BrokerConfig  # replaced by a reload: read it when needed, never keep it
    router: Router
    acl: AccessControl | None  # None: no ACL file
    persistence: PartitionLog | None  # the commit log, when it is on
    directory: SessionDirectory
    keeper: StateKeeper
    events: BrokerEvents | None  # webhooks, when configured
    services: Services  # request/reply: a connection's offers end with it
    counters: Counters
    shutting_down: bool  # a clean stop: no wills

    @property
    def connects(self) -> PendingConnects: ...

    @property
    def publishes(self) -> Publishes:
        """Publishes wills (``publish_unacknowledged``)."""


class Lifecycle:
    """The broker's sessions as they come and go (see the module docstring)."""

    def __init__(self, broker: LifecycleHost) -> None:
        self.broker = broker
        self.loop = broker.loop
        self.sessions = broker.sessions
        # connects and disconnects (server.log_connections)
        self.connection_log_level = (logging.INFO if broker.config.server.log_connections
                                     else logging.DEBUG)

    # ------------------------------------------------------------------ birth

    def new_session(self, client_id: str) -> Session:
        session = Session(client_id, self.broker.config.session)
        session.persistence = self.broker.persistence
        self.sessions[client_id] = session
        return session

    def set_user(self, session: Session, username: str | None) -> None:
        # Interned: a fleet shares a few user names, and each session would keep its own copy.
        session.username = None if username is None else sys.intern(username)
        acl = self.broker.acl
        if acl is not None:
            session.may_receive = partial(acl.can_receive, username, session.client_id)

    def restore_session(self, snapshot: SessionSnapshot) -> None:
        """Rebuild a stored session at start-up, offline, resuming from its log cursor.

        A session that was connected when the broker stopped is offline from now: its will
        and expiry run as for a lost connection. Messages from its cursor up to the end of the
        log as found now may have reached it before: they come again with DUP set.
        """
        session = self.new_session(snapshot.client_id)
        session.expiry_interval = snapshot.expiry
        self.set_user(session, snapshot.username)
        for topic_filter, subscription in snapshot.subscriptions.items():
            self.broker.router.subscribe(session, topic_filter, subscription)
        persistence = self.broker.persistence
        cursor = snapshot.cursor
        if persistence is not None and cursor is not None and len(cursor) == len(
                persistence.high_watermark):
            session.follow_log()
            catchup = session.catchup
            if catchup is not None:
                for entry in catchup.filters:
                    entry.start = list(cursor)
                catchup.dup_below = list(persistence.high_watermark)
        now_ms = int(time.time() * 1000)
        session.detached_at = snapshot.detached_at if snapshot.detached_at is not None \
            else now_ms
        offline = (now_ms - session.detached_at) / 1000
        will = snapshot.will
        if will is not None:
            delay = get_property(will.properties, PropertyId.WILL_DELAY_INTERVAL, 0)
            remaining = max(0.0, min(delay, snapshot.expiry) - offline)
            session.will = will
            session.will_handle = self.loop.call_later(remaining, self.publish_will, session,
                                                       will)
        if snapshot.expiry != NEVER_EXPIRES:
            remaining = snapshot.expiry - offline
            if remaining <= 0:
                self.end_session(session, self.loop.time())
            else:
                session.expiry_handle = self.loop.call_later(remaining, self.expire, session)

    # ------------------------------------------------------------------ moving between routers

    def release_session(self, client_id: str, clean_start: bool) -> Session | None:
        """Another router takes ``client_id`` over: disconnect its client here (0x8E) and give
        the session up (removed from here; its routes stay until the session directory's
        stand-in is dropped), or end it if the new connection starts clean."""
        session = self.sessions.get(client_id)
        if session is not None and is_handle(session.client):
            self.take_over(session.client)
            session = self.sessions.get(client_id)
        if session is None:
            return None
        if clean_start:
            self.end_session(session, self.loop.time())
            return None
        cancel_timers(session)  # its will and expiry go with it
        session.will = None
        if self.sessions.get(client_id) is session:
            del self.sessions[client_id]
            self.broker.keeper.ended(session)
        return session

    def export_session(self, session: Session) -> bytes:
        return SessionSnapshot.of(session, live=True).encode(self.loop.time())

    def adopt_sessions(self, blobs: list[bytes]) -> list[Session]:
        """Install sessions handed over by other routers (normally one; after a crash in the
        middle of a hand-over there may be two: the most recently detached one wins)."""
        now = self.loop.time()
        snapshots = []
        for blob in blobs:
            try:
                snapshots.append(SessionSnapshot.decode(blob, now))
            except SnapshotError as error:
                log.error("session handed over is unreadable, dropped: %s", error)
        adopted: dict[str, Session] = {}
        for snapshot in sorted(snapshots, key=lambda s: s.detached_at or 0):
            existing = self.sessions.get(snapshot.client_id)
            if existing is not None:
                self.discard_session(existing)
            adopted[snapshot.client_id] = self.install_session(snapshot)
        return list(adopted.values())

    def take_back_session(self, blob: bytes) -> bool:
        """A session handed to another router that never confirmed it (cluster/directory.py):
        installed here again, offline as if its client had just gone (expiry from now,
        journaled), unless a newer session for that client id is here already."""
        try:
            snapshot = SessionSnapshot.decode(blob, self.loop.time())
        except SnapshotError as error:
            log.error("session taken back is unreadable, dropped: %s", error)
            return False
        if snapshot.client_id in self.sessions:
            return False  # its client connected here again since: that session is newer
        session = self.install_session(snapshot)
        self.start_expiry(session)
        self.broker.keeper.detached(session)
        return True

    def install_session(self, snapshot: SessionSnapshot) -> Session:
        """A handed-over session here, detached (the caller attaches it)."""
        session = self.new_session(snapshot.client_id)
        session.expiry_interval = snapshot.expiry
        self.set_user(session, snapshot.username)
        session.detached_at = snapshot.detached_at
        for topic_filter, subscription in snapshot.subscriptions.items():
            self.broker.router.subscribe(session, topic_filter, subscription)
        if snapshot.live is not None:
            session.restore_live(snapshot.live)
        return session

    def discard_session(self, session: Session) -> None:
        """Remove a session from here without a will or redistribution (it lives on
        elsewhere)."""
        if is_handle(session.client):  # (a session's client always is)
            self.take_over(session.client)
        cancel_timers(session)
        session.will = None
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
            self.broker.keeper.ended(session)
        self.broker.router.drop_session(session, self.loop.time())

    def drop_session(self, session: Session) -> None:
        """Forget a stand-in's routes (cluster/moving.py)."""
        self.broker.router.drop_session(session, self.loop.time())

    def supersede(self, client_id: str) -> None:
        self.broker.connects.supersede(client_id)

    def forwarded_in(self) -> bool:
        return self.broker.router.forwarded_in

    def encode_message(self, message: Message) -> bytes:
        return encode_message(message, self.loop.time())

    def decode_message(self, body: bytes) -> Message:
        return decode_message(body, self.loop.time())

    # ------------------------------------------------------------------ connections ending

    def take_over(self, old: ClientHandle) -> None:
        old.close_reason = "taken over"
        old.conn.send_disconnect(ReasonCode.SESSION_TAKEN_OVER)
        old.close()
        self.connection_lost(old)

    def on_disconnect(self, client: ClientHandle, packet: Disconnect) -> None:
        client.close_reason = disconnect_reason(packet, client.conn.version)
        session = client.session
        if session is None:
            return
        expiry = get_property(packet.properties, PropertyId.SESSION_EXPIRY_INTERVAL)
        if expiry is not None:
            session.expiry_interval = min(expiry, self.broker.config.session.max_session_expiry)
        if packet.reason_code != ReasonCode.DISCONNECT_WITH_WILL_MESSAGE:
            session.will = None  # MQTT-3.1.2-10: a normal DISCONNECT discards the will

    def connection_lost(self, client: ClientHandle) -> None:
        """The connection is gone (or taken over): detach, schedule will and expiry."""
        broker = self.broker
        broker.clients.pop(client, None)
        broker.services.connection_lost(client)
        session = client.session
        if session is None or session.client is not client:
            return  # never connected, or already lost (taken over): logged then
        log.log(self.connection_log_level, "client disconnected", extra=kv(
            client_id=session.client_id, peer=client.peer,
            protocol=protocol_name(client.conn.version), reason=client.close_reason))
        events = broker.events
        if events is not None:
            events.client_disconnected(session.client_id, session.username, client.peer,
                                       protocol_name(client.conn.version), client.close_reason)
        session.detach()
        if broker.shutting_down:
            return  # wills are not sent on a clean broker shutdown; sessions are kept
        will = session.will
        session.will = None
        now = self.loop.time()
        if will is not None:
            delay = get_property(will.properties, PropertyId.WILL_DELAY_INTERVAL, 0)
            if delay and session.expiry_interval:
                session.will_handle = self.loop.call_later(
                    min(delay, session.expiry_interval), self.publish_will, session, will
                )
                session.will = will  # still pending: a reconnect cancels it
            else:
                self.publish_will(session, will)
        if session.expiry_interval == 0:
            self.end_session(session, now)
            return
        self.start_expiry(session)
        broker.keeper.detached(session)

    def start_expiry(self, session: Session) -> None:
        if session.expiry_interval != NEVER_EXPIRES:
            session.expiry_handle = self.loop.call_later(
                session.expiry_interval, self.expire, session
            )

    def publish_will(self, session: Session, will: Any) -> None:
        session.will_handle = None
        session.will = None
        self.broker.counters.wills += 1
        message = Message.from_will(will, session.client_id, self.loop.time())
        self.broker.publishes.publish_unacknowledged(message, session.client_id)

    def expire(self, session: Session) -> None:
        session.expiry_handle = None
        if session.client is None and self.sessions.get(session.client_id) is session:
            log.debug("session expired client_id=%s", session.client_id)
            self.end_session(session, self.loop.time())

    def end_session(self, session: Session, now: float) -> None:
        if session.will_handle is not None:  # the session ends first: will goes now
            cancel_timers(session)
            if session.will is not None:
                self.publish_will(session, session.will)
        cancel_timers(session)
        broker = self.broker
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
            broker.counters.ended_drops += session.dropped  # the node's drops stay counted
            broker.keeper.ended(session)
            broker.directory.ended(session)
        broker.router.drop_session(session, now)


def cancel_timers(session: Session) -> None:
    if session.will_handle is not None:
        session.will_handle.cancel()
        session.will_handle = None
    if session.expiry_handle is not None:
        session.expiry_handle.cancel()
        session.expiry_handle = None


def protocol_name(version: int) -> str:
    return {MQTT_5: "5.0", 4: "3.1.1", 3: "3.1"}.get(version, str(version))


def disconnect_reason(packet: Disconnect, version: int) -> str:
    """A client's DISCONNECT as a log reason: 'DISCONNECT 0x00 normal disconnection'."""
    if version != MQTT_5:
        return "DISCONNECT"  # 3.1.1 carries no reason code
    code = packet.reason_code
    name = "normal disconnection" if code == ReasonCode.SUCCESS else \
        ReasonCode(code).name.lower().replace("_", " ")  # the codec admits only known codes
    return f"DISCONNECT 0x{code:02X} {name}"
