"""``LogView``: a read-only view of a commit log that another process owns and appends to.

Theory of operation
-------------------
With ``server.workers = N`` one process owns ``data_dir/log`` (``CommitLog``: the flock and
every write); the other workers read the same files through a ``LogView`` so that their
persistent sessions can catch up from the log. The view answers ``CommitLog``'s reading calls
(``read``, ``earliest_offset``, ``next_offset``, ``offset_for_timestamp``) with the same results
and never locks, creates, writes or truncates a file. It reads as ``docs/log-format.md``
("Reading the log from another program") says; ``inspect.LogDirectory`` checks ``meta.json``
and lists the segments.

Sequential reads. Each partition has a ``_Cursor``: one open segment (an ``O_RDONLY`` fd read
with ``os.pread``) and the byte position of the batch holding the offset that follows the last
read (inside a batch when ``max_records`` cut it). A read starting there costs one ``fstat``
(is the file still linked?) before its ``pread``; the read size follows the bytes per record
seen so far; the records of a batch that ``max_records`` cut are kept for the next read. An
earlier offset in the open segment is found with its ``.index`` (the last entry at or below
it, checked against the header it points to, else byte 0); any other offset lists the
directory first, then uses the index of the segment holding it. Batch headers are then walked
forward to the offset.

Files changing underneath:

* Only whole batches whose checksum matches are returned. In a segment not known to be sealed,
  a batch cut short by the end of the file, or failing its checksum and ending exactly there,
  is a write in progress (or a torn tail that the owner truncates when it next opens the log):
  the read stops before it without an error. Other damage is ``CorruptSegment``.
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
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from struct import Struct
from types import TracebackType

from meshmq.log.errors import (
    CorruptBatch,
    CorruptSegment,
    IncompleteBatch,
    LogError,
    OffsetOutOfRange,
)
from meshmq.log.index import OffsetIndex, TimeIndex
from meshmq.log.inspect import LogDirectory, SegmentFile
from meshmq.log.partition import DEFAULT_READ_BYTES
from meshmq.log.record import (
    HEADER_SIZE,
    BatchHeader,
    Record,
    decode_batch,
    peek_batch_header,
    read_batch_header,
)

WALK_BYTES = 64 * 1024  # header walks (seeks, timestamps, next_offset) read this much at once
MIN_READ_BYTES = 16 * 1024
INITIAL_BYTES_PER_RECORD = 256
LISTING_ATTEMPTS = 8  # retention may delete a listed segment before it is opened

WalkedBatch = tuple[BatchHeader, bytes, int, int]  # header, buffer, start in it, file position


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
        listing = self._directory.segments(partition)
        return listing[0].base_offset if listing else 0

    def next_offset(self, partition: int) -> int:
        """One past the last whole batch of the partition (the last one's checksum checked)."""
        for _ in range(LISTING_ATTEMPTS):
            listing = self._directory.segments(partition)
            if not listing:
                return 0
            try:
                segment = _OpenSegment(listing[-1], sealed=False)
            except FileNotFoundError:
                continue  # the owner truncated below it meanwhile: list again
            try:
                return _end_offset(segment)
            finally:
                segment.close()
        raise LogError(f"partition {partition}: its segments keep disappearing")

    def offset_for_timestamp(self, partition: int, timestamp_ms: int) -> int | None:
        """First offset whose record timestamp is >= ``timestamp_ms``; None: all are older,
        start from ``next_offset``."""
        listing = self._directory.segments(partition)
        for i, file in enumerate(listing):
            try:
                segment = _OpenSegment(file, sealed=i + 1 < len(listing))
            except FileNotFoundError:
                continue  # deleted by retention since the listing
            try:
                found = _first_offset_at_or_after(segment, timestamp_ms)
            finally:
                segment.close()
            if found is not None:
                return found
        return None

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
            cursor.move(_OpenSegment(later[0], sealed=len(later) > 1), 0, later[0].base_offset)
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
        walk = _Walk(segment, cursor.position, _read_size(cursor, limits))
        for header, data, at, position in walk:
            if header.last_offset < offset:
                cursor.pass_batch(position, header)
                continue
            if not limits.admits(header.batch_length):
                return False
            batch = cursor.take_rest(position, offset) or _decode(
                segment, walk, (header, data, at, position))
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
        _check_end(segment, walk)
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


# -- one segment ------------------------------------------------------------------------------


class _OpenSegment:
    """A listed segment opened read-only; ``sealed`` once a listing showed a later segment."""

    def __init__(self, file: SegmentFile, *, sealed: bool) -> None:
        """Raises ``FileNotFoundError`` when the segment was deleted since the listing."""
        self.file = file
        self.sealed = sealed
        self.fd = os.open(file.path, os.O_RDONLY)
        self._offset_index = b""
        self._offset_index_final = False

    @property
    def base_offset(self) -> int:
        return self.file.base_offset

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def deleted(self) -> bool:
        """Whether retention unlinked the file (the fd still reads it)."""
        return os.fstat(self.fd).st_nlink == 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def index_start(self, offset: int) -> tuple[int, int]:
        """(byte position, base offset) of a batch at or before the one holding ``offset``:
        the last ``.index`` entry at or below it if a batch with that offset starts there."""
        if not self._offset_index_final:  # the active segment's index grows; a sealed one not
            self._offset_index = _read_index(self.file.index_path)
            self._offset_index_final = self.sealed
        found = _count_entries(self._offset_index, OffsetIndex.ENTRY, offset - self.base_offset)
        if found:
            relative, position = _entry(self._offset_index, OffsetIndex.ENTRY, found - 1)
            if self._batch_starts_at(position, self.base_offset + relative):
                return position, self.base_offset + relative
        return 0, self.base_offset

    def time_index_start(self, timestamp_ms: int) -> int:
        """A byte position before which every record is older than ``timestamp_ms``."""
        raw = _read_index(self.file.timeindex_path)
        older = _count_entries(raw, TimeIndex.ENTRY, timestamp_ms - 1)
        if not older:
            return 0
        relative = _entry(raw, TimeIndex.ENTRY, older - 1)[1]
        return self.index_start(self.base_offset + relative)[0]

    def _batch_starts_at(self, position: int, offset: int) -> bool:
        try:
            header = peek_batch_header(os.pread(self.fd, HEADER_SIZE, position))
        except (CorruptBatch, IncompleteBatch):
            return False
        return header.base_offset == offset


def _read_index(path: Path) -> bytes:
    """An index file's bytes (b"" if it is missing: the indexes are only hints)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


def _entry(raw: bytes, entry: Struct, i: int) -> tuple[int, int]:
    return entry.unpack_from(raw, i * entry.size)


def _count_entries(raw: bytes, entry: Struct, key: int) -> int:
    """How many leading entries of an index (keys increasing) have a key <= ``key``; a torn
    entry being written at the end is left out."""
    return bisect.bisect_right(range(len(raw) // entry.size), key,
                               key=lambda i: _entry(raw, entry, i)[0])


class _Walk:
    """The whole batches of a segment from byte ``start`` up to its size when the walk began,
    read ``chunk`` bytes at a time; headers are checked here, checksums by ``_decode``.

    Yields ``WalkedBatch`` tuples. When the walk ends before ``size``, ``problem`` is the
    batch it could not get past: (position, reason, whether the file ends inside it).
    """

    def __init__(self, segment: _OpenSegment, start: int, chunk: int) -> None:
        self.segment = segment
        self.start = start
        self.chunk = chunk
        self.size = segment.size()
        self.problem: tuple[int, str, bool] | None = None

    def __iter__(self) -> Iterator[WalkedBatch]:
        position, chunk = self.start, self.chunk
        while position < self.size:
            data = os.pread(self.segment.fd, min(chunk, self.size - position), position)
            at = 0
            while True:
                try:
                    header = read_batch_header(data, at)
                except IncompleteBatch:
                    break  # the buffer ends inside this batch
                except CorruptBatch as exc:
                    self.problem = (position + at, str(exc), False)
                    return
                yield header, data, at, position + at
                at += header.batch_length
            if at == 0:  # the first batch is longer than ``chunk``, or the file ends inside it
                if len(data) < chunk or position + len(data) >= self.size:
                    self.problem = (position, "the file ends inside this batch", True)
                    return
                chunk = peek_batch_header(data).batch_length
            position += at


def _decode(segment: _OpenSegment, walk: _Walk, batch: WalkedBatch) -> list[Record] | None:
    """The records of a walked batch; None when it may be a write in progress."""
    header, data, at, position = batch
    try:
        return decode_batch(data, at)[0]
    except (CorruptBatch, IncompleteBatch) as exc:
        if not segment.sealed and position + header.batch_length == walk.size:
            return None
        raise CorruptSegment(segment.file.path, position, str(exc)) from None


def _check_end(segment: _OpenSegment, walk: _Walk) -> None:
    """Raise for the damage that ended ``walk``, unless it may be a write in progress."""
    if walk.problem is not None:
        position, reason, cut_short = walk.problem
        if segment.sealed or not cut_short:
            raise CorruptSegment(segment.file.path, position, reason)


def _end_offset(segment: _OpenSegment) -> int:
    """One past the segment's last whole batch, walking from its last good index entry."""
    position, end = segment.index_start(sys.maxsize)
    walk = _Walk(segment, position, WALK_BYTES)
    last: WalkedBatch | None = None
    for last in walk:
        end = last[0].last_offset + 1
    if last is not None and _decode(segment, walk, last) is None:
        end = last[0].base_offset  # being written
    return end


def _first_offset_at_or_after(segment: _OpenSegment, timestamp_ms: int) -> int | None:
    """The segment's first offset with a timestamp >= ``timestamp_ms``, or None."""
    walk = _Walk(segment, segment.time_index_start(timestamp_ms), WALK_BYTES)
    for walked in walk:
        if walked[0].max_timestamp >= timestamp_ms:
            batch = _decode(segment, walk, walked)
            if batch is None:
                return None  # being written
            return next(r.offset for r in batch if r.timestamp_ms >= timestamp_ms)
    _check_end(segment, walk)
    return None


@dataclass(slots=True)
class _Cursor:
    """Where the next read of a partition starts without a search: the batch at ``position``
    of ``segment`` holds offsets ``first`` to ``last`` (at the end of the written data,
    ``first == last`` is the next offset). ``rest`` holds the records of that batch that the
    last read decoded but did not return (``max_records`` cut it)."""

    segment: _OpenSegment | None = None
    position: int = 0
    first: int = 0
    last: int = -1
    bytes_per_record: int = INITIAL_BYTES_PER_RECORD
    rest: list[Record] = field(default_factory=list)

    def holds(self, offset: int) -> bool:
        return self.segment is not None and self.first <= offset <= self.last

    def move(self, segment: _OpenSegment | None, position: int, first: int,
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

    def reuse_or_open(self, file: SegmentFile, *, sealed: bool) -> _OpenSegment:
        """The open segment if it is ``file`` and still linked, else ``file`` opened."""
        segment = self.segment
        if segment is not None and segment.base_offset == file.base_offset and (
                not segment.deleted()):
            segment.sealed = segment.sealed or sealed
            return segment
        return _OpenSegment(file, sealed=sealed)
