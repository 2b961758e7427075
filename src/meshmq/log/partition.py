"""``Partition``: an ordered list of segments with one writable (active) segment at the end.

Theory of operation
-------------------
Records appended to a partition get consecutive offsets from ``next_offset`` (Kafka's log end
offset; on a single node also the high watermark). An append is encoded into record batches of
about ``TARGET_BATCH_BYTES`` outside the state lock, then written to the active segment, which
is first rolled (sealed and replaced by a new empty one) when the batch would take it past
``segment_bytes`` or it is older than ``segment_ms``. Rolling cuts the preallocated zeros off the
old segment (``LogSegment.trim``) and fsyncs its log and indexes, so every sealed segment is
fully durable and exactly its batches.

The active segment is preallocated ``LogConfig.preallocate_bytes`` at a time (at most
``segment_bytes``), so that ``flush`` is usually an ``fdatasync`` of a file whose size is
durable already (``segment.py`` explains when it must be a full fsync).

Opening the partition is its recovery. ``close()`` leaves a ``.clean_shutdown`` marker after
fsyncing everything; opening removes it. After an unclean stop the active (last) segment is
verified batch by batch and a torn tail is cut off after a copy of the file is kept
(``LogSegment.recover``); the zeros preallocated past the last batch are not a torn tail. Sealed
segments are loaded from their indexes and only their tails
are verified; any damage in a sealed segment, and corruption in the middle of the active one,
is ``CorruptSegment``: the partition refuses to open rather than silently drop data.

Threading
---------
Every public method is thread-safe. ``_lock`` guards the segment list and the segment objects;
it is held only for in-memory work, page-cache writes and ``pread``s, never for an fsync of
appended data (``flush`` fsyncs a duplicate of the file descriptor outside it) and never while
encoding or decoding records. ``_mutation_lock`` serializes the mutators (append, roll,
truncate, retention, close) so offsets reserved before encoding stay valid; take it first.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from meshmq.log.config import UNLIMITED, LogConfig
from meshmq.log.errors import (
    CorruptBatch,
    CorruptSegment,
    IncompleteBatch,
    LogClosed,
    OffsetOutOfRange,
)
from meshmq.log.files import (
    SEGMENT_SUFFIXES,
    FsyncFunction,
    create_durably,
    fsync_directory,
    list_segment_bases,
    segment_file_name,
)
from meshmq.log.record import (
    NO_TIMESTAMP,
    BatchBuilder,
    BatchHeader,
    Record,
    decode_batch,
    encode_batch,
    split_batches,
    wall_clock_ms,
)
from meshmq.log.segment import LogSegment

CLEAN_SHUTDOWN_FILE: Final = ".clean_shutdown"
TARGET_BATCH_BYTES: Final = 1024 * 1024  # an append is split into batches of about this size
DEFAULT_READ_BYTES: Final = 1024 * 1024


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What opening the partition found: log it, and alert on ``truncated_bytes`` > 0.

    ``kept_tail`` is the copy of the active segment as it was before its tail was cut.
    """

    clean_shutdown: bool
    truncated_bytes: int
    segments: int
    kept_tail: Path | None = None


@dataclass(frozen=True, slots=True)
class PartitionStatistics:
    earliest_offset: int
    next_offset: int
    segments: int
    size_bytes: int
    max_timestamp: int


