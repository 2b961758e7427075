"""Catch-up: a session reading persisted messages from the commit log instead of holding copies.

Theory of operation
-------------------
Persisted messages are routed in log order: when an append is durable the broker moves that
partition's *high watermark* (``Persistence.high_watermark[p]``, the offset after the last routed
record) and routes the message, all on the event loop. So at any moment, every persisted
message a session should have seen is either below the high watermark (it was routed) or not
routed yet.

A session uses a ``CatchUp`` when live delivery is not enough:

* a persistent session that goes offline, or whose bounded queue overflows, switches to its
  cursor: it stops taking copies of persisted messages, and later reads them from the log from
  where it stopped (``from_positions``);
* a client asks to replay history on SUBSCRIBE (docs/replay.md): that filter reads from the
  requested offsets up to the high watermark before it goes live.

Each ``ReplayFilter`` has its own start offset per partition (so two replays, or a resume and a
replay, never deliver the same record twice for one filter), and the catch-up's cursor per
partition is the lowest start still ahead. While a catch-up is active, a live persisted message
that one of its filters will read is skipped by the session (``covers``); the catch-up reaches
it later, in order. When every cursor reaches the high watermark the catch-up is finished and the
session is live again. Reading happens in chunks, only while the session's queue has room, so a
catch-up of millions of records holds a bounded number of them in memory.

**The index: reading only what a session needs.** Reading every record from a cursor would
make a reconnect storm quadratic: ten thousand devices, each subscribed to its own topic, that
missed one message each while offline would each read all ten thousand records. So a catch-up
keeps, per partition, the offsets of the records it will deliver (``_index``), from
``_indexed_from`` on:

* while it runs, every persisted message routed to the session that ``covers`` says it will
  read is noted there (the router delivers every match to the session, in log order per
  partition, so from the high watermark at which noting began nothing is missed);
* at start-up, ``index_restored`` reads each partition once, from the lowest cursor of the
  restored sessions, and gives every restored catch-up the offsets its filters match.

Below ``_indexed_from`` the catch-up reads every record, as without an index; above it, it
reads only the listed offsets and skips the rest. Whatever could make the list incomplete
moves ``_indexed_from`` up to the high watermark, so that part is read in full instead: a
filter added (a replay from the past), a start moved back (``read_in_full_below``), more than
``INDEX_MAX`` offsets in one partition (a session that needs most records gains nothing from a
list). Only the partitions this router leads are indexed (``PartitionLog.routes_all``): every
record of those is routed here, with the routes as they are at the time. Of a partition led by
another worker this router sees only what the leader forwarded to it, and its view of the high
watermark may pass records routed before a route of a just moved or restored session reached the
leader; those partitions are read in full, as before.
"""

from __future__ import annotations

import logging
import time
from array import array
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from meshmq.broker.message import Message
from meshmq.broker.subscription import Subscription
from meshmq.log.errors import LogError, OffsetOutOfRange
from meshmq.log.record import Record
from meshmq.memo import remember
from meshmq.mqtt.codec import decode_properties
from meshmq.mqtt.properties import PacketKind, Properties, PropertyId, get_property
from meshmq.mqtt.topics import topic_matches

log = logging.getLogger("meshmq.catchup")

CHUNK_RECORDS = 512  # records read from one partition per step
INDEX_MAX = 8192  # offsets listed per partition; beyond, that partition is read in full
STARTUP_INDEX_RECORDS = 1_000_000  # per partition, read once at start-up (index_restored)
NEAR = 8  # listed offsets this close are read in one go, the records between them too
NEVER = 1 << 62  # an _indexed_from that no offset reaches: the partition is read in full


class LogReader(Protocol):
    """What a catch-up reads of the commit log: the core's ``PartitionLog``
    (broker/interfaces.py), seen from here."""

    high_watermark: list[int]  # per partition: the offset after the last record routed here

    def read(self, partition: int, offset: int, max_records: int) -> list[Record]:
        """Records from ``offset`` (raises ``OffsetOutOfRange`` below the earliest)."""

    def earliest_offset(self, partition: int) -> int: ...

    def routes_all(self, partition: int) -> bool:
        """Is every record of ``partition`` routed here (this router leads it)?"""

    def views_known(self) -> bool:
        """Is every partition's high watermark known here (heard from its leader)?"""


