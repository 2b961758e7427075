"""Retained messages across the nodes of a cluster: every node holds all of them.

Theory of operation
-------------------
Inside a node, a topic's retained message is stored by its owner worker (cluster/retained.py).
Across nodes, every node keeps the whole set, so a subscriber on any node gets the retained
messages of every topic from its own node, as fast as on a single node, and a node that is
cut off still serves what it had.

* **Stamps.** Each retained topic (and each recent clear) has a stamp: nanoseconds of wall
  time at the owner that stored it, and that node's id; of two versions the greater stamp wins
  (last writer wins; the node id breaks a tie). A client's change on this node takes a stamp
  greater than the topic's current one even if this node's clock is behind, so it always
  replaces what it saw. Stamps live in memory: a retained message restored at start has the
  unknown stamp (0), older than any other, so after a restart another node's copy of a topic
  wins over this node's, and between two such copies the one of the greater node id (see
  Limits in docs/cluster.md).
* **Changes.** When a client of this node changes a topic, its owner stores it (acknowledged
  once journaled, as on one node) and sends it, stamped, to every other node over its dialed
  links (``RETAIN_SYNC``). The worker of the other node that receives it hands each entry to
  the topic's owner there, which keeps it only if its stamp is newer (an entry is never passed
  on to a third node). A clear leaves a *tombstone* (its stamp, in memory, the newest
  ``MAX_TOMBSTONES``) so that an older copy arriving later does not bring the message back.
* **Catching up.** When this worker's link to a node comes up (first start, a restart of
  either side, a healed partition), it sends that node everything it owns, with stamps and
  tombstones. Every worker dials every node, so each node gets the whole set of the other,
  and both end with the newer version of every topic.
* ``$SYS/`` topics are each node's own and never cross.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshmq.broker.message import SYS_PREFIX, Message
from meshmq.cluster.codec import FrameType, RetainSync

if TYPE_CHECKING:
    from meshmq.cluster.nodes import NodeLinks
    from meshmq.cluster.retained import OwnedRetained

log = logging.getLogger("meshmq.retained")

Stamp = tuple[int, str]  # (wall time in ns at the storing owner, its node id)
Entry = tuple[str, int, str, bytes | None]  # topic, stamp, node, body (None: a clear)
UNKNOWN: Stamp = (0, "")  # a retained message restored at start: older than any other
MAX_TOMBSTONES = 100_000  # clears remembered (the newest): older ones are forgotten
BATCH_BYTES = 256 * 1024  # a catch-up is sent in frames of about this size


class NodeRetained:
    """One worker's part of the cluster's retained store (module docstring)."""

    def __init__(self, owned: OwnedRetained, nodes: NodeLinks,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.owned = owned
        self.nodes = nodes
        self.node_id = nodes.identity.node_id
        self.clock = clock
        self.stamps: dict[str, Stamp] = {}  # topic -> stamp of the retained message held
        self.tombstones: dict[str, Stamp] = {}  # topic -> stamp of its clear, oldest first
        self.counters = {"retained_sent": 0, "retained_applied": 0, "retained_stale": 0}
        owned.on_kept = self._kept
        owned.mesh.handle(FrameType.RETAIN_SYNC, self._from_peer)
        nodes.handlers[FrameType.RETAIN_SYNC] = self._from_node
        nodes.on_node_up.append(self._node_up)

    def stamp_of(self, topic: str) -> Stamp:
        """The stamp of what this node holds for ``topic``. A message with no stamp (restored
        at start) is (0, this node): of two such copies on two nodes, both keep the one of the
        greater node id, so they agree."""
        stamp = self.stamps.get(topic) or self.tombstones.get(topic)
        if stamp is not None:
            return stamp
        return (0, self.node_id) if self.owned.local.store.get(topic) is not None else UNKNOWN

    # ------------------------------------------------------------------ a change here

    def _kept(self, message: Message) -> None:
        """A client of this node changed ``message.topic``'s retained message, stored here."""
        topic = message.topic
        if topic.startswith(SYS_PREFIX):
            return
        current = self.stamp_of(topic)
        stamp = (max(self.clock(), current[0] + 1), self.node_id)
        body = self._note(topic, stamp, bool(message.payload))
        entry: Entry = (topic, stamp[0], stamp[1],
                        self.owned.encode(message) if body else None)
        frame = RetainSync([entry]).encode()
        for peer in self.nodes.linked_nodes():
            self.owned.mesh.send(peer, frame)
            self.counters["retained_sent"] += 1

    def _note(self, topic: str, stamp: Stamp, present: bool) -> bool:
        """Record ``topic``'s new stamp (a message or a clear); returns ``present``."""
        if present:
            self.stamps[topic] = stamp
            self.tombstones.pop(topic, None)
        else:
            self.stamps.pop(topic, None)
            self.tombstones.pop(topic, None)
            self.tombstones[topic] = stamp  # (moved to the newest end)
            if len(self.tombstones) > MAX_TOMBSTONES:
                del self.tombstones[next(iter(self.tombstones))]
        return present

    # ------------------------------------------------------------------ from other nodes

    def _from_node(self, peer: int, frame: RetainSync) -> None:
        """Entries another node sent this worker: each to its topic's owner in this node."""
        leadership = self.owned.leadership
        mine: list[Entry] = []
        others: dict[int, list[Entry]] = {}
        for entry in frame.entries:
            owner = leadership.owner_of_topic(entry[0])
            (mine if owner == self.owned.me else others.setdefault(owner, [])).append(entry)
        self._apply(mine)
        for owner, entries in others.items():
            if not self.owned.mesh.send(owner, RetainSync(entries).encode()):
                log.warning("retained messages from another node not stored: worker %d of "
                            "this node is down count=%d", owner, len(entries))

    def _from_peer(self, peer: int, frame: RetainSync) -> None:
        """Entries a worker of this node passed on: this worker owns their topics."""
        self._apply(frame.entries)

    def _apply(self, entries: list[Entry]) -> None:
        local = self.owned.local
        for topic, nanos, node_id, body in entries:
            if topic.startswith(SYS_PREFIX):
                continue
            stamp = (nanos, node_id)
            if stamp <= self.stamp_of(topic):
                self.counters["retained_stale"] += 1
                continue
            # a clear is an empty retained message (MQTT-3.3.1-6)
            message = Message(topic, b"", 0, True) if body is None else self.owned.decode(body)
            self._note(topic, stamp, body is not None)
            local.keep(message, None)  # stored and journaled, never passed on
            self.counters["retained_applied"] += 1

    # ------------------------------------------------------------------ catching up

    def _node_up(self, peer: int, node_id: str) -> None:
        """This worker's link to ``node_id`` is up: send it all this worker owns."""
        encode = self.owned.encode
        batch: list[Entry] = []
        size = 0
        sent = 0
        link_send = self.owned.mesh.send

        def flush() -> None:
            nonlocal batch, size, sent
            if batch and link_send(peer, RetainSync(batch).encode()):
                sent += len(batch)
            batch, size = [], 0

        for topic, message in self.owned.local.store.items():
            if topic.startswith(SYS_PREFIX):
                continue
            body = encode(message)
            nanos, stamp_node = self.stamp_of(topic)
            batch.append((topic, nanos, stamp_node, body))
            size += len(body) + len(topic) + 32
            if size >= BATCH_BYTES:
                flush()
        for topic, (nanos, stamp_node) in self.tombstones.items():
            batch.append((topic, nanos, stamp_node, None))
            size += len(topic) + 32
            if size >= BATCH_BYTES:
                flush()
        flush()
        self.counters["retained_sent"] += sent
        if sent:
            log.info("retained messages sent to node=%s count=%d", node_id, sent)
