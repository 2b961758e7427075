"""Reading the partitions other nodes lead: replay and log cursors on any node.

Theory of operation
-------------------
With the metadata on, each partition of the commit log is led by one node, and only that
node's log holds it (cluster/nodeappends.py). Its offsets are therefore the partition's
coordinates across the cluster: a record is ``(partition, offset)`` on every node. So a
leader node sends its records to the other nodes *with* their place, in the message body as
between the workers of one node, and a worker elsewhere treats a partition another node leads
as it treats one another worker of its node leads (cluster/partitions.py):

* **The view.** Its high watermark of such a partition only moves on what that partition's
  leader node says: the place of each record forwarded here (the live stream, in the
  leader's order), and the high watermarks the leader node answers to ``LOG_READ`` highs,
  asked *after a route barrier* (so every later record that matches this node's routes is
  forwarded here). So every record at or above the view that matches a route here is still
  to come live: a catch-up that reads up to the view and goes live neither misses nor repeats
  one (broker/catchup.py).
* **Known views.** A worker that has not heard the leader node's high watermarks since the
  partition was placed (the worker just started, the partition moved, the metadata not
  reached yet) does not know its view: ``views_known()`` is False and no catch-up finishes
  (a session restored at start would otherwise go live below records it never read). The
  view is asked for when a leader node's link comes up and when a partition moves here or
  there; the catch-ups are woken when it comes.
* **Reading.** ``read`` serves records from chunks fetched from the leader node (``LOG_READ``
  records: up to ``FETCH_RECORDS`` from an offset, read there from its log, the records as
  the log's own batches). A read of a chunk not here yet asks for it and returns nothing;
  the answer wakes the catch-ups (``on_ready``), which read again; a read past the middle of
  a chunk asks for the next one ahead. So a catch-up never
  blocks the loop; a partition whose leader node is down is read when it is back (its
  other partitions go on). Chunks are kept per partition, the newest ``CHUNKS_KEPT``, so
  sessions reading the same range share them. Below the leader's earliest offset (retention)
  a read raises ``OffsetOutOfRange`` as a local log would.
* **Serving** (the other side): a ``LOG_READ`` for highs is answered after this worker's own
  node sync (its node's leader workers' high watermarks, as of after everything sent to them),
  with the high watermark, earliest offset and (when asked) the offset at a timestamp of each
  partition this node leads; a ``LOG_READ`` for records reads this node's log (own or, for
  another worker's partition, its files) and answers ``NOT_LEADER`` for a partition this node
  does not lead.

Without the metadata nothing here runs: each node has its own log of every partition.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING

from meshmq.cluster.codec import (
    DATA_NOT_LEADER,
    DATA_OK,
    DATA_OUT_OF_RANGE,
    READ_HIGHS,
    READ_RECORDS,
    FrameType,
    LogData,
    LogRead,
    PartitionEnds,
)
from meshmq.log.errors import LogError, OffsetOutOfRange
from meshmq.log.record import decode_batches, encode_batch, split_batches

if TYPE_CHECKING:
    from meshmq.cluster.nodeappends import Placements
    from meshmq.cluster.nodes import NodeLinks
    from meshmq.cluster.partitions import PartitionedLog
    from meshmq.log.record import Record

log = logging.getLogger("meshmq.partitions")

FETCH_RECORDS = 1024  # records asked for per LOG_READ
FETCH_BYTES = 1 << 20  # about this many bytes of records per answer (whole batches)
CHUNKS_KEPT = 8  # fetched chunks kept per partition, the newest
READS_AT_ONCE = 4  # LOG_READs of records in flight per partition
RETRY_AFTER = 0.2  # seconds before an offset whose read brought nothing is asked again


class RemoteLog:
    """One worker's reads of partitions led by other nodes, and its answers to theirs."""

    def __init__(self, links: NodeLinks, partitions: PartitionedLog, placements: Placements,
                 node_id: str) -> None:
        self.links = links
        self.mesh = links.mesh
        self.partitions = partitions
        self.placements = placements
        self.node_id = node_id
        count = len(partitions.high_watermark)
        self.view = partitions.high_watermark  # (shared: the view of every partition)
        self.earliest = [0] * count
        self.known = [False] * count  # the leader node's high watermarks heard since placed
        self.at_timestamp: dict[tuple[int, int], int] = {}  # (partition, ms) -> offset, -1
        self._chunks: list[OrderedDict[int, list[Record]]] = [OrderedDict() for _ in range(count)]
        self._reading: list[set[int]] = [set() for _ in range(count)]  # offsets asked for
        self.on_ready: Callable[[], None] | None = None  # wake the catch-ups (workers.py)
        self.counters = {"log_reads_sent": 0, "log_reads_served": 0, "log_records_fetched": 0}
        links.handlers[FrameType.LOG_READ] = self._on_read
        links.answers[FrameType.LOG_DATA] = self._on_data
        links.on_node_up.append(self._node_up)
        placements.on_change.append(self._placed)

    # ------------------------------------------------------------------ where partitions are

    def elsewhere(self, partition: int) -> bool:
        """Does another node lead ``partition``?"""
        placed = self.placements.leaders[partition]
        return placed is not None and placed[0] != self.node_id

    def here(self, partition: int) -> bool:
        """Does this node lead ``partition``?"""
        placed = self.placements.leaders[partition]
        return placed is not None and placed[0] == self.node_id

    def views_known(self) -> bool:
        """Is every partition placed, and the view of each one led elsewhere heard?"""
        leaders = self.placements.leaders
        node_id = self.node_id
        known = self.known
        return all(placed is not None and (placed[0] == node_id or known[p])
                   for p, placed in enumerate(leaders))

    def _placed(self, changed: list[int]) -> None:
        """Partitions moved (or were placed): their views are asked for again."""
        nodes = set()
        for partition in changed:
            self.known[partition] = False
            self._chunks[partition].clear()
            placed = self.placements.leaders[partition]
            if placed is not None and placed[0] != self.node_id:
                nodes.add(placed[0])
        for node_id in sorted(nodes):
            self._refresh(node_id)
        self._wake()

    def _node_up(self, peer: int, node_id: str) -> None:
        if any(placed is not None and placed[0] == node_id
               for placed in self.placements.leaders):
            self._refresh(node_id)
        self._wake()  # reads of its partitions may go now

    def _refresh(self, node_id: str) -> None:
        """Ask ``node_id`` for its high watermarks (after a route barrier)."""
        self._ask_highs({node_id}, lambda: None)

    # ------------------------------------------------------------------ the view

    def sync(self, done: Callable[[], None], timestamp_ms: int | None = None) -> None:
        """Ask every leader node of a partition led elsewhere for its high watermarks, after
        a route barrier (and, ``timestamp_ms``, the offsets at that time); then ``done()``.
        A node that is not linked or does not answer is passed over."""
        self._ask_highs({placed[0] for placed in self.placements.leaders
                         if placed is not None and placed[0] != self.node_id},
                        done, timestamp_ms)

    def _ask_highs(self, nodes: set[str], done: Callable[[], None],
                   timestamp_ms: int | None = None) -> None:
        peers = [link.peer for node_id in sorted(nodes)
                 if (link := self.links.dialed(node_id)) is not None and link.peer is not None]
        if not peers:
            return done()  # (a node not linked is asked when its link comes up)
        mesh = self.mesh
        stamp = -1 if timestamp_ms is None else timestamp_ms

        def on_answer(peer: int, frame: LogData | None, late: bool) -> None:
            if frame is not None and frame.status == DATA_OK:
                self._heard(peer, frame.ends, timestamp_ms)

        def ask() -> None:
            self.counters["log_reads_sent"] += len(peers)
            mesh.ask_all(lambda request_id: LogRead(request_id, READ_HIGHS,
                                                    timestamp_ms=stamp).encode(),
                         on_answer, finished, "high watermarks of other nodes", peers=peers)

        def finished() -> None:
            done()
            self._wake()

        mesh.barrier(ask)

    def _heard(self, peer: int, ends: list[PartitionEnds], timestamp_ms: int | None) -> None:
        node_id = self.links.linked_nodes().get(peer)
        view, leaders = self.view, self.placements.leaders
        for partition, high, earliest, at in ends:
            if partition >= len(view):
                continue
            placed = leaders[partition]
            if placed is None or placed[0] != node_id:
                continue  # (moved meanwhile: asked again)
            if high > view[partition]:
                view[partition] = high
            self.earliest[partition] = earliest
            self.known[partition] = True
            if timestamp_ms is not None:
                self.at_timestamp[(partition, timestamp_ms)] = at

    def offset_for_timestamp(self, partition: int, timestamp_ms: int) -> int | None:
        at = self.at_timestamp.get((partition, timestamp_ms), -1)
        return None if at < 0 else at

    # ------------------------------------------------------------------ reading

    def read(self, partition: int, offset: int, max_records: int) -> list[Record]:
        """Records of ``partition`` from ``offset``, from the chunks fetched so far; none
        while the chunk is being fetched (``on_ready`` says when to read again)."""
        if offset < self.earliest[partition]:
            raise OffsetOutOfRange(offset, self.earliest[partition], self.view[partition])
        for first, records in reversed(self._chunks[partition].items()):
            last = records[-1].offset
            if first <= offset <= last:
                at = bisect_left(records, offset, key=attrgetter("offset"))
                found = records[at:at + max_records]
                if 2 * (at + len(found)) > len(records) and last + 1 < self.view[partition] \
                        and not self._cached(partition, last + 1):
                    self._fetch(partition, last + 1)  # read ahead: the next chunk
                return found
        self._fetch(partition, offset)
        return []

    def _cached(self, partition: int, offset: int) -> bool:
        return any(first <= offset <= records[-1].offset
                   for first, records in self._chunks[partition].items())

    def _fetch(self, partition: int, offset: int) -> None:
        reading = self._reading[partition]
        if offset in reading or len(reading) >= READS_AT_ONCE:
            return
        placed = self.placements.leaders[partition]
        link = self.links.dialed(placed[0]) if placed is not None else None
        if link is None or link.peer is None:
            return  # offline: read when its node's link comes up (_node_up wakes)
        reading.add(offset)
        self.counters["log_reads_sent"] += 1

        got = [False]

        def on_answer(peer: int, frame: LogData | None, late: bool) -> None:
            if frame is not None and not late:
                got[0] = self._records(partition, offset, frame)

        def again() -> None:
            reading.discard(offset)
            self._wake()

        def finished() -> None:
            if got[0]:
                return again()
            # nothing came (no answer, moved, or nothing there yet): not asked again at once
            self.mesh.call_at(self.mesh.io.now() + RETRY_AFTER, again)

        self.mesh.ask_all(lambda request_id: LogRead(request_id, READ_RECORDS, partition,
                                                     offset, FETCH_RECORDS).encode(),
                          on_answer, finished, f"log read of partition {partition}",
                          peers=[link.peer])

    def _records(self, partition: int, offset: int, frame: LogData) -> bool:
        """Keep the records an answer brought; True if it brought any (or an end)."""
        if frame.ends:  # (the partition's own ends)
            self.earliest[partition] = max(self.earliest[partition], frame.ends[0][2])
        if frame.status != DATA_OK:
            if frame.status == DATA_NOT_LEADER:
                log.info("log read of partition %d: that node no longer leads it", partition)
            return frame.status == DATA_OUT_OF_RANGE  # (read again from the earliest)
        try:
            records = decode_batches(frame.batches, offset)
        except LogError as error:
            log.warning("log read of partition %d answered with damaged records: %s",
                        partition, error)
            return False
        if not records:
            return False
        self.counters["log_records_fetched"] += len(records)
        chunks = self._chunks[partition]
        chunks[records[0].offset] = records
        chunks.move_to_end(records[0].offset)
        while len(chunks) > CHUNKS_KEPT:
            chunks.popitem(last=False)
        return True

    def _on_data(self, peer: int, frame: LogData) -> None:
        """(dialed link) An answer to one of this worker's LOG_READs."""
        link = self.mesh.remote.get(peer)
        if link is not None:
            self.mesh.requests.answer(link.ident, frame.request_id, frame)

    def _wake(self) -> None:
        if self.on_ready is not None:
            self.on_ready()

    # ------------------------------------------------------------------ serving other nodes

    def _on_read(self, peer: int, frame: LogRead) -> None:
        link = self.mesh.remote.get(peer)
        if link is None:
            return
        ident = link.ident
        self.counters["log_reads_served"] += 1
        if frame.kind == READ_HIGHS:
            def answer() -> None:
                self.mesh.send(peer, LogData(frame.request_id, DATA_OK,
                                             self._ends(frame.timestamp_ms)).encode(), ident)

            self.partitions.sync_workers(answer)
            return
        partition = frame.partition
        if not 0 <= partition < len(self.view) or not self.here(partition):
            self.mesh.send(peer, LogData(frame.request_id, DATA_NOT_LEADER, []).encode(), ident)
            return
        status, batches = DATA_OK, b""
        try:
            records = self.partitions.read(partition, frame.offset,
                                           min(frame.max_records, FETCH_RECORDS))
        except OffsetOutOfRange:
            status, records = DATA_OUT_OF_RANGE, []
        if records:
            batches = b"".join(encode_batch(run) for _, run in split_batches(
                records, FETCH_BYTES))
        ends = [(partition, self.view[partition],
                 self.partitions.earliest_offset(partition), -1)]
        self.mesh.send(peer, LogData(frame.request_id, status, ends, batches).encode(), ident)

    def _ends(self, timestamp_ms: int) -> list[PartitionEnds]:
        partitions = self.partitions
        ends = []
        for partition in range(len(self.view)):
            if not self.here(partition):
                continue
            at = -1
            if timestamp_ms >= 0:
                found = partitions.offset_for_timestamp(partition, timestamp_ms)
                at = -1 if found is None else found
            ends.append((partition, self.view[partition],
                         partitions.earliest_offset(partition), at))
        return ends
