"""Reading records for ``meshmq log dump`` and ``tail``, while a broker may be appending.

Theory of operation
-------------------
Everything is read from the files (``inspect``), never through ``CommitLog``: no lock, no
writes. ``dump_records`` walks each selected partition's segments in order, reading only batch
headers for batches it skips (below ``from_offset``, or older than ``from_timestamp``) and
decoding (with checksums) the rest. ``tail_partition`` reads a partition backwards, batch by
batch from the end, until it has the last N matching records.

``Follower`` keeps a ``Cursor`` per partition (segment, byte position, next offset) and polls:
it lists the partition's segments first, then reads the current segment from the cursor to its
end. A complete batch is returned and the cursor moves past it; an incomplete one at the end, or
one only zeros follow (the space the broker preallocates), is a write in progress, read again
at the next poll. So is, once, any other damage in a segment not known to be sealed: a read
racing with a write may see a later page of it copied and an earlier one not yet. When the
listing (taken *before* the read) shows a later segment, the current one was sealed before the
read, so once it is read to the end the cursor moves on to the next segment. A segment deleted
by retention under a slow cursor makes it jump to the next segment, with a warning.

Damage never stops a read: it is reported through ``warn`` (partition, file, byte, reason)
and the read goes on at the next valid batch. The end of a partition's last segment is not
reported when it may be a write in progress (``live``).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from meshmq.log.errors import CorruptBatch, IncompleteBatch
from meshmq.log.inspect import Batch, Damage, walk_batches
from meshmq.log.reader import LogDirectory, SegmentFile
from meshmq.log.record import Record, decode_batch, read_batch_header, verify_batch
from meshmq.mqtt.topics import topic_matches

Warn = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Selection:
    """Which records to show; every filter must pass (topic: any of ``topics``)."""

    partitions: tuple[int, ...]
    topics: tuple[str, ...] = ()
    from_offset: int | None = None
    from_timestamp: int | None = None

    def wants_topic(self, topic: str) -> bool:
        return not self.topics or any(topic_matches(f, topic) for f in self.topics)


def _damage_warning(segment: SegmentFile, damage: Damage) -> str:
    where = f"partition {segment.partition}, {segment.path.name}, byte {damage.position}"
    if damage.resume is None:
        return f"{where}: {damage.reason}; nothing readable after it in this file"
    return f"{where}: {damage.reason}; skipped to the next valid batch at byte {damage.resume}"


def _decode(segment: SegmentFile, data: bytes, position: int, warn: Warn,
            quiet: bool = False) -> list[Record]:
    """The records of the batch at ``position``; on a bad checksum, a warning (unless
    ``quiet``) and nothing."""
    try:
        return decode_batch(data, position)[0]
    except (CorruptBatch, IncompleteBatch) as exc:
        if not quiet:
            warn(f"partition {segment.partition}, {segment.path.name}, byte {position}: "
                 f"{exc}; batch skipped")
        return []


def _batches(segment: SegmentFile, data: bytes, last: bool, live: bool,
             warn: Warn) -> Iterator[Batch]:
    """Header-checked batches of ``data``; damage is warned about (except a live tail)."""
    for item in walk_batches(data, segment.base_offset, check=read_batch_header):
        if isinstance(item, Damage):
            if not (last and live and item.in_progress):
                warn(_damage_warning(segment, item))
            continue
        yield item


def _tail_in_progress(data: bytes, position: int, last: bool, live: bool) -> bool:
    """A live segment's last batch may fail its checksum while still being written."""
    return last and live and position + read_batch_header(data, position).batch_length == len(
        data)


def dump_records(log: LogDirectory, selection: Selection, *, live: bool,
                 warn: Warn) -> Iterator[tuple[int, Record]]:
    """Yield (partition, record) for every selected record, partition by partition.

    ``from_timestamp`` starts each partition at its first record at or after that time (as
    ``CommitLog.offset_for_timestamp`` does); later records are all shown.
    """
    for partition in selection.partitions:
        yield from ((partition, r) for r in _dump_partition(log, partition, selection, live,
                                                             warn))


def _dump_partition(log: LogDirectory, partition: int, selection: Selection, live: bool,
                    warn: Warn) -> Iterator[Record]:
    segments = log.segments(partition)
    from_offset = selection.from_offset or 0
    from_ts = selection.from_timestamp
    started = from_ts is None
    for i, segment in enumerate(segments):
        if i + 1 < len(segments) and segments[i + 1].base_offset <= from_offset:
            continue  # every offset of this segment is below from_offset
        data = segment.read()
        if data is None:
            continue  # deleted by retention since the listing
        last = i + 1 == len(segments)
        for batch in _batches(segment, data, last, live, warn):
            header = batch.header
            if header.last_offset < from_offset or (
                    from_ts is not None and not started and header.max_timestamp < from_ts):
                continue
            quiet = _tail_in_progress(data, batch.position, last, live)
            for record in _decode(segment, data, batch.position, warn, quiet):
                if record.offset < from_offset:
                    continue
                if not started:
                    if from_ts is not None and record.timestamp_ms < from_ts:
                        continue
                    started = True
                if selection.wants_topic(record.topic):
                    yield record


