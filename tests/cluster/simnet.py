"""A simulated network of workers in one process: real meshes, routers, directories and
partitioned logs; sockets, the clock and the disk replaced by doubles that behave like the
real ones.

* ``Wire`` is a mesh's I/O (``MeshIO``) with **one timer**, as ``cluster/sockets.py`` has:
  ``schedule(when)`` sets it, replacing the time set before, and it fires only once the clock
  reaches it (``Net.advance``). A deadline the mesh forgets to set again is never reached here
  either, as in the real layer.
* ``Net`` carries each mesh's queued bytes to the other end of its link when the test pumps;
  a link can be cut (both ends see it close), a node stopped (bytes wait for it, its timers
  do not fire, as with SIGSTOP) and resumed, and nodes relinked with new link ids (a new
  incarnation, as after a restart).
* ``FakeLog`` stands in for a leader's ``Persistence``: appends wait until the test makes
  them durable (``complete``), then ``done(Stored(...))`` runs, as the writer thread's
  completion does; records are kept per partition, with their message ids.
* ``Host`` is the ``SessionHost`` a directory serves, with real ``Session``s and the real
  hand-over codec (broker/snapshot.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshmq.broker.interfaces import AppendOutcome, Completion, Stored, StoredElsewhere
from meshmq.broker.message import Message
from meshmq.broker.router import Router
from meshmq.broker.session import Session, Subscription
from meshmq.broker.snapshot import SessionSnapshot
from meshmq.broker.wire import decode_message, encode_message
from meshmq.cluster.directory import Directory
from meshmq.cluster.leaders import Leadership
from meshmq.cluster.mesh import Mesh
from meshmq.cluster.spec import WorkerSpec
from meshmq.cluster.workers import join_router
from meshmq.config import LogSettings, SessionConfig
from meshmq.log.commit_log import CommitLog
from meshmq.log.config import LogConfig
from meshmq.mqtt.packets import SubscriptionOptions


class Clock:
    def __init__(self) -> None:
        self.time = 100.0


@dataclass
class Wire:
    """One mesh's I/O: bytes go nowhere until ``Net.pump``; one timer."""

    clock: Clock
    timer: float | None = None
    woken: int = 0
    closed: list[int] = field(default_factory=list)
    last: dict[int, bytes] = field(default_factory=dict)  # written before the close

    def now(self) -> float:
        return self.clock.time

    def wake(self) -> None:
        self.woken += 1

    def schedule(self, when: float) -> None:
        self.timer = when

    def close_link(self, link: int, last: bytes = b"") -> None:
        if last:
            self.last[link] = last
        self.closed.append(link)


class Loop:
    """What a partitioned log asks of its event loop: the time and later callbacks."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.soon: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def time(self) -> float:
        return self.clock.time

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        self.soon.append((callback, args))

    def run_soon(self) -> bool:
        ran = bool(self.soon)
        while self.soon:
            callback, args = self.soon.pop(0)
            callback(*args)
        return ran


@dataclass
class Record:
    message: Message
    client_id: str
    message_id: bytes | None


class FakeLog:
    """A leader's local log (``Persistence``): durable when the test says."""

    def __init__(self, settings: LogSettings, data_dir: str, loop: Loop,
                 owned: list[int] | None = None, high_watermark: list[int] | None = None
                 ) -> None:
        self.owned = tuple(owned or ())
        self.partitions: dict[int, list[Record]] = {p: [] for p in self.owned}
        self.waiting: list[tuple[int, Record, Completion]] = []
        self.high_watermark = high_watermark
        self.partitioner = None

    def append(self, message: Message, client_id: str, done: Completion,
               message_id: bytes | None = None) -> bool:
        self.waiting.append((-1, Record(message, client_id, message_id), done))
        return True

    def append_many(self, publishes: list[tuple[Any, ...]]) -> int:
        for message, client_id, done, *rest in publishes:
            self.append(message, client_id, done, rest[0] if rest else None)
        return len(publishes)

    def complete(self, partition_for: Callable[[str], int]) -> int:
        """Make every waiting append durable, in order; how many."""
        waiting, self.waiting = self.waiting, []
        for _, record, done in waiting:
            partition = partition_for(record.message.topic)
            records = self.partitions.setdefault(partition, [])
            records.append(record)
            done(Stored(partition, len(records) - 1))
        return len(waiting)

    def read(self, partition: int, offset: int, max_records: int) -> list[Any]:
        return []

    def earliest_offset(self, partition: int) -> int:
        return 0

    def offset_for_timestamp(self, partition: int, timestamp_ms: int) -> int | None:
        return None

    def close(self) -> None:
        pass


