"""The cluster's ``$SYS`` figures (cluster/nodestats.py) in the simulated network: every
node's worker 0 ends with each node's totals and their sums; a silent node's figures go."""

from __future__ import annotations

from simnet import ClusterNet

from meshmq.cluster.nodestats import STALE_AFTER, ClusterStatistics
from meshmq.cluster.stats import MeshStatistics

INTERVAL = 10.0


def attach(net: ClusterNet) -> dict[int, ClusterStatistics]:
    return {worker.index: ClusterStatistics(
        MeshStatistics(worker.mesh, worker.spec.index == 0), worker.links, INTERVAL)
        for worker in net.nodes}


def tick(net: ClusterNet, parts: dict[int, ClusterStatistics],
         counts: dict[int, int]) -> dict[str, dict[str, int]]:
    """One $SYS interval: every worker hands in its count of connected clients (workers
    other than 0 first, as their timers may fire); returns what each node publishes."""
    published = {}
    for worker in sorted(net.nodes, key=lambda w: w.spec.index == 0):
        totals = parts[worker.index].totals({"clients_connected": counts[worker.index],
                                             "retained": 5 if worker.spec.index == 0 else 0})
        net.pump()
        if totals is not None:
            published[net.node_of[worker.index]] = totals
    return published


def test_every_node_publishes_each_nodes_figures_and_the_clusters_sums() -> None:
    net = ClusterNet({"a": 2, "b": 3, "c": 1})
    parts = attach(net)
    counts = {worker.index: 10 * worker.index + 1 for worker in net.nodes}
    by_node = {node_id: sum(counts[w.index] for w in workers)
               for node_id, workers in net.workers.items()}
    tick(net, parts, counts)
    published = tick(net, parts, counts)  # (the first round: some nodes had not heard yet)
    assert sorted(published) == ["a", "b", "c"]  # one publisher per node: its worker 0
    for node_id, topics in published.items():
        assert topics["clients_connected"] == by_node[node_id]  # the node's own, as before
        assert topics["cluster/nodes"] == 3
        assert topics["cluster/clients/connected"] == sum(by_node.values())
        assert topics["cluster/retained messages/count"] == 5  # held by all: not summed
        for other, value in by_node.items():
            assert topics[f"cluster/nodes/{other}/clients/connected"] == value
    figures = parts[net.of("b").index].figures()
    assert figures["totals"]["clients_connected"] == sum(by_node.values())
    assert parts[net.of("b", 1).index].figures() == {}  # only worker 0 adds up


def test_a_silent_nodes_figures_leave_the_sums() -> None:
    net = ClusterNet({"a": 1, "b": 1, "c": 1})
    parts = attach(net)
    counts = {worker.index: 7 for worker in net.nodes}
    tick(net, parts, counts)
    assert tick(net, parts, counts)["a"]["cluster/clients/connected"] == 21
    net.stop(net.of("c").index)
    net.advance(STALE_AFTER * INTERVAL + 1)
    tick(net, parts, counts)  # (a hears b's figures of this round after its own tick)
    published = tick(net, parts, counts)
    assert published["a"]["cluster/nodes"] == 2
    assert published["a"]["cluster/clients/connected"] == 14
    assert "cluster/nodes/c/clients/connected" not in published["a"]