@dataclass(slots=True)
class ReplayFilter:
    """One topic filter read from the log, from ``start[p]`` on in each partition ``p``
    (``first``: where it began, for ``CatchUp.read_already``)."""

    topic_filter: str
    subscription: Subscription | None  # None: use the session's current subscription
    start: list[int]
    first: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.first:
            self.first = list(self.start)

    def restart(self, start: list[int]) -> None:
        self.start = list(start)
        self.first = list(start)


@dataclass(slots=True)
class CatchUp:
    persistence: LogReader
    filters: list[ReplayFilter] = field(default_factory=list)
    dup_below: list[int] | None = None  # records below these offsets may have been sent before
    lost: int = 0  # records deleted by retention before this session could read them
    syncing: int = 0  # waiting for the leaders' high watermarks (PartitionLog.sync)
    _skipped: dict[int, int] = field(default_factory=dict)
    _failing: set[int] = field(default_factory=set)  # partitions whose read failed (logged)
    _matched: dict[tuple[str, str], bool] = field(default_factory=dict)
    # per partition: from this offset on, _index lists every record this catch-up delivers
    _indexed_from: list[int] | None = None
    _index: list[array[int]] = field(default_factory=list)
    _unpassed: set[int] | None = None  # (finished) partitions no copy past its read came in

    def _matches(self, topic_filter: str, topic: str) -> bool:
        """``topic_matches``, cached per (filter, topic): a catch-up sees the same few topics
        over and over."""
        key = (topic_filter, topic)
        found = self._matched.get(key)
        if found is None:
            found = remember(self._matched, key, topic_matches(topic_filter, topic))
        return found

    # ------------------------------------------------------------------ construction

    def add(self, topic_filter: str, subscription: Subscription | None, start: list[int]) -> None:
        """Read ``topic_filter`` from ``start`` (replaces an earlier entry for that filter)."""
        self.filters = [f for f in self.filters if f.topic_filter != topic_filter]
        self.filters.append(ReplayFilter(topic_filter, subscription, list(start)))
        self._index_from_now()  # what it needs below the high watermark was not noted

    def read_in_full_below(self, partition: int, offset: int) -> None:
        """A filter's start moved back below ``offset``: read that part in full."""
        indexed_from = self._indexed_from
        if indexed_from is not None and indexed_from[partition] < offset:
            indexed_from[partition] = offset

    def _index_from_now(self) -> None:
        """Note from the high watermark on, on the partitions this router leads (on another's,
        the leader forwards only what matched this router's routes when it routed it, and the
        view may pass records routed before a route got there: those are read in full)."""
        log_ = self.persistence
        high = log_.high_watermark
        indexed_from = self._indexed_from
        if indexed_from is None:
            self._index = [array("q") for _ in high]
            self._indexed_from = [end if log_.routes_all(p) else NEVER
                                  for p, end in enumerate(high)]
            return
        for partition, end in enumerate(high):
            if indexed_from[partition] < end:
                indexed_from[partition] = end

    def cursor(self) -> list[int]:
        """Per partition: the lowest offset some filter still has to read."""
        high = self.persistence.high_watermark
        if not self.filters:
            return list(high)
        return [min(f.start[p] for f in self.filters) for p in range(len(high))]

    # ------------------------------------------------------------------ live traffic

    def covers(self, topic: str, position: tuple[int, int]) -> bool:
        """Will this catch-up deliver the persisted message at ``position`` on ``topic``?"""
        partition, offset = position
        if not self._wants(topic, partition, offset):
            return False
        indexed_from = self._indexed_from
        if indexed_from is not None and offset >= indexed_from[partition]:
            self._note(partition, offset)
        return True

    def read_already(self, topic: str, position: tuple[int, int]) -> bool:
        """(A finished catch-up) Did it deliver the persisted message at ``position``? A live
        copy can come after the catch-up read it when the view passed a record still on its
        way here: from another node, whose high watermarks and records do not travel on
        one link (cluster/remotelog.py), or resent to a node that restarted."""
        partition, offset = position
        unpassed = self._unpassed
        if unpassed is None:  # the partitions it read something of
            unpassed = self._unpassed = {
                p for p in range(len(self.persistence.high_watermark))
                if any(f.first[p] < f.start[p] for f in self.filters)}
        if partition not in unpassed:
            return False
        if all(offset >= f.start[partition] for f in self.filters):
            unpassed.discard(partition)  # live past what it read: no late copy comes now
            return False  # (one partition's copies come in its leader's order)
        return self.read_before(topic, partition, offset)

    def read_before(self, topic: str, partition: int, offset: int) -> bool:
        """Has this catch-up read (and delivered) the record at ``offset`` on ``topic``?"""
        return any(
            f.first[partition] <= offset < f.start[partition]
            and self._matches(f.topic_filter, topic) for f in self.filters
        )

    @property
    def tail_passed(self) -> bool:
        """(A finished catch-up) Has a live copy past what it read come in every partition
        it read? Then ``read_already`` is False from now on."""
        return self._unpassed is not None and not self._unpassed

    def _wants(self, topic: str, partition: int, offset: int) -> bool:
        return any(
            f.start[partition] <= offset and self._matches(f.topic_filter, topic)
            for f in self.filters
        )

    def _note(self, partition: int, offset: int) -> None:
        """The record at ``offset`` is one to deliver (it is at or above ``_indexed_from``)."""
        index = self._index[partition]
        if not index or index[-1] < offset:
            if len(index) >= INDEX_MAX:  # too many to list: read the partition in full
                self._index[partition] = array("q")
                assert self._indexed_from is not None
                self._indexed_from[partition] = offset + 1
                return
            index.append(offset)
        elif index[bisect_left(index, offset)] != offset:
            insort(index, offset)  # (routing is in log order: not seen)

    # ------------------------------------------------------------------ reading

    @property
    def finished(self) -> bool:
        if self.syncing or not self.persistence.views_known():
            return False
        high = self.persistence.high_watermark
        return all(f.start[p] >= high[p] for f in self.filters for p in range(len(high)))

    def step(
        self, budget: int, subscriptions: dict[str, Subscription],
        deliver: Callable[[Message, Subscription, bool], bool], loop_now: float,
    ) -> int:
        """Read up to ``budget`` records and ``deliver`` the matching ones; return records read.

        ``deliver(message, subscription, dup)`` gets each match in log order per partition and
        returns False when the session cannot take it now: reading stops there, and that record
        is read again by the next step.
        """
        if self.syncing:
            return 0
        high = self.persistence.high_watermark
        cursor = self.cursor()
        read = 0
        for partition, end in enumerate(high):
            if read >= budget:
                break
            offset = cursor[partition]
            if offset >= end:
                continue
            offset, limit = self._span(partition, offset, min(budget - read, end - offset), end)
            done = offset
            for record in self._read(partition, offset, limit) if limit else ():
                if record.offset >= end:
                    break
                if not self._deliver(record, partition, subscriptions, deliver, loop_now):
                    budget = 0
                    break
                read += 1
                done = record.offset + 1
            else:
                done = max(done, self._after_gap(partition, offset))
            for f in self.filters:
                f.start[partition] = max(f.start[partition], done)
        return read

    def _span(self, partition: int, offset: int, limit: int, end: int) -> tuple[int, int]:
        """Where to read ``partition`` from, and how many records: from ``offset`` in full
        below ``_indexed_from``; above it, from the next listed offset through the run of
        listed offsets at most ``NEAR`` apart that follows it, within ``limit`` records (none
        left below ``end``: ``(end, 0)``, nothing to read)."""
        indexed_from = self._indexed_from
        if indexed_from is None:
            return offset, limit
        start = indexed_from[partition]
        if offset < start:
            return offset, min(limit, start - offset)
        index = self._index[partition]
        first = bisect_left(index, offset)
        if first > CHUNK_RECORDS:
            del index[:first]  # behind every filter's start: never read again
            first = 0
        if first == len(index) or index[first] >= end:
            return end, 0
        offset = index[first]
        stop = min(end, offset + limit)
        last = offset  # extend over the next listed offsets while they lie close
        for listed in index[first + 1:first + CHUNK_RECORDS]:
            if listed >= stop or listed - last > NEAR:
                break
            last = listed
        return offset, last - offset + 1

    def _after_gap(self, partition: int, offset: int) -> int:
        """Where reading continues when a read returned nothing (a retention gap skipped)."""
        return self._skipped.pop(partition, offset)

    def _read(self, partition: int, offset: int, limit: int) -> list[Record]:
        log_ = self.persistence
        try:
            return log_.read(partition, offset, min(limit, CHUNK_RECORDS))
        except OffsetOutOfRange as error:
            earliest = log_.earliest_offset(partition)
            if earliest <= offset:
                return self._unreadable(partition, offset, error)
            self.lost += earliest - offset
            log.warning("catch-up skipped records deleted by retention partition=%d "
                        "offsets=%d..%d", partition, offset, earliest - 1)
            self._skipped[partition] = earliest
            return []
        except (OSError, LogError) as error:
            return self._unreadable(partition, offset, error)

    def _unreadable(self, partition: int, offset: int, error: Exception) -> list[Record]:
        """A read that failed (damaged stored bytes, a view ahead of the log): nothing now,
        read again on the next step. The catch-up waits at that offset: it skips nothing, and
        the error does not reach the loop (it would close the connection or the mesh link
        whose event woke this session). Logged once per partition."""
        if partition not in self._failing:
            self._failing.add(partition)
            log.error("catch-up cannot read partition=%d offset=%d error=%r (it waits there)",
                      partition, offset, error)
        return []

    def _deliver(
        self, record: Record, partition: int, subscriptions: dict[str, Subscription],
        deliver: Callable[[Message, Subscription, bool], bool], loop_now: float,
    ) -> bool:
        offset = record.offset
        chosen: Subscription | None = None
        for f in self.filters:
            if f.start[partition] > offset or not self._matches(f.topic_filter, record.topic):
                continue
            sub = f.subscription or subscriptions.get(f.topic_filter)
            if sub is None:
                continue
            if chosen is None or sub.options.qos > chosen.options.qos:
                chosen = sub
        if chosen is None:
            return True
        message = message_from_record(record, partition, loop_now)
        if message is None:
            return True  # expired (MQTT-3.3.2-5)
        dup = self.dup_below is not None and offset < self.dup_below[partition]
        return deliver(message, chosen, dup)


