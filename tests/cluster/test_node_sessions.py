"""Sessions moving between the nodes of a cluster (cluster/nodesessions.py), in the simulated
network (tests/cluster/simnet.py ``ClusterNet``): real meshes, routers, directories and
sessions, the real hand-over codec; time moved by the test.
"""

from __future__ import annotations

import time

import pytest
from simnet import ClusterNet, Node

import meshmq.cluster.nodesessions as nodesessions
from meshmq.broker.message import Message
from meshmq.broker.session import LiveState, Outbound, QueueEntry, Session, Subscription
from meshmq.broker.snapshot import SessionSnapshot
from meshmq.cluster.mesh import ANSWER_TIMEOUT
from meshmq.cluster.moving import SETTLE_TIMEOUT, MovedSession
from meshmq.cluster.nodes import Side
from meshmq.cluster.nodesessions import NodeSessions, export_for_node
from meshmq.config import SessionConfig
from meshmq.log.record import Record
from meshmq.mqtt.packets import SubscriptionOptions

CLIENT = "dev-1"


def cluster(nodes: dict[str, int]) -> ClusterNet:
    net = ClusterNet(nodes, directory=True)
    for worker in net.nodes:
        assert worker.directory is not None
        worker.across = NodeSessions(worker.directory, worker.links,  # type: ignore[attr-defined]
                                     lambda: net.clock.time)
        worker.directory.restored()
    net.pump()
    return net


def rich_session(worker: Node, client_id: str = CLIENT, queued: int = 1,
                 payload: bytes = b"queued") -> Session:
    """An offline session held by ``worker``: a subscription with options and an id, two
    inflight messages (one at PUBREL), queued messages, a QoS 2 packet id awaiting PUBREL."""
    session = worker.sessions[client_id] = Session(client_id, SessionConfig())
    session.expiry_interval = 300
    worker.router.subscribe(session, "t/#", Subscription(
        SubscriptionOptions(qos=2, no_local=True, retain_as_published=True), 9))
    sent = Outbound(Message("t/1", b"inflight-1", 1), 1, False, [9], None)
    released = Outbound(Message("t/2", b"inflight-2", 2), 2, False, [9], None)
    released.released = True
    queue = [QueueEntry(Message("t/3", payload if queued == 1 else payload + b"-%d" % n, 1),
                        1, False, [9], None, False) for n in range(queued)]
    session.restore_live(LiveState({7}, 40, 0, [(3, sent), (4, released)], queue, None))
    assert worker.directory is not None
    worker.directory.created(session)
    return session


def claim(worker: Node, clean_start: bool = False) -> list[list[Session]]:
    adopted: list[list[Session]] = []
    assert worker.directory is not None
    assert worker.directory.claim(CLIENT, clean_start, adopted.append)
    return adopted


def check_intact(session: Session, queued: list[bytes] | None = None) -> None:
    subscription = session.subscriptions["t/#"]
    assert subscription.subscription_id == 9
    assert (subscription.options.qos, subscription.options.no_local,
            subscription.options.retain_as_published) == (2, True, True)
    assert sorted(session.inflight) == [3, 4]
    assert session.inflight[3].message.payload == b"inflight-1"
    assert not session.inflight[3].released and session.inflight[4].released  # PUBREL state
    assert [e.message.payload for e in session.queue] == (queued or [b"queued"])
    assert session.qos2_in == {7}
    assert session.statistics()["queued"] == len(session.queue)


def acceptor_of(net: ClusterNet, worker: Node, node_id: str) -> Node:
    """The worker of ``node_id`` that accepted ``worker``'s dialed link to it."""
    for link in worker.mesh.remote.values():
        if link.remote.side is Side.DIALED and link.remote.hello.node_id == node_id:
            return net.nodes[net.ends[(worker.index, link.ident)][0]]
    raise AssertionError(f"no link to {node_id}")


