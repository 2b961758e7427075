"""Read-only access to a log directory, for the ``meshmq log`` tools.

Theory of operation
-------------------
The tools must work while a broker has the log open, so nothing here goes through
``CommitLog``/``LogSegment`` (they take the ``.lock`` flock, create missing files, rebuild
indexes and truncate torn tails). The directory, its ``meta.json`` and the listing of each
partition's segments are ``reader.py``'s (``LogDirectory``, ``SegmentFile``), as for every
reader of the log; what this module adds is the tools' own view of damage. Nothing is ever
written.

``walk_batches`` is the one batch walker: over the bytes of a segment it yields each good batch
(``Batch``) and each damaged region (``Damage``). At a bad batch it looks for the next batch
that verifies and has plausible offsets (``find_verified_batch``, as recovery does) and goes on
from there, so one walk reports every damaged region and every valid batch after it.

The batches of a segment end where only zeros follow (``record.all_zero``): the space a broker
preallocates in the active segment for its appends (``docs/log-format.md``), which the walk
neither yields nor calls damage. A running broker appends to the last segment of each
partition: a ``Damage`` at the end of that segment that runs to the end of the file, or that
only zeros follow, is possibly a write in progress (``in_progress``), not corruption.
``reader.log_is_locked`` tells whether a broker holds the log, without taking the lock. A
segment deleted by retention between listing and reading reads as ``None``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

from meshmq.log.errors import CorruptBatch, IncompleteBatch
from meshmq.log.reader import BatchCheck, OpenSegment, SegmentFile
from meshmq.log.record import (
    BATCH_HEADER,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAX_BATCH_BYTES,
    NO_TIMESTAMP,
    BatchHeader,
    all_zero,
    decode_batch,
    find_verified_batch,
    peek_batch_header,
    read_batch_header,
    verify_batch,
)
from meshmq.log.segment import MAX_RELATIVE_OFFSET

SCAN_CHUNK_BYTES = 1 << 20  # header scans read this much at a time
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


# -- walking the batches of a segment -------------------------------------------------------


class Batch(NamedTuple):
    position: int
    header: BatchHeader


class Damage(NamedTuple):
    """Bytes ``[position, resume)`` hold no valid batch (``resume`` None: up to the end).

    ``expected_offset`` is the offset the next batch should have had; ``claimed`` is the
    damaged batch's own (untrusted) offset range when its header could be read.
    """

    position: int
    resume: int | None
    reason: str
    expected_offset: int
    claimed: tuple[int, int] | None
    reaches_end: bool  # the bad batch runs to (or past) the end of the bytes
    incomplete: bool  # the bytes end inside the batch (a torn write), not a failed check
    zeros_after: bool = False  # only zeros follow the bad batch (written into preallocation)

    @property
    def in_progress(self) -> bool:
        """Could be a write still in progress (when this is the active segment's end)."""
        return self.resume is None and (self.incomplete or self.reaches_end or self.zeros_after)


def walk_batches(data: bytes, segment_base: int, *, check: BatchCheck = verify_batch,
                 start: int = 0, next_offset: int | None = None) -> Iterator[Batch | Damage]:
    """Yield every batch and damaged region of a segment's bytes, in file order.

    ``check(data, position)`` accepts a batch by returning its header, or raises
    ``CorruptBatch``/``IncompleteBatch``: ``verify_batch`` (the default: CRC and header rules),
    ``read_batch_header`` (cheap, for skipping) or ``decoded_header`` (records too). Offsets
    must increase from ``next_offset`` (default: the segment base) and stay within the
    segment's relative-offset range, as recovery requires.
    """
    position, expected = start, segment_base if next_offset is None else next_offset
    while position < len(data):
        try:
            header = check(data, position)
            _check_sequence(header, segment_base, expected)
        except (CorruptBatch, IncompleteBatch) as exc:
            if all_zero(data, position, len(data)):
                return  # preallocated space: the written batches end here
            damage = _damage(data, position, exc, segment_base, expected, check)
            yield damage
            if damage.resume is None:
                return
            position = damage.resume
            continue
        yield Batch(position, header)
        expected = header.last_offset + 1
        position += header.batch_length


def decoded_header(data: bytes, position: int) -> BatchHeader:
    """A ``BatchCheck`` that also decodes every record (what reads do)."""
    decode_batch(data, position)
    return read_batch_header(data, position)


def _check_sequence(header: BatchHeader, segment_base: int, expected: int) -> None:
    if header.base_offset < expected:
        raise CorruptBatch(f"offset {header.base_offset} goes backwards (expected >= {expected})")
    if header.last_offset - segment_base > MAX_RELATIVE_OFFSET:
        raise CorruptBatch(f"offset {header.last_offset} is outside this segment")


def _damage(data: bytes, position: int, exc: Exception, segment_base: int, expected: int,
            check: BatchCheck) -> Damage:
    claimed, reaches_end = None, True
    try:
        header = peek_batch_header(data, position)
        claimed = (header.base_offset, header.last_offset)
        reaches_end = position + header.batch_length >= len(data)
        after = position + header.batch_length
    except (CorruptBatch, IncompleteBatch):
        reaches_end = len(data) - position < HEADER_SIZE
        after = position + HEADER_SIZE  # a header being written: only it
    resume = resync(data, position + 1, segment_base, expected, check)
    return Damage(position, resume, str(exc), expected, claimed, reaches_end,
                  isinstance(exc, IncompleteBatch), all_zero(data, after, len(data)))


def resync(data: bytes, start: int, segment_base: int, expected: int,
           check: BatchCheck = verify_batch) -> int | None:
    """Position of the next batch at or after ``start`` that verifies, passes ``check`` and
    has offsets at or after ``expected`` within the segment; None if there is none."""
    def plausible(header: BatchHeader) -> bool:
        return (header.base_offset >= expected
                and header.last_offset - segment_base <= MAX_RELATIVE_OFFSET)

    while (found := find_verified_batch(data, start, plausible)) is not None:
        try:
            check(data, found)
            return found
        except (CorruptBatch, IncompleteBatch):
            start = found + 1
    return None


# -- cheap header scans (ls) ----------------------------------------------------------------


@dataclass(slots=True)
class SegmentSummary:
    """What a header scan of one segment found; ``size`` is the file size when read, less
    the preallocated zeros after the last batch."""

    segment: SegmentFile
    size: int = 0
    batches: int = 0
    records: int = 0
    first_timestamp: int = NO_TIMESTAMP
    max_timestamp: int = NO_TIMESTAMP
    next_offset: int = 0
    index_entries: int | None = None
    unreadable_at: int | None = None  # first byte the scan could not get past
    unreadable_reason: str = ""
    vanished: bool = False


def summarize_segment(segment: SegmentFile) -> SegmentSummary:
    """Scan the batch headers of one segment (no checksums: ``verify`` does those)."""
    summary = SegmentSummary(segment, next_offset=segment.base_offset)
    try:
        summary.index_entries = os.stat(segment.index_path).st_size // 8
    except FileNotFoundError:
        pass
    try:
        opened = OpenSegment(segment, sealed=True)
    except FileNotFoundError:
        summary.vanished = True
        return summary
    with opened:
        summary.size = opened.size()
        _scan_headers(opened.fd, summary)
    return summary


def _scan_headers(fd: int, summary: SegmentSummary) -> None:
    """Add up the batch headers from byte 0, reading ``SCAN_CHUNK_BYTES`` at a time and
    skipping the bodies of larger batches; stop at the first header that is not usable."""
    position, size, buffer, buffer_start = 0, summary.size, b"", 0
    base = summary.segment.base_offset
    unpack = BATCH_HEADER.unpack_from
    while position < size:
        at = position - buffer_start
        if at + HEADER_SIZE > len(buffer):
            buffer, buffer_start, at = os.pread(fd, SCAN_CHUNK_BYTES, position), position, 0
        if len(buffer) - at >= HEADER_SIZE:  # the fast path; the checks of peek_batch_header
            magic, length, _, _, first, delta, first_ts, max_ts, count = unpack(buffer, at)
            if (magic == FORMAT_VERSION and HEADER_SIZE <= length <= MAX_BATCH_BYTES
                    and first >= summary.next_offset and first + delta - base
                    <= MAX_RELATIVE_OFFSET and position + length <= size):
                summary.batches += 1
                summary.records += count
                if summary.first_timestamp == NO_TIMESTAMP:
                    summary.first_timestamp = first_ts
                summary.max_timestamp = max(summary.max_timestamp, max_ts)
                summary.next_offset = first + delta + 1
                position += length
                continue
        if at < len(buffer) and buffer[at] == 0 and _zeros_to_end(fd, position, size):
            summary.size = position  # the rest is preallocated space, not data
            return
        summary.unreadable_at = position
        summary.unreadable_reason = _header_problem(buffer, at, summary, position)
        return


def _zeros_to_end(fd: int, position: int, size: int) -> bool:
    """Whether the file holds only zeros from ``position`` to ``size`` (or to its end)."""
    while position < size:
        chunk = os.pread(fd, min(SCAN_CHUNK_BYTES, size - position), position)
        if not chunk:
            return True  # cut shorter meanwhile
        if not all_zero(chunk, 0, len(chunk)):
            return False
        position += len(chunk)
    return True


def _header_problem(buffer: bytes, at: int, summary: SegmentSummary, position: int) -> str:
    try:
        header = peek_batch_header(buffer, at)
        _check_sequence(header, summary.segment.base_offset, summary.next_offset)
    except (CorruptBatch, IncompleteBatch) as exc:
        return str(exc)
    return f"the batch of {header.batch_length} bytes runs past the end of the file " \
           f"({summary.size - position} bytes left)"


# -- small shared helpers -------------------------------------------------------------------


def iso_timestamp(timestamp_ms: int) -> str:
    """``2025-01-31T12:00:00.123Z``; ``-`` for no timestamp, the number if out of range."""
    if timestamp_ms == NO_TIMESTAMP:
        return "-"
    seconds, millis = divmod(timestamp_ms, 1000)
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"
    except (OverflowError, OSError, ValueError):
        return str(timestamp_ms)


def parse_timestamp(text: str) -> int:
    """Milliseconds since the epoch from ``1735689600000`` or an ISO 8601 date/time (UTC when
    no zone is given). Raises ``ValueError`` with a one-line explanation."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"not a timestamp: {text!r} (use ISO 8601 or milliseconds)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - EPOCH) // timedelta(milliseconds=1)