class Host:
    """The broker side a directory serves (``SessionHost``), with real sessions."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.sessions = node.sessions
        self.superseded: list[str] = []

    def _now(self) -> float:
        return self.node.clock.time

    def release_session(self, client_id: str, clean_start: bool) -> Session | None:
        session = self.sessions.pop(client_id, None)
        if session is not None and clean_start:
            self.node.router.drop_session(session, self._now())
            return None
        return session

    def export_session(self, session: Session) -> bytes:
        return SessionSnapshot.of(session, live=True).encode(self._now())

    def _install(self, snapshot: SessionSnapshot) -> Session:
        session = self.sessions[snapshot.client_id] = Session(snapshot.client_id,
                                                               SessionConfig())
        for topic_filter, subscription in snapshot.subscriptions.items():
            self.node.router.subscribe(session, topic_filter, subscription)
        if snapshot.live is not None:
            session.restore_live(snapshot.live)
        return session

    def adopt_sessions(self, blobs: list[bytes]) -> list[Session]:
        adopted = []
        for blob in blobs:
            snapshot = SessionSnapshot.decode(blob, self._now())
            existing = self.sessions.pop(snapshot.client_id, None)
            if existing is not None:
                self.node.router.drop_session(existing, self._now())
            adopted.append(self._install(snapshot))
        return adopted

    def take_back_session(self, blob: bytes) -> bool:
        snapshot = SessionSnapshot.decode(blob, self._now())
        if snapshot.client_id in self.sessions:
            return False
        self._install(snapshot)
        return True

    def drop_session(self, session: Session) -> None:
        self.node.router.drop_session(session, self._now())

    def supersede(self, client_id: str) -> None:
        self.superseded.append(client_id)

    def forwarded_in(self) -> bool:
        return self.node.router.forwarded_in

    def encode_message(self, message: Message) -> bytes:
        return encode_message(message, self._now())

    def decode_message(self, body: bytes) -> Message:
        return decode_message(body, self._now())


class Node:
    """One worker: a router with real sessions joined to a mesh; with ``directory`` a
    session directory, with ``log_dir`` a partitioned log over a ``FakeLog``."""

    def __init__(self, index: int, count: int, clock: Clock, *, directory: bool = False,
                 log_dir: Path | None = None, partitions: int = 8) -> None:
        self.index = index
        self.clock = clock
        self.wire = Wire(clock)
        self.loop = Loop(clock)
        self.sessions: dict[str, Session] = {}
        self.router = Router(self.sessions)
        self.spec = WorkerSpec(index, count, "token")
        self.leadership = Leadership(self.spec, partitions, None)
        self.mesh = Mesh(self.spec, self.wire, encode_message, self._highs)  # type: ignore[arg-type]
        join_router(self.mesh, self.router, decode_message, self._position)
        self.deliveries: dict[str, list[bytes]] = {}
        self.deferred: list[Callable[[], None]] = []
        self.host = Host(self)
        self.directory: Directory | None = None
        if directory:
            self.directory = Directory(self.host, self.leadership, self.mesh,  # type: ignore[arg-type]
                                       self.deferred.append)
        self.log: Any = None
        if log_dir is not None:
            self._open_log(log_dir, partitions)

    def _open_log(self, log_dir: Path, partitions: int) -> None:
        import meshmq.cluster.partitions as module

        log_dir.mkdir(parents=True, exist_ok=True)
        CommitLog(log_dir, LogConfig(partitions=partitions)).close()  # what a reader finds
        real = module.Persistence
        module.Persistence = FakeLog  # type: ignore[misc,assignment]
        try:
            self.log = module.PartitionedLog(
                LogSettings(partitions=partitions), str(log_dir), self.loop,  # type: ignore[arg-type]
                self.leadership, self.mesh, lambda m: encode_message(m, self.clock.time),
                decode_message)
        finally:
            module.Persistence = real  # type: ignore[misc]
        self.log.route_stored = self._route_stored

    def _highs(self) -> dict[int, int]:
        return self.log.leader_highs() if self.log is not None else {}

    def _position(self, position: tuple[int, int]) -> None:
        if self.log is not None:
            self.log.routed(*position)

    def _route_stored(self, message: Message, outcome: Stored,
                      done: Callable[[int], None]) -> None:
        """As ``Publishes.route_stored``: positioned, routed here and to the peers."""
        message.set_position(outcome.partition, outcome.offset)
        self.log.routed(outcome.partition, outcome.offset)
        done(self.router.publish(message, self.clock.time))

    # ------------------------------------------------------------------ clients

    def subscribe(self, client_id: str, topic_filter: str) -> None:
        session = self.sessions.get(client_id)
        if session is None:
            session = self.sessions[client_id] = CapturingSession(client_id, self)
        self.router.subscribe(session, topic_filter, Subscription(SubscriptionOptions(qos=1)))

    def unsubscribe(self, client_id: str, topic_filter: str) -> None:
        self.router.unsubscribe(self.sessions[client_id], topic_filter)

    def publish(self, topic: str, payload: bytes) -> int:
        """A QoS 1 publish routed as a non-persisted one is."""
        return self.router.publish(Message(topic, payload, 1), self.clock.time)

    def append(self, topic: str, payload: bytes, outcomes: list[AppendOutcome],
               message_id: bytes | None = None) -> Message:
        """A persisted publish, as ``Publishes._persist`` makes it: into the log; on
        ``StoredElsewhere`` with ``local``, delivered to the subscribers here."""
        message = Message(topic, payload, 1, False, None, "publisher", self.clock.time)

        def done(outcome: AppendOutcome) -> None:
            outcomes.append(outcome)
            if isinstance(outcome, StoredElsewhere) and outcome.local is not None:
                message.set_position(outcome.partition, outcome.offset)
                self.router.deliver_forwarded(message, outcome.local, self.clock.time)
            elif isinstance(outcome, Stored):
                self._route_stored(message, outcome, lambda receivers: None)

        if message_id is None:
            assert self.log.append(message, "publisher", done)
        else:
            assert self.log.append(message, "publisher", done, message_id)
        return message

    def durable(self) -> int:
        """This leader's waiting appends become durable."""
        return int(self.log.local.complete(self.leadership.partition_for))

    def run_soon(self) -> bool:
        ran = self.loop.run_soon()
        while self.deferred:
            self.deferred.pop(0)()
            ran = True
        return ran


