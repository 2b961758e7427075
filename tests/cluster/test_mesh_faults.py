"""Faults of the mesh that a cluster would multiply, each in the simulated network
(tests/cluster/simnet.py: real meshes, routers, directories and partitioned logs; one timer
per mesh, as the real I/O layer has; time moved by the test).

Each test states the fault it guards against; each failed on the mesh before its fix.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from simnet import Net, Node

from meshmq.broker.interfaces import AppendOutcome, Refused, StoredElsewhere, Unknown
from meshmq.broker.local import LocalRetained
from meshmq.broker.message import Message
from meshmq.broker.retained import RetainedStore
from meshmq.broker.session import Session, Subscription
from meshmq.cluster.codec import Barrier, FrameType, Stats
from meshmq.cluster.directory import CLAIM_TIMEOUT
from meshmq.cluster.mesh import ANSWER_TIMEOUT, Mesh
from meshmq.cluster.moving import SETTLE_TIMEOUT, MovedSession
from meshmq.cluster.partitions import APPEND_TIMEOUT
from meshmq.cluster.retained import OwnedRetained
from meshmq.config import SessionConfig
from meshmq.mqtt.packets import SubscriptionOptions


def owned_by(node: Node, owner: int) -> str:
    """A client id whose directory owner is worker ``owner``."""
    return next(c for c in (f"c{i}" for i in range(100))
                if node.leadership.owner_of_client(c) == owner)


def led_by(node: Node, leader: int) -> str:
    """A topic whose partition worker ``leader`` leads."""
    return next(t for t in (f"t/{i}" for i in range(100))
                if node.leadership.leader_of(node.leadership.partition_for(t)) == leader)


def hold_session(node: Node, client_id: str, topic_filter: str = "t/#") -> Session:
    """An offline session held by ``node``, registered with its owner."""
    session = node.sessions[client_id] = Session(client_id, SessionConfig())
    node.router.subscribe(session, topic_filter, Subscription(SubscriptionOptions(qos=1)))
    assert node.directory is not None
    node.directory.created(session)
    return session


def restored(net: Net, *indexes: int) -> None:
    for index in indexes:
        directory = net.nodes[index].directory
        assert directory is not None
        directory.restored()
    net.pump()


# ---------------------------------------------------------------------- one deadline structure


def test_a_stand_in_expires_though_an_earlier_deadline_fired_before_it() -> None:
    """Lost timers: the mesh kept only its earliest deadline; a stand-in's 10 s deadline was
    forgotten once an earlier request's fired, and the stand-in (with the session) stayed."""
    net = Net(3, directory=True)
    restored(net, 0, 1, 2)
    client_id = owned_by(net.nodes[0], 0)
    hold_session(net.nodes[1], client_id)
    net.pump()
    adopted: list[list[Session]] = []
    claimant = net.nodes[2].directory
    assert claimant is not None and claimant.claim(client_id, False, adopted.append)
    net.pump()
    assert adopted and [s.client_id for s in adopted[0]] == [client_id]
    holder = net.nodes[1]
    assert isinstance(holder.sessions[client_id], MovedSession)  # waits for SETTLED
    net.stop(2)  # never settles
    answers: list[object] = []
    assert holder.mesh.request(2, lambda request_id: Barrier(request_id).encode(),
                               answers.append, timeout=1.0)
    net.advance(1.5)
    assert answers == [None]  # the earlier deadline fired
    net.advance(SETTLE_TIMEOUT)
    assert not isinstance(holder.sessions.get(client_id), MovedSession)


