"""Sessions across the nodes of a cluster: a client connecting to any node gets its session.

Theory of operation
-------------------
Inside a node a session moves between workers with the session directory's two-phase
hand-over (cluster/directory.py, cluster/moving.py). Across nodes it moves the same way, with
the claimant asking every node instead of an owner (no node knows where another node's
sessions are):

* **Fetch.** A CONNECT with Clean Start 0 on worker ``w`` of node B first claims the session
  inside B (as always), then asks every node this worker has a dialed link to
  (``SESSION_FETCH``, after the ``TAKEOVER`` on the same link, with the same stamp) and waits
  for every answer, at most ``ANSWER_TIMEOUT``. A node that is down (or cut off) is not
  asked, and one that does not answer in time is passed over: the client then gets a new
  session, or B's own, and a session that node holds stays there (docs/cluster.md).
* **Hand over.** On node A the worker ``h`` that accepted the link gathers the session from
  A's workers onto itself (the directory's claim, with no connection: ``claim_here``), unless
  a connection of that client id newer than the stamp holds it here (the newer CONNECT keeps
  it, as TAKEOVER decides). It disconnects the session's connection, if any, with DISCONNECT
  0x8E, and exports it for another node (``export_for_node``): subscriptions with their
  options and ids, inflight messages (resent with DUP on B, PUBREL state kept), the queue,
  inbound QoS 2 packet ids, expiry, next packet id. It answers in ``SESSION_PART`` frames of at
  most ``PART_BYTES`` each, so a session with a big queue crosses without a frame near the
  link's size cap and without holding the link for one huge write.
* **Log positions do not cross.** A's log is not B's: a message's position, and a session's
  cursor into A's log, mean nothing on B. So the export reads from A's log, right then, what
  the session's cursor still owes it (its catch-up, up to the high watermarks A's leaders
  report), and adds it to the queue after the queued messages, as plain copies; every
  message crosses without its position, and the session without a cursor. At most the
  session's queue limits (``max_queued_messages``, ``max_queued_bytes``) are materialised:
  beyond, the newest are dropped and counted, as a full queue on B would.
* **Stand-in.** Until B confirms, ``h`` keeps the session it exported in a ``MovedSession``
  (cluster/moving.py) that holds its routes and sends whatever is routed to it to B's worker
  ``w`` (``SESSION_MOVED`` deliver frames on the link the session went on, so they arrive after
  it; ``w`` holds them until the session is adopted). It skips nothing (a copy A forwards to
  B may reach B before the session does; with positions crossing, B's catch-up skips one it
  will read itself); so a message routed in the moment of the move can arrive twice (QoS 1
  allows it), never not at all.
* **Settle.** ``w`` adopts the session (the most recently detached copy wins, B's own or a
  node's), and once its routes are in place everywhere (a route barrier across nodes) it
  tells each node that handed one over (``SESSION_MOVED`` settle, a request). ``h`` drops the
  stand-in and its routes and answers once every node has applied that (its own barrier); only
  then does B send CONNACK, with session present 1. So nothing published after the CONNACK
  reaches the session twice.
* **Take back.** If the settle does not come within ``SETTLE_TIMEOUT``, or the link it was
  handed over on drops first, ``h`` takes the session back: installed offline, journaled, its
  expiry from now. A session is never dropped on the hope that another node has it; after a
  partition both may have a copy, and the next CONNECT takes both, the newer one winning.

With Clean Start 1 nothing is fetched: TAKEOVER ends the session on the other nodes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from meshmq.broker.catchup import CatchUp, ReplayFilter
from meshmq.broker.session import QueueEntry
from meshmq.broker.snapshot import SessionSnapshot
from meshmq.broker.wire import encode_message
from meshmq.cluster.codec import (
    MOVED_DELIVER,
    MOVED_SETTLE,
    SESSION_HANDED,
    SESSION_NONE,
    SESSION_SETTLED,
    FrameType,
    LinkError,
    SessionFetch,
    SessionMoved,
    SessionPart,
)
from meshmq.cluster.moving import SETTLE_TIMEOUT, MovedSession

if TYPE_CHECKING:
    from meshmq.broker.message import Message
    from meshmq.broker.session import Session
    from meshmq.cluster.directory import Directory
    from meshmq.cluster.nodes import NodeLinks

log = logging.getLogger("meshmq.directory")

PART_BYTES = 1024 * 1024  # a session crosses in SESSION_PART frames of at most this many bytes
READ_CHUNK = 512  # records read from the log per step while materialising a cursor


@dataclass(slots=True)
class Fetched:
    """A whole answer to SESSION_FETCH or to a settle (its parts put together)."""

    status: int
    blob: bytes


# ---------------------------------------------------------------------- the export


def export_for_node(session: Session, now: float) -> bytes:
    """``session`` as another node installs it: its live state, what its log cursor still
    owes read from this node's log into its queue, and no log position anywhere."""
    snapshot = SessionSnapshot.of(session, live=True)
    live = snapshot.live
    assert live is not None
    catchup = session.catchup
    if catchup is not None:
        owed, dropped = materialise(session, catchup, now, live.queue)
        live.queue = live.queue + owed
        live.dropped += dropped
    live.catchup = None
    snapshot.cursor = None
    return snapshot.encode(now, positioned=False)


