"""Read-only access to a meshmq commit log on disk, for readers outside the broker.

Theory of operation
-------------------
The broker owns ``data_dir/log`` (it holds a ``flock`` and may append, roll, truncate and
delete segments at any moment); this module never locks, writes, or opens the log through
``CommitLog``. It reads files the way ``docs/log-format.md`` ("Reading the log from another
program") says:

* ``LogDirectory`` resolves a data_dir or a log dir, checks ``meta.json`` and lists each
  partition's segments by name. Index files are never written or cleaned up here.
* ``SegmentFile`` opens one ``.log`` file ``O_RDONLY`` and snapshots its size. Once open, the
  file stays readable even if retention unlinks it. ``batches()`` yields checksummed batches
  read in large chunks. In the partition's **last** segment a batch cut short by the end of
  the file, or failing its checksum and ending exactly there, is a write in progress (or a
  torn tail after a crash): iteration stops before it. Anywhere else it is ``CorruptLog``.
* The ``.index``/``.timeindex`` files are caches the broker writes without fsync, so they
  are only hints: an entry is used after checking that a batch with the expected base offset
  starts where it points, and otherwise the scan starts at byte 0.

Positions in a partition are offsets: ``earliest_offset`` is the first segment's base offset
and ``next_offset`` is one past the last record of the last complete batch.
"""

from __future__ import annotations

import bisect
import json
import os
import struct
import sys
from array import array
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from meshmq.log.errors import CorruptBatch, IncompleteBatch
from meshmq.log.files import INDEX_SUFFIX, LOG_SUFFIX, TIMEINDEX_SUFFIX, segment_file_name
from meshmq.log.record import (
    HEADER_SIZE,
    RECORD_PREFIX,
    RECORD_PREFIX_SIZE,
    BatchHeader,
    peek_batch_header,
    verify_batch,
)
from meshmq.pipeline.errors import CorruptLog, LogNotFound

META_FILE = "meta.json"
LOG_DIRECTORY = "log"
SUPPORTED_FORMAT = ("meshmq-log", 1)
READ_CHUNK_BYTES = 4 * 1024 * 1024
_TIME_ENTRY = struct.Struct(">QI")
_INDEX_TRIES = 8  # index entries checked before a damaged index is given up for byte 0


class LogDirectory:
    """A meshmq log directory (the one holding ``meta.json``), opened read-only."""

    def __init__(self, path: Path, partitions: int) -> None:
        self.path = path
        self.partitions = partitions

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> LogDirectory:
        """Resolve ``path`` (a broker data_dir, or its ``log`` directory) and read meta.json.

        Raises ``LogNotFound`` when neither holds a meshmq log, ``CorruptLog`` for a meta.json
        this reader cannot use.
        """
        given = Path(path)
        for candidate in (given / LOG_DIRECTORY, given):
            meta = candidate / META_FILE
            if meta.is_file():
                return cls(candidate, _read_meta(meta))
        raise LogNotFound(
            f"no meshmq commit log at {given} (expected {META_FILE} in {given / LOG_DIRECTORY}"
            f" or in {given})"
        )

    def segment_bases(self, partition: int) -> list[int]:
        """Base offsets of the partition's segments, oldest first (a listing: retention may
        delete the oldest ones at any time)."""
        try:
            names = os.listdir(self.path / str(partition))
        except FileNotFoundError:
            return []
        return sorted(int(n[:-len(LOG_SUFFIX)]) for n in names
                      if n.endswith(LOG_SUFFIX) and n[:-len(LOG_SUFFIX)].isdigit())

    def segment(self, partition: int, base_offset: int, *, last: bool) -> SegmentFile:
        """Open one segment; raises ``FileNotFoundError`` if retention deleted it."""
        return SegmentFile(self.path / str(partition), base_offset, last=last)

    def earliest_offset(self, partition: int) -> int:
        """The first offset still stored (0 for a partition that has no segment yet)."""
        bases = self.segment_bases(partition)
        return bases[0] if bases else 0

    def next_offset(self, partition: int) -> int:
        """One past the last record of the last complete batch: the "latest" position."""
        for _ in range(10):  # the listing can go stale under a concurrent roll or truncation
            bases = self.segment_bases(partition)
            if not bases:
                return 0
            try:
                with self.segment(partition, bases[-1], last=True) as segment:
                    return segment.next_offset()
            except FileNotFoundError:
                continue
        raise CorruptLog(str(self.path / str(partition)), 0, "segments keep disappearing")

    def offset_for_timestamp(self, partition: int, timestamp_ms: int) -> int | None:
        """First offset whose record timestamp is >= ``timestamp_ms``; None if there is none."""
        bases = self.segment_bases(partition)
        for i, base in enumerate(bases):
            try:
                with self.segment(partition, base, last=i == len(bases) - 1) as segment:
                    found = segment.offset_for_timestamp(timestamp_ms)
            except FileNotFoundError:
                continue  # deleted by retention: everything in it was older anyway
            if found is not None:
                return found
        return None


