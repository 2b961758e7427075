"""``LogView``: a read-only view of a commit log that another process owns and appends to.

Theory of operation
-------------------
With ``server.workers = N`` each partition has one leader process (``CommitLog``: the flock and
every write); the other workers read its files through a ``LogView`` so that their persistent
sessions can catch up from the log. The view answers ``CommitLog``'s reading calls (``read``,
``earliest_offset``, ``next_offset``, ``offset_for_timestamp``) with the same results and never
locks, creates, writes or truncates a file. Listing, opening, the indexes and the batch walk
are ``reader.py``'s (the one reader of the files); this module adds the per-partition cursor
and ``CommitLog.read``'s limits.

Sequential reads. Each partition has a ``_Cursor``: one ``OpenSegment`` and the byte position
of the batch holding the offset that follows the last read (inside a batch when
``max_records`` cut it). A read starting there costs one ``fstat`` (is the file still linked?)
before its ``pread``; the read size follows the bytes per record seen so far; the records of
a batch that ``max_records`` cut are kept for the next read. An earlier offset in the open
segment is found with its ``.index``; any other offset lists the directory first, then uses the
index of the segment holding it. Batch headers are then walked forward to the offset.

Files changing underneath:

* Only whole batches whose checksum matches are returned. A ``Tail`` the reader tolerates (a
  write in progress at the end of an unsealed segment) ends the read without an error; other
  damage is ``CorruptSegment``.
* A segment is *sealed* once a listing shows a later one. At the end of an unsealed segment the
  view lists the directory and only then reads the rest of the segment once more (the listing
  must come first, or a batch appended just before the roll could be missed); at the end of a
  sealed segment it moves on to the next listed one.
* Retention unlinks whole segments, oldest first. An open fd still reads; ``st_nlink == 0``
  tells the cursor that its segment is gone, so the next read lists the directory and raises
  ``OffsetOutOfRange`` below the first listed segment, as ``CommitLog`` does.

Not thread-safe: each thread (the broker: its event loop) uses its own view.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from meshmq.log.errors import LogError, OffsetOutOfRange
from meshmq.log.partition import DEFAULT_READ_BYTES
from meshmq.log.reader import (
    LISTING_ATTEMPTS,
    LogDirectory,
    OpenSegment,
    SegmentFile,
    Walk,
    decode_walked,
)
from meshmq.log.record import BatchHeader, Record

MIN_READ_BYTES = 16 * 1024
INITIAL_BYTES_PER_RECORD = 256


class LogView:
    """Read-only access to ``data_dir/log`` while its owner appends; see the module docstring."""

    def __init__(self, data_dir: Path | str) -> None:
        """Read ``meta.json``; raises ``LogDirectoryError`` when ``data_dir`` holds no log."""
        self._directory = LogDirectory.locate(data_dir)
        self._cursors = [_Cursor() for _ in range(self._directory.partitions)]

    @property
    def partition_count(self) -> int:
        return self._directory.partitions

    def read(self, partition: int, offset: int, max_records: int | None = None, *,
             max_bytes: int = DEFAULT_READ_BYTES) -> list[Record]:
        """Records of ``partition`` from ``offset`` on, as ``CommitLog.read`` returns them.

        An empty list means the reader is at (or past) the end of the written data: read again
        later. Raises ``OffsetOutOfRange`` below ``earliest_offset`` (restart from the
        exception's ``earliest_offset`` or report the gap) and ``CorruptSegment`` on damage.
        """
        cursor = self._cursors[partition]
        self._position_at(partition, cursor, offset)
        limits = _Limits(max_bytes, max_records)
        records: list[Record] = []
        while cursor.segment is not None and not limits.exhausted():
            if not self._read_segment(cursor, offset, limits, records) or (
                    not self._next_segment(partition, cursor, offset)):
                break
        if limits.taken_records:
            cursor.bytes_per_record = max(limits.taken_bytes // limits.taken_records, 1)
        if max_records is not None and len(records) > max_records:
            cursor.rest = records[max_records:]  # the next chunk starts with them
            del records[max_records:]
        return records

    def earliest_offset(self, partition: int) -> int:
        """The lowest offset still stored (0 while the partition has no segment)."""
        return self._directory.earliest_offset(partition)

    def next_offset(self, partition: int) -> int:
        """One past the last whole batch of the partition (the last one's checksum checked)."""
        return self._directory.next_offset(partition)

    def offset_for_timestamp(self, partition: int, timestamp_ms: int) -> int | None:
        """First offset whose record timestamp is >= ``timestamp_ms``; None: all are older,
        start from ``next_offset``."""
        return self._directory.offset_for_timestamp(partition, timestamp_ms)

    def close(self) -> None:
        """Close every open segment. Idempotent; a closed view reopens files if used again."""
        for cursor in self._cursors:
            cursor.move(None, 0, 0)

    def __enter__(self) -> LogView:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- positioning ----------------------------------------------------------------------

    def _position_at(self, partition: int, cursor: _Cursor, offset: int) -> None:
        """Point ``cursor`` at a batch at or before the one holding ``offset``."""
        segment = cursor.segment
        if segment is not None and not segment.deleted():
            if cursor.holds(offset):
                return  # the sequential case: no search
            if segment.base_offset <= offset < cursor.first:
                cursor.move(segment, *segment.index_start(offset))
                return
        self._seek(partition, cursor, offset)

    def _seek(self, partition: int, cursor: _Cursor, offset: int) -> None:
        for _ in range(LISTING_ATTEMPTS):
            listing = self._directory.segments(partition)
            if not listing:
                cursor.move(None, 0, 0)  # nothing written yet: reads return []
                return
            if offset < listing[0].base_offset:
                raise OffsetOutOfRange(offset, listing[0].base_offset,
                                       self.next_offset(partition))
            i = bisect.bisect_right([file.base_offset for file in listing], offset) - 1
            try:
                segment = cursor.reuse_or_open(listing[i], sealed=i + 1 < len(listing))
            except FileNotFoundError:
                continue  # deleted by retention since the listing: list again
            cursor.move(segment, *segment.index_start(offset))
            return
        raise LogError(f"partition {partition}: its segments keep disappearing")

    def _next_segment(self, partition: int, cursor: _Cursor, offset: int) -> bool:
        """At the end of the cursor's segment: whether there is more to read (the segment
        turned out to be sealed, or the cursor moved to the next one)."""
        segment = cursor.segment
        assert segment is not None
        listing = self._directory.segments(partition)
        later = [file for file in listing if file.base_offset > segment.base_offset]
        if not later:
            return False  # the active segment: caught up
        if not segment.sealed:
            segment.sealed = True
            return True  # read its end once more: it may have grown before the roll
        if later[0].base_offset > cursor.first and segment.deleted():
            raise OffsetOutOfRange(offset, listing[0].base_offset, self.next_offset(partition))
        try:
            cursor.move(OpenSegment(later[0], sealed=len(later) > 1), 0, later[0].base_offset)
        except FileNotFoundError:
            return False  # deleted meanwhile: the next read lists again
        return True

    # -- reading --------------------------------------------------------------------------

    def _read_segment(self, cursor: _Cursor, offset: int, limits: _Limits,
                      records: list[Record]) -> bool:
        """Add the records at or after ``offset`` from the cursor's segment to ``records``
        until ``limits`` stop the read (False) or the segment's whole, checksummed batches
        end (True: look for the next segment)."""
        segment = cursor.segment
        assert segment is not None
        walk = Walk(segment, cursor.position, _read_size(cursor, limits))
        for walked in walk:
            header, position = walked.header, walked.position
            if header.last_offset < offset:
                cursor.pass_batch(position, header)
                continue
            if not limits.admits(header.batch_length):
                return False
            batch = cursor.take_rest(position, offset) or decode_walked(walk, walked)
            if batch is None:
                return True  # a write in progress: was the segment sealed meanwhile?
            records += batch if header.base_offset >= offset else [
                r for r in batch if r.offset >= offset]
            limits.take(header, offset)
            if limits.surplus():  # max_records cut this batch: the next read starts inside it
                cursor.move(segment, position, header.base_offset, header.last_offset)
            else:
                cursor.pass_batch(position, header)
            if limits.exhausted():
                return False
        walk.raise_unless_tolerated()
        return True


@dataclass(slots=True)
class _Limits:
    """``CommitLog.read``'s limits: the first batch always, then whole batches while they fit
    in ``max_bytes`` and fewer than ``max_records`` records (at or after the offset) are taken."""

    max_bytes: int
    max_records: int | None
    taken_bytes: int = 0
    taken_records: int = 0

    def exhausted(self) -> bool:
        return self.taken_bytes >= self.max_bytes or (
            self.max_records is not None and self.taken_records >= self.max_records)

    def admits(self, batch_length: int) -> bool:
        return not self.taken_bytes or self.taken_bytes + batch_length <= self.max_bytes

    def take(self, header: BatchHeader, offset: int) -> None:
        self.taken_bytes += header.batch_length
        self.taken_records += header.last_offset - max(header.base_offset, offset) + 1

    def surplus(self) -> bool:
        return self.max_records is not None and self.taken_records > self.max_records


def _read_size(cursor: _Cursor, limits: _Limits) -> int:
    """Bytes to ``pread`` first: enough for the records still wanted, at the usual size."""
    left = limits.max_bytes - limits.taken_bytes
    if limits.max_records is not None:
        wanted = limits.max_records - limits.taken_records
        left = min(left, wanted * cursor.bytes_per_record * 5 // 4)
    return max(left, MIN_READ_BYTES)


@dataclass(slots=True)
class _Cursor:
    """Where the next read of a partition starts without a search: the batch at ``position``
    of ``segment`` holds offsets ``first`` to ``last`` (at the end of the written data,
    ``first == last`` is the next offset). ``rest`` holds the records of that batch that the
    last read decoded but did not return (``max_records`` cut it)."""

    segment: OpenSegment | None = None
    position: int = 0
    first: int = 0
    last: int = -1
    bytes_per_record: int = INITIAL_BYTES_PER_RECORD
    rest: list[Record] = field(default_factory=list)

    def holds(self, offset: int) -> bool:
        return self.segment is not None and self.first <= offset <= self.last

    def move(self, segment: OpenSegment | None, position: int, first: int,
             last: int | None = None) -> None:
        """Point at another batch (closing the old segment when the segment changes)."""
        if self.segment is not None and self.segment is not segment:
            self.segment.close()
        self.segment, self.position, self.first = segment, position, first
        self.last = first if last is None else last
        self.rest = []

    def take_rest(self, position: int, offset: int) -> list[Record]:
        """``rest`` if the batch at ``position`` is the one it came from and a read from
        ``offset`` needs none of the records before it; else [] (decode the batch)."""
        rest, self.rest = self.rest, []
        if rest and position == self.position and rest[0].offset <= offset:
            return rest
        return []

    def pass_batch(self, position: int, header: BatchHeader) -> None:
        self.move(self.segment, position + header.batch_length, header.last_offset + 1)

    def reuse_or_open(self, file: SegmentFile, *, sealed: bool) -> OpenSegment:
        """The open segment if it is ``file`` and still linked, else ``file`` opened."""
        segment = self.segment
        if segment is not None and segment.base_offset == file.base_offset and (
                not segment.deleted()):
            segment.sealed = segment.sealed or sealed
            return segment
        return OpenSegment(file, sealed=sealed)
