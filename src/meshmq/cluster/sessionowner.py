"""Owner epochs: one order for the CONNECTs of a client id across the nodes of a cluster.

Theory of operation
-------------------
One connection per client id holds across the cluster (MQTT-3.1.4-3): a CONNECT tells the
other nodes (``TAKEOVER``) and, with Clean Start 0, asks them for the session
(``SESSION_FETCH``); a node whose connection of that id is *older* than the claim closes it
and hands the session over, one whose connection is newer keeps it (cluster/takeover.py,
cluster/nodesessions.py). "Older" needs one order for the claims of a client id made on
different nodes, and the hosts' clocks do not give one (a host whose clock is ahead would
win every race).

So each claim carries an *owner epoch*, drawn by the session's owner:

* **The owner** of a client id is the leader node of the client id's partition of the log
  (the metadata's assignment, cluster/nodeappends.py ``Placements``), and there the node's
  owner worker of that id (``Leadership.owner_of_client``, the worker that knows where the
  session is inside the node, cluster/directory.py).
* **An epoch** is drawn from one counter per owner worker: the greater of the last one
  plus one and its wall clock in nanoseconds. So the claims of one client id are ordered as
  they reached its owner, whichever node made them, and an epoch drawn after a restart of
  the owner, or by a new owner after its partition moved, is still after the old ones as
  long as the hosts' clocks differ by less than the time between the two claims.
* **Asking.** The claiming worker asks its link to the owner node (``SESSION_OWNER``); the
  worker there that took the link passes it to the owner worker of its node, whose answer
  (``SESSION_OWNED``) goes back the same way. On the owner node itself, the claiming worker
  asks its node's owner worker (or draws the epoch itself). Nothing is written to the
  metadata: a reconnect storm costs one small round trip per CONNECT, not a Raft write.
* **Without an owner** (the metadata off or not reached yet, the partition unassigned, the
  owner node down or not answering within ``OWNER_TIMEOUT``) the claim is stamped with the
  claiming host's clock, as before owner epochs existed, and the log says so once a minute.

An epoch orders claims; it does not keep state: the owner remembers nothing per client id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshmq.cluster.codec import FrameType, SessionOwned, SessionOwner

if TYPE_CHECKING:
    from meshmq.cluster.leaders import Leadership
    from meshmq.cluster.nodeappends import Placements
    from meshmq.cluster.nodes import NodeLinks

log = logging.getLogger("meshmq.directory")

OWNER_TIMEOUT = 2.0  # seconds a claim waits for its owner's epoch before using this clock
WARN_EVERY = 60.0  # seconds between two "claimed without an owner" log lines

Stamped = Callable[[int | None], None]  # the owner's epoch, or None: none could be had


class SessionOwners:
    """One worker's part: asks owners for epochs, and draws them for the client ids it owns."""

    def __init__(self, links: NodeLinks, leadership: Leadership, placements: Placements,
                 node_id: str, clock: Callable[[], int] = time.time_ns) -> None:
        self.links = links
        self.mesh = mesh = links.mesh
        self.leadership = leadership
        self.placements = placements
        self.node_id = node_id
        self.clock = clock
        self._last = 0
        self._warned = -WARN_EVERY
        self.counters = {"owner_epochs_drawn": 0, "owner_epochs_asked": 0,
                         "claims_without_owner": 0}
        links.handlers[FrameType.SESSION_OWNER] = self._from_node
        links.answers[FrameType.SESSION_OWNED] = self._answer_from_node
        mesh.handle(FrameType.SESSION_OWNER, self._from_worker)

    def owner_node(self, client_id: str) -> str | None:
        placed = self.placements.of(self.leadership.partitioner.partition_for(client_id))
        return None if placed is None else placed[0]

    # ------------------------------------------------------------------ the claimant

    def epoch(self, client_id: str, done: Stamped) -> None:
        """``done(epoch)`` for a claim of ``client_id`` now (None: no owner could give one);
        maybe at once, else on a later loop turn."""
        node = self.owner_node(client_id)
        if node is None:
            return self._without(client_id, "its partition has no leader yet", done)
        if node == self.node_id:
            return self._from_owner_worker(client_id, done)
        link = self.links.dialed(node)
        if link is None or link.peer is None:
            return self._without(client_id, f"its owner, node {node}, is not linked", done)
        self.counters["owner_epochs_asked"] += 1
        got: list[int] = []

        def on_answer(peer: int, frame: SessionOwned | None, late: bool) -> None:
            if frame is not None and frame.epoch and not late:
                got.append(frame.epoch)

        def finished() -> None:
            if got:
                return done(got[0])
            self._without(client_id, f"its owner, node {node}, gave no epoch", done)

        self.mesh.ask_all(lambda request_id: SessionOwner(request_id, client_id).encode(),
                          on_answer, finished, f"owner epoch of client_id={client_id}",
                          peers=[link.peer])

    def _without(self, client_id: str, why: str, done: Stamped) -> None:
        self.counters["claims_without_owner"] += 1
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY:
            self._warned = now
            log.warning("client_id=%s claimed with this host's clock: %s", client_id, why)
        done(None)

    def _from_owner_worker(self, client_id: str, done: Stamped) -> None:
        """This node owns ``client_id``: its owner worker draws the epoch."""
        owner = self.leadership.owner_of_client(client_id)
        if owner == self.leadership.worker.index:
            return done(self.draw())

        def answered(frame: SessionOwned | None) -> None:
            done(frame.epoch if frame is not None and frame.epoch else None)

        if not self.mesh.request(owner, lambda request_id: SessionOwner(
                request_id, client_id).encode(), answered, timeout=OWNER_TIMEOUT):
            done(None)  # the owner worker is down (being restarted)

    def draw(self) -> int:
        epoch = max(self._last + 1, self.clock())
        self._last = epoch
        self.counters["owner_epochs_drawn"] += 1
        return epoch

    # ------------------------------------------------------------------ the owner

    def _from_node(self, peer: int, frame: SessionOwner) -> None:
        """(accepted link) Another node's claim: this node's owner worker draws the epoch."""
        link = self.mesh.remote.get(peer)
        if link is None:
            return
        ident = link.ident

        def answer(epoch: int | None) -> None:
            self.mesh.send(peer, SessionOwned(frame.request_id, epoch or 0).encode(), ident)

        if self.owner_node(frame.client_id) != self.node_id:
            return answer(None)  # (not the owner: the claimant's view is behind)
        self._from_owner_worker(frame.client_id, answer)

    def _answer_from_node(self, peer: int, frame: SessionOwned) -> None:
        """(dialed link) The answer to one of this worker's SESSION_OWNERs."""
        link = self.mesh.remote.get(peer)
        if link is not None:
            self.mesh.requests.answer(link.ident, frame.request_id, frame)

    def _from_worker(self, peer: int, frame: SessionOwner) -> None:
        """(this node's worker) A claim for a client id this worker owns."""
        link = self.mesh.incarnation(peer)
        self.mesh.send(peer, SessionOwned(frame.request_id, self.draw()).encode(), link)