class CapturingSession(Session):
    """A session that records what is delivered to it (payloads, in order)."""

    __slots__ = ("node",)

    def __init__(self, client_id: str, node: Node) -> None:
        super().__init__(client_id, SessionConfig())
        self.node = node

    def deliver(self, message: Message, qos: int, retain: bool,
                subscription_ids: list[int] | None, now: float,
                group: tuple[str, str] | None = None) -> None:
        self.node.deliveries.setdefault(self.client_id, []).append(message.payload)


class Net:
    """N nodes, fully linked; link ``(a, b)`` is the id of a's end of its link to b."""

    def __init__(self, count: int = 3, **node_options: Any) -> None:
        self.clock = Clock()
        self.nodes = [Node(i, count, self.clock, **node_options) for i in range(count)]
        self.links: dict[tuple[int, int], int] = {}  # (node, peer) -> link id at node
        self.ends: dict[tuple[int, int], tuple[int, int]] = {}  # (node, id) -> (peer, its id)
        self.stopped: set[int] = set()
        self.held: dict[int, list[tuple[int, bytes]]] = {}  # bytes waiting for a stopped node
        self._ids = itertools.count(1)
        for a in range(count):
            for b in range(a + 1, count):
                self.link(a, b, pump=False)
        self.pump()

    def link(self, a: int, b: int, pump: bool = True) -> None:
        """A new link between a and b (a dials b): new ids on both ends."""
        ident_a, ident_b = self._wire(a, b)
        self.nodes[a].mesh.link_opened(ident_a, b)
        self.nodes[b].mesh.link_opened(ident_b, None)
        if pump:
            self.pump()

    def _wire(self, a: int, b: int) -> tuple[int, int]:
        ident_a, ident_b = next(self._ids), next(self._ids)
        self.links[(a, b)] = ident_a
        self.links[(b, a)] = ident_b
        self.ends[(a, ident_a)] = (b, ident_b)
        self.ends[(b, ident_b)] = (a, ident_a)
        return ident_a, ident_b

    def pump(self) -> None:
        """Carry bytes and run later callbacks until nothing moves; a link one end closed
        closes at the other end too, as a socket does."""
        moved = True
        while moved:
            moved = self._propagate_closes()
            for node in self.nodes:
                if node.index in self.stopped:
                    continue
                moved = node.run_soon() or moved
                for ident, data in node.mesh.data_to_send().items():
                    end = self.ends.get((node.index, ident))
                    if end is None:
                        continue  # a link that was cut
                    peer, target = end
                    if peer in self.stopped:
                        self.held.setdefault(peer, []).append((target, data))
                        continue
                    self.nodes[peer].mesh.data_received(target, data)
                    moved = True

    def _propagate_closes(self) -> bool:
        closed = False
        for node in self.nodes:
            for ident in node.wire.closed:
                if (node.index, ident) in self.ends:
                    last = node.wire.last.pop(ident, b"")
                    peer, target = self.ends[(node.index, ident)]
                    if last and peer not in self.stopped:  # as a socket's close flushes
                        self.nodes[peer].mesh.data_received(target, last)
                    if (node.index, ident) in self.ends:
                        self.cut_ends(node.index, ident)
                    closed = True
        return closed

    def cut(self, a: int, b: int) -> None:
        """The link between a and b breaks: both ends see it close."""
        ident_a = self.links.pop((a, b))
        self.links.pop((b, a))
        if (a, ident_a) in self.ends:  # (not closed by one end already)
            self.cut_ends(a, ident_a)

    def cut_ends(self, a: int, ident_a: int) -> None:
        """The link whose end at ``a`` is ``ident_a`` breaks: both ends see it close."""
        b, ident_b = self.ends.pop((a, ident_a))
        del self.ends[(b, ident_b)]
        self.nodes[a].mesh.link_closed(ident_a)
        self.nodes[b].mesh.link_closed(ident_b)

    def stop(self, index: int) -> None:
        self.stopped.add(index)

    def resume(self, index: int) -> None:
        self.stopped.discard(index)
        for ident, data in self.held.pop(index, []):
            self.nodes[index].mesh.data_received(ident, data)
        self.pump()

    def advance(self, seconds: float) -> None:
        """Move the clock, firing each node's timer when it is due, in time order."""
        target = self.clock.time + seconds
        while True:
            due = [(node.wire.timer, node.index) for node in self.nodes
                   if node.wire.timer is not None and node.wire.timer <= target
                   and node.index not in self.stopped]
            if not due:
                break
            when, index = min(due)
            self.clock.time = max(self.clock.time, when)
            node = self.nodes[index]
            node.wire.timer = None
            node.mesh.expire(self.clock.time)
            self.pump()
        self.clock.time = target
        self.pump()