def _read_meta(path: Path) -> int:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        found = (meta["format"], meta["format_version"])
        partitions = meta["partitions"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptLog(str(path), 0, f"unreadable {META_FILE}: {exc}") from None
    if found != SUPPORTED_FORMAT:
        raise CorruptLog(str(path), 0, f"unsupported log format {found[0]!r} version {found[1]!r}"
                         f" (this reader knows {SUPPORTED_FORMAT[0]!r} {SUPPORTED_FORMAT[1]})")
    if not isinstance(partitions, int) or partitions < 1:
        raise CorruptLog(str(path), 0, f"bad partition count {partitions!r}")
    return partitions


class SegmentFile:
    """One ``.log`` file opened read-only, with its size as of opening (see module doc)."""

    def __init__(self, directory: Path, base_offset: int, *, last: bool) -> None:
        self.directory = directory
        self.base_offset = base_offset
        self.last = last
        self.path = directory / segment_file_name(base_offset, LOG_SUFFIX)
        self._fd = os.open(self.path, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size
        self._offset_index: tuple[array, array] | None = None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SegmentFile:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- batches --------------------------------------------------------------------------

    def batches(self, position: int = 0) -> Iterator[tuple[BatchHeader, bytes, int, int]]:
        """Verified batches from byte ``position``: (header, buffer, where the batch starts in
        the buffer, where it starts in the file).

        One buffer (the same object) holds all the batches of a read chunk.
        """
        while position < self.size:
            data = os.pread(self._fd, min(READ_CHUNK_BYTES, self.size - position), position)
            used = 0
            while used < len(data):
                try:
                    header = verify_batch(data, used)
                except IncompleteBatch:
                    break
                except CorruptBatch as exc:
                    self._damaged(position + used, data, used, str(exc))
                    return
                yield header, data, used, position + used
                used += header.batch_length
            if used == 0:  # a batch larger than the chunk, or the end of the written data
                whole = self._whole_batch(position, data)
                if whole is None:
                    return
                yield whole[0], whole[1], 0, position
                used = whole[0].batch_length
            position += used

    def _whole_batch(self, position: int, start: bytes) -> tuple[BatchHeader, bytes] | None:
        """The batch at ``position`` read in one piece, or None at a tolerated torn tail."""
        try:
            length = peek_batch_header(start).batch_length
        except IncompleteBatch:
            self._torn(position, "header cut short")
            return None
        except CorruptBatch as exc:
            self._damaged(position, start, 0, str(exc))
            return None
        if position + length > self.size:
            self._torn(position, f"batch of {length} bytes runs past the end")
            return None
        data = os.pread(self._fd, length, position)
        try:
            return verify_batch(data, 0), data
        except IncompleteBatch:  # the file shrank under us: the broker truncated a torn tail
            self._torn(position, "file shrank while reading")
            return None
        except CorruptBatch as exc:
            self._damaged(position, data, 0, str(exc))
            return None

    def _torn(self, position: int, reason: str) -> None:
        if not self.last:
            raise CorruptLog(str(self.path), position, reason)
        return None  # a write in progress, or a torn tail the broker will truncate

    def _damaged(self, position: int, data: bytes, at: int, reason: str) -> None:
        """A batch failed its checks: tolerated only as the very end of the last segment."""
        try:
            end = position + peek_batch_header(data, at).batch_length
        except (CorruptBatch, IncompleteBatch):
            end = -1
        if not (self.last and end == self.size):
            raise CorruptLog(str(self.path), position, reason)

    def next_offset(self) -> int:
        """One past the last record of the last whole batch (``base_offset`` when empty)."""
        relative, positions = self._load_offset_index()
        position, next_offset = 0, self.base_offset
        last = len(relative) - 1
        for i in range(last, max(last - _INDEX_TRIES, -1), -1):  # the last entry that checks out
            checked = self._checked_position(relative[i], positions[i])
            if checked is not None:  # whole batches precede it: the next offset is at least its
                position, next_offset = checked, self.base_offset + relative[i]
                break
        for header, *_ in self.batches(position):
            next_offset = header.last_offset + 1
        return next_offset

    # -- indexes --------------------------------------------------------------------------

    def position_for(self, offset: int) -> int:
        """A byte position at or before the batch holding ``offset`` (0 if the index fails)."""
        relative, positions = self._load_offset_index()
        found = bisect.bisect_right(relative, offset - self.base_offset)
        for i in range(found, max(found - _INDEX_TRIES, 0), -1):
            position = self._checked_position(relative[i - 1], positions[i - 1])
            if position is not None:
                return position
        return 0

    def _checked_position(self, relative: int, position: int) -> int | None:
        """``position`` if a batch with base offset ``base + relative`` starts there."""
        if position + HEADER_SIZE > self.size:
            return None
        try:
            header = peek_batch_header(os.pread(self._fd, HEADER_SIZE, position))
        except (CorruptBatch, IncompleteBatch):
            return None
        return position if header.base_offset == self.base_offset + relative else None

    def _load_offset_index(self) -> tuple[array, array]:
        if self._offset_index is None:
            raw = _read_small(self.directory / segment_file_name(self.base_offset, INDEX_SUFFIX))
            words = array("I")
            if len(raw) % 8 == 0 and words.itemsize == 4:
                words.frombytes(raw)
                if sys.byteorder == "little":
                    words.byteswap()
            self._offset_index = (words[0::2], words[1::2])
        return self._offset_index

    def offset_for_timestamp(self, timestamp_ms: int) -> int | None:
        """First offset in this segment with a timestamp >= ``timestamp_ms``, or None."""
        position = self._time_index_start(timestamp_ms)
        for header, data, at, _ in self.batches(position):
            if header.max_timestamp >= timestamp_ms:
                return _first_record_at_or_after(header, data, at, timestamp_ms)
        return None

    def _time_index_start(self, timestamp_ms: int) -> int:
        """A position before which every record is older than ``timestamp_ms`` (or 0)."""
        raw = _read_small(self.directory / segment_file_name(self.base_offset, TIMEINDEX_SUFFIX))
        if len(raw) % _TIME_ENTRY.size:
            return 0
        entries = list(_TIME_ENTRY.iter_unpack(raw))
        i = bisect.bisect_left([t for t, _ in entries], timestamp_ms)
        if i == 0:
            return 0
        relative = entries[i - 1][1]
        offsets, positions = self._load_offset_index()
        j = bisect.bisect_left(offsets, relative)
        if j < len(offsets) and offsets[j] == relative:
            checked = self._checked_position(relative, positions[j])
            if checked is not None:
                return checked
        return 0


def _first_record_at_or_after(header: BatchHeader, data: bytes, at: int,
                              timestamp_ms: int) -> int:
    p = at + HEADER_SIZE
    unpack = RECORD_PREFIX.unpack_from
    for _ in range(header.record_count):
        delta, ts_delta, _, _, tl, cl, pl, yl = unpack(data, p)
        if header.first_timestamp + ts_delta >= timestamp_ms:
            return header.base_offset + delta
        p += RECORD_PREFIX_SIZE + tl + cl + pl + yl
    return header.last_offset  # unreachable for a verified batch: max_timestamp >= t


def _read_small(path: Path) -> bytes:
    """A whole index file, or b"" if it is missing (deleted, or never written)."""
    try:
        with open(path, "rb") as file:
            return file.read()
    except FileNotFoundError:
        return b""