def message_from_record(record: Record, partition: int, loop_now: float) -> Message | None:
    """Rebuild the ``Message`` a log record holds; None when its expiry interval has passed.

    The record's property block is the 5.0 PUBLISH block as published (length prefix
    included); a remaining expiry is counted from the record's timestamp (MQTT-3.3.2-6).
    """
    properties: Properties = {}
    if record.properties:
        properties, _ = decode_properties(
            record.properties, 0, len(record.properties), PacketKind.PUBLISH
        )
    expiry = get_property(properties, PropertyId.MESSAGE_EXPIRY_INTERVAL)
    if expiry is not None:
        age = (int(time.time() * 1000) - record.timestamp_ms) // 1000
        remaining = expiry - max(age, 0)
        if remaining <= 0:
            return None
        properties[PropertyId.MESSAGE_EXPIRY_INTERVAL] = remaining
    message = Message(
        record.topic, record.payload, record.qos, record.retain, properties,
        record.client_id or None, loop_now,
    )
    message.set_position(partition, record.offset)
    return message


def index_restored(
    catchups: list[CatchUp], persistence: LogReader,
    candidates: Callable[[str], Iterable[CatchUp]],
) -> int:
    """Index the catch-ups of sessions just restored at start-up: read each partition once,
    from the lowest of their cursors (at most ``STARTUP_INDEX_RECORDS`` back) to the high
    watermark, and list each record for the catch-ups that will deliver it. ``candidates``
    names the catch-ups whose sessions subscribe to a topic (a superset is fine: each is
    asked). Returns the records read."""
    high = persistence.high_watermark
    read = 0
    for partition, end in enumerate(high):
        restored = [c for c in catchups
                    if c._indexed_from is not None and c._indexed_from[partition] == end]
        if not restored:
            continue
        lowest = min(c.cursor()[partition] for c in restored)
        if lowest >= end:
            continue
        found: dict[int, list[int]] = {}  # id(catch-up) -> offsets
        try:
            begin = offset = max(lowest, end - STARTUP_INDEX_RECORDS,
                                 persistence.earliest_offset(partition))
            while offset < end:
                records = persistence.read(partition, offset, min(CHUNK_RECORDS, end - offset))
                if not records:
                    break
                for record in records:
                    if record.offset >= end:
                        break
                    topic, at = record.topic, record.offset
                    for catchup in candidates(topic):
                        if catchup._wants(topic, partition, at):
                            listed = found.setdefault(id(catchup), [])
                            if not listed or listed[-1] != at:
                                listed.append(at)
                read += len(records)
                offset = records[-1].offset + 1
        except (OSError, LogError) as error:
            log.warning("start-up index of partition %d not built error=%r", partition, error)
            continue
        if offset < end:
            continue  # could not read it all: these catch-ups read this partition in full
        for catchup in restored:
            index = catchup._index[partition]
            listed = found.get(id(catchup), [])
            if len(listed) + len(index) > INDEX_MAX:
                continue
            catchup._index[partition] = array("q", listed + list(index))
            indexed_from = catchup._indexed_from
            assert indexed_from is not None
            indexed_from[partition] = begin
    return read
