"""One connection per client id across the nodes of a cluster (MQTT-3.1.4-3).

Theory of operation
-------------------
Inside a node, a CONNECT claims its client id's session from wherever it is held, and the
connection holding it is closed with DISCONNECT 0x8E (cluster/directory.py). Across nodes,
every CONNECT also tells the other nodes (``TAKEOVER``, over this worker's dialed links, with
the wall time of the claim in nanoseconds); the worker that receives it passes it to its
node's other workers, and each closes a connection of that client id whose own claim is
*older* than the stamp, with DISCONNECT 0x8E ("session taken over"), as a broker must when a
client id connects again (MQTT-3.1.4-3). Two CONNECTs of one id on two nodes at once: only the
older one's connection is closed (the newer one ignores the older one's stamp).

The stamp is the claim's *owner epoch* (cluster/sessionowner.py: drawn by the session's
owner, the leader node of the client id's partition, so one counter orders every claim of
that id): the TAKEOVER goes once it came, and anything that weighs another node's claim
against this node's own (a TAKEOVER or SESSION_FETCH that arrives meanwhile) waits for it too
(``when_stamped``). Without an owner (the metadata off or not reached, the owner down) the
stamp is the host's wall clock: keep the clocks in step (NTP), or a skew wider than the time
between two CONNECTs of one id may close the newer one instead.

Sessions move between nodes (cluster/nodesessions.py, docs/cluster.md): with Clean Start 1
the closed connection's session ends (its will, if any, is published as at any session end);
with Clean Start 0 the new node then fetches it (``SESSION_FETCH``, on the same link, after
this frame): the closed connection's session, offline now, is handed over with its queue and
inflight messages, and the new node answers session present 1. Its will follows the rules
of a takeover on one node: published at once when it has no will delay; with one it is not
sent, since the session is resumed before the delay passed (MQTT-3.1.3-9). A session held
by a node the new one could not ask (down, cut off, or not answering in time) stays there,
offline, until it expires or its client comes back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from meshmq.broker.client import is_handle
from meshmq.cluster.codec import FrameType, Takeover

if TYPE_CHECKING:
    from meshmq.broker.lifecycle import Lifecycle
    from meshmq.broker.session import Session
    from meshmq.cluster.directory import Directory
    from meshmq.cluster.nodes import NodeLinks
    from meshmq.cluster.sessionowner import SessionOwners

log = logging.getLogger("meshmq.directory")


class NodeTakeover:
    """One worker's part (module docstring)."""

    def __init__(self, directory: Directory, links: NodeLinks, sessions: dict[str, Session],
                 lifecycle: Lifecycle, now: Callable[[], float],
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.links = links
        self.sessions = sessions
        self.lifecycle = lifecycle
        self.now = now  # the loop's time (a session's end)
        self.clock = clock
        self.counters = {"takeovers_sent": 0, "taken_over": 0}
        # client id -> the stamp of its last CONNECT here: the two sides of a race compare
        # the same kind of time (a claim's), so exactly one of them goes
        self.claimed_at: dict[str, int] = {}
        # the owner epochs (cluster/sessionowner.py; None: this host's clock stamps claims)
        self.owners: SessionOwners | None = None
        # client id -> claims here waiting for their epoch, and what waits for them
        self._stamping: dict[str, int] = {}
        self._after_stamp: dict[str, list[Callable[[], None]]] = {}
        directory.on_claim = self._claimed_here
        links.mesh.handle(FrameType.TAKEOVER, self._from_peer)
        links.handlers[FrameType.TAKEOVER] = self._from_node

    def when_stamped(self, client_id: str, then: Callable[[], None]) -> None:
        """``then()`` once the claims of ``client_id`` made here have their stamps (at once
        if none waits): a session fetch goes after its TAKEOVER, and another node's claim is
        weighed against this node's own."""
        if self._stamping.get(client_id):
            self._after_stamp.setdefault(client_id, []).append(then)
        else:
            then()

    def _claimed_here(self, client_id: str, clean_start: bool) -> None:
        owners = self.owners
        if owners is None:
            return self._stamped(client_id, clean_start, None)
        self._stamping[client_id] = self._stamping.get(client_id, 0) + 1
        owners.epoch(client_id, lambda epoch: self._stamped(client_id, clean_start, epoch,
                                                            counted=True))

    def _stamped(self, client_id: str, clean_start: bool, epoch: int | None,
                 counted: bool = False) -> None:
        stamp = self.clock() if epoch is None else epoch
        claimed = self.claimed_at
        claimed[client_id] = max(stamp, claimed.get(client_id, 0))
        if len(claimed) > 2 * len(self.sessions) + 1024:  # forget those with no session here
            self.claimed_at = {cid: at for cid, at in claimed.items() if cid in self.sessions}
        frame = Takeover(client_id, clean_start, stamp).encode()
        for peer in self.links.linked_nodes():
            if self.links.mesh.send(peer, frame):
                self.counters["takeovers_sent"] += 1
        if counted:
            left = self._stamping.pop(client_id, 1) - 1
            if left > 0:
                self._stamping[client_id] = left
            else:
                for then in self._after_stamp.pop(client_id, []):
                    then()

    def _from_node(self, peer: int, frame: Takeover) -> None:
        self._apply(frame)
        self.links.mesh.broadcast(frame.encode())  # this node's other workers

    def _from_peer(self, peer: int, frame: Takeover) -> None:
        self._apply(frame)

    def _apply(self, frame: Takeover) -> None:
        if self._stamping.get(frame.client_id):  # weighed once this node's claim has its own
            return self.when_stamped(frame.client_id, partial(self._apply, frame))
        session = self.sessions.get(frame.client_id)
        if session is None:
            return
        client = session.client
        if is_handle(client):
            mine = self.claimed_at.get(frame.client_id, int(client.connected_at * 1e9))
            if mine >= frame.stamp:
                return  # newer than the CONNECT elsewhere: that one's connection goes
            self.counters["taken_over"] += 1
            log.info("connection taken over from another node client_id=%s", frame.client_id)
            self.lifecycle.take_over(client)
        if frame.clean_start and self.sessions.get(frame.client_id) is session:
            self.lifecycle.end_session(session, self.now())
