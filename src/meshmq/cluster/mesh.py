"""The mesh: one worker's links to its peers, the routes they exchange, and requests across them.

Theory of operation
-------------------
``Mesh`` is the protocol, sans I/O, as ``mqtt/connection.py`` is for MQTT: it is told about
links and bytes (``link_opened``, ``data_received``, ``link_closed``, ``link_paused``) and time
(``expire(now)``), and it queues bytes per link for the I/O layer to write (``data_to_send``;
``io.wake()`` asks for a write at the end of the loop turn). The asyncio glue is
``cluster/sockets.py``; tests drive several meshes in one process by passing the bytes between
them (``tests/cluster/simnet.py``).

Links. Both ends of a link first send ``HELLO`` (index, worker count, node token, and the high
watermark of each partition the sender leads); a wrong token or count is a ``LinkError`` and
the link is closed. Until its ``HELLO`` has arrived a link may carry nothing else, no frame
over ``HANDSHAKE_MAX_FRAME`` (a stranger cannot make us buffer 512 MiB), and it is closed after
``HANDSHAKE_TIMEOUT`` (a peer that accepted and never answers, such as a stopped one, is dialed
again later). Who may open a link at all is the I/O layer's check (peer credentials,
cluster/sockets.py). A peer is *linked* once its ``HELLO`` arrived; a newer link to the same
peer replaces an older one. Each link has an *incarnation* (its id, never reused): requests and
their answers belong to the incarnation they went out on (``incarnation``, ``send(...,
link=)``), so nothing asked on an earlier link, or of an earlier process, completes on a later
one. When a link closes, the peer's routes go, its pending requests fail, and the components
that registered ``on_link_down`` hear of it. Any failure while handling a peer's frame (a
``LinkError`` or a bug) closes the link, logged: both sides then start afresh on a new link
(fail-stop), instead of going on with the frames of that read lost.

Lanes. A link has two output lanes. *Data* (``FORWARD``, ``APPEND``, ``DELIVER``, and the
records a ``LOG_DATA`` answer carries to another node) is written
to the socket only while the socket's buffer is below its mark (``link_paused``), at most
``DATA_CHUNK`` bytes a turn, and otherwise waits in the mesh; *control* (every other frame) is
written at once, so answers, claims and barriers never wait behind megabytes of forwards.
*Ordered* control frames (those that report log positions or follow data: ``APPENDED``,
``BARRIER_DONE``, ``SYNCED``, ``SETTLED``, ``CLAIMED``) keep their place after the data queued
before them: they join the data lane while it holds anything (``send_ordered``), and before
one is queued the components flush what must precede it (``before_ordered``: the append
answers of this turn), so no high watermark reaches a peer ahead of an answer or a forward it
covers.

Routes (``cluster/routes.py``). The router reports every subscription added or removed
(``route_changed``); the changes that matter to peers go out in one ``ROUTES`` frame per loop
turn, and the whole set on each new link.

Routing (core interface ``Peers``). After delivering to its local plain subscribers, the router
calls ``route()``: each peer with a matching plain route, or chosen for a shared group, gets one
``FORWARD`` (the message body encoded once for all of them); the groups to serve here go back to
the router. A forwarded message is delivered where it lands and never forwarded again, except
a shared group's message whose group has no member left where it landed (``group_elsewhere``).

Requests (``cluster/requests.py``). A request frame carries an id and its answer comes back on
the same link after everything the peer sent before; ``request()`` and ``ask_all()`` send them
with a deadline; before any request, pending route changes are sent, so an answer also means
the peer applied them (``barrier()``).

Time. Every deadline of the mesh and its components is a timer in one heap (``call_at``,
cluster/timers.py) behind the I/O layer's single timer (``MeshIO.schedule``).

Backpressure. A link whose data lane holds more than ``WRITE_HIGH_WATER`` bytes (its peer is
stopped or slower than this worker's clients) is *congested* until it drains below
``WRITE_LOW_WATER``. Forwarding or appending to a congested peer still queues (nothing is
dropped), and calls ``on_congested(peer)``: the broker pauses the client whose publish it was,
and only that one, until this link drains (``when_drained``). One slow peer does not stop the
clients that do not publish to it.

Everything else a frame can carry (the log, retained messages, sessions, statistics) belongs
to the component that registered a handler for its type (``handle``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from meshmq.cluster.codec import (
    MAX_FRAME,
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
    SessionOwned,
    Synced,
    decode_frame,
    forward_at_frame,
    forward_frame,
)
from meshmq.cluster.requests import Requests
from meshmq.cluster.routes import RouteKey
from meshmq.cluster.routes import Routes as RouteTable
from meshmq.cluster.spec import WorkerSpec
from meshmq.cluster.timers import Timer, Timers
from meshmq.completions import after_both

if TYPE_CHECKING:
    from meshmq.broker.message import Message
    from meshmq.cluster.nodes import NodeLinks
    from meshmq.cluster.resend import ResendLog

log = logging.getLogger("meshmq.mesh")

ANSWER_TIMEOUT = 3.0  # seconds before a peer that does not answer (stopped, stuck) is passed over
HANDSHAKE_TIMEOUT = 5.0  # seconds a new link may take to say HELLO
HANDSHAKE_MAX_FRAME = 64 * 1024  # the largest frame accepted before HELLO (a HELLO is ~100 B)
WRITE_HIGH_WATER = 16 * 1024 * 1024  # data bytes waiting for a peer before its link is congested
WRITE_LOW_WATER = 4 * 1024 * 1024  # ... and after which it is not any more
SOCKET_HIGH_WATER = 256 * 1024  # the socket's buffer above which data waits in the mesh
SOCKET_LOW_WATER = 64 * 1024  # ... and below which it flows again
DATA_CHUNK = 1024 * 1024  # data bytes handed to one socket per loop turn
# answers to a request
_ANSWER_FRAMES = (Reply, Retained, Claimed, Synced, BarrierDone, AdminAnswer, SessionOwned)


class Lane(Enum):
    CONTROL = "control"  # written at once
    DATA = "data"  # written while the socket keeps up; waits in the mesh otherwise
    ORDERED = "ordered"  # control that keeps its place after the data queued before it


# Every frame type's lane, in one table (the module docstring says why each is where it is).
LANES: dict[int, Lane] = {frame_type: Lane.CONTROL for frame_type in FrameType}
LANES.update({FrameType.FORWARD: Lane.DATA, FrameType.APPEND: Lane.DATA,
              FrameType.NODE_APPEND: Lane.DATA, FrameType.FORWARD_AT: Lane.DATA,
              FrameType.DELIVER: Lane.DATA, FrameType.RETAIN_SYNC: Lane.DATA,
              FrameType.LOG_DATA: Lane.DATA,
              FrameType.APPENDED: Lane.ORDERED,
              FrameType.BARRIER_DONE: Lane.ORDERED, FrameType.SYNCED: Lane.ORDERED,
              FrameType.SETTLED: Lane.ORDERED, FrameType.CLAIMED: Lane.ORDERED})
_TYPE_BYTE = 4  # a frame is length (u32) | type (u8) | body
# frames a dialed link to another node keeps until acknowledged (cluster/resend.py)
RESENT = frozenset({FrameType.FORWARD, FrameType.FORWARD_AT, FrameType.RETAIN_SYNC})

Handler = Callable[[int, Any], None]  # (peer, decoded frame)
Highs = dict[int, int]


class MeshIO(Protocol):
    """What the mesh needs from the I/O layer."""

    def now(self) -> float: ...

    def wake(self) -> None:
        """Output is queued: call ``data_to_send`` (and write it) at the end of this turn."""

    def schedule(self, when: float) -> None:
        """Set the one timer: call ``expire`` at ``when`` (replacing the time set before)."""

    def close_link(self, link: int, last: bytes = b"") -> None:
        """Close the link (a protocol error, or a newer link to the same peer), after
        writing ``last`` (the frames a link refused in its handshake had queued)."""


EncodeMessage = Callable[["Message", float], bytes]  # the core's one body (broker/wire.py)


@dataclass(slots=True)
class _Link:
    """One link: its peer once known, whether its HELLO arrived, what waits to be written."""

    ident: int  # also its incarnation: never reused
    peer: int | None
    reader: FrameReader = field(default_factory=lambda: FrameReader(HANDSHAKE_MAX_FRAME))
    ready: bool = False
    control: list[bytes] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)
    data_bytes: int = 0  # in ``data``
    paused: bool = False  # the socket's buffer is above its mark: data waits
    congested: bool = False
    handshake: Timer | None = None
    remote: Any = None  # a link between nodes: its state (cluster/nodes.py); None: local
    last_in: float = 0.0  # (links between nodes) when a byte last came, and last went
    last_out: float = 0.0
    # (a link this worker dialed to another node) its frames not acknowledged yet; once it
    # closed, ``parked``: still the node's route, what is routed there waits in ``resend``
    resend: ResendLog | None = None
    parked: bool = False


class Mesh:
    """One worker's side of the mesh (see the module docstring)."""

    def __init__(self, worker: WorkerSpec, io: MeshIO, encode: EncodeMessage,
                 highs: Callable[[], Highs]) -> None:
        self.worker = worker
        self.io = io
        self.encode = encode
        # a FORWARD to another node: the body without its place in this node's log, which
        # the other node's log does not share (set by the node's wiring; tests leave it)
        self.encode_for_node: EncodeMessage = encode
        # partitions led across nodes (cluster/nodeappends.py): a persisted message goes to
        # another node with its place in the partition (FORWARD_AT, cluster/catchup.py)
        self.places_for_nodes = False
        self.highs = highs  # the high watermarks of the partitions this worker leads
        self.routes = RouteTable()
        self.requests: Requests[Any] = Requests()
        self.timers = Timers()
        self._armed = float("inf")  # what the I/O layer's timer is set to
        self._links: dict[int, _Link] = {}  # by link id
        self.peers: dict[int, _Link] = {}  # linked peers of this node (HELLO received)
        self.remote: dict[int, _Link] = {}  # ready links to other nodes (cluster/nodes.py)
        self.routable: dict[int, _Link] = {}  # the peers a publish may be forwarded to
        self.parked: set[int] = set()  # ... of which nodes that are down (cluster/resend.py)
        self.node_links: NodeLinks | None = None  # set by NodeLinks
        self._handlers: dict[int, Handler] = {}
        self._answers = {FrameType.REPLY, FrameType.RETAINED, FrameType.CLAIMED,
                         FrameType.SYNCED, FrameType.BARRIER_DONE, FrameType.ADMIN_ANSWER,
                         FrameType.SESSION_OWNED}
        self._wanted_write = False
        self._drained: dict[int, list[Callable[[], None]]] = {}
        self.on_link_up: list[Callable[[int, Hello], None]] = []
        self.on_link_down: list[Callable[[int], None]] = []
        self.before_send: list[Callable[[], None]] = []  # batches to turn into frames now
        # an ordered frame or a FORWARD is about to be queued for this peer: queue first what
        # must precede it (the append answers of this turn, cluster/partitions.py)
        self.before_ordered: Callable[[int], None] | None = None
        self.local_for: int | None = None  # route(): this peer delivers the message itself
        self.local_groups: list[RouteKey] | None = None  # ... serving these groups
        self.on_congested: Callable[[int], None] | None = None
        self.on_forward: Callable[[int, Forward], None] | None = None
        # (sender, relayed) of the FORWARD being delivered, for ``group_elsewhere``
        self.forwarding: tuple[int | None, bool] = (None, False)
        self.on_highs: Callable[[int, Highs], None] | None = None
        self.closing = False
        self.counters = {"forwarded": 0, "frames_in": 0, "frames_out": 0, "bytes_in": 0,
                         "bytes_out": 0, "congested": 0, "link_failures": 0,
                         "shared_dropped": 0}
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

    def incarnation(self, peer: int) -> int | None:
        """The current link to ``peer`` (None: not linked). An answer computed later for a
        request that came on it goes with ``send(..., link=incarnation)``."""
        link = self.peers.get(peer)
        return None if link is None else link.ident

    # ------------------------------------------------------------------ time

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """``callback()`` at ``when`` (io time), unless the returned timer is cancelled."""
        timer = self.timers.call_at(when, callback)
        self._arm(when)
        return timer

    def _arm(self, when: float) -> None:
        if when < self._armed:
            self._armed = when
            self.io.schedule(when)

    def expire(self, now: float) -> None:
        """The I/O layer's timer fired: run what is due, then set it to the next deadline."""
        self._armed = float("inf")
        self.timers.run_due(now)
        self.requests.expire(now)
        deadlines = [d for d in (self.timers.next_deadline(), self.requests.next_deadline())
                     if d is not None]
        if deadlines:
            self._arm(min(deadlines))

    # ------------------------------------------------------------------ links (from the I/O)

    def link_opened(self, ident: int, peer: int | None) -> None:
        """A connection exists (``peer`` known when we dialed it; the I/O layer has checked
        who is at the other end): send our HELLO, and expect its within
        ``HANDSHAKE_TIMEOUT``."""
        link = self._links[ident] = _Link(ident, peer)
        worker = self.worker
        self._queue(link, Hello(worker.index, worker.count, worker.token, self.highs()).encode())
        link.handshake = self.call_at(self.io.now() + HANDSHAKE_TIMEOUT,
                                      lambda: self._handshake_overdue(ident))

    def remote_opened(self, ident: int, dialed: bool) -> None:
        """A TCP link with another node exists (``dialed``: by this worker): its handshake
        (cluster/nodes.py) must end within ``HANDSHAKE_TIMEOUT``."""
        if self.node_links is None:
            raise RuntimeError("a link between nodes on a worker that is in no cluster")
        link = self._links[ident] = _Link(ident, None)
        link.last_in = link.last_out = self.io.now()
        self.node_links.opened(link, dialed)
        link.handshake = self.call_at(self.io.now() + HANDSHAKE_TIMEOUT,
                                      lambda: self._handshake_overdue(ident))

    def handshake_done(self, link: _Link) -> None:
        if link.handshake is not None:
            link.handshake.cancel()
            link.handshake = None

    def links(self) -> Iterable[_Link]:
        return self._links.values()

    def link(self, ident: int) -> _Link | None:
        return self._links.get(ident)

    def _handshake_overdue(self, ident: int) -> None:
        link = self._links.get(ident)
        if link is not None and not link.ready:
            self._fail_link(link, f"no HELLO within {HANDSHAKE_TIMEOUT:.0f} s")

    def data_received(self, ident: int, data: bytes) -> None:
        """Bytes from a link. A frame that breaks the protocol, or any failure while
        handling one, closes the link (logged): both sides resynchronise on a new one."""
        link = self._links.get(ident)
        if link is None:
            return
        self.counters["bytes_in"] += len(data)
        if link.remote is not None:
            link.last_in = self.io.now()
        try:
            for frame_type, body in link.reader.feed(data):
                if self._links.get(ident) is not link:
                    return  # closed by an earlier frame
                self.counters["frames_in"] += 1
                self._dispatch(link, frame_type, body)
        except LinkError as error:
            self._fail_link(link, f"protocol error: {error}")
        except Exception:  # a handler's bug: fail-stop, never a link with frames lost
            log.exception("link failed while handling a frame peer=%s: closing the link",
                          link.peer)
            self._fail_link(link, "handler failure", logged=True)

    def fail_link(self, link: _Link, why: str) -> None:
        self._fail_link(link, why)

    def close_link(self, link: _Link) -> None:
        """Close ``link`` (a newer one replaces it)."""
        self.link_closed(link.ident)
        self.io.close_link(link.ident)

    def _fail_link(self, link: _Link, why: str, logged: bool = False) -> None:
        self.counters["link_failures"] += 1
        if not logged:
            log.error("link failed peer=%s: %s: closing the link", link.peer, why)
        # a link between nodes refused in its handshake: our own LINK_AUTH, queued this turn,
        # still goes, so that the other end learns of the refusal from its own check too
        last = b"".join(link.control) if link.remote is not None and not link.ready else b""
        self.link_closed(link.ident)
        self.io.close_link(link.ident, last)

    def link_closed(self, ident: int) -> None:
        """The link is gone (either side closed it, or it broke)."""
        link = self._links.pop(ident, None)
        if link is None:
            return
        if link.handshake is not None:
            link.handshake.cancel()
        if link.remote is not None:
            if link.peer is not None and self.routable.get(link.peer) is link:
                del self.routable[link.peer]
            if self.node_links is not None:
                self.node_links.closed(link)  # (which may park it as the node's route)
            return
        peer = link.peer
        if peer is None or self.peers.get(peer) is not link:
            return  # never said HELLO, or a newer link to that peer is up
        del self.peers[peer]
        self.routable.pop(peer, None)
        if not self.closing:
            log.warning("link lost peer=%d", peer)
        self.routes.forget(peer)
        self.requests.link_down(ident)
        self._release_drained(peer)
        for listener in self.on_link_down:
            listener(peer)

    def link_paused(self, ident: int, paused: bool) -> None:
        """The link's socket buffer went above (or back below) its mark: data waits (or
        flows again)."""
        link = self._links.get(ident)
        if link is None:
            return
        link.paused = paused
        if not paused and link.data:
            self.wake()

    def data_to_send(self) -> dict[int, bytes]:
        """What to write, per link id (taken: the mesh forgets it): all control frames, and
        up to ``DATA_CHUNK`` bytes of data unless the socket is behind."""
        for hook in self.before_send:
            hook()
        self._wanted_write = False
        self._flush_routes()
        out = {}
        more = False
        for ident, link in self._links.items():
            parts = link.control
            if link.data and not link.paused:
                if link.data_bytes <= DATA_CHUNK:
                    taken, link.data, size = link.data, [], link.data_bytes
                else:
                    taken, size = self._take_chunk(link)
                    more = True
                link.data_bytes -= size
                parts = parts + taken if parts else taken
                if link.congested and link.data_bytes <= WRITE_LOW_WATER:
                    link.congested = False
                    if link.peer is not None and self.peers.get(link.peer) is link:
                        self._release_drained(link.peer)
            if parts:
                link.control = []
                data = b"".join(parts) if len(parts) > 1 else parts[0]
                out[ident] = data
                self.counters["bytes_out"] += len(data)
                if link.remote is not None:
                    link.last_out = self.io.now()
        if more:
            self.wake()  # the rest of the data next turn, after what else is ready
        return out

    @staticmethod
    def _take_chunk(link: _Link) -> tuple[list[bytes], int]:
        size = 0
        count = 0
        for frame in link.data:
            size += len(frame)
            count += 1
            if size >= DATA_CHUNK:
                break
        taken = link.data[:count]
        del link.data[:count]
        return taken, size

    def close(self) -> None:
        """Stop: every link is closed by the I/O layer; nothing is announced any more."""
        self.closing = True

    def _dispatch(self, link: _Link, frame_type: int, body: bytes) -> None:
        if link.remote is not None:
            assert self.node_links is not None
            return self.node_links.dispatch(link, frame_type, body)
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
            self.requests.answer(link.ident, frame.request_id, frame)
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
        link.reader.max_frame = MAX_FRAME
        if link.handshake is not None:
            link.handshake.cancel()
            link.handshake = None
        old = self.peers.get(peer)
        if old is not None and old is not link:  # a newer link replaces the old one
            self.link_closed(old.ident)
            self.io.close_link(old.ident)
        self.peers[peer] = link
        self.routable[peer] = link
        routes = self.routes.announce_all()
        if routes:
            self._queue(link, Routes(routes).encode())
        log.info("linked peer=%d", peer)
        for listener in self.on_link_up:
            listener(peer, hello)

    def queue(self, link: _Link, frame: bytes) -> None:
        """Queue ``frame`` on ``link`` in its lane."""
        self._queue(link, frame)

    def _queue(self, link: _Link, frame: bytes) -> None:
        lane = LANES[frame[_TYPE_BYTE]]
        if lane is Lane.ORDERED:
            hook = self.before_ordered
            if hook is not None and link.peer is not None:
                hook(link.peer)  # (what it queues comes first)
            lane = Lane.DATA if link.data else Lane.CONTROL
        if lane is Lane.DATA:
            self._queue_data(link, frame)
        else:
            link.control.append(frame)
            self.counters["frames_out"] += 1
        if not self._wanted_write:
            self._wanted_write = True
            self.io.wake()

    def _queue_data(self, link: _Link, frame: bytes) -> None:
        resend = link.resend
        if resend is not None and frame[_TYPE_BYTE] in RESENT:
            resend.append(frame)  # (until the other node acknowledges it: cluster/resend.py)
        if link.parked:
            return  # the link is gone: the frame waits in ``resend`` for the next one
        link.data.append(frame)
        link.data_bytes += len(frame)
        self.counters["frames_out"] += 1
        if not link.congested and link.data_bytes >= WRITE_HIGH_WATER:
            link.congested = True
            self.counters["congested"] += 1

    def send(self, peer: int, frame: bytes, link: int | None = None) -> bool:
        """Queue ``frame`` for ``peer`` in its lane (``LANES``); False if it is not linked,
        or (``link`` given: an answer) if the link the request came on is gone."""
        current = self.peers.get(peer) or self.remote.get(peer)
        if current is None or (link is not None and current.ident != link):
            return False
        self._queue(current, frame)
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
        link = self.routable.get(peer)
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

    def release_drained(self, peer: int) -> None:
        self._release_drained(peer)

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
                    link.control.append(frame)
                    self.counters["frames_out"] += 1
        if self.node_links is not None and not self.closing:
            self.node_links.flush_routes()

    def _on_routes(self, peer: int, frame: Routes) -> None:
        self.routes.apply(peer, frame.changes)

    # ------------------------------------------------------------------ routing

    def route(self, message: Message, local_groups: Collection[RouteKey], now: float
              ) -> tuple[list[RouteKey], int]:
        """After the local plain deliveries (core interface ``Peers``): forward ``message``
        once to each peer that has a match; return the shared groups to serve here and the
        number of peers forwarded to."""
        here, targets = self.routes.targets(message.topic, local_groups, self.routable,
                                            self.parked)
        if self.local_for is not None:  # that peer delivers it itself (partitions.py)
            self.local_groups = targets.pop(self.local_for, None)
        if not targets:
            return here, 0
        body = node_body = place = None
        before = self.before_ordered
        for peer, groups in targets.items():
            link = self.routable[peer]
            if before is not None:
                before(peer)  # answers to appends routed earlier keep their place
            if link.remote is None:
                if body is None:
                    body = self.encode(message, now)
                self._forward(link, forward_frame(groups, body))
                continue
            if node_body is None:
                node_body = self.encode_for_node(message, now)
                place = message.position if self.places_for_nodes else None
            self._forward(link, forward_at_frame(place, groups, node_body))
        self.counters["forwarded"] += len(targets)
        return here, len(targets)

    def forward_to_node(self, peer: int, message: Message, now: float) -> bool:
        """Forward a record again to one node only (its routes decide; cluster/catchup.py);
        False if that node has no match for it or is not linked."""
        link = self.routable.get(peer)
        if link is None or link.remote is None:
            return False
        _here, targets = self.routes.targets(message.topic, (), {peer: link}, self.parked)
        groups = targets.get(peer)
        if groups is None:
            return False
        self._forward(link, forward_at_frame(message.position, groups,
                                             self.encode_for_node(message, now)))
        return True

    def forward_to(self, link: _Link, frame: bytes) -> None:
        self._forward(link, frame)

    def _forward(self, link: _Link, frame: bytes) -> None:
        self._queue_data(link, frame)
        if not self._wanted_write:
            self._wanted_write = True
            self.io.wake()
        if link.congested and self.on_congested is not None and link.peer is not None:
            self.on_congested(link.peer)

    def group_elsewhere(self, key: RouteKey, message: Message, now: float) -> int:
        """A shared message with no member left here (its session ended, or the group
        emptied before the FORWARD that chose us for it arrived): a peer with members takes
        it, marked relayed (the peer that sent it here only if no other has members). A
        message relayed once already is not relayed again (routes that disagree must not
        bounce it between routers): it is dropped, counted and logged."""
        sender, relayed = self.forwarding
        if relayed:
            self.counters["shared_dropped"] += 1
            log.warning("shared message dropped: group %r has no member here and was relayed "
                        "once already topic=%r", key[0], message.topic)
            return 0
        peer = self.routes.group_peer(key, [p for p in self.peers if p != sender])
        if peer is None and sender is not None and sender in self.peers:
            peer = self.routes.group_peer(key, [sender])
        if peer is None:
            return 0
        self._forward(self.peers[peer], forward_frame([key], self.encode(message, now),
                                                      relayed=True))
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
        deadline = self.io.now() + timeout
        request_id = self.requests.start(link.ident, answer, deadline)
        self._queue(link, frame(request_id))
        self._arm(deadline)
        return True

    def ask_all(self, frame: Callable[[int], bytes],
                on_answer: Callable[[int, Any, bool], None], done: Callable[[], None],
                what: str, peers: Iterable[int] | None = None) -> None:
        """``frame(request_id)`` to every linked peer (or those of ``peers`` that are
        linked); ``done()`` once all answered or after ``ANSWER_TIMEOUT``: a stopped or stuck
        peer must not hold the caller back. ``on_answer(peer, frame or None, late)``."""
        self._flush_routes()
        links = self.peers if peers is None else {
            p: link for p in peers if (link := self.peers.get(p) or self.remote.get(p))}
        chosen = [(p, link.ident) for p, link in links.items()]

        def finished(missing: list[int]) -> None:
            if missing:
                log.warning("%s unanswered after %.0f s, going on without workers %s", what,
                            ANSWER_TIMEOUT, missing)
            done()

        deadline = self.io.now() + ANSWER_TIMEOUT
        self.requests.ask_all(chosen, lambda peer, request_id: self._queue(
            links[peer], frame(request_id)), on_answer, finished, deadline)
        self._arm(deadline)

    def barrier(self, done: Callable[[], None]) -> None:
        """``done()`` once every linked peer has applied our route changes so far (core
        interface ``Peers``): a SUBACK after it means a publish on any worker reaches the new
        subscription. Each peer answers with the high watermarks of the partitions it leads,
        for ``on_highs``."""
        def on_answer(peer: int, frame: BarrierDone | None, late: bool) -> None:
            if frame is not None and frame.highs and self.on_highs is not None:
                self.on_highs(peer, frame.highs)

        accepted = self.node_links.accepted_peers() if self.node_links is not None else []
        if not accepted and self.node_links is None:
            self.ask_all(lambda request_id: Barrier(request_id).encode(), on_answer, done,
                         "route barrier")
            return
        def within_node(one_done: Callable[[], None]) -> None:
            # the node's workers, each after the other nodes it routes for applied its routes
            self.ask_all(lambda request_id: Barrier(request_id, nodes=True).encode(),
                         on_answer, one_done, "route barrier")

        def across_nodes(one_done: Callable[[], None]) -> None:
            # the other nodes' workers that route to this node through this one
            self.ask_all(lambda request_id: Barrier(request_id).encode(),
                         lambda peer, frame, late: None, one_done,
                         "route barrier across nodes", peers=accepted)

        after_both(done, within_node, across_nodes)()

    def _on_barrier(self, peer: int, frame: Barrier) -> None:
        self.answer_barrier(peer, frame)

    def answer_barrier(self, peer: int, frame: Barrier) -> None:
        """Answer a BARRIER from ``peer``: at once, or (``frame.nodes``) once the workers of
        other nodes that dialed this one have applied this node's routes."""
        link = self.incarnation(peer) if peer in self.peers else None

        def answer() -> None:
            # BARRIER_DONE is ordered: the answers queued for ``peer`` go before it, so its
            # high watermarks never pass an offset the peer has not been told is its own
            self.send(peer, BarrierDone(frame.request_id, self.highs()).encode(), link)

        accepted = self.node_links.accepted_peers() if (
            frame.nodes and self.node_links is not None) else []
        if not accepted:
            return answer()
        self.ask_all(lambda request_id: Barrier(request_id).encode(),
                     lambda p, f, late: None, answer, "route barrier across nodes",
                     peers=accepted)