def dialed_ident(worker: Node, node_id: str) -> int:
    for link in worker.mesh.remote.values():
        if link.remote.side is Side.DIALED and link.remote.hello.node_id == node_id:
            return link.ident
    raise AssertionError(f"no link to {node_id}")


def send_out(net: ClusterNet, worker: Node) -> None:
    """Run ``worker``'s callbacks and carry what it queued, once (the test then stops it)."""
    worker.run_soon()
    for ident, data in worker.mesh.data_to_send().items():
        peer, target = net.ends[(worker.index, ident)]
        net.nodes[peer].mesh.data_received(target, data)


def test_a_session_on_another_node_moves_with_its_queue_and_inflight_messages() -> None:
    net = cluster({"a": 1, "b": 1})
    holder, claimant = net.of("a"), net.of("b")
    rich_session(holder)
    net.pump()
    adopted = claim(claimant)
    net.pump()
    assert len(adopted) == 1 and [s.client_id for s in adopted[0]] == [CLIENT]
    session = claimant.sessions[CLIENT]
    assert session is adopted[0][0]
    check_intact(session)
    assert CLIENT not in holder.sessions  # settled: the stand-in and its routes are gone
    assert holder.across.counters["sessions_handed"] == 1  # type: ignore[attr-defined]
    holder.publish("t/after", b"new")  # routed to the session's new node, once
    net.pump()
    assert [e.message.payload for e in session.queue] == [b"queued", b"new"]


def test_a_session_on_another_worker_of_the_other_node_is_found_there() -> None:
    net = cluster({"a": 3, "b": 2})
    claimant = net.of("b", 1)
    acceptor = acceptor_of(net, claimant, "a")
    holder = next(w for w in net.workers["a"] if w is not acceptor)
    rich_session(holder)
    net.pump()
    adopted = claim(claimant)
    net.pump()
    assert [s.client_id for s in adopted[0]] == [CLIENT]
    check_intact(claimant.sessions[CLIENT])
    assert all(CLIENT not in w.sessions for w in net.workers["a"])
    assert all(w.directory is not None and CLIENT not in w.directory.holders
               for w in net.workers["a"])  # A's directory forgot it: B holds it
    net.of("a", 0).publish("t/x", b"after")
    net.pump()
    assert [e.message.payload for e in claimant.sessions[CLIENT].queue] == [b"queued",
                                                                            b"after"]


def test_a_session_whose_settle_never_comes_is_taken_back() -> None:
    net = cluster({"a": 1, "b": 1})
    holder, claimant = net.of("a"), net.of("b")
    rich_session(holder)
    net.pump()
    claim(claimant)
    send_out(net, claimant)  # the SESSION_FETCH leaves ...
    net.stop(claimant.index)  # ... and the claimant stalls: no settle
    net.pump()
    stub = holder.sessions[CLIENT]
    assert isinstance(stub, MovedSession)  # handed over, kept until settled
    holder.publish("t/meanwhile", b"meanwhile")  # the stand-in sends it on (it waits)
    net.pump()
    net.advance(SETTLE_TIMEOUT + 0.1)
    back = holder.sessions[CLIENT]
    assert not isinstance(back, MovedSession)
    check_intact(back)
    assert holder.across.counters["sessions_taken_back"] == 1  # type: ignore[attr-defined]
    assert holder.directory is not None and holder.directory.holders.get(CLIENT) == 0
    holder.publish("t/later", b"later")  # routed to it again
    net.pump()
    assert [e.message.payload for e in back.queue] == [b"queued", b"later"]


def test_a_link_drop_in_the_middle_of_a_hand_over_gives_the_session_back_at_once() -> None:
    net = cluster({"a": 1, "b": 1})
    holder, claimant = net.of("a"), net.of("b")
    rich_session(holder)
    net.pump()
    adopted = claim(claimant)
    send_out(net, claimant)  # the SESSION_FETCH leaves, and the claimant stalls
    net.stop(claimant.index)
    net.pump()
    assert isinstance(holder.sessions[CLIENT], MovedSession)
    net.cut_ends(claimant.index, dialed_ident(claimant, "a"))
    net.pump()
    back = holder.sessions[CLIENT]
    assert not isinstance(back, MovedSession)  # taken back when the link dropped
    check_intact(back)
    assert holder.across.counters["sessions_taken_back"] == 1  # type: ignore[attr-defined]
    net.resume(claimant.index)
    net.pump()
    assert adopted == [[]]  # the claimant went on without it: a new session
    assert CLIENT not in claimant.sessions


