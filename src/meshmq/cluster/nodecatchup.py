"""What a leader node routed to another node and lost when it died, sent again from its log.

Theory of operation
-------------------
With partitions led across nodes (cluster/nodeappends.py), a partition's leader node routes
every one of its records to the other nodes' subscribers, after it has answered the
publisher. If the leader is killed, the FORWARDs it had queued for another node (in its
buffers, or sent but not yet read) are lost with it, while the records are on its disk and
their publishers were acknowledged. A link that is merely cut keeps them (cluster/resend.py);
a process that dies does not.

So a leader sends a record to another node with its place (``FORWARD_AT``: partition,
offset), and each worker that receives one remembers, per leader node and partition, the
last offset it got and the leader's *incarnation* (drawn at each start, in its
``LINK_HELLO``). When it next hears from that node under another incarnation (its own
dialed link to it comes up, or a FORWARD_AT arrives from the new one), the leader restarted:
it asks it (``FETCH``: this node, and per partition the last offset got) to send again what
came after. The worker that receives the FETCH passes each partition's part to that
partition's leader worker, which reads its log from there up to where it ended when the
worker started (what came later was routed live), and forwards each record that the asking
node's routes match, to that node only. At most ``REPLAY_MAX`` records are read per
partition and request. The leader worker reads its own log (the metadata may not have reached
it yet). A FETCH it cannot serve yet (its own link to the asking node not up, or none of that
node's routes matched a record read: they may not have come yet, the FETCH having come on
another link) is tried again every ``FETCH_RETRY_AFTER`` s, ``FETCH_ATTEMPTS`` times in all.

At least once: a record the asking node had got but whose FORWARD_AT came after the last
one it remembers is sent twice. A node that restarts itself forgets its places (its
persistent sessions get what was routed to them while it was down from the senders' resend
logs, cluster/resend.py). Nothing here runs with the metadata off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from meshmq.broker.catchup import message_from_record
from meshmq.cluster.codec import Fetch, FrameType
from meshmq.log.errors import LogError

if TYPE_CHECKING:
    from meshmq.cluster.leaders import Leadership
    from meshmq.cluster.nodes import NodeLinks
    from meshmq.cluster.partitions import PartitionedLog
    from meshmq.log.record import Record

log = logging.getLogger("meshmq.partitions")

REPLAY_MAX = 65536  # records read per partition for one FETCH
FETCH_ATTEMPTS = 10  # a FETCH this worker cannot serve yet is tried again, this many times in all
FETCH_RETRY_AFTER = 1.0  # seconds between the attempts


class NodeCatchup:
    """One worker's side of it (module docstring)."""

    def __init__(self, links: NodeLinks, partitions: PartitionedLog, leadership: Leadership,
                 now: Callable[[], float]) -> None:
        self.links = links
        self.mesh = mesh = links.mesh
        self.partitions = partitions
        self.leadership = leadership
        self.now = now
        # where this worker's log ended when it started, per partition it leads
        self.started_at = list(partitions.high_watermark)
        # leader node -> partition -> [its incarnation, the last offset got from it]
        self.got: dict[str, dict[int, list[int]]] = {}
        self.wanted: dict[str, list[tuple[int, int]]] = {}  # FETCH parts not sent yet
        self.counters = {"fetches_sent": 0, "fetches_served": 0, "records_sent_again": 0}
        mesh.places_for_nodes = True
        links.on_place = self._place
        links.on_node_up.append(self._node_up)
        links.handlers[FrameType.FETCH] = self._fetch_from_node
        mesh.handle(FrameType.FETCH, self._fetch_from_peer)

    # ------------------------------------------------------------------ receiving records

    def _place(self, node_id: str, incarnation: int, partition: int, offset: int) -> None:
        parts = self.got.get(node_id)
        if parts is None:
            parts = self.got[node_id] = {}
        entry = parts.get(partition)
        if entry is None:
            parts[partition] = [incarnation, offset]
            return
        if entry[0] != incarnation:  # the first record from a restarted leader
            self._want(node_id, partition, entry[1])
            entry[0] = incarnation
            self._send_wanted(node_id)
        if offset > entry[1]:
            entry[1] = offset

    def _node_up(self, peer: int, node_id: str) -> None:
        """This worker's dialed link to ``node_id`` is up: if the node restarted, ask it for
        what came after the last record got from it before."""
        parts = self.got.get(node_id)
        link = self.mesh.remote.get(peer)
        hello = link.remote.hello if link is not None else None
        if parts and hello is not None:
            for partition, entry in parts.items():
                if entry[0] != hello.incarnation:
                    self._want(node_id, partition, entry[1])
                    entry[0] = hello.incarnation
        self._send_wanted(node_id)

    def _want(self, node_id: str, partition: int, after: int) -> None:
        self.wanted.setdefault(node_id, []).append((partition, after))

    def _send_wanted(self, node_id: str) -> None:
        wanted = self.wanted.get(node_id)
        link = self.links.dialed(node_id)
        if not wanted or link is None or link.peer is None:
            return  # (when the dialed link comes up)
        if self.mesh.send(link.peer, Fetch(self.links.identity.node_id, wanted).encode()):
            log.info("asking node %s, restarted, for what came after %s", node_id,
                     dict(wanted))
            self.counters["fetches_sent"] += 1
            del self.wanted[node_id]

    # ------------------------------------------------------------------ serving a FETCH

    def _fetch_from_node(self, peer: int, frame: Fetch) -> None:
        """Another node's FETCH: each partition to its leader worker here."""
        by_worker: dict[int, list[tuple[int, int]]] = {}
        for partition, after in frame.partitions:
            if 0 <= partition < self.leadership.partitions:
                by_worker.setdefault(self.leadership.leader_of(partition), []).append(
                    (partition, after))
        for worker, parts in by_worker.items():
            if worker == self.leadership.worker.index:
                self._replay(frame.node_id, parts)
            elif not self.mesh.send(worker, Fetch(frame.node_id, parts).encode()):
                log.warning("cannot pass a FETCH of node %s to worker %d: not linked",
                            frame.node_id, worker)

    def _fetch_from_peer(self, peer: int, frame: Fetch) -> None:
        self._replay(frame.node_id, frame.partitions)

    def _replay(self, node_id: str, parts: list[tuple[int, int]], attempt: int = 0) -> None:
        link = self.links.dialed(node_id)
        if link is None or link.peer is None:
            self._again(node_id, parts, attempt, "not linked to it")
            return
        now = self.now()
        sent = read = 0
        for partition, after in parts:
            if not self.leadership.leads(partition):
                continue
            end = self.started_at[partition]
            offset = max(after + 1, self.partitions.earliest_offset(partition))
            if end - offset > REPLAY_MAX:
                log.warning("FETCH of node %s: partition %d from offset %d is %d records "
                            "back; sending the last %d only", node_id, partition, offset,
                            end - offset, REPLAY_MAX)
                offset = end - REPLAY_MAX
            while offset < end:
                records = self._read_own(partition, offset, min(1024, end - offset))
                if not records:
                    break
                for record in records:
                    if record.offset >= end:
                        break
                    read += 1
                    message = message_from_record(record, partition, now)
                    if message is not None and self.mesh.forward_to_node(link.peer, message,
                                                                          now):
                        sent += 1
                offset = records[-1].offset + 1
        if read and not sent and attempt < FETCH_ATTEMPTS - 1:
            # (the asking node's routes may not have reached this worker yet: its link to
            # that node can come up after the FETCH did, on another link)
            self._again(node_id, parts, attempt, "none of its routes matched yet")
            return
        self.counters["fetches_served"] += 1
        self.counters["records_sent_again"] += sent
        log.info("sent again to node %s after this node restarted records=%d partitions=%s",
                 node_id, sent, [p for p, _ in parts])

    def _again(self, node_id: str, parts: list[tuple[int, int]], attempt: int, why: str
               ) -> None:
        """Serve the FETCH again in ``FETCH_RETRY_AFTER`` s, up to ``FETCH_ATTEMPTS`` in all."""
        if attempt >= FETCH_ATTEMPTS - 1:
            log.warning("FETCH of node %s: %s after %d attempts, nothing sent again", node_id,
                        why, FETCH_ATTEMPTS)
            return
        self.mesh.call_at(self.mesh.io.now() + FETCH_RETRY_AFTER,
                          partial(self._replay, node_id, parts, attempt + 1))

    def _read_own(self, partition: int, offset: int, count: int) -> list[Record]:
        """This worker's own log of a partition it leads: what it wrote before it restarted
        is there, whether or not the metadata has reached it yet (``PartitionedLog.read``
        reads nothing of a partition not placed yet)."""
        try:
            return self.partitions.local.read(partition, offset, count)
        except (OSError, LogError) as error:
            log.warning("FETCH: partition %d not read from offset %d: %r", partition, offset,
                        error)
            return []
