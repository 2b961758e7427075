"""The mesh: this worker's links to the other workers, their routes, and requests across them.

Theory of operation
-------------------
Every worker listens on an abstract unix socket named by the node's token and its index, and
dials every worker with a higher index (so each pair has one link); a dropped link is dialed
again by the lower index. Both ends send ``HELLO`` first (index, worker count, token, and from
the leader its high watermark); a wrong token or count closes the link. A worker starts serving
clients only once it is linked to every peer.

Routes. The router reports each subscription added or removed (``_local_route``); the mesh
counts them per (group, filter) and tells every peer when a filter gains its first subscriber
or loses its last (``ROUTES``, batched per loop turn, the full set on each new link). It keeps
the peers' routes in two tries: plain filters → peers, and shared filters → group → peers.

Routing. The router delivers a publish to local plain subscribers, then calls ``route()``: each
shared group matching the topic, wherever its members are, gets exactly one delivery (round
robin over this worker, if it has members, and the peers that have some); each peer with a
matching plain route or a chosen group gets one ``FORWARD`` carrying the groups it must serve.
The message body is encoded once for all peers. A forwarded message is delivered where it
lands and never forwarded again.

The leader (worker 0) owns the commit log and the retained messages; the others persist through
it (``APPEND``, see remotelog.py), store retained messages through it (``RETAIN``), and ask it
for retained messages when a client subscribes (``QUERY_RETAINED``). Requests carry an id; the
answer comes back on the same link, after everything the leader sent before it. A link that
drops fails its pending requests (a publish is then refused, a query answers nothing).

Sessions. A client may connect to any worker. Before accepting a CONNECT, the worker asks every
peer for the client id (``CLAIM``): a peer with that session disconnects its client (0x8E),
as a local takeover would, and hands the session over, or ends it when the new connection asks
for a clean start. Two claims for one client id at once: the lower index wins, the higher one
is told to retry (so one connection wins and the other is taken over, as on one worker).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from meshmq.broker.message import Message
from meshmq.broker.trie import SubscriptionTrie
from meshmq.cluster.codec import (
    FrameType,
    LinkError,
    Reader,
    Writer,
    decode_message,
    forward_frame,
    parse_forward,
)
from meshmq.cluster.link import Link
from meshmq.cluster.moving import SETTLE_TIMEOUT, MovedSession
from meshmq.cluster.remotelog import Appended, LeaderUnavailable, RemoteLog
from meshmq.cluster.spec import LEADER, WorkerSpec
from meshmq.cluster.transfer import (
    export_session,
    from_wire,
    install_session,
    message_body,
    read_session,
)
from meshmq.mqtt.reason_codes import ReasonCode

if TYPE_CHECKING:
    from meshmq.broker.broker import Broker
    from meshmq.broker.session import Session

log = logging.getLogger("meshmq.mesh")

LOCAL = -1  # "this worker" among the candidates of a shared group
LINK_TIMEOUT = 60.0  # seconds to link to every peer at start-up
CLAIM_RETRY_SECONDS = 0.02
ANSWER_TIMEOUT = 3.0  # seconds before a peer that does not answer a claim or a barrier
# (stopped, stuck) is passed over
REDIAL_MAX_SECONDS = 1.0

CLAIM_NONE, CLAIM_SESSION, CLAIM_RETRY = 0, 1, 2

RouteKey = tuple[str, str]  # (group or "", filter)
Answer = Callable[[Reader | None], None]  # None: the link dropped first


class MeshError(Exception):
    """The workers could not link; the message says which are missing."""


class Mesh:
    def __init__(self, broker: Broker, worker: WorkerSpec) -> None:
        self.broker = broker
        self.worker = worker
        self.loop = broker.loop
        self.router = broker.router
        self.links: dict[int, Link] = {}
        self.remote: SubscriptionTrie[int, bool] = SubscriptionTrie()
        self.remote_shared: SubscriptionTrie[str, set[int]] = SubscriptionTrie()
        self._peer_routes: dict[int, set[RouteKey]] = {}
        self._local_refs: dict[RouteKey, int] = {}
        self._route_changes: list[tuple[bool, str, str]] = []
        self._turn: dict[RouteKey, int] = {}
        self._requests: dict[int, tuple[int, Answer]] = {}
        self._next_request = 1
        self._claiming: set[str] = set()
        self._linked = asyncio.Event()
        self._server: Any = None
        self._redial: dict[int, float] = {}
        self._congested: set[int] = set()  # id() of links over their write high water
        self.closing = False
        self.leader_high: list[int] = []  # the leader's high watermark in its HELLO
        self.peer_statistics: dict[int, dict[str, int]] = {}
        self.counters = {"forwarded": 0, "backpressure": 0}
        self._backpressure_logged = -1e9
        self._handlers: dict[int, Callable[[Link, bytes], None]] = {
            FrameType.ROUTES: self._on_routes,
            FrameType.FORWARD: self._on_forward,
            FrameType.APPEND: self._on_append,
            FrameType.RETAIN: self._on_retain,
            FrameType.QUERY_RETAINED: self._on_query_retained,
            FrameType.CLAIM: self._on_claim,
            FrameType.SYNC: self._on_sync,
            FrameType.STATS: self._on_stats,
            FrameType.REPLY: self._on_answer,
            FrameType.RETAINED: self._on_answer,
            FrameType.CLAIMED: self._on_answer,
            FrameType.SYNCED: self._on_answer,
            FrameType.BARRIER: self._on_barrier,
            FrameType.BARRIER_DONE: self._on_answer,
            FrameType.DELIVER: self._on_deliver,
            FrameType.SETTLED: self._on_settled,
        }
        self._held: dict[str, list[tuple[Message, int, bool, list[int] | None,
                                         RouteKey | None]]] = {}
        self.router.mesh = self
        self.router.route_listener = self._local_route
        self.router.keeps_retained = worker.is_leader

    @property
    def peers(self) -> int:
        return self.worker.count - 1

    # ------------------------------------------------------------------ links

    async def start(self) -> None:
        """Listen, dial the higher indexes, and wait until every peer is linked."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.worker.link_address(self.worker.index))
        except OSError as error:
            sock.close()
            raise MeshError(f"cannot listen for links worker={self.worker.index}: "
                            f"{error.strerror or error}") from None
        sock.listen(64)
        sock.setblocking(False)
        self._server = await self.loop.create_unix_server(lambda: Link(self, None), sock=sock)
        for peer in range(self.worker.index + 1, self.worker.count):
            self._dial(peer)
        try:
            await asyncio.wait_for(self._linked.wait(), LINK_TIMEOUT)
        except TimeoutError:
            missing = sorted(set(range(self.worker.count)) - set(self.links)
                             - {self.worker.index})
            raise MeshError(f"worker {self.worker.index} could not link to workers {missing} "
                            f"within {LINK_TIMEOUT:.0f} s") from None

    def _dial(self, peer: int) -> None:
        if self.closing or peer in self.links:
            return
        self.loop.create_task(self._connect(peer))

    async def _connect(self, peer: int) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await self.loop.sock_connect(sock, self.worker.link_address(peer))
            await self.loop.create_unix_connection(lambda: Link(self, peer), sock=sock)
        except OSError as error:
            log.debug("dial failed peer=%d error=%r", peer, str(error))
            sock.close()
            delay = min(REDIAL_MAX_SECONDS, self._redial.get(peer, 0.01) * 2)
            self._redial[peer] = delay
            if not self.closing:
                self.loop.call_later(delay, self._dial, peer)

    def link_made(self, link: Link) -> None:
        persistence = self.broker.persistence
        high = persistence.high_watermark if (
            self.worker.is_leader and persistence is not None) else []
        worker = self.worker
        link.send(Writer().u16(worker.index).u16(worker.count).text(worker.token)
                  .offsets(list(high)).frame(FrameType.HELLO))

    def on_frame(self, link: Link, frame_type: int, body: bytes) -> None:
        if not link.ready:
            if frame_type != FrameType.HELLO:
                raise LinkError(f"frame type {frame_type} before HELLO")
            return self._on_hello(link, body)
        self._handlers[frame_type](link, body)

    def _on_hello(self, link: Link, body: bytes) -> None:
        reader = Reader(body)
        index, count, token = reader.u16(), reader.u16(), reader.text()
        high = reader.offsets()
        reader.end()
        worker = self.worker
        if token != worker.token or count != worker.count or index == worker.index or (
                index >= count or (link.peer is not None and link.peer != index)):
            raise LinkError(f"unexpected HELLO index={index} count={count}")
        link.peer = index
        link.ready = True
        old = self.links.get(index)
        if old is not None and old is not link:
            old.close()
            self._forget_peer(index)
        self.links[index] = link
        self._redial.pop(index, None)
        if index == LEADER:
            self.leader_high = high
            if isinstance(self.broker.persistence, RemoteLog):
                self.broker.persistence.synced(high)
        keys = [(True, group, plain) for (group, plain) in self._local_refs]
        if keys:
            link.send(_routes_frame(keys))
        log.info("linked peer=%d", index)
        if len(self.links) == self.peers:
            self._linked.set()

    def link_congested(self, link: Link, congested: bool) -> None:
        """Backpressure from a slow peer: every client of this worker pauses reading while
        any link has too much queued (link.py)."""
        was = bool(self._congested)
        if congested:
            self._congested.add(id(link))
        else:
            self._congested.discard(id(link))
        if bool(self._congested) == was:
            return
        self.broker.pause_input("mesh", bool(self._congested))
        if congested:
            self.counters["backpressure"] += 1
            now = self.loop.time()
            if now - self._backpressure_logged >= 10.0:  # one line per 10 s, not per episode
                self._backpressure_logged = now
                log.warning("link backlog high: client input paused (episodes=%d)",
                            self.counters["backpressure"])

    def link_lost(self, link: Link) -> None:
        peer = link.peer
        if peer is None:
            return  # an accepted link that never said HELLO
        if self.links.get(peer) is link:
            del self.links[peer]
            self._forget_peer(peer)
            if not self.closing:
                log.warning("link lost peer=%d", peer)
        elif peer in self.links:
            return  # a stale link: a newer one is up
        # Ours to dial again, also when a dial reached a dying peer and was dropped before
        # HELLO (the peer's old listening socket can still accept while it exits).
        if not self.closing and peer > self.worker.index:
            self._dial(peer)

    def _forget_peer(self, peer: int) -> None:
        """The peer's routes go; its pending requests fail; sessions moved to it are its."""
        for client_id, stub in list(self.broker.sessions.items()):
            if isinstance(stub, MovedSession) and stub.peer == peer:
                self._drop_stand_in(client_id, stub)
        for group, topic_filter in self._peer_routes.pop(peer, set()):
            self._remove_remote(peer, group, topic_filter)
        self.peer_statistics.pop(peer, None)
        for request_id, (target, answer) in list(self._requests.items()):
            if target == peer:
                del self._requests[request_id]
                answer(None)

    def close(self) -> None:
        self.closing = True
        if self._server is not None:
            self._server.close()
        for link in list(self.links.values()):
            link.close()

    # ------------------------------------------------------------------ routes

    def _local_route(self, added: bool, group: str, plain: str) -> None:
        key = (group, plain)
        count = self._local_refs.get(key, 0) + (1 if added else -1)
        if count > 0:
            self._local_refs[key] = count
            if count == 1 and added:
                self._queue_route(True, key)
        elif key in self._local_refs:
            del self._local_refs[key]
            self._queue_route(False, key)

    def _queue_route(self, added: bool, key: RouteKey) -> None:
        if not self._route_changes:
            self.loop.call_soon(self._send_routes)
        self._route_changes.append((added, *key))

    def _send_routes(self) -> None:
        changes = self._route_changes
        if not changes:
            return
        self._route_changes = []
        frame = _routes_frame(changes)
        for link in self.links.values():
            link.send(frame)

    def _on_routes(self, link: Link, body: bytes) -> None:
        reader = Reader(body)
        peer = link.peer
        assert peer is not None
        known = self._peer_routes.setdefault(peer, set())
        for _ in range(reader.u32()):
            added, group, topic_filter = reader.u8(), reader.text(), reader.text()
            key = (group, topic_filter)
            if added and key not in known:
                known.add(key)
                self._add_remote(peer, group, topic_filter)
            elif not added and key in known:
                known.discard(key)
                self._remove_remote(peer, group, topic_filter)
        reader.end()

    def _add_remote(self, peer: int, group: str, topic_filter: str) -> None:
        if not group:
            self.remote.add(topic_filter, peer, True)
            return
        peers = self.remote_shared.get(topic_filter, group)
        if peers is None:
            self.remote_shared.add(topic_filter, group, {peer})
        else:
            peers.add(peer)

    def _remove_remote(self, peer: int, group: str, topic_filter: str) -> None:
        if not group:
            self.remote.remove(topic_filter, peer)
            return
        peers = self.remote_shared.get(topic_filter, group)
        if peers is not None:
            peers.discard(peer)
            if not peers:
                self.remote_shared.remove(topic_filter, group)

    # ------------------------------------------------------------------ routing

    def route(self, message: Message, now: float) -> tuple[int, int]:
        """After the local plain deliveries: shared groups anywhere, and one FORWARD per peer
        with a match. Returns (shared deliveries made here, peers forwarded to)."""
        topic = message.topic
        targets: dict[int, list[RouteKey]] = {}
        if self.remote.entry_count:
            for _, peers in self.remote.match(topic):
                for peer in peers:
                    targets.setdefault(peer, [])
        count = 0
        router = self.router
        local = router.shared.match(topic) if router.shared.entry_count else ()
        remote = self.remote_shared.match(topic) if self.remote_shared.entry_count else ()
        if local or remote:
            local_groups = {(name, f): group for f, groups in local
                            for name, group in groups.items() if group.members}
            remote_groups = {(name, f): peers for f, groups in remote
                             for name, peers in groups.items()}
            for key in local_groups.keys() | remote_groups.keys():
                candidates = [LOCAL] if key in local_groups else []
                candidates += sorted(p for p in remote_groups.get(key, ()) if p in self.links)
                if not candidates:
                    continue
                turn = self._turn.get(key, 0)
                self._turn[key] = turn + 1
                chosen = candidates[turn % len(candidates)]
                if chosen == LOCAL:
                    count += router._deliver_to_group(
                        key, local_groups[key], message, message.qos, now, None)
                else:
                    targets.setdefault(chosen, []).append(key)
        forwarded = 0
        if targets:
            body = message_body(message, now)
            links = self.links
            for peer, groups in targets.items():
                link = links.get(peer)
                if link is not None:
                    link.send(forward_frame(groups, body))
                    forwarded += 1
            self.counters["forwarded"] += forwarded
        return count, forwarded

    def forward_to_group(self, key: RouteKey, message: Message, now: float) -> int:
        """A shared message with no member left here (its session ended): one elsewhere."""
        peers = sorted(p for p in self.remote_shared.get(key[1], key[0]) or () if p in self.links)
        if not peers:
            return 0
        turn = self._turn.get(key, 0)
        self._turn[key] = turn + 1
        body = message_body(message, now)
        self.links[peers[turn % len(peers)]].send(forward_frame([key], body))
        return 1

    def _on_forward(self, link: Link, body: bytes) -> None:
        groups, wire = parse_forward(body)
        now = self.loop.time()
        message = from_wire(wire, now)
        persistence = self.broker.persistence
        if wire.position is not None and isinstance(persistence, RemoteLog):
            persistence.routed(*wire.position)
        self.router.deliver_forwarded(message, groups, now)

    # ------------------------------------------------------------------ requests

    def _request(self, peer: int, answer: Answer) -> tuple[Link, int] | None:
        link = self.links.get(peer)
        if link is None:
            return None
        self._send_routes()  # a request is answered after our route changes are in place
        request_id = self._next_request
        self._next_request += 1
        self._requests[request_id] = (peer, answer)
        return link, request_id

    def _on_answer(self, link: Link, body: bytes) -> None:
        reader = Reader(body)
        entry = self._requests.pop(reader.u64(), None)
        if entry is not None:
            entry[1](reader)

    def append(self, message: Message, client_id: str,
               done: Callable[[Appended | LeaderUnavailable], None]) -> None:
        """Have the leader persist and route ``message`` (remotelog.py)."""
        def answer(reader: Reader | None) -> None:
            if reader is None:
                return done(LeaderUnavailable(ReasonCode.UNSPECIFIED_ERROR, "leader link lost"))
            status, partition, offset, receivers = (
                reader.u8(), reader.u32(), reader.u64(), reader.u32())
            if status:
                return done(LeaderUnavailable(status, f"leader refused: 0x{status:02X}"))
            done(Appended(partition, offset, receivers))

        sent = self._request(LEADER, answer)
        if sent is None:
            self.loop.call_soon(done, LeaderUnavailable(
                ReasonCode.UNSPECIFIED_ERROR, "no link to the leader"))
            return
        link, request_id = sent
        body = message_body(message, self.loop.time())
        link.send(_with_body(Writer().u64(request_id).text(client_id), FrameType.APPEND, body))

    def store_retained(self, message: Message, done: Callable[[], None] | None) -> None:
        """Have the leader store (empty payload: clear) the retained message of a topic."""
        def answer(reader: Reader | None) -> None:
            if reader is None:
                log.warning("retained message not stored, leader link lost topic=%r",
                            message.topic)
            if done is not None:
                done()

        sent = self._request(LEADER, answer)
        if sent is None:
            log.warning("retained message not stored, no link to the leader topic=%r",
                        message.topic)
            if done is not None:
                self.loop.call_soon(done)
            return
        link, request_id = sent
        body = message_body(message, self.loop.time(), positioned=False)
        link.send(_with_body(Writer().u64(request_id), FrameType.RETAIN, body))

    def query_retained(self, filters: list[str],
                       done: Callable[[list[list[Message]]], None]) -> None:
        """The leader's retained messages matching each filter."""
        def answer(reader: Reader | None) -> None:
            found: list[list[Message]] = [[] for _ in filters]
            if reader is None:
                log.warning("retained messages not sent, leader link lost")
            else:
                now = self.loop.time()
                for _ in range(reader.u32()):
                    index = reader.u16()
                    message = from_wire(decode_message(reader.blob()), now)
                    if index < len(found):
                        found[index].append(message)
            done(found)

        sent = self._request(LEADER, answer)
        if sent is None:
            self.loop.call_soon(answer, None)
            return
        link, request_id = sent
        writer = Writer().u64(request_id).u16(len(filters))
        for topic_filter in filters:
            writer.text(topic_filter)
        link.send(writer.frame(FrameType.QUERY_RETAINED))

    def sync(self, done: Callable[[], None]) -> None:
        """Bring the high watermark view up to the leader's, then call ``done``."""
        def answer(reader: Reader | None) -> None:
            persistence = self.broker.persistence
            if reader is None:
                log.warning("high watermark not synced, leader link lost")
            elif isinstance(persistence, RemoteLog):
                persistence.synced(reader.offsets())
            done()

        sent = self._request(LEADER, answer)
        if sent is None:
            self.loop.call_soon(answer, None)
            return
        link, request_id = sent
        link.send(Writer().u64(request_id).frame(FrameType.SYNC))

    def _ask_all(self, frame: Callable[[int], bytes],
                 on_answer: Callable[[Reader | None, bool], None], done: Callable[[], None],
                 what: str) -> None:
        """Send ``frame(request_id)`` to every linked peer and call ``done`` once all have
        answered, or after ``ANSWER_TIMEOUT``: a stopped or stuck peer must not hold the
        caller back. ``on_answer(reader, late)`` sees every answer (None: the link dropped;
        ``late``: it came after ``done``)."""
        waiting = 0
        finished = False

        def finish() -> None:
            nonlocal finished
            if not finished:
                finished = True
                timer.cancel()
                done()

        def answer(reader: Reader | None) -> None:
            nonlocal waiting
            on_answer(reader, finished)
            if not finished:
                waiting -= 1
                if waiting == 0:
                    finish()

        def timed_out() -> None:
            log.warning("%s unanswered after %.0f s, going on without it waiting=%d", what,
                        ANSWER_TIMEOUT, waiting)
            finish()

        timer = self.loop.call_later(ANSWER_TIMEOUT, timed_out)
        for peer in list(self.links):
            sent = self._request(peer, answer)  # flushes the pending route changes first
            if sent is not None:
                link, request_id = sent
                waiting += 1
                link.send(frame(request_id))
        if not waiting:
            self.loop.call_soon(finish)

    def barrier(self, done: Callable[[], None]) -> None:
        """Call ``done`` once every linked peer has applied our route changes so far: a
        SUBACK sent after it means a publish on any worker reaches the new subscription.

        The leader answers with its high watermark as of then, which this worker's view takes
        (remotelog.py): a log cursor started from the view after the barrier never reaches
        back before the routes were in place, even for partitions nothing was forwarded from.
        """
        def on_answer(reader: Reader | None, late: bool) -> None:
            if reader is None:
                return
            high = reader.offsets()
            persistence = self.broker.persistence
            if high and isinstance(persistence, RemoteLog):
                persistence.synced(high)

        self._ask_all(lambda request_id: Writer().u64(request_id).frame(FrameType.BARRIER),
                      on_answer, done, "route barrier")

    def _on_barrier(self, link: Link, body: bytes) -> None:
        reader = Reader(body)
        request_id = reader.u64()
        reader.end()
        persistence = self.broker.persistence
        high = persistence.high_watermark if (
            self.worker.is_leader and persistence is not None) else []
        link.send(Writer().u64(request_id).offsets(list(high)).frame(FrameType.BARRIER_DONE))

    def claim(self, client_id: str, clean_start: bool,
              done: Callable[[list[bytes]], None]) -> None:
        """Ask every peer for ``client_id``'s session; ``done`` gets those handed over."""
        self._claiming.add(client_id)
        self._claim_round(client_id, clean_start, [], done)

    def _claim_round(self, client_id: str, clean_start: bool, sessions: list[bytes],
                     done: Callable[[list[bytes]], None]) -> None:
        retry = False

        def on_answer(reader: Reader | None, late: bool) -> None:
            nonlocal retry
            if reader is None:
                return
            status, blob = reader.u8(), reader.blob()
            if status == CLAIM_RETRY:
                retry = True
            elif status == CLAIM_SESSION and late:  # the connection went on without it
                log.warning("session handed over after the claim timed out, dropped "
                            "client_id=%s", client_id)
            elif status == CLAIM_SESSION:
                sessions.append(blob)

        def answered() -> None:
            if retry and not self.closing:
                self.loop.call_later(CLAIM_RETRY_SECONDS, self._claim_round, client_id,
                                     clean_start, sessions, done)
                return
            self._claiming.discard(client_id)
            done(sessions)

        self._ask_all(
            lambda request_id: Writer().u64(request_id).text(client_id).u8(clean_start)
            .frame(FrameType.CLAIM), on_answer, answered, f"claim of client_id={client_id}")

    # ------------------------------------------------------------------ serving peers

    def _reply(self, link: Link, request_id: int, status: int, partition: int = 0,
               offset: int = 0, receivers: int = 0) -> None:
        link.send(Writer().u64(request_id).u8(status).u32(partition).u64(offset)
                  .u32(receivers).frame(FrameType.REPLY))

    def _on_append(self, link: Link, body: bytes) -> None:
        reader = Reader(body)
        request_id, client_id = reader.u64(), reader.text()
        message = from_wire(decode_message(body, reader.pos), self.loop.time())
        self.broker.append_for_peer(message, client_id, partial_reply(self, link, request_id))

    def _on_retain(self, link: Link, body: bytes) -> None:
        reader = Reader(body)
        request_id = reader.u64()
        message = from_wire(decode_message(body, reader.pos), self.loop.time())
        self.broker.store_retained(message, lambda: self._reply(link, request_id, 0))

    def _on_query_retained(self, link: Link, body: bytes) -> None:
        reader = Reader(body)
        request_id = reader.u64()
        filters = [reader.text() for _ in range(reader.u16())]
        reader.end()
        now = self.loop.time()
        writer = Writer().u64(request_id)
        found = [(index, message) for index, topic_filter in enumerate(filters)
                 for message in self.broker.retained_matching(topic_filter)]
        writer.u32(len(found))
        for index, message in found:
            writer.u16(index).blob(message_body(message, now))
        link.send(writer.frame(FrameType.RETAINED))

    def _on_sync(self, link: Link, body: bytes) -> None:
        reader = Reader(body)
        request_id = reader.u64()
        persistence = self.broker.persistence
        high = list(persistence.high_watermark) if persistence is not None else []
        link.send(Writer().u64(request_id).offsets(high).frame(FrameType.SYNCED))

    def _on_claim(self, link: Link, body: bytes) -> None:
        reader = Reader(body)
        request_id, client_id, clean_start = reader.u64(), reader.text(), bool(reader.u8())
        reader.end()
        assert link.peer is not None
        status, blob, session = CLAIM_NONE, b"", None
        if client_id in self._claiming:  # both connecting it at once: the lower index wins
            status = CLAIM_RETRY if self.worker.index < link.peer else CLAIM_NONE
        elif isinstance(self.broker.sessions.get(client_id), MovedSession):
            pass  # it lives on another worker, which answers (our stand-in keeps following it)
        else:
            session = self.broker.release_session(client_id, clean_start)
            if session is not None:
                status, blob = CLAIM_SESSION, export_session(session, self.loop.time())
        link.send(Writer().u64(request_id).u8(status).blob(blob).frame(FrameType.CLAIMED))
        if session is not None:  # it follows the session until the peer has settled it
            self._stand_in(session, link.peer)

    def adopt(self, blobs: list[bytes]) -> list[Session]:
        """Install sessions handed over by peers (normally one; after a crash in the middle
        of a handover there may be two: the most recently detached one wins)."""
        now = self.loop.time()
        adopted: dict[str, Session] = {}
        documents = []
        for blob in blobs:
            try:
                documents.append(read_session(blob, now))
            except LinkError as error:
                log.error("session handed over is unreadable, dropped: %s", error)
        for document in sorted(documents, key=lambda d: d.detached_at or 0):
            existing = self.broker.sessions.get(document.client_id)
            if existing is not None:
                self.broker.discard_session(existing)
            adopted[document.client_id] = install_session(self.broker, document)
        return list(adopted.values())

    # ------------------------------------------------------------------ sessions on the move

    def _stand_in(self, session: Session, peer: int) -> None:
        """Put a ``MovedSession`` where ``session`` was (cluster/moving.py)."""
        client_id = session.client_id
        stub = MovedSession(session, peer, partial(self._deliver_moved, peer, client_id),
                            partial(self._covered, peer))
        stub.timer = self.loop.call_later(SETTLE_TIMEOUT, self._drop_stand_in, client_id, stub)
        self.broker.sessions[client_id] = stub

    def _covered(self, peer: int, message: Message) -> bool:
        """Will ``peer`` get this message from us anyway (a publish made here that a route of
        the peer matches)?"""
        if self.router.forwarded_in:
            return False  # delivered where it landed: never forwarded again
        return any(peer in entries for _, entries in self.remote.match(message.topic))

    def _deliver_moved(self, peer: int, client_id: str, message: Message, qos: int,
                       retain: bool, ids: list[int] | None, group: RouteKey | None) -> None:
        link = self.links.get(peer)
        if link is None:
            return
        writer = Writer().text(client_id).u8(qos).u8(retain).offsets(ids or [])
        writer.text(group[0] if group else "").text(group[1] if group else "")
        link.send(_with_body(writer, FrameType.DELIVER, message_body(message, self.loop.time())))

    def _on_deliver(self, link: Link, body: bytes) -> None:
        reader = Reader(body)
        client_id, qos, retain = reader.text(), reader.u8(), bool(reader.u8())
        ids = reader.offsets() or None
        name, topic_filter = reader.text(), reader.text()
        message = from_wire(decode_message(body, reader.pos), self.loop.time())
        group = (name, topic_filter) if name else None
        if client_id in self._claiming:  # the session is on its way: deliver once adopted
            self._held.setdefault(client_id, []).append((message, qos, retain, ids, group))
            return
        session = self.broker.sessions.get(client_id)
        if session is not None:
            session.deliver(message, qos, retain, ids, self.loop.time(), group)

    def settle(self, client_id: str) -> None:
        """The sessions handed over for ``client_id`` are adopted (their routes are queued):
        deliver what came for them meanwhile, and tell the peers to drop their stand-ins."""
        held = self._held.pop(client_id, [])
        session = self.broker.sessions.get(client_id)
        if session is not None:
            now = self.loop.time()
            for message, qos, retain, ids, group in held:
                session.deliver(message, qos, retain, ids, now, group)
        self._send_routes()  # SETTLED after our routes: the peer's stand-in is then redundant
        frame = Writer().text(client_id).frame(FrameType.SETTLED)
        for link in self.links.values():
            link.send(frame)

    def _on_settled(self, link: Link, body: bytes) -> None:
        reader = Reader(body)
        client_id = reader.text()
        reader.end()
        stub = self.broker.sessions.get(client_id)
        if isinstance(stub, MovedSession) and stub.peer == link.peer:
            self._drop_stand_in(client_id, stub)

    def _drop_stand_in(self, client_id: str, stub: MovedSession) -> None:
        if stub.timer is not None:
            stub.timer.cancel()  # type: ignore[attr-defined]
            stub.timer = None
        if self.broker.sessions.get(client_id) is stub:
            del self.broker.sessions[client_id]
            self.router.drop_session(stub, self.loop.time())

    def drop_moved(self, client_id: str) -> None:
        """A connection for ``client_id`` is being accepted here: a stand-in left for it is
        not a session."""
        stub = self.broker.sessions.get(client_id)
        if isinstance(stub, MovedSession):
            self._drop_stand_in(client_id, stub)

    def _on_stats(self, link: Link, body: bytes) -> None:
        reader = Reader(body)
        names = [reader.text() for _ in range(reader.u16())]
        values = reader.offsets()
        reader.end()
        assert link.peer is not None
        self.peer_statistics[link.peer] = dict(zip(names, values, strict=False))

    def send_statistics(self, values: dict[str, int]) -> None:
        link = self.links.get(LEADER)
        if link is None:
            return
        writer = Writer().u16(len(values))
        for name in values:
            writer.text(name)
        link.send(writer.offsets([max(0, int(v)) for v in values.values()])
                  .frame(FrameType.STATS))


def _routes_frame(changes: list[tuple[bool, str, str]]) -> bytes:
    writer = Writer().u32(len(changes))
    for added, group, topic_filter in changes:
        writer.u8(added).text(group).text(topic_filter)
    return writer.frame(FrameType.ROUTES)


def _with_body(writer: Writer, frame_type: FrameType, body: bytes) -> bytes:
    """A frame of ``writer``'s fields followed by an encoded message body."""
    writer.parts.append(body)
    return writer.frame(frame_type)


def partial_reply(mesh: Mesh, link: Link, request_id: int) -> Callable[..., None]:
    def reply(status: int, partition: int = 0, offset: int = 0, receivers: int = 0) -> None:
        mesh._reply(link, request_id, status, partition, offset, receivers)
    return reply