def test_clean_start_fetches_nothing() -> None:
    net = cluster({"a": 1, "b": 2})
    holder, claimant = net.of("a"), net.of("b", 1)
    rich_session(holder)
    net.pump()
    adopted = claim(claimant, clean_start=True)
    net.pump()
    assert adopted == [[]]
    assert not isinstance(holder.sessions[CLIENT], MovedSession)
    assert holder.across.counters["sessions_handed"] == 0  # type: ignore[attr-defined]
    assert claimant.across.counters["sessions_fetched"] == 0  # type: ignore[attr-defined]


def test_a_node_that_does_not_answer_is_passed_over_after_the_deadline() -> None:
    net = cluster({"a": 1, "b": 1, "c": 1})
    holder, claimant, silent = net.of("a"), net.of("b"), net.of("c")
    rich_session(holder)
    net.pump()
    net.stop(silent.index)
    adopted = claim(claimant)
    net.pump()
    assert not adopted  # waits for every node's answer ...
    net.advance(ANSWER_TIMEOUT - 0.5)
    assert not adopted
    net.advance(1.0)  # ... at most the deadline: then goes on with what came
    assert isinstance(claimant.sessions.get(CLIENT), Session)  # adopted, and now its
    assert not adopted  # its routes wait for the route barriers (each passes over c when
    net.advance(2 * ANSWER_TIMEOUT)  # its deadline comes: b's, then a's on the settle)
    assert [s.client_id for s in adopted[0]] == [CLIENT]
    check_intact(claimant.sessions[CLIENT])
    assert CLIENT not in holder.sessions


def test_a_session_a_node_hands_over_after_the_deadline_stays_there() -> None:
    net = cluster({"a": 1, "b": 1})
    holder, claimant = net.of("a"), net.of("b")
    rich_session(holder)
    net.pump()
    net.stop(holder.index)
    adopted = claim(claimant)
    net.pump()
    net.advance(ANSWER_TIMEOUT + 0.1)
    assert adopted == [[]]  # a new session on b
    net.resume(holder.index)  # a serves the fetch now: the answer is late, b leaves it
    net.advance(SETTLE_TIMEOUT + 0.1)
    back = holder.sessions[CLIENT]
    assert not isinstance(back, MovedSession)
    check_intact(back)


def test_a_message_routed_to_the_old_node_during_the_move_follows_the_session() -> None:
    net = cluster({"a": 2, "b": 1})
    claimant = net.of("b")
    holder = acceptor_of(net, claimant, "a")
    rich_session(holder)
    net.pump()
    adopted = claim(claimant)
    send_out(net, claimant)
    net.stop(claimant.index)
    net.pump()
    assert isinstance(holder.sessions[CLIENT], MovedSession)
    other = next(w for w in net.workers["a"] if w is not holder)
    other.publish("t/during", b"during")  # a's routes still point at the stand-in
    persisted = Message("t/log", b"persisted", 1)
    persisted.set_position(0, 5)  # in a's log: the cursor that would read it did not move
    holder.router.publish(persisted, net.clock.time)
    net.pump()
    net.resume(claimant.index)
    net.pump()
    session = adopted[0][0]
    assert claimant.directory is not None
    claimant.directory.settled(CLIENT, adopted[0])  # (the CONNECT path does: held ones)
    got = {e.message.payload: e.message for e in session.queue}
    assert sorted(got) == [b"during", b"persisted", b"queued"]
    assert got[b"persisted"].position is None  # a's position stayed on a
    assert CLIENT not in holder.sessions


