"""Reading the partitions other nodes lead (cluster/remotelog.py), sans-I/O: two nodes in
the simulated network, the placements set by the test, the leader's log records served
from memory, time moved by the test."""

from __future__ import annotations

from pathlib import Path

import pytest
from simnet import ClusterNet, Node
from test_node_appends import append_for, settle

from meshmq.broker.catchup import CatchUp
from meshmq.broker.wire import decode_message, encode_message
from meshmq.cluster.nodeappends import NodeAppends, Placements
from meshmq.cluster.remotelog import RETRY_AFTER, RemoteLog
from meshmq.log.errors import OffsetOutOfRange
from meshmq.log.record import Record

TOPIC = "fleet/7/temp"
PARTITIONS = 8


def joined(net: ClusterNet, leader_of_topic: dict[str, str]) -> int:
    """Every worker gets NodeAppends and a RemoteLog; on node ``n``, TOPIC's partition is
    led by ``leader_of_topic[n]`` and every other partition by node a. Returns TOPIC's
    partition."""
    partition = -1
    for node_id, workers in net.workers.items():
        for worker in workers:
            partition = worker.leadership.partition_for(TOPIC)
            placed = Placements(PARTITIONS)
            placed.leaders = [(leader_of_topic[node_id], 1) if p == partition else ("a", 1)
                              for p in range(PARTITIONS)]
            worker.node_appends = NodeAppends(
                worker.log, worker.links, placed, append_for(worker),
                lambda m, w=worker: encode_message(m, w.clock.time), decode_message,
                worker.loop.call_soon)
            worker.remote = RemoteLog(worker.links, worker.log, placed, node_id)
            worker.log.remote = worker.remote
            worker.woken = 0

            def wake(worker: Node = worker) -> None:
                worker.woken += 1

            worker.remote.on_ready = wake
    return partition


def serve_from_memory(worker: Node, earliest: int = 0) -> None:
    """The leader worker's log reads what its fake log stored (offset = index), as records;
    below ``earliest`` retention deleted them."""
    local = worker.log.local

    def read(partition: int, offset: int, max_records: int) -> list[Record]:
        stored = local.partitions.get(partition, [])
        if offset < earliest:
            raise OffsetOutOfRange(offset, earliest, len(stored))
        return [Record(at, 1_000 + at, entry.message.topic, 1, False, b"",
                       entry.message.payload, entry.client_id, bytes(16))
                for at, entry in enumerate(stored[offset:offset + max_records], start=offset)]

    local.read = read
    local.earliest_offset = lambda partition: earliest


def published(net: ClusterNet, count: int) -> None:
    for number in range(count):
        net.of("a").append(TOPIC, f"m{number}".encode(), [])
    settle(net)


def test_a_node_reads_a_partition_another_node_leads_once_its_view_is_known(
        tmp_path: Path) -> None:
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    partition = joined(net, {"a": "b", "b": "b"})
    serve_from_memory(net.of("b"))
    reader = net.of("a")
    reader.subscribe("sub", "fleet/#")
    settle(net)
    published(net, 3)
    assert reader.deliveries["sub"] == [b"m0", b"m1", b"m2"]
    # the copies came with their places: the view follows them
    assert reader.log.high_watermark[partition] == 3
    assert not reader.log.views_known()  # the leader node's high watermarks not heard yet

    synced: list[bool] = []
    reader.log.sync(lambda: synced.append(True))
    settle(net)
    assert synced == [True] and reader.log.views_known()
    assert reader.woken >= 1

    assert reader.log.read(partition, 1, 10) == []  # asked for; nothing here yet
    settle(net)
    records = reader.log.read(partition, 1, 10)
    assert [(r.offset, r.payload) for r in records] == [(1, b"m1"), (2, b"m2")]
    assert reader.log.read(partition, 0, 1) == []  # not in the chunk fetched: asked for
    settle(net)
    assert [r.payload for r in reader.log.read(partition, 0, 10)] == [b"m0", b"m1", b"m2"]
    assert reader.remote.counters["log_records_fetched"] >= 3
    assert not reader.log.routes_all(partition)  # the index is not used for it


