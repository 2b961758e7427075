"""Partitions led across nodes (cluster/nodeappends.py), sans-I/O: nodes of workers in the
simulated network, each worker's partitioned log over a log that is durable when the test
says, the metadata's placements set by the test, time moved by the test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from simnet import ClusterNet, Node

from meshmq.broker.interfaces import (
    AppendOutcome,
    Refused,
    Stored,
    StoredElsewhere,
    Unknown,
)
from meshmq.broker.wire import decode_message, encode_message
from meshmq.cluster.nodeappends import (
    CHECK_EVERY,
    HOLD_FOR_LEADER,
    RETRY_AFTER,
    NodeAppends,
    Placements,
)
from meshmq.cluster.partitions import APPEND_TIMEOUT
from meshmq.mqtt.reason_codes import ReasonCode

TOPIC = "fleet/7/temp"


def joined(net: ClusterNet, leaders: dict[str, tuple[str, int] | None]) -> dict[int, Placements]:
    """Every worker gets a NodeAppends; every node's placements name ``leaders[node]`` for
    TOPIC's partition (None: unassigned). Returns the placements by sim index."""
    placements = {}
    for node_id, workers in net.workers.items():
        for worker in workers:
            placed = Placements(8)
            placed.leaders[worker.leadership.partition_for(TOPIC)] = leaders[node_id]
            placements[worker.index] = placed
            worker.node_appends = NodeAppends(
                worker.log, worker.links, placed, append_for(worker),
                lambda m, w=worker: encode_message(m, w.clock.time), decode_message,
                worker.loop.call_soon)
    return placements


def append_for(worker: Node) -> Callable[..., bool]:
    """As ``Publishes.append_for``: into the log, routed once durable, then answered."""
    def append(message, client_id, message_id, done) -> bool:  # type: ignore[no-untyped-def]
        def durable(outcome: AppendOutcome) -> None:
            if isinstance(outcome, Stored):
                worker._route_stored(message, outcome, lambda receivers: done(outcome, receivers))
            elif isinstance(outcome, StoredElsewhere):
                delivered = 0
                if outcome.local is not None:
                    message.set_position(outcome.partition, outcome.offset)
                    delivered = worker.router.deliver_forwarded(message, outcome.local,
                                                                worker.clock.time)
                done(outcome, outcome.receivers + delivered)
            else:
                done(outcome, 0)

        return bool(worker.log.append(message, client_id, durable, message_id))
    return append


def leader_worker(net: ClusterNet, node_id: str) -> Node:
    return net.workers[node_id][net.of(node_id).leadership.leader_of(
        net.of(node_id).leadership.partition_for(TOPIC))]


def settle(net: ClusterNet) -> None:
    """Run what is due, make the waiting appends durable, until nothing moves."""
    while True:
        net.pump()
        moved = any(worker.run_soon() for worker in net.nodes)
        moved = any([worker.durable() for worker in net.nodes]) or moved
        net.pump()
        if not moved:
            return


def test_a_publish_is_stored_by_the_leader_node_and_reaches_every_node_once(
        tmp_path: Path) -> None:
    net = ClusterNet({"a": 1, "b": 2, "c": 1}, log_dir=tmp_path)
    joined(net, {node: ("b", 1) for node in ("a", "b", "c")})
    for node_id in ("a", "b", "c"):
        net.of(node_id).subscribe(f"sub-{node_id}", "fleet/#")
    settle(net)
    outcomes: list[AppendOutcome] = []
    net.of("a").append(TOPIC, b"one", outcomes)
    settle(net)
    assert len(outcomes) == 1 and isinstance(outcomes[0], StoredElsewhere), outcomes
    assert outcomes[0].local is None  # the leader node routed it back here
    leader = leader_worker(net, "b")
    assert [r.message.payload for r in leader.log.local.partitions[
        leader.leadership.partition_for(TOPIC)]] == [b"one"]
    assert not any(w.log.local.partitions.get(leader.leadership.partition_for(TOPIC))
                   for w in net.nodes if w is not leader)  # stored once, there only
    for node_id in ("a", "b", "c"):
        assert net.of(node_id).deliveries[f"sub-{node_id}"] == [b"one"]


