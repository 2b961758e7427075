"""The mesh protocol in one process: three routers, their frames passed by hand, time injected.

Each ``Node`` is a real ``Router`` with real ``Session``s, joined to a real ``Mesh``
(cluster/mesh.py) the way a worker's is (``cluster.workers.join_router``); only the sockets are
replaced by ``Wire``, which carries each mesh's queued bytes to the other end when the test says
so (``Net.pump``), and the clock is a number the test moves. So route changes, forwarding,
shared groups, requests, timeouts and dropped links are exercised without processes or sleeps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from meshmq.broker.message import Message
from meshmq.broker.router import Router
from meshmq.broker.session import Session, Subscription
from meshmq.broker.wire import decode_message, encode_message
from meshmq.cluster.codec import Barrier
from meshmq.cluster.mesh import ANSWER_TIMEOUT, Mesh
from meshmq.cluster.spec import WorkerSpec
from meshmq.cluster.workers import join_router
from meshmq.config import SessionConfig
from meshmq.mqtt.packets import SubscriptionOptions


class Clock:
    def __init__(self) -> None:
        self.time = 100.0
        self.due: list[float] = []


@dataclass
class Wire:
    """The I/O of one mesh: bytes go nowhere until ``Net.pump`` carries them."""

    clock: Clock
    woken: int = 0
    closed: list[int] = field(default_factory=list)

    def now(self) -> float:
        return self.clock.time

    def wake(self) -> None:
        self.woken += 1

    def schedule(self, when: float) -> None:
        self.clock.due.append(when)

    def close_link(self, link: int, last: bytes = b"") -> None:
        self.closed.append(link)


class Collector:
    """A connected client as a session sees it: everything delivered is kept."""

    def __init__(self) -> None:
        self.got: list[tuple[str, bytes]] = []
        self.conn = self
        self.version = 5
        self.client_receive_maximum = 65535
        self.outgoing_alias_maximum = 0
        self.congested = False

    def send_frame(self, frame: bytes) -> bool:
        self.got.append(("frame", frame))
        return True

    def wake(self) -> None:
        pass


class Node:
    def __init__(self, index: int, count: int, clock: Clock) -> None:
        self.index = index
        self.wire = Wire(clock)
        self.sessions: dict[str, Session] = {}
        self.router = Router(self.sessions)
        self.mesh = Mesh(WorkerSpec(index, count, "token"), self.wire,  # type: ignore[arg-type]
                         lambda message, now: encode_message(message, now), lambda: {})
        join_router(self.mesh, self.router, lambda body, now: decode_message(body, now),
                    lambda position: None)
        self.deliveries: dict[str, list[bytes]] = {}

    def subscribe(self, client_id: str, topic_filter: str) -> None:
        session = self.sessions.get(client_id)
        if session is None:
            session = self.sessions[client_id] = _CapturingSession(client_id, self)
        self.router.subscribe(session, topic_filter, Subscription(SubscriptionOptions(qos=1)))

    def unsubscribe(self, client_id: str, topic_filter: str) -> None:
        self.router.unsubscribe(self.sessions[client_id], topic_filter)

    def publish(self, topic: str, payload: bytes) -> int:
        return self.router.publish(Message(topic, payload, 1), self.wire.clock.time)


class _CapturingSession(Session):
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
    """Three (or N) nodes, fully linked: link ``(a, b)`` is a pair of link ids."""

    def __init__(self, count: int = 3) -> None:
        self.clock = Clock()
        self.nodes = [Node(i, count, self.clock) for i in range(count)]
        self.links: dict[tuple[int, int], int] = {}  # (node, peer) -> link id at node
        self.cut: set[frozenset[int]] = set()
        self.stopped: set[int] = set()
        ident = 1
        for a in range(count):
            for b in range(a + 1, count):
                self.links[(a, b)] = ident
                self.links[(b, a)] = ident + 1
                self.nodes[a].mesh.link_opened(ident, b)
                self.nodes[b].mesh.link_opened(ident + 1, None)
                ident += 2
        self.pump()

    def peer_of(self, node: int, ident: int) -> int:
        return next(b for (a, b), i in self.links.items() if a == node and i == ident)

    def pump(self) -> None:
        """Carry bytes until nothing moves (a stopped node reads nothing)."""
        moved = True
        while moved:
            moved = False
            for node in self.nodes:
                for ident, data in node.mesh.data_to_send().items():
                    peer = self.peer_of(node.index, ident)
                    if peer in self.stopped or frozenset((node.index, peer)) in self.cut:
                        continue
                    self.nodes[peer].mesh.data_received(self.links[(peer, node.index)], data)
                    moved = True

    def drop_link(self, a: int, b: int) -> None:
        self.cut.add(frozenset((a, b)))
        self.nodes[a].mesh.link_closed(self.links[(a, b)])
        self.nodes[b].mesh.link_closed(self.links[(b, a)])

    def advance(self, seconds: float) -> None:
        self.clock.time += seconds
        for node in self.nodes:
            node.mesh.expire(self.clock.time)
        self.pump()


def test_every_node_links_to_every_other() -> None:
    net = Net(3)
    for node in net.nodes:
        assert sorted(node.mesh.peers) == sorted({0, 1, 2} - {node.index})


def test_route_changes_reach_every_peer_and_a_publish_crosses_once() -> None:
    net = Net(3)
    b, c = net.nodes[1], net.nodes[2]
    b.subscribe("s1", "a/+")
    c.subscribe("s2", "a/#")
    c.subscribe("s3", "a/b")  # two subscribers on c: still one FORWARD to c
    net.pump()
    forwarded = net.nodes[0].mesh.counters["forwarded"]
    assert net.nodes[0].publish("a/b", b"one") == 2  # two peers, no local subscriber
    assert net.nodes[0].mesh.counters["forwarded"] == forwarded + 2
    net.pump()
    assert b.deliveries == {"s1": [b"one"]}
    assert c.deliveries == {"s2": [b"one"], "s3": [b"one"]}
    c.unsubscribe("s2", "a/#")
    c.unsubscribe("s3", "a/b")
    net.pump()
    assert net.nodes[0].publish("a/b", b"two") == 1  # c withdrew its last route on a/b
    net.pump()
    assert b.deliveries["s1"] == [b"one", b"two"]
    assert c.deliveries == {"s2": [b"one"], "s3": [b"one"]}


def test_a_route_added_after_a_publish_on_its_topic_gets_the_next_one() -> None:
    """The peers of a topic are remembered per topic: a new route must still be heard."""
    net = Net(3)
    net.nodes[1].subscribe("s1", "t/1")
    net.pump()
    assert net.nodes[0].publish("t/1", b"one") == 1
    net.nodes[2].subscribe("s2", "t/+")
    net.pump()
    assert net.nodes[0].publish("t/1", b"two") == 2
    net.pump()
    assert net.nodes[1].deliveries == {"s1": [b"one", b"two"]}
    assert net.nodes[2].deliveries == {"s2": [b"two"]}


def test_a_forwarded_message_is_never_forwarded_again() -> None:
    net = Net(3)
    for node in net.nodes:
        node.subscribe(f"s{node.index}", "x")
    net.pump()
    net.nodes[0].publish("x", b"m")
    net.pump()
    assert [node.deliveries for node in net.nodes] == [
        {"s0": [b"m"]}, {"s1": [b"m"]}, {"s2": [b"m"]}]
    assert net.nodes[1].mesh.counters["forwarded"] == 0
    assert net.nodes[2].mesh.counters["forwarded"] == 0


def test_a_shared_group_gets_each_message_once_wherever_its_members_are() -> None:
    net = Net(3)
    net.nodes[0].subscribe("m0", "$share/g/jobs/#")
    net.nodes[2].subscribe("m2", "$share/g/jobs/#")
    net.nodes[2].subscribe("m2b", "$share/g/jobs/#")
    net.pump()
    for n in range(12):
        net.nodes[1].publish("jobs/run", f"{n}".encode())
        net.pump()
    got = [p for node in net.nodes for ps in node.deliveries.values() for p in ps]
    assert sorted(got) == sorted(f"{n}".encode() for n in range(12))  # once each
    assert len(net.nodes[0].deliveries["m0"]) == 6  # round robin over the two workers
    on_two = net.nodes[2].deliveries
    assert len(on_two["m2"]) + len(on_two["m2b"]) == 6


def test_a_barrier_completes_once_every_peer_applied_our_routes() -> None:
    net = Net(3)
    done: list[bool] = []
    net.nodes[0].subscribe("s", "late/route")
    net.nodes[0].mesh.barrier(lambda: done.append(True))
    assert not done
    net.pump()
    assert done == [True]
    assert net.nodes[2].mesh.routes.plain_peers("late/route") == {0}


def test_a_request_to_a_stopped_peer_times_out_and_the_others_go_on() -> None:
    net = Net(3)
    net.stopped.add(2)
    done: list[float] = []
    answers: dict[int, object] = {}
    net.nodes[0].mesh.ask_all(lambda request_id: Barrier(request_id).encode(),
                              lambda peer, frame, late: answers.setdefault(peer, frame),
                              lambda: done.append(net.clock.time), "test")
    net.pump()
    assert not done and answers.keys() == {1}  # peer 1 answered, peer 2 is stopped
    net.advance(ANSWER_TIMEOUT - 0.1)
    assert not done
    net.advance(0.2)
    assert done == [net.clock.time]  # went on without peer 2
    single: list[object] = []
    assert net.nodes[0].mesh.request(2, lambda request_id: Barrier(request_id).encode(),
                                     single.append, timeout=1.0)
    net.advance(1.1)
    assert single == [None]  # the request failed at its deadline


def test_a_dropped_link_takes_the_peers_routes_and_fails_its_requests() -> None:
    net = Net(3)
    net.nodes[1].subscribe("s", "t")
    net.pump()
    answers: list[object] = []
    net.nodes[0].mesh.request(1, lambda request_id: Barrier(request_id).encode(),
                              answers.append)
    down: list[int] = []
    net.nodes[0].mesh.on_link_down.append(down.append)
    net.drop_link(0, 1)
    assert answers == [None] and down == [1]
    assert net.nodes[0].publish("t", b"lost") == 0  # no route to 1 any more
    assert net.nodes[0].mesh.routes.plain_peers("t") == set()


def test_garbage_on_a_link_closes_it() -> None:
    net = Net(2)
    mesh = net.nodes[0].mesh
    ident = net.links[(0, 1)]
    mesh.data_received(ident, b"\x00\x00\x00\x05\xfe....")  # unknown frame type
    assert ident in net.nodes[0].wire.closed
    assert 1 not in mesh.peers


def test_a_hello_with_the_wrong_token_is_refused() -> None:
    clock = Clock()
    wire = Wire(clock)
    mesh = Mesh(WorkerSpec(0, 2, "token"), wire, lambda m, now: b"", lambda: {})  # type: ignore[arg-type]
    other = Mesh(WorkerSpec(1, 2, "other"), Wire(clock), lambda m, now: b"", lambda: {})  # type: ignore[arg-type]
    mesh.link_opened(1, None)
    other.link_opened(2, 0)
    mesh.data_received(1, other.data_to_send()[2])
    assert wire.closed == [1] and not mesh.peers


Check = Callable[[], bool]
