"""The mesh: one worker's links to its peers, the routes they exchange, and requests across them.

Theory of operation
-------------------
``Mesh`` is the protocol, sans I/O, as ``mqtt/connection.py`` is for MQTT: it is told about
links and bytes (``link_opened``, ``data_received``, ``link_closed``, ``link_congested``) and
time (``expire(now)``), and it queues bytes per link for the I/O layer to write
(``data_to_send``; ``io.wake()`` asks for a write at the end of the loop turn). The asyncio glue
is ``cluster/sockets.py``; tests drive several meshes in one process by passing the bytes
between them (``tests/cluster/test_mesh_protocol.py``).

Links. Both ends of a link first send ``HELLO`` (index, worker count, node token, and the high
watermark of each partition the sender leads); a wrong token or count is a ``LinkError`` and
the link is closed. A peer is *linked* once its ``HELLO`` arrived; a newer link to the same
peer replaces an older one. When a link closes, the peer's routes go, its pending requests
fail, and the components that registered ``on_link_down`` hear of it.

Routes (``cluster/routes.py``). The router reports every subscription added or removed
(``route_changed``); the changes that matter to peers go out in one ``ROUTES`` frame per loop
turn, and the whole set on each new link.

Routing (core interface ``Peers``). After delivering to its local plain subscribers, the router
calls ``route()``: each peer with a matching plain route, or chosen for a shared group, gets one
``FORWARD`` (the message body encoded once for all of them); the groups to serve here go back to
the router. A forwarded message is delivered where it lands and never forwarded again.

Requests (``cluster/requests.py``). A request frame carries an id and its answer comes back on
the same link after everything the peer sent before; ``request()`` and ``ask_all()`` send them
with a deadline; before any request, pending route changes are sent, so an answer also means
the peer applied them (``barrier()``).

Backpressure. A link that queues more than ``WRITE_HIGH_WATER`` bytes (its peer is stopped or
slower than this worker's clients) is *congested* until it drains below ``WRITE_LOW_WATER``.
Forwarding to a congested peer still queues (nothing is dropped), and calls
``on_congested(peer)``: the broker pauses the client whose publish it was, and only that one,
until this link drains (``when_drained``). One slow peer does not stop the clients that do not
publish to it.

Everything else a frame can carry (the log, retained messages, sessions, statistics) belongs
to the component that registered a handler for its type (``handle``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from meshmq.cluster.codec import (
    AdminAnswer,
    Barrier,
    BarrierDone,
    Claimed,
    Forward,
    FrameReader,
    FrameType,
    Hello,
    LinkError,
    Reply,
    Retained,
    Routes,
    Synced,
    decode_frame,
    forward_frame,
)
from meshmq.cluster.requests import Requests
from meshmq.cluster.routes import RouteKey
from meshmq.cluster.routes import Routes as RouteTable
from meshmq.cluster.spec import WorkerSpec

if TYPE_CHECKING:
    from meshmq.broker.message import Message

log = logging.getLogger("meshmq.mesh")

ANSWER_TIMEOUT = 3.0  # seconds before a peer that does not answer (stopped, stuck) is passed over
WRITE_HIGH_WATER = 16 * 1024 * 1024  # bytes queued for a peer before its link is congested
WRITE_LOW_WATER = 4 * 1024 * 1024  # ... and after which it is not any more
# answers to a request
_ANSWER_FRAMES = (Reply, Retained, Claimed, Synced, BarrierDone, AdminAnswer)

Handler = Callable[[int, Any], None]  # (peer, decoded frame)
Highs = dict[int, int]


class MeshIO(Protocol):
    """What the mesh needs from the I/O layer."""

    def now(self) -> float: ...

    def wake(self) -> None:
        """Output is queued: call ``data_to_send`` (and write it) at the end of this turn."""

    def schedule(self, when: float) -> None:
        """Call ``expire`` at ``when`` (an earlier schedule may be replaced)."""

    def close_link(self, link: int) -> None:
        """Close the link (a protocol error, or a newer link to the same peer)."""


EncodeMessage = Callable[["Message", float], bytes]  # the core's one body (broker/wire.py)


@dataclass(slots=True)
class _Link:
    """One link: its peer once known, whether its HELLO arrived, what waits to be written."""

    ident: int
    peer: int | None
    reader: FrameReader = field(default_factory=FrameReader)
    ready: bool = False
    out: list[bytes] = field(default_factory=list)
    queued: int = 0  # bytes handed to the I/O layer and not yet written to the socket
    congested: bool = False


class Mesh:
    """One worker's side of the mesh (see the module docstring)."""

    def __init__(self, worker: WorkerSpec, io: MeshIO, encode: EncodeMessage,
                 highs: Callable[[], Highs]) -> None:
        self.worker = worker
        self.io = io
        self.encode = encode
        self.highs = highs  # the high watermarks of the partitions this worker leads
        self.routes = RouteTable()
        self.requests: Requests[Any] = Requests()
        self._links: dict[int, _Link] = {}  # by link id
        self.peers: dict[int, _Link] = {}  # linked peers (HELLO received)
        self._handlers: dict[int, Handler] = {}
        self._answers = {FrameType.REPLY, FrameType.RETAINED, FrameType.CLAIMED,
                         FrameType.SYNCED, FrameType.BARRIER_DONE, FrameType.ADMIN_ANSWER}
        self._wanted_write = False
        self._drained: dict[int, list[Callable[[], None]]] = {}
        self.on_link_up: list[Callable[[int, Hello], None]] = []
        self.on_link_down: list[Callable[[int], None]] = []
        self.on_tick: list[Callable[[float], None]] = []
        self.before_send: list[Callable[[], None]] = []  # batches to turn into frames now
        self.before_forward: Callable[[int], None] | None = None  # flush what must go first
        self.local_for: int | None = None  # route(): this peer delivers the message itself
        self.local_groups: list[RouteKey] | None = None  # ... serving these groups
        self.on_congested: Callable[[int], None] | None = None
        self.on_forward: Callable[[int, Forward], None] | None = None
        self.on_highs: Callable[[int, Highs], None] | None = None
        self.closing = False
        self.counters = {"forwarded": 0, "frames_in": 0, "frames_out": 0, "bytes_in": 0,
                         "bytes_out": 0, "congested": 0}
        self.handle(FrameType.ROUTES, self._on_routes)
        self.handle(FrameType.BARRIER, self._on_barrier)

    # ------------------------------------------------------------------ wiring

    def handle(self, frame_type: FrameType, handler: Handler) -> None:
        """Frames of ``frame_type`` go to ``handler(peer, frame)``."""
        self._handlers[frame_type] = handler

    @property
    def linked(self) -> bool:
        return bool(self.peers)

    @property
    def peer_count(self) -> int:
        return self.worker.count - 1

    def all_linked(self) -> bool:
        return len(self.peers) == self.peer_count

    # ------------------------------------------------------------------ links (from the I/O)

    def link_opened(self, ident: int, peer: int | None) -> None:
        """A connection exists (``peer`` known when we dialed it): send our HELLO."""
        link = self._links[ident] = _Link(ident, peer)
        worker = self.worker
        self._queue(link, Hello(worker.index, worker.count, worker.token, self.highs()).encode())

    def data_received(self, ident: int, data: bytes) -> None:
        """Bytes from a link; a protocol error closes it."""
        link = self._links.get(ident)
        if link is None:
            return
        self.counters["bytes_in"] += len(data)
        try:
            for frame_type, body in link.reader.feed(data):
                if self._links.get(ident) is not link:
                    return  # closed by an earlier frame
                self.counters["frames_in"] += 1
                self._dispatch(link, frame_type, body)
        except LinkError as error:
            log.error("link protocol error peer=%s error=%r: closing the link", link.peer,
                      str(error))
            self.link_closed(ident)
            self.io.close_link(ident)

    def link_closed(self, ident: int) -> None:
        """The link is gone (either side closed it, or it broke)."""
        link = self._links.pop(ident, None)
        if link is None:
            return
        peer = link.peer
        if peer is None or self.peers.get(peer) is not link:
            return  # never said HELLO, or a newer link to that peer is up
        del self.peers[peer]
        if not self.closing:
            log.warning("link lost peer=%d", peer)
        self.routes.forget(peer)
        self.requests.link_down(peer)
        self._release_drained(peer)
        for listener in self.on_link_down:
            listener(peer)

    def link_written(self, ident: int, queued: int) -> None:
        """The I/O layer's write buffer of this link now holds ``queued`` bytes."""
        link = self._links.get(ident)
        if link is None:
            return
        link.queued = queued
        if link.congested and queued <= WRITE_LOW_WATER:
            link.congested = False
            if link.peer is not None:
                self._release_drained(link.peer)
        elif not link.congested and queued >= WRITE_HIGH_WATER:
            link.congested = True
            self.counters["congested"] += 1

    def data_to_send(self) -> dict[int, bytes]:
        """What to write, per link id (taken: the mesh forgets it)."""
        for hook in self.before_send:
            hook()
        self._wanted_write = False
        self._flush_routes()
        out = {}
        for ident, link in self._links.items():
            if link.out:
                data = b"".join(link.out) if len(link.out) > 1 else link.out[0]
                link.out = []
                out[ident] = data
                self.counters["bytes_out"] += len(data)
        return out

    def close(self) -> None:
        """Stop: every link is closed by the I/O layer; nothing is announced any more."""
        self.closing = True

    def _dispatch(self, link: _Link, frame_type: int, body: bytes) -> None:
        if not link.ready:
            if frame_type != FrameType.HELLO:
                raise LinkError(f"frame type {frame_type} before HELLO")
            return self._hello(link, Hello.decode(body))
        peer = link.peer
        assert peer is not None
        if frame_type == FrameType.FORWARD:
            if self.on_forward is not None:
                self.on_forward(peer, Forward.decode(body))
            return
        frame = decode_frame(frame_type, body)
        if frame_type in self._answers:
            assert isinstance(frame, _ANSWER_FRAMES)  # the frame types in ``_answers``
            self.requests.answer(peer, frame.request_id, frame)
            return
        handler = self._handlers.get(frame_type)
        if handler is None:
            raise LinkError(f"unexpected frame type {frame_type}")
        handler(peer, frame)

    def _hello(self, link: _Link, hello: Hello) -> None:
        worker = self.worker
        if hello.token != worker.token or hello.count != worker.count or (
                hello.index == worker.index or hello.index >= hello.count
                or (link.peer is not None and link.peer != hello.index)):
            raise LinkError(f"unexpected HELLO index={hello.index} count={hello.count}")
        peer = link.peer = hello.index
        link.ready = True
        old = self.peers.get(peer)
        if old is not None and old is not link:  # a newer link replaces the old one
            self.link_closed(old.ident)
            self.io.close_link(old.ident)
        self.peers[peer] = link
        routes = self.routes.announce_all()
        if routes:
            self._queue(link, Routes(routes).encode())
        log.info("linked peer=%d", peer)
        for listener in self.on_link_up:
            listener(peer, hello)

    def _queue(self, link: _Link, frame: bytes) -> None:
        link.out.append(frame)
        self.counters["frames_out"] += 1
        if not self._wanted_write:
            self._wanted_write = True
            self.io.wake()

    def send(self, peer: int, frame: bytes) -> bool:
        """Queue ``frame`` for ``peer``; False if it is not linked."""
        link = self.peers.get(peer)
        if link is None:
            return False
        self._queue(link, frame)
        return True

    def wake(self) -> None:
        """A component has a batch for ``before_send``: write at the end of this turn."""
        if not self._wanted_write:
            self._wanted_write = True
            self.io.wake()

    def broadcast(self, frame: bytes) -> None:
        for link in self.peers.values():
            self._queue(link, frame)

    def congested(self, peer: int) -> bool:
        link = self.peers.get(peer)
        return link is not None and link.congested

    def when_drained(self, peer: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` once ``peer``'s link is no longer congested (or is gone)."""
        if not self.congested(peer):
            callback()
            return
        self._drained.setdefault(peer, []).append(callback)

    def _release_drained(self, peer: int) -> None:
        for callback in self._drained.pop(peer, []):
            callback()

    # ------------------------------------------------------------------ routes

    def route_changed(self, added: bool, group: str, topic_filter: str) -> None:
        """The router added or removed a subscription (core interface ``Peers``)."""
        if self.routes.local_change(added, group, topic_filter) and not self._wanted_write:
            self._wanted_write = True
            self.io.wake()

    def _flush_routes(self) -> None:
        if self.routes.pending:
            frame = Routes(self.routes.take_changes()).encode()
            if not self.closing:
                for link in self.peers.values():
                    link.out.append(frame)
                    self.counters["frames_out"] += 1

    def _on_routes(self, peer: int, frame: Routes) -> None:
        self.routes.apply(peer, frame.changes)

    # ------------------------------------------------------------------ routing

    def route(self, message: Message, local_groups: Collection[RouteKey], now: float
              ) -> tuple[list[RouteKey], int]:
        """After the local plain deliveries (core interface ``Peers``): forward ``message``
        once to each peer that has a match; return the shared groups to serve here and the
        number of peers forwarded to."""
        here, targets = self.routes.targets(message.topic, local_groups, self.peers)
        if self.local_for is not None:  # that peer delivers it itself (partitions.py)
            self.local_groups = targets.pop(self.local_for, None)
        if not targets:
            return here, 0
        body = self.encode(message, now)
        before = self.before_forward
        for peer, groups in targets.items():
            link = self.peers[peer]
            if before is not None:
                before(peer)  # answers to appends routed earlier keep their place
            self._queue(link, forward_frame(groups, body))
            if link.congested and self.on_congested is not None:
                self.on_congested(peer)
        self.counters["forwarded"] += len(targets)
        return here, len(targets)

    def group_elsewhere(self, key: RouteKey, message: Message, now: float) -> int:
        """A shared message with no member left here (its session ended): one elsewhere."""
        peer = self.routes.group_peer(key, self.peers)
        if peer is None:
            return 0
        self._queue(self.peers[peer], forward_frame([key], self.encode(message, now)))
        return 1

    # ------------------------------------------------------------------ requests

    def request(self, peer: int, frame: Callable[[int], bytes],
                answer: Callable[[Any], None], timeout: float = ANSWER_TIMEOUT) -> bool:
        """Send ``frame(request_id)`` to ``peer``; ``answer(frame or None)`` later (None: the
        link dropped or ``timeout`` passed). False (and no answer) if ``peer`` is not linked."""
        link = self.peers.get(peer)
        if link is None:
            return False
        self._flush_routes()  # answered after our route changes are applied
        now = self.io.now()
        request_id = self.requests.start(peer, answer, now + timeout)
        self._queue(link, frame(request_id))
        self._schedule()
        return True

    def ask_all(self, frame: Callable[[int], bytes],
                on_answer: Callable[[int, Any, bool], None], done: Callable[[], None],
                what: str, peers: Iterable[int] | None = None) -> None:
        """``frame(request_id)`` to every linked peer (or those of ``peers`` that are
        linked); ``done()`` once all answered or after ``ANSWER_TIMEOUT``: a stopped or stuck
        peer must not hold the caller back. ``on_answer(peer, frame or None, late)``."""
        self._flush_routes()
        chosen = [p for p in (self.peers if peers is None else peers) if p in self.peers]

        def finished(missing: list[int]) -> None:
            if missing:
                log.warning("%s unanswered after %.0f s, going on without workers %s", what,
                            ANSWER_TIMEOUT, missing)
            done()

        self.requests.ask_all(chosen, lambda peer, request_id: self._queue(
            self.peers[peer], frame(request_id)), on_answer, finished,
            self.io.now() + ANSWER_TIMEOUT)
        self._schedule()

    def expire(self, now: float) -> None:
        """Time passed (the I/O layer's timer): fail or finish what is overdue."""
        self._schedule(now)
        for tick in self.on_tick:
            tick(now)

    def _schedule(self, now: float | None = None) -> None:
        deadline = self.requests.expire(self.io.now() if now is None else now)
        if deadline is not None:
            self.io.schedule(deadline)

    def barrier(self, done: Callable[[], None]) -> None:
        """``done()`` once every linked peer has applied our route changes so far (core
        interface ``Peers``): a SUBACK after it means a publish on any worker reaches the new
        subscription. Each peer answers with the high watermarks of the partitions it leads,
        for ``on_highs``."""
        def on_answer(peer: int, frame: BarrierDone | None, late: bool) -> None:
            if frame is not None and frame.highs and self.on_highs is not None:
                self.on_highs(peer, frame.highs)

        self.ask_all(lambda request_id: Barrier(request_id).encode(), on_answer, done,
                     "route barrier")

    def _on_barrier(self, peer: int, frame: Barrier) -> None:
        self.send(peer, BarrierDone(frame.request_id, self.highs()).encode())