def test_a_stale_sender_is_sent_to_the_hinted_leader(tmp_path: Path) -> None:
    """a still takes b for the leader (epoch 1); b knows that c leads since epoch 2: b
    stores nothing and hints c, and a's append goes there."""
    net = ClusterNet({"a": 1, "b": 1, "c": 1}, log_dir=tmp_path)
    joined(net, {"a": ("b", 1), "b": ("c", 2), "c": ("c", 2)})
    outcomes: list[AppendOutcome] = []
    net.of("a").append(TOPIC, b"moved", outcomes)
    settle(net)
    assert isinstance(outcomes[0], StoredElsewhere), outcomes
    assert net.of("b").log.local.waiting == [] and not any(
        net.of("b").log.local.partitions.values())
    assert [r.message.payload for records in net.of("c").log.local.partitions.values()
            for r in records] == [b"moved"]
    counters = net.of("a").node_appends.counters
    assert counters["node_appends_not_leader"] == 1 and counters["node_appends_redirected"] == 1


def test_a_leader_whose_mirror_is_behind_is_asked_again_until_it_catches_up(
        tmp_path: Path) -> None:
    """a knows epoch 2 of b's leadership; b's mirror still says epoch 1: b refuses (its hint
    is older, so a asks b again) until its mirror catches up; then it stores."""
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    placements = joined(net, {"a": ("b", 2), "b": ("b", 1)})
    outcomes: list[AppendOutcome] = []
    net.of("a").append(TOPIC, b"later", outcomes)
    settle(net)
    net.advance(RETRY_AFTER)
    settle(net)
    assert outcomes == []  # still waiting, nothing stored
    placements[net.of("b").index].leaders[net.of("b").leadership.partition_for(TOPIC)] = ("b", 2)
    net.advance(RETRY_AFTER)
    settle(net)
    assert isinstance(outcomes[0], StoredElsewhere), outcomes
    assert net.of("a").node_appends.counters["node_appends_not_leader"] >= 2


def test_a_publish_for_a_node_that_never_leads_it_is_refused_at_its_deadline(
        tmp_path: Path) -> None:
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    joined(net, {"a": ("b", 1), "b": None})
    outcomes: list[AppendOutcome] = []
    net.of("a").append(TOPIC, b"nobody", outcomes)
    for _ in range(int(APPEND_TIMEOUT / RETRY_AFTER) + 2):
        net.advance(RETRY_AFTER)
        settle(net)
    assert len(outcomes) == 1 and isinstance(outcomes[0], Refused), outcomes
    assert "does not lead it" in outcomes[0].why  # not stored: a refusal is the truth


def test_an_offline_partition_is_refused_at_once(tmp_path: Path) -> None:
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    joined(net, {"a": ("b", 1), "b": ("b", 1)})
    a = net.of("a")
    link = next(link for link in a.mesh.remote.values() if link.remote.side.value == "dialed")
    net.cut_ends(a.index, link.ident)
    outcomes: list[AppendOutcome] = []
    a.append(TOPIC, b"offline", outcomes)
    settle(net)
    assert isinstance(outcomes[0], Refused) and outcomes[0].reason_code == (
        ReasonCode.UNSPECIFIED_ERROR)
    assert "offline" in outcomes[0].why and "node b" in outcomes[0].why


def test_a_publish_for_an_unassigned_partition_waits_for_its_leader(tmp_path: Path) -> None:
    """A cluster starting: the partition has no leader yet. The publish waits, is stored by
    the leader once the metadata names one; without one by its deadline, it is refused."""
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    placements = joined(net, {"a": None, "b": ("b", 1)})
    a, b = net.of("a"), net.of("b")
    partition = a.leadership.partition_for(TOPIC)
    outcomes: list[AppendOutcome] = []
    a.append(TOPIC, b"early", outcomes)
    settle(net)
    net.advance(APPEND_TIMEOUT / 2)
    assert outcomes == []  # waiting, not refused
    placements[a.index].leaders[partition] = ("b", 1)  # the mirror catches up
    net.advance(RETRY_AFTER)
    settle(net)
    assert len(outcomes) == 1 and isinstance(outcomes[0], StoredElsewhere), outcomes
    stored = [r for records in b.log.local.partitions.values() for r in records]
    assert [r.message.payload for r in stored] == [b"early"]

    placements[a.index].leaders[partition] = None
    a.append(TOPIC, b"never", outcomes)
    settle(net)
    net.advance(APPEND_TIMEOUT + RETRY_AFTER)
    settle(net)
    assert isinstance(outcomes[1], Refused) and "has no leader" in outcomes[1].why
    assert len([r for records in b.log.local.partitions.values() for r in records]) == 1


