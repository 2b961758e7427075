"""Owner epochs (cluster/sessionowner.py), sans-I/O: nodes of workers in the simulated
network, the placements set by the test, each worker's clock injected."""

from __future__ import annotations

from simnet import ClusterNet, Node

from meshmq.cluster.mesh import ANSWER_TIMEOUT
from meshmq.cluster.nodeappends import Placements
from meshmq.cluster.sessionowner import SessionOwners

CLIENT = "dev-1"
PARTITIONS = 8


def owners(net: ClusterNet, clocks: dict[str, int], owner: str | None) -> None:
    """Every worker gets SessionOwners; CLIENT's partition is led by ``owner`` (None: not
    assigned), the others by node a; each node's workers' clock reads ``clocks[node]``."""
    for node_id, workers in net.workers.items():
        for worker in workers:
            placed = Placements(PARTITIONS)
            partition = worker.leadership.partitioner.partition_for(CLIENT)
            placed.leaders = [(owner, 1) if p == partition and owner else
                              None if p == partition else ("a", 1) for p in range(PARTITIONS)]
            worker.owners = SessionOwners(worker.links, worker.leadership, placed, node_id,
                                          clock=lambda node_id=node_id: clocks[node_id])


def epoch_of(net: ClusterNet, worker: Node) -> int | None:
    got: list[int | None] = []
    worker.owners.epoch(CLIENT, got.append)
    net.pump()
    for _ in range(3):  # (answers through a second worker: one more round)
        if got:
            break
        any(w.run_soon() for w in net.nodes)
        net.pump()
    assert len(got) == 1, got
    return got[0]


def test_claims_are_ordered_by_the_owner_not_by_the_claimants_clocks() -> None:
    """Node a's clock is far ahead of b's: with b owning the client id, a claim made on a
    and then one made on b get increasing epochs, both drawn by b, whatever a's clock says;
    so the later CONNECT wins the race, not the host whose clock is ahead."""
    net = ClusterNet({"a": 2, "b": 2})
    clocks = {"a": 10**18, "b": 5_000}
    owners(net, clocks, "b")
    first = epoch_of(net, net.of("a", 0))
    second = epoch_of(net, net.of("b", 1))
    third = epoch_of(net, net.of("a", 1))
    assert first is not None and second is not None and third is not None
    assert first < second < third < 10**18  # b's counter: a's clock was never read
    assert first >= 5_000


def test_every_worker_of_the_owner_node_draws_from_its_owner_worker() -> None:
    net = ClusterNet({"a": 1, "b": 3})
    clocks = {"a": 1, "b": 7}  # a clock that stands still: the counter still moves
    owners(net, clocks, "b")
    drawn = [epoch_of(net, worker) for worker in net.workers["b"] for _ in range(2)]
    assert drawn == sorted(drawn) and len(set(drawn)) == len(drawn), drawn
    owner = net.of("b", net.of("b").leadership.owner_of_client(CLIENT))
    assert owner.owners.counters["owner_epochs_drawn"] == len(drawn)


def test_without_an_owner_a_claim_is_stamped_by_its_own_host() -> None:
    """No owner assigned, or the owner node gone: the claim gets no epoch (its host's clock
    stamps it), after at most the answer deadline."""
    net = ClusterNet({"a": 1, "b": 1})
    owners(net, {"a": 1, "b": 2}, None)
    assert epoch_of(net, net.of("a")) is None
    assert net.of("a").owners.counters["claims_without_owner"] == 1

    net = ClusterNet({"a": 1, "b": 1})
    owners(net, {"a": 1, "b": 2}, "b")
    net.stop(net.of("b").index)  # stopped: its link stays up, nothing answers
    got: list[int | None] = []
    net.of("a").owners.epoch(CLIENT, got.append)
    net.pump()
    assert got == []
    net.advance(ANSWER_TIMEOUT + 0.1)
    assert got == [None]


def test_a_node_that_is_not_the_owner_gives_no_epoch() -> None:
    """a takes b for the owner, b's own view says a: b gives none, a stamps with its clock."""
    net = ClusterNet({"a": 1, "b": 1})
    owners(net, {"a": 1, "b": 2}, "b")
    partition = net.of("b").leadership.partitioner.partition_for(CLIENT)
    net.of("b").owners.placements.leaders[partition] = ("a", 2)
    assert epoch_of(net, net.of("a")) is None