class Partition:
    """One partition directory of ``{base_offset:020d}.log/.index/.timeindex`` files."""

    def __init__(self, directory: Path | str, config: LogConfig | None = None, *,
                 fsync: FsyncFunction = os.fsync, datasync: FsyncFunction | None = None,
                 now_ms: int | None = None) -> None:
        """Open (or create) the partition and recover it; see ``recovery`` for what was found.

        ``datasync``: see ``LogSegment``. Raises ``CorruptSegment`` when a segment is damaged
        beyond a torn tail.
        """
        self.directory = Path(directory)
        self.config = config or LogConfig()
        self._fsync = fsync
        self._datasync = datasync
        self._preallocate = min(self.config.preallocate_bytes, self.config.segment_bytes)
        self._lock = threading.Lock()
        self._mutation_lock = threading.Lock()
        self._segments: list[LogSegment] = []
        self._closed = False
        self.directory.mkdir(parents=True, exist_ok=True)
        self.recovery = self._recover(now_ms if now_ms is not None else wall_clock_ms())

    # -- offsets and inspection -----------------------------------------------------------

    @property
    def earliest_offset(self) -> int:
        """The lowest offset still stored (Kafka's log start offset)."""
        with self._lock:
            return self._segments[0].base_offset

    @property
    def next_offset(self) -> int:
        """The offset the next appended record gets; every offset below it is readable."""
        with self._lock:
            return self._segments[-1].next_offset

    @property
    def active_segment(self) -> LogSegment:
        """The segment appends go to. Use it for inspection only, and only under no load."""
        with self._lock:
            return self._segments[-1]

    def segment_base_offsets(self) -> list[int]:
        with self._lock:
            return [segment.base_offset for segment in self._segments]

    def statistics(self) -> PartitionStatistics:
        with self._lock:
            segments = self._segments
            return PartitionStatistics(
                segments[0].base_offset, segments[-1].next_offset, len(segments),
                sum(s.size for s in segments), max(s.max_timestamp for s in segments),
            )

    # -- appending ------------------------------------------------------------------------

    def append(self, records: Sequence[Record], now_ms: int | None = None) -> tuple[int, int]:
        """Append ``records`` (their ``offset`` fields are ignored); return (first, last) offset.

        The records are in the OS page cache on return, readable at once; call ``flush()`` to
        make them durable. On error nothing of this call remains in the log.
        """
        if not records:
            raise ValueError("nothing to append")
        now = now_ms if now_ms is not None else wall_clock_ms()
        with self._mutation_lock:
            base = self.next_offset
            batches = [(encode_batch(chunk, base + start), base + start, chunk)
                       for start, chunk in split_batches(records, TARGET_BATCH_BYTES)]
            with self._lock:
                self._check_open()
                try:
                    for batch, first, chunk in batches:
                        self._append_locked(batch, first, chunk, now)
                except BaseException:
                    self._undo_append(base)
                    raise
        return base, base + len(records) - 1

    def append_built(self, batches: Sequence[BatchBuilder], now_ms: int | None = None, *,
                     roll: bool = True) -> bool:
        """Append batches of records encoded already (``BatchBuilder``), in order: each is
        sealed with the next offsets (its ``base_offset`` says where it went) and all are
        written with one vectored write when they fit the active segment.

        ``roll=False``: when the active segment would have to be rolled first (which fsyncs
        it), append nothing and return False; the caller appends them where an fsync may wait.
        The records are in the OS page cache on return; on error nothing of this call remains.
        """
        if not batches:
            return True
        now = now_ms if now_ms is not None else wall_clock_ms()
        with self._mutation_lock:
            base = self.next_offset
            with self._lock:
                self._check_open()
                active = self._segments[-1]
                total = sum(batch.size for batch in batches)
                count = sum(batch.count for batch in batches)
                due = not active.is_empty and (
                    active.size + total > self.config.segment_bytes
                    or active.age(now) > self.config.segment_ms
                    or not active.fits(total, base + count - 1))
            if due and not roll:
                return False
            buffers: list[bytes] = []
            headers: list[BatchHeader] = []
            offset = base
            for batch in batches:  # outside the state lock, as in append()
                head, body, header = batch.seal(offset)
                buffers += (head, body)
                headers.append(header)
                offset += batch.count
            with self._lock:
                self._check_open()
                try:
                    if due:
                        for index, header in enumerate(headers):
                            self._append_sealed_locked(buffers[2 * index:2 * index + 2],
                                                       header, now)
                    else:
                        self._segments[-1].append_sealed(buffers, headers)
                except BaseException:
                    self._undo_append(base)
                    raise
        return True

    def _append_sealed_locked(self, buffers: list[bytes], header: BatchHeader,
                              now: int) -> None:
        active = self._segments[-1]
        if not active.is_empty and (
                active.size + header.batch_length > self.config.segment_bytes
                or active.age(now) > self.config.segment_ms
                or not active.fits(header.batch_length, header.last_offset)):
            active = self._roll_locked(now)
        active.append_sealed(buffers, [header])

    def _append_locked(self, batch: bytes, first: int, chunk: Sequence[Record],
                       now: int) -> None:
        last = first + len(chunk) - 1
        active = self._segments[-1]
        if not active.is_empty and (
                active.size + len(batch) > self.config.segment_bytes
                or active.age(now) > self.config.segment_ms
                or not active.fits(len(batch), last)):
            active = self._roll_locked(now)
        active.append(batch, first, last, max(r.timestamp_ms for r in chunk))

    def _undo_append(self, base: int) -> None:
        try:
            if self._segments[-1].next_offset > base:
                self._truncate_locked(base, wall_clock_ms())
        except Exception:
            pass  # the append's own error is the one to report

    def roll(self, now_ms: int | None = None) -> None:
        """Seal the active segment and start a new one (no-op when the active one is empty)."""
        with self._mutation_lock, self._lock:
            self._check_open()
            if not self._segments[-1].is_empty:
                self._roll_locked(now_ms if now_ms is not None else wall_clock_ms())

    def _roll_locked(self, now: int) -> LogSegment:
        old = self._segments[-1]
        old.trim()  # durable (the flush) before the next segment exists: readers then know
        old.flush()  # that a segment followed by another one ends with its last batch
        old.flush_indexes()
        new = self._create_segment(old.next_offset, now)
        self._segments.append(new)
        return new

    def _create_segment(self, base_offset: int, now: int) -> LogSegment:
        for suffix in SEGMENT_SUFFIXES:  # leftovers of a deleted segment must not be loaded
            (self.directory / segment_file_name(base_offset, suffix)).unlink(missing_ok=True)
        segment = self._open_segment(base_offset, now)
        fsync_directory(self.directory, self._fsync)
        return segment

    def _open_segment(self, base_offset: int, now: int) -> LogSegment:
        return LogSegment(self.directory, base_offset, fsync=self._fsync,
                          datasync=self._datasync, preallocate_bytes=self._preallocate,
                          now_ms=now, index_interval_bytes=self.config.index_interval_bytes)

    # -- reading --------------------------------------------------------------------------

    def read(self, offset: int, *, max_records: int | None = None,
             max_bytes: int = DEFAULT_READ_BYTES) -> list[Record]:
        """Records from ``offset`` on, across segments, within ``max_records``/``max_bytes``.

        At least one record is returned when ``offset < next_offset``; an empty list means the
        reader is caught up. Raises ``OffsetOutOfRange`` below ``earliest_offset`` (retention
        deleted it: restart from the exception's ``earliest_offset`` or report the gap) or above
        ``next_offset``, and ``CorruptSegment`` if the stored bytes fail their checksum.
        """
        records: list[Record] = []
        for path, position, data in self._fetch(offset, max_bytes, max_records):
            records += _decode(path, position, data, offset)
        return records if max_records is None else records[:max_records]

    def _fetch(self, offset: int, max_bytes: int,
               max_records: int | None) -> list[tuple[Path, int, bytes]]:
        chunks: list[tuple[Path, int, bytes]] = []
        with self._lock:
            self._check_open()
            self._check_range(offset)
            for segment in self._segments[self._segment_index(offset):]:
                if max_bytes <= 0 or (max_records is not None and max_records <= 0):
                    break
                position, data, count = segment.read_batches(
                    max(offset, segment.base_offset), max_bytes, max_records,
                    at_least_one=not chunks)
                if data:
                    chunks.append((segment.log_path, position, data))
                    max_bytes -= len(data)
                    max_records = None if max_records is None else max_records - count
                if position + len(data) < segment.size:
                    break
        return chunks

    def _check_range(self, offset: int) -> None:
        earliest, end = self._segments[0].base_offset, self._segments[-1].next_offset
        if not earliest <= offset <= end:
            raise OffsetOutOfRange(offset, earliest, end)

    def _segment_index(self, offset: int) -> int:
        bases = [segment.base_offset for segment in self._segments]
        return max(bisect.bisect_right(bases, offset) - 1, 0)

    def offset_for_timestamp(self, timestamp_ms: int) -> int | None:
        """The first offset whose record timestamp is >= ``timestamp_ms``.

        ``None`` means every stored record is older: start from ``next_offset``.
        """
        with self._lock:
            self._check_open()
            for segment in self._segments:
                if segment.max_timestamp >= timestamp_ms:
                    return segment.find_offset_by_timestamp(timestamp_ms)
        return None

    # -- maintenance ----------------------------------------------------------------------

    def enforce_retention(self, now_ms: int | None = None) -> int:
        """Delete whole oldest segments beyond ``retention_bytes`` or older than
        ``retention_ms`` (never the active one); return how many were deleted.

        Cursors below the new ``earliest_offset`` get ``OffsetOutOfRange`` on their next read.
        """
        now = now_ms if now_ms is not None else wall_clock_ms()
        deleted = 0
        with self._mutation_lock, self._lock:
            self._check_open()
            total = sum(segment.size for segment in self._segments)
            while len(self._segments) > 1 and self._expired(self._segments[0], total, now):
                segment = self._segments.pop(0)
                total -= segment.size
                segment.delete()
                deleted += 1
        return deleted

    def _expired(self, segment: LogSegment, total_bytes: int, now: int) -> bool:
        limit_bytes, limit_ms = self.config.retention_bytes, self.config.retention_ms
        too_big = limit_bytes != UNLIMITED and total_bytes - segment.size >= limit_bytes
        too_old = limit_ms != UNLIMITED and (
            segment.max_timestamp == NO_TIMESTAMP or now - segment.max_timestamp > limit_ms)
        return too_big or too_old

    def truncate_to(self, offset: int, now_ms: int | None = None) -> None:
        """Remove every record at or after ``offset`` (``next_offset`` becomes ``offset``).

        Below ``earliest_offset`` the partition is emptied and restarts at ``offset``. The
        truncation is fsynced before returning.
        """
        with self._mutation_lock, self._lock:
            self._check_open()
            self._truncate_locked(offset, now_ms if now_ms is not None else wall_clock_ms())
            self._segments[-1].flush()
            fsync_directory(self.directory, self._fsync)  # deleted segments stay deleted

    def _truncate_locked(self, offset: int, now: int) -> None:
        if offset >= self._segments[-1].next_offset:
            return
        if offset < self._segments[0].base_offset:
            self._delete_segments(0)
            self._segments.append(self._create_segment(offset, now))
            return
        self._delete_segments(self._segment_index(offset) + 1)
        self._segments[-1].truncate_to(offset)

    def _delete_segments(self, start: int) -> None:
        for segment in self._segments[start:]:
            segment.delete()
        del self._segments[start:]

    def flush(self) -> None:
        """Sync the active segment: every record appended before the call is durable."""
        with self._lock:
            self._check_open()
            segment = self._segments[-1]
            fd = os.dup(segment.fileno())
            size_changes = segment.size_changes
        try:
            segment.sync(fd, size_changes)  # fdatasync when the size is durable already
        finally:
            os.close(fd)

    def sync_point(self) -> tuple[LogSegment, int]:
        """The active segment and its count of size changes, for a caller that syncs the
        whole file system (``CommitLog.flush``) and then tells the segment (``synced``)."""
        with self._lock:
            self._check_open()
            segment = self._segments[-1]
            return segment, segment.size_changes

    def close(self) -> None:
        """Flush everything, leave the clean-shutdown marker and close the files. Idempotent."""
        with self._mutation_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._segments[-1].trim()
                self._segments[-1].flush()
                self._segments[-1].flush_indexes()
                create_durably(self.directory / CLEAN_SHUTDOWN_FILE, self._fsync)
            finally:
                for segment in self._segments:
                    segment.close()

    def _check_open(self) -> None:
        if self._closed:
            raise LogClosed(f"partition {self.directory} is closed")

    # -- opening --------------------------------------------------------------------------

    def _recover(self, now: int) -> RecoveryReport:
        marker = self.directory / CLEAN_SHUTDOWN_FILE
        clean = marker.exists()
        try:
            truncated = self._open_segments(clean, now)
        except BaseException:
            for segment in self._segments:
                segment.close()
            raise
        if clean:
            marker.unlink()
            fsync_directory(self.directory, self._fsync)
        return RecoveryReport(clean, truncated, len(self._segments),
                              self._segments[-1].kept_tail)

    def _open_segments(self, clean: bool, now: int) -> int:
        for base in list_segment_bases(self.directory):
            self._segments.append(self._open_segment(base, now))
        if not self._segments:
            self._segments.append(self._create_segment(0, now))
        for previous, segment in zip(self._segments, self._segments[1:], strict=False):
            if previous.damage is not None:
                raise previous.damage
            if previous.next_offset > segment.base_offset:
                raise CorruptSegment(segment.log_path, 0, "overlaps the previous segment")
            if previous.file_size > previous.size:  # a roll's trim lost in a crash: redo it
                previous.trim()
                previous.flush()
        last = self._segments[-1]
        return last.recover() if not clean or last.damage is not None else 0


def _decode(path: Path, position: int, data: bytes, min_offset: int) -> list[Record]:
    records: list[Record] = []
    pos = 0
    while pos < len(data):
        try:
            batch, end = decode_batch(data, pos)
        except (CorruptBatch, IncompleteBatch) as exc:
            raise CorruptSegment(path, position + pos, str(exc)) from None
        records += batch if batch[0].offset >= min_offset else [
            r for r in batch if r.offset >= min_offset]
        pos = end
    return records