class ClusterNet(Net):
    """Several nodes of several workers: each node's workers linked by the mesh, and each
    worker linked to every other node by a link it dials, which a worker of that node accepts
    (round robin here; the kernel's choice in real life). ``nodes``: node id -> workers."""

    def __init__(self, nodes: dict[str, int], secrets: dict[str, bytes] | None = None,
                 cluster_ids: dict[str, str] | None = None, **node_options: Any) -> None:
        from meshmq.cluster.nodelink import NodeIdentity
        from meshmq.cluster.nodes import NodeLinks

        self.clock = Clock()
        self.nodes = []
        self.node_of: dict[int, str] = {}  # sim index -> node id
        self.workers: dict[str, list[Node]] = {}
        self.identities: dict[str, NodeIdentity] = {}
        for node_id, count in nodes.items():
            secret = (secrets or {}).get(node_id, b"secret")
            identity = NodeIdentity.new(node_id, secret, (cluster_ids or {}).get(node_id, ""),
                                        f"{node_id}:7883")
            self.identities[node_id] = identity
            members = []
            for index in range(count):
                worker = Node(index, count, self.clock, **node_options)
                worker.index = len(self.nodes)  # the sim's own index, unique across nodes
                worker.links = NodeLinks(worker.mesh, NodeIdentity(
                    node_id, identity.incarnation, secret, identity.cluster_id,
                    identity.address))
                self.nodes.append(worker)
                self.node_of[worker.index] = node_id
                members.append(worker)
            self.workers[node_id] = members
        self.links = {}
        self.ends = {}
        self.stopped = set()
        self.held = {}
        self._ids = itertools.count(1)
        self._accepting: dict[str, int] = {}
        for members in self.workers.values():  # inside each node, as Net does
            for a in range(len(members)):
                for b in range(a + 1, len(members)):
                    self.link(members[a].index, members[b].index, pump=False, local=(a, b))
        for node_id in self.workers:
            for other in self.workers:
                if other != node_id:
                    for worker in self.workers[node_id]:
                        self.dial(worker.index, other, pump=False)
        self.pump()

    def link(self, a: int, b: int, pump: bool = True,
             local: tuple[int, int] | None = None) -> None:
        """A new local link between sim workers a and b (a dials b); ``local``: their
        indexes inside their node."""
        if local is None:
            local = (self.nodes[a].spec.index, self.nodes[b].spec.index)
        ident_a, ident_b = self._wire(a, b)
        self.nodes[a].mesh.link_opened(ident_a, local[1])
        self.nodes[b].mesh.link_opened(ident_b, None)
        if pump:
            self.pump()

    def dial(self, a: int, node_id: str, pump: bool = True) -> int:
        """Sim worker ``a`` dials node ``node_id``; one of its workers accepts (round robin).
        Returns the accepting worker's sim index."""
        members = self.workers[node_id]
        turn = self._accepting.get(node_id, 0)
        self._accepting[node_id] = turn + 1
        b = members[turn % len(members)].index
        ident_a, ident_b = next(self._ids), next(self._ids)
        self.ends[(a, ident_a)] = (b, ident_b)
        self.ends[(b, ident_b)] = (a, ident_a)
        self.nodes[a].mesh.remote_opened(ident_a, dialed=True)
        self.nodes[b].mesh.remote_opened(ident_b, dialed=False)
        if pump:
            self.pump()
        return b

    def of(self, node_id: str, index: int = 0) -> Node:
        return self.workers[node_id][index]
