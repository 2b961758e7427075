"""``$SYS`` and the admin API across the nodes of a cluster: each node's totals, and the sums.

Theory of operation
-------------------
Inside a node, worker 0 adds up its workers' counters every ``mqtt.sys_interval``
(cluster/stats.py). In a cluster it also sends the node's totals to every other node over its
dialed links (``NODE_STATS``); the worker of the other node that receives them hands them to
its own worker 0. So every node's worker 0 holds the latest totals of each node it hears from,
and publishes, beside the node's own topics:

* ``$SYS/broker/cluster/nodes/<node id>/<topic>``: each node's figures (this one's included);
* ``$SYS/broker/cluster/<topic>``: their sums over the nodes heard from within the last
  ``STALE_AFTER`` intervals, and ``cluster/nodes`` (how many that is). The retained messages
  are held by every node (cluster/noderetained.py): their count is the greatest of the nodes',
  not a sum.

A dead or cut-off node's figures go after ``STALE_AFTER`` intervals. The figures are at most
one interval old per node (two hops: a worker to its worker 0, that node to this one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshmq.broker.systopics import TOPICS
from meshmq.cluster.codec import FrameType, NodeStats
from meshmq.cluster.leaders import STATISTICS_OWNER

if TYPE_CHECKING:
    from meshmq.cluster.nodes import NodeLinks
    from meshmq.cluster.stats import MeshStatistics

STALE_AFTER = 3.0  # intervals without figures from a node: left out of the sums
HELD_EVERYWHERE = frozenset({"retained"})  # the same set on every node: not summed


class ClusterStatistics:
    """The core's ``NodeStatistics`` for one worker of a cluster's node (module docstring)."""

    def __init__(self, node: MeshStatistics, links: NodeLinks, interval: float) -> None:
        self.node = node
        self.links = links
        self.node_id = links.identity.node_id
        self.interval = interval
        self.workers = node.workers
        self.heard: dict[str, tuple[float, dict[str, int]]] = {}  # node id -> (when, totals)
        node.mesh.handle(FrameType.NODE_STATS, self._from_peer)
        links.handlers[FrameType.NODE_STATS] = self._from_node

    def complete(self) -> bool:
        return self.node.complete()

    def totals(self, mine: dict[str, int]) -> dict[str, int] | None:
        totals = self.node.totals(mine)
        if totals is None:  # not this node's statistics owner: sent to it
            return None
        frame = NodeStats(self.node_id, totals).encode()
        for peer in self.links.linked_nodes():
            self.node.mesh.send(peer, frame)
        self.heard[self.node_id] = (self.node.mesh.io.now(), dict(totals))
        return {**totals, **self._cluster_topics()}

    def figures(self) -> dict[str, Any]:
        """Per node and summed, for the admin API (empty on a worker other than worker 0)."""
        nodes = self._fresh()
        return {"nodes": nodes, "totals": _sums(nodes)} if nodes else {}

    # ------------------------------------------------------------------ from other nodes

    def _from_node(self, peer: int, frame: NodeStats) -> None:
        if self.node.owner:
            self._record(frame)
        else:
            self.node.mesh.send(STATISTICS_OWNER, frame.encode())

    def _from_peer(self, peer: int, frame: NodeStats) -> None:
        self._record(frame)

    def _record(self, frame: NodeStats) -> None:
        if frame.node_id != self.node_id:
            self.heard[frame.node_id] = (self.node.mesh.io.now(), dict(frame.values))

    # ------------------------------------------------------------------ the figures

    def _fresh(self) -> dict[str, dict[str, int]]:
        oldest = self.node.mesh.io.now() - STALE_AFTER * max(self.interval, 1.0)
        for node_id in [n for n, (when, _) in self.heard.items() if when < oldest]:
            del self.heard[node_id]
        return {node_id: values for node_id, (_, values) in sorted(self.heard.items())}

    def _cluster_topics(self) -> dict[str, int]:
        """Extra ``$SYS/broker/`` topics: counter names the core does not know are topics."""
        nodes = self._fresh()
        topics = {f"cluster/{_topic(name)}": value for name, value in _sums(nodes).items()}
        topics["cluster/nodes"] = len(nodes)
        for node_id, values in nodes.items():
            for name, value in values.items():
                topics[f"cluster/nodes/{node_id}/{_topic(name)}"] = value
        return topics


def _sums(nodes: dict[str, dict[str, int]]) -> dict[str, int]:
    sums: dict[str, int] = {}
    for values in nodes.values():
        for name, value in values.items():
            if name in HELD_EVERYWHERE:
                sums[name] = max(sums.get(name, 0), value)
            else:
                sums[name] = sums.get(name, 0) + value
    return sums


def _topic(name: str) -> str:
    return TOPICS.get(name, name)