def materialise(session: Session, catchup: CatchUp, now: float,
                queued: list[QueueEntry]) -> tuple[list[QueueEntry], int]:
    """The messages ``catchup`` would still deliver (read from the log now, on a copy of its
    cursor: the session's own is left as it was), within the session's queue limits; and
    how many of them did not fit (the newest)."""
    limits = session.limits
    room = limits.max_queued_messages - len(queued)
    room_bytes = limits.max_queued_bytes - sum(entry.message.size for entry in queued)
    reader = CatchUp(catchup.persistence, [
        ReplayFilter(f.topic_filter, f.subscription, list(f.start)) for f in catchup.filters],
        None if catchup.dup_below is None else list(catchup.dup_below))
    owed: list[QueueEntry] = []
    dropped = 0

    def take(message: Message, subscription: Any, dup: bool) -> bool:
        nonlocal room, room_bytes, dropped
        options = subscription.options
        if options.no_local and message.sender == session.client_id:
            return True  # MQTT-3.8.3-3
        if room <= 0 or message.size > room_bytes:
            dropped += 1
            return True
        room -= 1
        room_bytes -= message.size
        ids = None if subscription.subscription_id is None else [subscription.subscription_id]
        owed.append(QueueEntry(message, min(options.qos, message.qos),
                               message.retain and options.retain_as_published, ids, None, dup))
        return True

    while not reader.finished:
        before = reader.cursor()
        reader.step(READ_CHUNK, session.subscriptions, take, now)
        if reader.cursor() == before:
            break
    if reader.lost or dropped:
        log.warning("session for another node: records of its cursor lost to retention=%d, "
                    "dropped past its queue limits=%d client_id=%s", reader.lost, dropped,
                    session.client_id)
    return owed, dropped


class NodeMovedSession(MovedSession):
    """The stand-in of a session handed to another node: sends on everything routed to it.
    Unlike a stand-in inside a node it skips no persisted message (the session's cursor did
    not go along: positions do not cross) and no message forwarded to that node anyway (the
    copy may reach that node before the session does)."""

    __slots__ = ()

    def deliver(
        self, message: Message, qos: int, retain: bool, subscription_ids: list[int] | None,
        now: float, group: tuple[str, str] | None = None,
    ) -> None:
        self.redirect(message, qos, retain, subscription_ids, group)


def split(blob: bytes, size: int) -> list[bytes]:
    return [blob[at:at + size] for at in range(0, len(blob), size)] or [b""]