@dataclass(slots=True)
class Cursor:
    """Where a follower is in one partition: the next byte to read and the offset expected."""

    partition: int
    segment_base: int
    position: int
    next_offset: int


def tail_partition(log: LogDirectory, partition: int, count: int, selection: Selection, *,
                   live: bool, warn: Warn) -> tuple[list[Record], Cursor]:
    """The last ``count`` records of ``partition`` that pass ``selection`` (oldest first), and
    a cursor just after the last complete batch read, where ``Follower`` takes over."""
    found: deque[Record] = deque()
    cursor: Cursor | None = None
    segments = log.segments(partition)
    for segment in reversed(segments):
        if cursor is not None and len(found) >= count:
            break
        data = segment.read()
        if data is None:
            continue  # deleted by retention since the listing
        last = segment is segments[-1]
        positions = array("Q", (b.position for b in _batches(segment, data, last, live, warn)))
        if cursor is None:
            cursor = _cursor_after(segment, data, positions)
        for position in reversed(positions):
            if len(found) >= count:
                break
            quiet = _tail_in_progress(data, position, last, live)
            matching = [r for r in _decode(segment, data, position, warn, quiet)
                        if selection.wants_topic(r.topic)]
            found.extendleft(reversed(matching))
    if cursor is None:
        base = segments[0].base_offset if segments else 0
        cursor = Cursor(partition, base, 0, base)
    return list(found)[max(len(found) - count, 0):], cursor


def _cursor_after(segment: SegmentFile, data: bytes, positions: array) -> Cursor:
    cursor = Cursor(segment.partition, segment.base_offset, 0, segment.base_offset)
    for position in reversed(positions[-2:]):
        try:
            header = verify_batch(data, position)
        except (CorruptBatch, IncompleteBatch):
            continue  # the last batch may be being written: the follower reads it again
        cursor.position = position + header.batch_length
        cursor.next_offset = header.last_offset + 1
        break
    return cursor


@dataclass(slots=True)
class Follower:
    """Polls partitions for records appended after each ``Cursor``; see the module docstring."""

    log: LogDirectory
    cursors: list[Cursor]
    selection: Selection
    warn: Warn
    _warned: set[tuple[int, int, int]] = field(default_factory=set)
    _suspect: set[tuple[int, int, int]] = field(default_factory=set)  # damage seen once

    def poll(self) -> list[tuple[int, Record]]:
        """Every new selected record since the last poll, partition by partition."""
        found: list[tuple[int, Record]] = []
        for cursor in self.cursors:
            found += ((cursor.partition, r) for r in self._poll_partition(cursor)
                      if self.selection.wants_topic(r.topic))
        return found

    def _poll_partition(self, cursor: Cursor) -> list[Record]:
        records: list[Record] = []
        segments = self.log.segments(cursor.partition)  # before any read: see the docstring
        while True:
            later = [s for s in segments if s.base_offset > cursor.segment_base]
            current = next((s for s in segments if s.base_offset == cursor.segment_base), None)
            data = None if current is None else current.read(cursor.position)
            if current is not None and data is not None:
                records += self._read(cursor, current, data, sealed=bool(later))
            if not later:
                return records
            if data is None and later[0].base_offset > cursor.next_offset:
                self.warn(f"partition {cursor.partition}: offsets {cursor.next_offset}-"
                          f"{later[0].base_offset - 1} were deleted before they were read")
            cursor.segment_base, cursor.position = later[0].base_offset, 0
            cursor.next_offset = max(cursor.next_offset, later[0].base_offset)

    def _read(self, cursor: Cursor, segment: SegmentFile, data: bytes,
              sealed: bool) -> list[Record]:
        records: list[Record] = []
        start = cursor.position
        for item in walk_batches(data, segment.base_offset, next_offset=cursor.next_offset):
            if isinstance(item, Damage):
                if item.in_progress and not sealed:
                    break  # being written: read it again at the next poll
                key = (segment.partition, segment.base_offset, start + item.position)
                if not sealed and key not in self._suspect:
                    self._suspect.add(key)
                    break  # perhaps a racing read of a write: read it again at the next poll
                self._warn_once(segment, start, item)
                if item.resume is None:
                    cursor.position = start + len(data)
                    break
                cursor.position = start + item.resume
                continue
            records += _decode(segment, data, item.position, self.warn)
            cursor.position = start + item.position + item.header.batch_length
            cursor.next_offset = item.header.last_offset + 1
        return records

    def _warn_once(self, segment: SegmentFile, start: int, damage: Damage) -> None:
        key = (segment.partition, segment.base_offset, start + damage.position)
        if key not in self._warned:
            self._warned.add(key)
            self.warn(_damage_warning(segment, damage._replace(
                position=start + damage.position,
                resume=None if damage.resume is None else start + damage.resume)))