def test_an_append_whose_link_drops_is_held_and_sent_again_when_the_leader_is_back(
        tmp_path: Path) -> None:
    """The link to the leader node drops after the append went and the leader stored it:
    no answer yet (a refusal could be false; an unknown outcome would close the publisher's
    connection); when the node links again the append goes again as a resend, and the leader
    answers with where it stored the first one."""
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    joined(net, {"a": ("b", 1), "b": ("b", 1)})
    a, b = net.of("a"), net.of("b")
    outcomes: list[AppendOutcome] = []
    a.append(TOPIC, b"once", outcomes)
    net.pump()
    assert b.log.local.waiting  # it arrived
    dialed = next(link for link in a.mesh.remote.values() if link.remote.side.value == "dialed")
    net.cut_ends(a.index, dialed.ident)
    settle(net)  # b makes it durable; its answer has no link to go on
    assert outcomes == []  # held
    net.advance(HOLD_FOR_LEADER / 2)
    assert outcomes == []
    net.dial(a.index, "b")
    settle(net)
    assert len(outcomes) == 1 and isinstance(outcomes[0], StoredElsewhere), outcomes
    stored = [r for records in b.log.local.partitions.values() for r in records]
    assert [r.message.payload for r in stored] == [b"once"]  # not stored twice
    assert outcomes[0].offset == 0
    assert a.node_appends.counters["node_appends_held"] == 1


def test_an_append_held_for_a_leader_that_does_not_come_back_is_unknown(
        tmp_path: Path) -> None:
    """Held no longer than ``HOLD_FOR_LEADER``: then its outcome is unknown (the client
    resends on its next connection, with the message id); a resend while the node is still
    away is held again."""
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    joined(net, {"a": ("b", 1), "b": ("b", 1)})
    a = net.of("a")
    outcomes: list[AppendOutcome] = []
    a.append(TOPIC, b"lost?", outcomes)
    net.pump()
    dialed = next(link for link in a.mesh.remote.values() if link.remote.side.value == "dialed")
    net.stop(net.of("b").index)  # b never answers nor links again
    net.cut_ends(a.index, dialed.ident)
    net.advance(HOLD_FOR_LEADER + 2)
    assert len(outcomes) == 1 and isinstance(outcomes[0], Unknown), outcomes
    assert outcomes[0].message_id is not None
    a.append(TOPIC, b"lost?", outcomes, outcomes[0].message_id)  # the client's resend
    settle(net)
    assert len(outcomes) == 1  # held again, not refused


def test_an_append_without_an_answer_is_unknown_after_its_deadline(tmp_path: Path) -> None:
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    joined(net, {"a": ("b", 1), "b": ("b", 1)})
    a, b = net.of("a"), net.of("b")
    outcomes: list[AppendOutcome] = []
    a.append(TOPIC, b"slow", outcomes)
    net.pump()
    assert b.log.local.waiting  # b's disk never says durable
    net.advance(APPEND_TIMEOUT + 1.5)
    assert len(outcomes) == 1 and isinstance(outcomes[0], Unknown), outcomes


def test_a_resend_whose_link_drops_before_it_left_is_held_not_refused(tmp_path: Path) -> None:
    """A client's resend (it carries its first attempt's message id) queued for a leader
    whose link drops before the frame left: this attempt is not stored, but the first may
    be, so it is held, not refused; it goes when the node is back."""
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    joined(net, {"a": ("b", 1), "b": ("b", 1)})
    a = net.of("a")
    outcomes: list[AppendOutcome] = []
    a.append(TOPIC, b"again", outcomes, b"\x01" * 16)  # queued this turn, not sent yet
    dialed = next(link for link in a.mesh.remote.values() if link.remote.side.value == "dialed")
    net.cut_ends(a.index, dialed.ident)
    settle(net)
    assert outcomes == []  # held (before: refused, though the first attempt may be stored)
    net.dial(a.index, "b")
    settle(net)
    assert len(outcomes) == 1 and isinstance(outcomes[0], StoredElsewhere), outcomes