# ---------------------------------------------------------------------- one worker's part


class NodeSessions:
    """One worker's part of sessions across nodes (see the module docstring)."""

    def __init__(self, directory: Directory, links: NodeLinks,
                 now: Callable[[], float],
                 stamp_of: Callable[[str], int | None] = lambda client_id: None,
                 sync: Callable[[Callable[[], None]], None] | None = None,
                 clock: Callable[[], int] = time.time_ns,
                 when_stamped: Callable[[str, Callable[[], None]], None] = (
                     lambda client_id, then: then())) -> None:
        self.directory = directory
        self.host = directory.host
        self.links = links
        self.mesh = links.mesh
        self.now = now  # the loop's time
        self.stamp_of = stamp_of  # the stamp TAKEOVER sent for this client id's CONNECT
        self.sync = sync  # the leaders' high watermarks, before a cursor is read (the log)
        self.clock = clock
        self.when_stamped = when_stamped  # (takeover.py: a claim's owner epoch came)
        self.stand_ins: dict[str, MovedSession] = {}  # sessions handed to another node
        # the metadata on: every node reads every partition at the same offsets (its leader
        # node's, cluster/remotelog.py), so a session crosses with its places and its cursor
        self.positions_cross = False
        self._parts: dict[tuple[int, int], list[bytes]] = {}  # (peer, request) -> parts so far
        self.counters = {"sessions_fetched": 0, "sessions_handed": 0,
                         "sessions_taken_back": 0}
        directory.remote = self
        links.handlers[FrameType.SESSION_FETCH] = self._on_fetch
        links.handlers[FrameType.SESSION_MOVED] = self._on_moved
        links.answers[FrameType.SESSION_PART] = self._on_part
        links.answers[FrameType.SESSION_MOVED] = self._on_delivered
        links.on_closed.append(self._on_closed)

    # ------------------------------------------------------------------ the claimant

    def wanted(self) -> bool:
        return bool(self.links.linked_nodes())

    def fetch(self, client_id: str, done: Callable[[list[tuple[int, bytes]]], None]) -> None:
        # after this CONNECT's TAKEOVER, with its stamp (its owner epoch: sessionowner.py)
        self.when_stamped(client_id, partial(self._fetch, client_id, done))

    def _fetch(self, client_id: str, done: Callable[[list[tuple[int, bytes]]], None]) -> None:
        stamp = self.stamp_of(client_id) or self.clock()
        found: list[tuple[int, bytes]] = []

        def on_answer(peer: int, frame: Fetched | None, late: bool) -> None:
            if frame is None or frame.status != SESSION_HANDED:
                return
            if late:  # never settled: that node takes it back
                log.warning("session handed over by another node after the deadline, left "
                            "there client_id=%s", client_id)
                return
            self.counters["sessions_fetched"] += 1
            found.append((peer, frame.blob))

        self.mesh.ask_all(lambda request_id: SessionFetch(request_id, client_id, stamp).encode(),
                          on_answer, lambda: done(found), f"session fetch of {client_id}",
                          peers=list(self.links.linked_nodes()))

    def settle(self, client_id: str, nodes: list[int], done: Callable[[], None]) -> None:
        self.mesh.ask_all(lambda request_id: SessionMoved(MOVED_SETTLE, request_id,
                                                          client_id).encode(),
                          lambda peer, frame, late: None, done,
                          f"session settle of {client_id}", peers=nodes)

    def _on_part(self, peer: int, frame: SessionPart) -> None:
        """(dialed link) An answer, or a part of one."""
        blob = frame.chunk
        if frame.parts > 1:
            key = (peer, frame.request_id)
            parts = self._parts.setdefault(key, [])
            if frame.part != len(parts):
                raise LinkError("session part out of order")
            parts.append(blob)
            if len(parts) < frame.parts:
                return
            del self._parts[key]
            blob = b"".join(parts)
        link = self.mesh.remote.get(peer)
        if link is not None:
            self.mesh.requests.answer(link.ident, frame.request_id, Fetched(frame.status, blob))

    def _on_delivered(self, peer: int, frame: SessionMoved) -> None:
        """(dialed link) A message the stand-in of a session fetched over this link got."""
        if frame.kind != MOVED_DELIVER:
            raise LinkError("session moved: a settle on a dialed link")
        message = self.host.decode_message(frame.body)
        ids = frame.subscription_ids or None
        client_id = frame.client_id
        if self.directory.claiming(client_id):  # not adopted yet: delivered once it is
            self.directory.hold(client_id, message, frame.qos, frame.retain, ids, frame.group)
            return
        session = self.host.sessions.get(client_id)
        if session is not None:
            session.deliver(message, frame.qos, frame.retain, ids, self.now(), frame.group)

    # ------------------------------------------------------------------ the holder

    def _on_fetch(self, peer: int, frame: SessionFetch) -> None:
        # a CONNECT of that client id here still waiting for its stamp is weighed with it
        self.when_stamped(frame.client_id, partial(self._on_fetch_now, peer, frame))

    def _on_fetch_now(self, peer: int, frame: SessionFetch) -> None:
        link = self.mesh.remote.get(peer)
        if link is None:
            return
        ident = link.ident
        client_id = frame.client_id
        session = self.host.sessions.get(client_id)
        if session is not None and self._newer_here(session, frame.stamp):
            return self._answer(peer, ident, frame.request_id, SESSION_NONE, b"")
        self.directory.claim_here(client_id, partial(self._gathered, peer, ident, frame))

    def _newer_here(self, session: Session, stamp: int) -> bool:
        """Is a connection of this client id here newer than the CONNECT that asks?"""
        client = session.client
        if client is None or isinstance(session, MovedSession):
            return False
        mine = self.stamp_of(session.client_id)
        if mine is None:
            mine = int(getattr(client, "connected_at", 0.0) * 1e9)
        return mine >= stamp

    def _gathered(self, peer: int, ident: int, frame: SessionFetch,
                  adopted: list[Session]) -> None:
        """The session, if this node has it, is on this worker now."""
        session = self.host.sessions.get(frame.client_id)
        if session is not None and session.catchup is not None and self.sync is not None \
                and not self.positions_cross:
            # its cursor reads up to the leaders' high watermarks as of now
            self.sync(partial(self._hand_over, peer, ident, frame, adopted))
        else:
            self._hand_over(peer, ident, frame, adopted)

    def _hand_over(self, peer: int, ident: int, frame: SessionFetch,
                   adopted: list[Session]) -> None:
        client_id = frame.client_id
        current = self.host.sessions.get(client_id)
        link = self.mesh.remote.get(peer)
        if current is None or isinstance(current, MovedSession) or link is None \
                or link.ident != ident:
            self._keep(client_id, adopted)
            return self._answer(peer, ident, frame.request_id, SESSION_NONE, b"")
        session = self.host.release_session(client_id, False)  # its connection: 0x8E
        if session is None:  # (it ended with its connection: expiry 0)
            return self._answer(peer, ident, frame.request_id, SESSION_NONE, b"")
        blob = (self.host.export_session(session) if self.positions_cross
                else export_for_node(session, self.now()))
        stub = NodeMovedSession(session, peer, partial(self._redirect, peer, ident, client_id),
                                lambda message: False, blob)
        stub.timer = self.mesh.call_at(self.mesh.io.now() + SETTLE_TIMEOUT,
                                       partial(self._unsettled, client_id, stub))
        self.host.sessions[client_id] = stub
        self.stand_ins[client_id] = stub
        self.directory.ended(session)  # not held here any more (unless taken back)
        self.counters["sessions_handed"] += 1
        log.info("session handed over to another node client_id=%s node=%s bytes=%d",
                 client_id, self._node_of(peer), len(blob))
        self._answer(peer, ident, frame.request_id, SESSION_HANDED, blob)

    def _keep(self, client_id: str, adopted: list[Session]) -> None:
        """A session gathered onto this worker for another node that will not get it: it
        stays here, offline as any (its expiry running, journaled)."""
        session = self.host.sessions.get(client_id)
        if session is None or session not in adopted:
            return
        blob = self.host.export_session(session)
        del self.host.sessions[client_id]
        self.host.drop_session(session)
        if self.host.take_back_session(blob):
            kept = self.host.sessions.get(client_id)
            if kept is not None:
                self.directory.created(kept)

    def _node_of(self, peer: int) -> str:
        link = self.mesh.remote.get(peer)
        hello = link.remote.hello if link is not None else None
        return hello.node_id if hello is not None else "?"

    def _answer(self, peer: int, ident: int, request_id: int, status: int,
                blob: bytes) -> None:
        parts = split(blob, PART_BYTES) if status == SESSION_HANDED else [b""]
        for index, chunk in enumerate(parts):
            self.mesh.send(peer, SessionPart(request_id, status, index, len(parts),
                                             chunk).encode(), ident)

    def _redirect(self, peer: int, ident: int, client_id: str, message: Message, qos: int,
                  retain: bool, ids: list[int] | None, group: tuple[str, str] | None) -> None:
        # (without the metadata a place is one in this node's log only)
        body = encode_message(message, self.now(), positioned=self.positions_cross)
        self.mesh.send(peer, SessionMoved(MOVED_DELIVER, 0, client_id, qos, retain, ids or [],
                                          group, body).encode(), ident)

    def _on_moved(self, peer: int, frame: SessionMoved) -> None:
        """(accepted link) The node a session went to settled it: drop the stand-in, then
        answer once every node has dropped its routes."""
        if frame.kind != MOVED_SETTLE:
            raise LinkError("session moved: a delivery on an accepted link")
        link = self.mesh.remote.get(peer)
        if link is None:
            return
        ident = link.ident
        stub = self.stand_ins.get(frame.client_id)
        if stub is None or stub.peer != peer:
            return self._answer(peer, ident, frame.request_id, SESSION_SETTLED, b"")
        self._drop_stand_in(frame.client_id, stub)
        self.mesh.barrier(partial(self._answer, peer, ident, frame.request_id, SESSION_SETTLED,
                                  b""))

    def _drop_stand_in(self, client_id: str, stub: MovedSession) -> None:
        if stub.timer is not None:
            stub.timer.cancel()
        if self.stand_ins.get(client_id) is stub:
            del self.stand_ins[client_id]
        if self.host.sessions.get(client_id) is stub:
            del self.host.sessions[client_id]
            self.host.drop_session(stub)

    def _unsettled(self, client_id: str, stub: MovedSession) -> None:
        if self.stand_ins.get(client_id) is stub:
            self._take_back(client_id, stub, f"not settled within {SETTLE_TIMEOUT:.0f} s")

    def _take_back(self, client_id: str, stub: MovedSession, why: str) -> None:
        self._drop_stand_in(client_id, stub)
        if self.host.take_back_session(stub.blob):
            self.counters["sessions_taken_back"] += 1
            log.warning("session handed to another node taken back client_id=%s: %s",
                        client_id, why)
            session = self.host.sessions.get(client_id)
            if session is not None:
                self.directory.created(session)

    def _on_closed(self, peer: int) -> None:
        for key in [key for key in self._parts if key[0] == peer]:
            del self._parts[key]
        for client_id, stub in list(self.stand_ins.items()):
            if stub.peer == peer:
                self._take_back(client_id, stub, "the link it went on dropped before it "
                                "was settled")

    def statistics(self) -> dict[str, Any]:
        return {"sessions_handed_away": len(self.stand_ins), **self.counters}