def test_a_claim_waits_for_registrations_at_most_its_deadline() -> None:
    """Lost timers: an owner serves claims once every peer registered its sessions, or after
    ANSWER_TIMEOUT; that deadline was scheduled once and lost to an earlier one, so a CONNECT
    waited for ever on a peer that never registered."""
    net = Net(3, directory=True)
    restored(net, 0, 1)  # worker 2 is linked but still restoring: no registration yet
    owner = net.nodes[0]
    client_id = owned_by(owner, 0)
    net.stop(2)
    adopted: list[list[Session]] = []
    claimant = net.nodes[1].directory
    assert claimant is not None and claimant.claim(client_id, False, adopted.append)
    net.pump()
    assert not adopted  # the owner waits for worker 2's registration
    answers: list[object] = []
    assert owner.mesh.request(2, lambda request_id: Barrier(request_id).encode(),
                              answers.append, timeout=0.5)
    net.advance(1.0)
    assert answers == [None] and not adopted
    net.advance(ANSWER_TIMEOUT)
    assert adopted == [[]]  # served without worker 2, within its deadline: by the owner,
    assert owner.directory is not None  # not by the claimant giving up
    assert owner.directory.holders.get(client_id) == 1


# ---------------------------------------------------------------------- answers first


@pytest.mark.parametrize("ask", ["barrier", "sync"])
def test_no_high_watermark_reaches_a_peer_before_the_answer_to_its_append(
        tmp_path: Path, ask: str) -> None:
    """An answer overtaken: BARRIER_DONE and SYNCED went onto the link at once, with the
    leader's high watermarks, while the APPENDED answer waited for the end of the turn; the
    requester's view passed its own publish before it learned it was its own (its catch-up
    would deliver it, then the publish path again)."""
    net = Net(2, log_dir=tmp_path)
    leader, requester = net.nodes
    topic = led_by(leader, 0)
    partition = leader.leadership.partition_for(topic)
    views: list[int] = []
    outcomes: list[AppendOutcome] = []
    requester.append(topic, b"mine", outcomes)
    net.pump()
    assert leader.log.local.waiting  # the APPEND is at its leader, not durable yet
    leader.durable()  # durable: routed, its answer batched for the end of the turn
    if ask == "barrier":
        requester.mesh.barrier(lambda: views.append(requester.log.high_watermark[partition]))
    else:
        requester.log.sync(lambda: views.append(requester.log.high_watermark[partition]))
    for data in requester.mesh.data_to_send().values():  # the request arrives in that turn
        leader.mesh.data_received(net.links[(0, 1)], data)
    seen: list[int] = []
    original = requester.log._on_appended

    def on_appended(peer: int, frame: object) -> None:
        seen.append(requester.log.high_watermark[partition])
        original(peer, frame)

    requester.mesh.handle(FrameType.APPENDED, on_appended)
    net.pump()
    assert outcomes == [StoredElsewhere(partition, 0, 0, None)]  # (no subscriber here)
    assert seen == [0]  # the answer came while the view was still before the offset
    assert views == [1]


# ---------------------------------------------------------------------- unknown outcomes


def test_an_append_whose_link_drops_has_an_unknown_outcome_not_a_refusal(
        tmp_path: Path) -> None:
    """Unknown outcomes: a dropped link failed the pending appends as refusals (a PUBACK with
    0x80) though the leader may have stored and delivered them."""
    net = Net(2, log_dir=tmp_path)
    leader, requester = net.nodes
    topic = led_by(leader, 0)
    outcomes: list[AppendOutcome] = []
    requester.append(topic, b"sent", outcomes)
    net.pump()  # the APPEND is at the leader
    unsent: list[AppendOutcome] = []
    requester.append(topic, b"unsent", unsent)  # still in this turn's outbox
    net.cut(0, 1)
    assert len(outcomes) == 1 and isinstance(outcomes[0], Unknown)
    assert isinstance(unsent[0], Refused)  # never left this worker: certainly not stored