def test_a_leaders_first_record_waits_for_the_partition_to_be_marked_written(
        tmp_path: Path) -> None:
    """A partition nobody wrote may still move (a node joined): its leader marks it written
    in the metadata before the first append. Publishes meanwhile wait (one mark for them
    all) and are stored in order once it is marked; after that, no mark."""
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    placements = joined(net, {"a": ("a", 1), "b": ("a", 1)})
    a = net.of("a")
    partition = a.leadership.partition_for(TOPIC)
    asked: list[tuple[int, int, Callable[[bool | None], None]]] = []
    a.node_appends.mark = lambda p, epoch, done: asked.append((p, epoch, done))
    placements[a.index].written[partition] = False
    outcomes: list[AppendOutcome] = []
    a.append(TOPIC, b"first", outcomes)
    a.append(TOPIC, b"second", outcomes)
    settle(net)
    assert outcomes == [] and not a.log.local.partitions.get(partition)
    assert [(p, epoch) for p, epoch, _ in asked] == [(partition, 1)]  # once for both
    asked[0][2](True)
    settle(net)
    assert [type(o) for o in outcomes] == [Stored, Stored]
    assert [r.message.payload for r in a.log.local.partitions[partition]] == [b"first",
                                                                              b"second"]
    a.append(TOPIC, b"third", outcomes)
    settle(net)
    assert len(asked) == 1 and len(outcomes) == 3  # marked: straight to the log


def test_a_publish_for_a_partition_that_moved_before_its_mark_goes_to_the_new_leader(
        tmp_path: Path) -> None:
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    placements = joined(net, {"a": ("a", 1), "b": ("b", 2)})
    a, b = net.of("a"), net.of("b")
    partition = a.leadership.partition_for(TOPIC)
    asked: list[Callable[[bool | None], None]] = []
    a.node_appends.mark = lambda p, epoch, done: asked.append(done)
    placements[a.index].written[partition] = False
    outcomes: list[AppendOutcome] = []
    a.append(TOPIC, b"moving", outcomes)
    settle(net)
    asked[0](None)  # the metadata has it on b now (the move won over the mark)
    placements[a.index].leaders[partition] = ("b", 2)  # and a's mirror catches up
    net.advance(RETRY_AFTER)
    settle(net)
    assert len(outcomes) == 1 and isinstance(outcomes[0], StoredElsewhere), outcomes
    assert not a.log.local.partitions.get(partition)
    assert [r.message.payload for r in b.log.local.partitions[partition]] == [b"moving"]


def test_a_first_record_that_cannot_be_marked_is_refused_at_its_deadline(
        tmp_path: Path) -> None:
    """The metadata without a majority: every mark comes back undecided; the publish keeps
    its first deadline through the attempts and is refused there, stored nowhere."""
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    placements = joined(net, {"a": ("a", 1), "b": ("a", 1)})
    a = net.of("a")
    partition = a.leadership.partition_for(TOPIC)
    attempts: list[float] = []

    def undecided(p: int, epoch: int, done: Callable[[bool | None], None]) -> None:
        attempts.append(a.clock.time)
        a.loop.call_soon(done, False)

    a.node_appends.mark = undecided
    placements[a.index].written[partition] = False
    outcomes: list[AppendOutcome] = []
    a.append(TOPIC, b"needs agreement", outcomes)
    for _ in range(int((APPEND_TIMEOUT + CHECK_EVERY) / RETRY_AFTER) + 2):
        settle(net)
        net.advance(RETRY_AFTER)
    settle(net)
    assert len(outcomes) == 1 and isinstance(outcomes[0], Refused), outcomes
    assert "could not be marked" in outcomes[0].why
    assert len(attempts) > 3  # asked again and again, the deadline kept
    assert not a.log.local.partitions.get(partition)
