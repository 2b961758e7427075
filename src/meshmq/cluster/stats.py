"""``$SYS`` totals of a node of several workers: each sends its counters to one, which adds.

Every ``mqtt.sys_interval`` each worker's ``SysTopics`` hands ``totals`` its own counters. A
worker other than the statistics owner (worker 0, cluster/leaders.py) sends them there
(``STATS``) and publishes nothing; the owner adds the latest figures of each linked peer to its
own and publishes the node's totals. A peer's figures are at most one interval old, and go
when its link does (a restarted worker starts counting afresh).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshmq.cluster.codec import FrameType, Stats
from meshmq.cluster.leaders import STATISTICS_OWNER

if TYPE_CHECKING:
    from meshmq.cluster.mesh import Mesh


class MeshStatistics:
    """The core's ``NodeStatistics`` for one worker of several."""

    def __init__(self, mesh: Mesh, owner: bool) -> None:
        self.mesh = mesh
        self.owner = owner
        self.workers = mesh.worker.count
        self.peers: dict[int, dict[str, int]] = {}
        mesh.handle(FrameType.STATS, self._on_stats)
        mesh.on_link_down.append(self._forget)

    def _forget(self, peer: int) -> None:
        self.peers.pop(peer, None)

    def totals(self, mine: dict[str, int]) -> dict[str, int] | None:
        mine = {**mine, "forwarded": self.mesh.counters["forwarded"]}
        if not self.owner:
            self.mesh.send(STATISTICS_OWNER, Stats(mine).encode())
            return None
        totals = dict(mine)
        for figures in self.peers.values():
            for name, value in figures.items():
                if name in totals:
                    totals[name] += value
        return totals

    def complete(self) -> bool:
        """Every linked peer has reported once (the first totals after a start)."""
        return not self.owner or set(self.mesh.peers) <= set(self.peers)

    def _on_stats(self, peer: int, frame: Stats) -> None:
        self.peers[peer] = frame.values