def test_a_resend_after_an_unknown_outcome_is_recognised_not_stored_twice(
        tmp_path: Path) -> None:
    """Unknown outcomes: the resend must be harmless. The leader stored the first attempt;
    the resend carries its message id and gets the first attempt's place."""
    net = Net(2, log_dir=tmp_path)
    leader, requester = net.nodes
    topic = led_by(leader, 0)
    partition = leader.leadership.partition_for(topic)
    requester.subscribe("sub", topic)
    net.pump()
    outcomes: list[AppendOutcome] = []
    requester.append(topic, b"once", outcomes)
    net.pump()
    leader.durable()  # stored and routed; the answer is lost with the link
    net.cut(0, 1)
    first = outcomes[0]
    assert isinstance(first, Unknown) and first.message_id is not None
    net.link(0, 1)
    again: list[AppendOutcome] = []
    requester.append(topic, b"once", again, first.message_id)  # the client's resend (DUP)
    net.pump()
    assert leader.durable() == 0  # nothing new to store
    assert again == [StoredElsewhere(partition, 0, 0, [])]
    assert len(leader.log.local.partitions[partition]) == 1
    assert requester.deliveries == {"sub": [b"once"]}  # delivered here once, on the resend


def test_only_a_resend_is_looked_up_a_new_publish_is_always_stored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new publish whose id happens to equal a stored one (two workers forked from one
    process drew the same ids) must be stored, never taken for a resend: only an append that
    says it is one is looked up."""
    import meshmq.cluster.partitions as partitions

    net = Net(2, log_dir=tmp_path)
    leader, requester = net.nodes
    topic = led_by(leader, 0)
    partition = leader.leadership.partition_for(topic)
    monkeypatch.setattr(partitions, "new_message_id", lambda now_ms: bytes(16))  # the same id
    outcomes: list[AppendOutcome] = []
    requester.append(topic, b"one", outcomes)
    net.pump()
    assert leader.durable() == 1  # stored: its id is remembered
    requester.append(topic, b"two", outcomes)  # a new publish, the same id
    net.pump()
    assert leader.durable() == 1
    net.pump()
    assert outcomes == [StoredElsewhere(partition, 0, 0, None),
                        StoredElsewhere(partition, 1, 0, None)]


def test_a_resend_on_the_leaders_own_worker_is_recognised_too(tmp_path: Path) -> None:
    """The session moves with the client: its resend may reach the partition's leader
    itself, which recognises the message id there as well (no second record, nothing routed
    again)."""
    net = Net(2, log_dir=tmp_path)
    leader, requester = net.nodes
    topic = led_by(leader, 0)
    partition = leader.leadership.partition_for(topic)
    leader.subscribe("sub", topic)
    net.pump()
    outcomes: list[AppendOutcome] = []
    requester.append(topic, b"moved", outcomes)
    net.pump()
    leader.durable()
    net.cut(0, 1)
    first = outcomes[0]
    assert isinstance(first, Unknown) and first.message_id is not None
    again: list[AppendOutcome] = []
    leader.append(topic, b"moved", again, first.message_id)  # reconnected to the leader
    net.pump()
    assert leader.durable() == 0
    assert again == [StoredElsewhere(partition, 0, 1, None)]
    assert leader.deliveries == {"sub": [b"moved"]}


def test_a_resend_while_its_leader_is_down_is_unknown_again_not_refused(
        tmp_path: Path) -> None:
    """A resend of a publish whose first attempt the leader may have stored must not be
    refused because the leader is down (a PUBACK 0x80 for a message that is in the log): its
    outcome is unknown again, and the client resends once more later."""
    net = Net(2, log_dir=tmp_path)
    leader, requester = net.nodes
    topic = led_by(leader, 0)
    outcomes: list[AppendOutcome] = []
    requester.append(topic, b"first", outcomes)
    net.pump()
    leader.durable()
    net.cut(0, 1)  # the leader dies after storing it
    first = outcomes[0]
    assert isinstance(first, Unknown) and first.message_id is not None
    again: list[AppendOutcome] = []
    requester.append(topic, b"first", again, first.message_id)  # resent while it is down
    net.pump()
    assert isinstance(again[0], Unknown) and again[0].message_id == first.message_id
    fresh: list[AppendOutcome] = []
    requester.append(topic, b"new", fresh)  # a new publish is certainly not stored: refused
    net.pump()
    assert isinstance(fresh[0], Refused)


def test_a_resend_whose_link_drops_before_it_left_is_unknown_not_refused(
        tmp_path: Path) -> None:
    """A resend queued for its leader in the turn the link drops never left: this attempt is
    not stored, but its first may be: unknown, not refused (a new publish is refused)."""
    net = Net(2, log_dir=tmp_path)
    leader, requester = net.nodes
    topic = led_by(leader, 0)
    again: list[AppendOutcome] = []
    fresh: list[AppendOutcome] = []
    requester.append(topic, b"first", again, b"\x07" * 16)  # a resend, queued this turn
    requester.append(topic, b"new", fresh)
    net.cut(0, 1)  # before the turn's frame left
    net.pump()
    assert isinstance(again[0], Unknown) and again[0].message_id == b"\x07" * 16
    assert isinstance(fresh[0], Refused)


def test_a_restarted_leader_recognises_a_resend_it_stored_before(tmp_path: Path) -> None:
    """The ids a leader remembers are read back from its log when it starts: a resend whose
    first attempt was stored before the leader restarted is not stored twice."""
    import asyncio

    from simnet import Wire

    from meshmq.broker.wire import decode_message, encode_message
    from meshmq.cluster.leaders import Leadership
    from meshmq.cluster.partitions import PartitionedLog
    from meshmq.cluster.spec import WorkerSpec
    from meshmq.config import LogSettings
    from meshmq.log.commit_log import CommitLog
    from meshmq.log.config import LogConfig
    from meshmq.log.record import new_message_id

    spec = WorkerSpec(0, 2, "token")
    leadership = Leadership(spec, 8, None)
    topic = next(t for t in (f"t/{i}" for i in range(100))
                 if leadership.leads(leadership.partition_for(t)))
    partition = leadership.partition_for(topic)
    message_id = new_message_id(1_000)
    before = CommitLog(tmp_path, LogConfig(partitions=8))  # the leader's previous run
    before.append(topic, 1, False, b"", b"stored", "publisher", 1_000, message_id=message_id)
    before.append(topic, 1, False, b"", b"later", "other", 1_001)
    before.flush()
    before.close()
    loop = asyncio.new_event_loop()
    clock = Net(1).clock
    mesh = Mesh(spec, Wire(clock), encode_message, lambda: {})  # type: ignore[arg-type]
    log = PartitionedLog(LogSettings(partitions=8), str(tmp_path), loop, leadership, mesh,
                         lambda m: encode_message(m, 0.0), decode_message)
    try:
        outcomes: list[AppendOutcome] = []
        assert log.append(Message(topic, b"stored", 1), "publisher", outcomes.append,
                          message_id)
        loop.run_until_complete(asyncio.sleep(0))
        assert outcomes == [StoredElsewhere(partition, 0, 1, None)]
        assert log.local.commit_log.next_offset(partition) == 2  # nothing appended
    finally:
        log.close()
        loop.close()


def test_a_slow_leaders_late_answer_delivers_here_once_and_the_resend_adds_nothing(
        tmp_path: Path) -> None:
    """Unknown outcomes with a leader that was only slow (stopped, then resumed): it stored
    and routed the publish everywhere but on the requester, which gave up on the answer. The
    late answer still brings it to the requester's subscribers, once; the client's resend is
    recognised and delivers nothing more."""
    net = Net(2, log_dir=tmp_path)
    leader, requester = net.nodes
    topic = led_by(leader, 0)
    partition = leader.leadership.partition_for(topic)
    requester.subscribe("sub", topic)
    net.pump()
    outcomes: list[AppendOutcome] = []
    requester.append(topic, b"slow", outcomes)
    net.pump()
    net.stop(0)
    net.advance(APPEND_TIMEOUT + 0.1)
    first = outcomes[0]
    assert isinstance(first, Unknown) and first.message_id is not None
    net.resume(0)
    leader.durable()  # stored after all; the answer arrives late
    net.pump()
    assert requester.deliveries == {"sub": [b"slow"]}
    again: list[AppendOutcome] = []
    requester.append(topic, b"slow", again, first.message_id)  # the client's resend
    net.pump()
    assert again == [StoredElsewhere(partition, 0, 1, None)]
    assert requester.deliveries == {"sub": [b"slow"]}  # not a second time
    assert len(leader.log.local.partitions[partition]) == 1


def test_a_late_answer_never_completes_a_request_of_a_later_link(tmp_path: Path) -> None:
    """Request ids not tied to a link: ids restart at 1 in every process, and a leader sent
    an answer computed for a requester's previous process on the link to its new one, where
    request 1 is another publish (acknowledged with another message's position)."""
    net = Net(2, log_dir=tmp_path)
    leader = net.nodes[0]
    topic = led_by(leader, 0)
    partition = leader.leadership.partition_for(topic)
    net.nodes[1].append(topic, b"before the restart", [])
    net.pump()
    net.cut(0, 1)  # the requester is killed
    net.nodes[1] = Node(1, 2, net.clock, log_dir=tmp_path / "restarted")
    net.link(0, 1)
    outcomes: list[AppendOutcome] = []
    net.nodes[1].append(topic, b"after the restart", outcomes)  # request id 1 again
    leader.durable()  # the first publish becomes durable only now
    net.pump()
    assert outcomes == []  # not the first publish's answer
    leader.durable()
    net.pump()
    assert outcomes == [StoredElsewhere(partition, 1, 0, None)]


# ---------------------------------------------------------------------- a stranger, a bug


def test_a_link_that_never_says_hello_is_closed_after_the_handshake_timeout() -> None:
    """A peer that never sent HELLO was never timed out (a stopped peer accepts and never
    answers; a stranger holds the link open)."""
    net = Net(2)
    mesh = net.nodes[0].mesh
    mesh.link_opened(99, None)  # a connection from someone who says nothing
    net.advance(4.0)
    assert 99 not in net.nodes[0].wire.closed
    net.advance(2.0)
    assert 99 in net.nodes[0].wire.closed


def test_a_huge_frame_before_hello_closes_the_link_at_once() -> None:
    """Before HELLO a peer could announce a 512 MiB frame and have it buffered."""
    net = Net(2)
    mesh = net.nodes[0].mesh
    mesh.link_opened(99, None)
    mesh.data_received(99, (300 * 1024 * 1024).to_bytes(4, "big") + bytes([FrameType.HELLO]))
    assert 99 in net.nodes[0].wire.closed


def test_a_handler_failure_closes_the_link_and_both_sides_start_afresh() -> None:
    """A handler exception kept a broken link: only LinkError was caught, so the frames after
    the failing one in that read were lost and the link stayed up."""
    net = Net(2)
    a, b = net.nodes
    b.subscribe("s", "x")
    net.pump()

    def broken(peer: int, frame: object) -> None:
        raise RuntimeError("a bug")

    b.mesh.handle(FrameType.STATS, broken)
    a.mesh.send(1, Stats({"n": 1}).encode())
    a.publish("x", b"after the failure")  # in the same read as the STATS frame
    net.pump()
    assert net.links[(1, 0)] in b.wire.closed and 0 not in b.mesh.peers
    net.cut(0, 1)  # the I/O layer closes the socket: the other side sees it too
    net.link(0, 1)
    a.publish("x", b"on the new link")
    net.pump()
    assert b.deliveries == {"s": [b"on the new link"]}


# ---------------------------------------------------------------------- sessions


def test_a_session_handed_over_without_confirmation_is_taken_back() -> None:
    """A hand-over that could lose the session: the holder exported the session and left a
    stand-in; when the claimant's CLAIMED came too late (dropped) no SETTLED ever came and
    the stand-in was dropped with the session's subscriptions and queued messages."""
    net = Net(3, directory=True)
    restored(net, 0, 1, 2)
    owner, holder = net.nodes[0], net.nodes[1]
    client_id = owned_by(owner, 0)
    hold_session(holder, client_id, "keep/#")
    net.pump()
    net.stop(0)  # the owner stalls: the claim times out, the CLAIMED comes late
    adopted: list[list[Session]] = []
    claimant = net.nodes[2].directory
    assert claimant is not None and claimant.claim(client_id, False, adopted.append)
    net.pump()
    net.advance(CLAIM_TIMEOUT + 0.1)
    assert adopted == [[]]  # the claimant went on with a new session
    net.resume(0)  # the owner serves the claim now; the holder hands the session over
    assert isinstance(holder.sessions[client_id], MovedSession)
    net.advance(SETTLE_TIMEOUT + 0.1)
    back = holder.sessions[client_id]
    assert not isinstance(back, MovedSession) and "keep/#" in back.subscriptions
    assert owner.directory is not None
    assert holder.index in {owner.directory.holders.get(client_id),
                            *owner.directory.extra.get(client_id, ())}


def test_two_connects_of_one_client_id_on_one_worker_each_count_as_claiming() -> None:
    """The per-client-id ``_claiming`` flag: with two CONNECTs of one id in flight on one
    worker, the first answer cleared it, and a RELEASE for that id no longer superseded the
    second connection, still waiting for its CONNACK."""
    net = Net(2, directory=True)
    restored(net, 0, 1)
    worker = net.nodes[1]
    client_id = owned_by(worker, 1)  # its own directory owner: answers come a turn later
    hold_session(worker, client_id)
    directory = worker.directory
    assert directory is not None
    first: list[list[Session]] = []
    second: list[list[Session]] = []
    assert directory.claim(client_id, False, first.append)
    assert directory.claim(client_id, False, second.append)
    worker.deferred.pop(0)()  # the first CONNECT's answer; the second is still to come
    assert first == [[]] and not second
    other = net.nodes[0].directory
    assert other is not None and other.claim(client_id, False, lambda adopted: None)
    for data in net.nodes[0].mesh.data_to_send().values():  # its CLAIM reaches the owner
        worker.mesh.data_received(net.links[(1, 0)], data)
    assert worker.host.superseded == [client_id]  # the second CONNECT must not go on


# ---------------------------------------------------------------------- retained messages


class Journal:
    """A keeper that journals at once (the state store's fsync is not the point here)."""

    def __init__(self) -> None:
        self.written: list[str] = []

    def retained(self, topic: str, message: object, done: Callable[[], None] | None = None
                 ) -> None:
        self.written.append(topic)
        if done is not None:
            done()


def retained_pair(net: Net) -> list[OwnedRetained]:
    return [OwnedRetained(LocalRetained(RetainedStore(), Journal(),  # type: ignore[arg-type]
                                        lambda: net.clock.time),
                          node.leadership, node.mesh, node.host.encode_message,
                          node.host.decode_message) for node in net.nodes]


def test_a_retained_publish_is_acknowledged_only_once_its_owner_stored_it() -> None:
    """A retained PUBACK without storage: when the topic's owner was down or silent, the
    retained message was acknowledged anyway."""
    net = Net(2)
    stores = retained_pair(net)
    topic = led_by(net.nodes[0], 0)  # owned by worker 0; published on worker 1
    outcomes: list[object] = []
    stores[1].keep(Message(topic, b"kept", 1, True), outcomes.append)
    net.pump()
    assert outcomes == [None]  # stored by its owner: acknowledge
    net.stop(0)  # the owner is silent
    stores[1].keep(Message(topic, b"silent", 1, True), outcomes.append)
    net.pump()
    net.advance(ANSWER_TIMEOUT + 0.1)
    assert isinstance(outcomes[1], Unknown)  # perhaps stored: neither ack nor refusal
    net.resume(0)
    net.cut(0, 1)  # the owner is down
    stores[1].keep(Message(topic, b"down", 1, True), outcomes.append)
    assert isinstance(outcomes[2], Refused)  # certainly not stored: refused


# ---------------------------------------------------------------------- shared groups


def test_a_shared_message_for_a_group_that_emptied_goes_to_a_member_elsewhere() -> None:
    """A shared-group message dropped: a FORWARD for a group whose last member here left
    before it arrived was dropped (a QoS 1/2 loss) instead of going to a member elsewhere."""
    net = Net(3)
    publisher, first, second = net.nodes
    first.subscribe("m1", "$share/g/jobs/#")
    second.subscribe("m2", "$share/g/jobs/#")
    net.pump()
    for n in range(2):  # round robin over the two workers with members: 1, then 2
        publisher.publish("jobs/run", f"warm {n}".encode())
        net.pump()
    assert first.deliveries == {"m1": [b"warm 0"]} and second.deliveries == {"m2": [b"warm 1"]}
    publisher.publish("jobs/run", b"in flight")  # forwarded to worker 1 (its turn)...
    first.unsubscribe("m1", "$share/g/jobs/#")  # ... whose member leaves before it arrives
    net.pump()
    assert first.deliveries == {"m1": [b"warm 0"]}
    assert second.deliveries == {"m2": [b"warm 1", b"in flight"]}


def test_a_relayed_shared_message_is_not_relayed_again() -> None:
    """Routes that disagree must not bounce a shared message between workers for ever."""
    net = Net(3)
    net.nodes[1].subscribe("m1", "$share/g/jobs/#")
    net.pump()
    net.nodes[1].unsubscribe("m1", "$share/g/jobs/#")  # gone, the others not yet told
    net.nodes[0].publish("jobs/run", b"nobody")
    net.pump()
    assert sum(node.mesh.counters["shared_dropped"] for node in net.nodes) <= 1
    assert all(not node.deliveries for node in net.nodes)


# ---------------------------------------------------------------------- backpressure


def test_control_frames_are_not_stuck_behind_forwards() -> None:
    """Backpressure: control frames (answers, claims, barriers) waited behind up to 16 MiB
    of FORWARDs. Data waits in the mesh while the socket is behind; control goes at once."""
    net = Net(2)
    sender, receiver = net.nodes
    receiver.subscribe("s", "bulk")
    net.pump()
    sender.mesh.link_paused(net.links[(0, 1)], True)  # the socket's buffer is full
    for _ in range(100):
        sender.publish("bulk", bytes(64 * 1024))  # 6.4 MB of FORWARDs wait in the mesh
    answers: list[object] = []
    sender.mesh.request(1, lambda request_id: Barrier(request_id).encode(), answers.append)
    out = sender.mesh.data_to_send()[net.links[(0, 1)]]
    assert len(out) < 1024  # the BARRIER alone, not behind the data
    receiver.mesh.data_received(net.links[(1, 0)], out)
    net.pump()
    assert answers and answers[0] is not None and "s" not in receiver.deliveries
    sender.mesh.link_paused(net.links[(0, 1)], False)
    net.pump()
    assert len(receiver.deliveries["s"]) == 100  # all of it, in order, after


def test_appends_to_a_leader_that_does_not_keep_up_pause_the_publisher(
        tmp_path: Path) -> None:
    """Backpressure: APPENDs to a slow or stopped leader queued without bound; they travel
    in the data lane and a congested link pauses the publisher, as forwarding does."""
    net = Net(2, log_dir=tmp_path)
    leader, requester = net.nodes
    paused: list[int] = []
    requester.mesh.on_congested = paused.append
    requester.mesh.link_paused(net.links[(1, 0)], True)  # the leader reads nothing
    topic = led_by(leader, 0)
    payload = bytes(64 * 1024)
    for _ in range(300):  # 19 MB of appends
        requester.append(topic, payload, [])
        requester.mesh.data_to_send()  # each turn's APPEND frame joins the data lane
    assert requester.mesh.congested(0) and paused and set(paused) == {0}