def test_a_large_session_crosses_in_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodesessions, "PART_BYTES", 4096)
    net = cluster({"a": 1, "b": 1})
    holder, claimant = net.of("a"), net.of("b")
    payload = bytes(range(256)) * 4
    session = rich_session(holder, queued=300, payload=payload)
    assert len(export_for_node(session, net.clock.time)) > 50 * 4096  # many parts
    net.pump()
    adopted = claim(claimant)
    net.pump()
    moved = adopted[0][0]
    check_intact(moved, [payload + b"-%d" % n for n in range(300)])


class LogOf:
    """A ``LogReader`` over records of one partition (what the session's cursor reads)."""

    def __init__(self, records: list[Record]) -> None:
        self.records = records
        self.high_watermark = [len(records)]

    def read(self, partition: int, offset: int, max_records: int) -> list[Record]:
        return self.records[offset:offset + max_records]

    def earliest_offset(self, partition: int) -> int:
        return 0

    def routes_all(self, partition: int) -> bool:
        return True

    def views_known(self) -> bool:
        return True


def test_what_a_cursor_still_owes_crosses_as_queued_copies_without_positions() -> None:
    now_ms = int(time.time() * 1000)
    records = [Record(n, now_ms, "t/log" if n % 2 else "other", 1, False, b"", b"rec-%d" % n,
                      "pub", bytes(16)) for n in range(8)]
    session = Session(CLIENT, SessionConfig())
    session.persistence = LogOf(records)
    session.expiry_interval = 300
    session.add_subscription("t/#", Subscription(SubscriptionOptions(qos=1), 4))
    queued = Message("t/q", b"copy", 1)
    queued.set_position(0, 1)
    session.restore_live(LiveState(set(), 1, 0, [], [QueueEntry(queued, 1, False, [4], None,
                                                                False)], None))
    session.replay("t/#", [3])  # the cursor: records 3.. of this node's log are still owed
    blob = export_for_node(session, 0.0)
    snapshot = SessionSnapshot.decode(blob, 0.0)
    assert snapshot.cursor is None
    live = snapshot.live
    assert live is not None and live.catchup is None
    assert [e.message.payload for e in live.queue] == [b"copy", b"rec-3", b"rec-5", b"rec-7"]
    assert all(e.message.position is None for e in live.queue)
    assert all(e.subscription_ids == [4] for e in live.queue)
    assert session.catchup is not None and session.catchup.cursor() == [3]  # left as it was


def test_a_session_gathered_for_a_node_whose_link_then_drops_stays_on_the_gathering_worker(
        ) -> None:
    net = cluster({"a": 2, "b": 1})
    claimant = net.of("b")
    acceptor = acceptor_of(net, claimant, "a")
    holder = next(w for w in net.workers["a"] if w is not acceptor)
    rich_session(holder)
    net.pump()
    installed: list[str] = []  # installed offline as any (the broker: expiry, journal)
    take_back = acceptor.host.take_back_session

    def taken_back(blob: bytes) -> bool:
        installed.append(SessionSnapshot.decode(blob, net.clock.time).client_id)
        return take_back(blob)

    acceptor.host.take_back_session = taken_back  # type: ignore[method-assign]
    adopted = claim(claimant)
    send_out(net, claimant)  # the fetch reaches a: its session is gathered onto the acceptor
    net.cut_ends(claimant.index, dialed_ident(claimant, "a"))  # ... for a link now gone
    net.pump()
    kept = acceptor.sessions[CLIENT]
    assert not isinstance(kept, MovedSession) and CLIENT not in holder.sessions
    check_intact(kept)
    assert installed == [CLIENT]
    owners = [w.directory.holders.get(CLIENT) for w in net.workers["a"]
              if w.directory is not None and CLIENT in w.directory.holders]
    assert owners == [acceptor.spec.index]  # registered where it is
    net.advance(ANSWER_TIMEOUT + 0.1)
    assert adopted == [[]]