def test_a_catch_up_on_another_node_delivers_the_history_in_order(tmp_path: Path) -> None:
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    partition = joined(net, {"a": "b", "b": "b"})
    serve_from_memory(net.of("b"))
    published(net, 5)
    reader = net.of("a")
    catchup = CatchUp(reader.log)
    start = [0] * PARTITIONS
    catchup.add("fleet/#", None, start)
    got: list[tuple[bytes, tuple[int, int] | None]] = []

    def deliver(message, subscription, dup) -> bool:  # type: ignore[no-untyped-def]
        got.append((message.payload, message.position))
        return True

    synced: list[bool] = []
    reader.log.sync(lambda: synced.append(True))
    settle(net)
    assert synced and reader.log.high_watermark[partition] == 5
    subscriptions = {"fleet/#": object()}
    while not catchup.finished:
        before = catchup.cursor()
        catchup.step(512, subscriptions, deliver, 0.0)  # type: ignore[arg-type]
        if catchup.cursor() == before:
            settle(net)
    assert got == [(f"m{n}".encode(), (partition, n)) for n in range(5)]


def test_below_the_leaders_earliest_offset_a_read_says_so(tmp_path: Path) -> None:
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    partition = joined(net, {"a": "b", "b": "b"})
    serve_from_memory(net.of("b"), earliest=2)
    published(net, 4)
    reader = net.of("a")
    assert reader.log.read(partition, 0, 10) == []
    settle(net)
    with pytest.raises(OffsetOutOfRange):
        reader.log.read(partition, 0, 10)
    assert reader.log.earliest_offset(partition) == 2
    reader.log.read(partition, 2, 10)
    settle(net)
    assert [r.payload for r in reader.log.read(partition, 2, 10)] == [b"m2", b"m3"]


def test_a_node_that_does_not_lead_the_partition_serves_nothing_and_is_asked_again_later(
        tmp_path: Path) -> None:
    """a takes b for the leader; b's own placements say a leads it: b answers not leader,
    and a does not ask again for that offset before RETRY_AFTER."""
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    partition = joined(net, {"a": "b", "b": "a"})
    reader, other = net.of("a"), net.of("b")
    assert reader.log.read(partition, 0, 10) == []
    settle(net)
    served = other.remote.counters["log_reads_served"]
    assert served == 1
    assert reader.log.read(partition, 0, 10) == []
    settle(net)
    assert other.remote.counters["log_reads_served"] == served  # not at once
    net.advance(RETRY_AFTER + 0.01)
    settle(net)
    assert reader.log.read(partition, 0, 10) == []
    settle(net)
    assert other.remote.counters["log_reads_served"] == served + 1


def test_before_the_partitions_are_placed_a_read_brings_nothing_and_the_placement_wakes_it(
        tmp_path: Path) -> None:
    """A worker that just started has not reached the metadata: a partition not placed yet
    may be led by another node, so this node's own log (empty for it) is no answer. A read
    there (a forwarded record's place moved the view past it) brings nothing instead of
    raising out of the log; once placed elsewhere, the catch-ups are woken and it is read
    from the leader."""
    net = ClusterNet({"a": 1, "b": 1}, log_dir=tmp_path)
    partition = joined(net, {"a": "b", "b": "b"})
    serve_from_memory(net.of("b"))
    published(net, 3)
    reader = net.of("a")
    placements = reader.remote.placements
    placed = list(placements.leaders)
    placements.leaders = [None] * PARTITIONS  # (as in a worker started again)

    def own_log(partition: int, offset: int, max_records: int) -> list[Record]:
        if offset > 0:  # this node's log holds nothing of it: above its end
            raise OffsetOutOfRange(offset, 0, 0)
        return []

    reader.log.local.read = own_log
    assert reader.log.read(partition, 1, 10) == []
    assert not reader.log.views_known()
    settle(net)
    assert reader.remote.counters["log_reads_sent"] == 0  # nowhere to ask yet

    woken = reader.woken
    placements.leaders = placed
    for placed_anew in placements.on_change:
        placed_anew(list(range(PARTITIONS)))
    assert reader.woken > woken
    settle(net)
    assert reader.log.views_known()
    assert reader.log.read(partition, 1, 10) == []  # asked for
    settle(net)
    assert [r.payload for r in reader.log.read(partition, 1, 10)] == [b"m1", b"m2"]
