"""The one read-only reader of the commit log's files, for every program that does not own it.

Theory of operation
-------------------
The owner of a partition (``CommitLog``: the flock, every write) may append, roll, truncate a
torn tail and delete old segments at any moment. Readers without the lock (``LogView`` in the
broker's workers, the ``meshmq log`` tools, the Spark source) find and open the files through
this module, and read them as ``docs/log-format.md`` ("Reading the log from another program")
says. (The tools add, in ``inspect.py``, a walk over the bytes that resynchronises past damage
to report all of it; everyone else stops at the first.) Nothing here locks, creates, writes or
truncates a file.

* ``LogDirectory`` resolves a data_dir or a log dir, checks ``meta.json`` and lists a
  partition's segments (``SegmentFile``) by name, oldest first. A listing goes stale: retention
  may delete a listed segment before it is opened (``FileNotFoundError``: list again).
* ``OpenSegment`` opens one ``.log`` ``O_RDONLY``; the fd keeps reading a file that retention
  unlinks (``deleted()`` tells). It is *sealed* once a listing showed a later segment: only the
  end of an unsealed segment can be a write in progress.
* ``Walk`` yields the whole batches of a segment from a byte position up to the file's size when
  the walk began, read a chunk at a time (``os.pread``). A batch passes the ``check`` given
  (``read_batch_header`` for a cheap header walk whose caller decodes later, ``verify_batch``
  for checksums). When the walk cannot get past a batch it stops without raising and records
  a ``Tail``: where, why, and whether it may be a write in progress or the end of the written
  data, in a segment not known to be sealed: the file ends inside the batch, or the batch
  fails its checks and ends exactly at the end of the file, or only zeros follow it (the
  owner preallocates the active segment: its written batches are followed by zeros, and a
  batch being written is followed by zeros too). The caller decides: stop quietly at a
  tolerated tail, or raise (``Tail.error()`` is the ``CorruptSegment`` for it).
* "Only zeros follow" is judged on the ``ZERO_PROBE_BYTES`` after the batch, not up to the end
  of the preallocated file, so that a reader at the end of the log does not read and compare
  megabytes of zeros each time (damage followed by that many zeros in the active segment
  therefore reads as its end until the segment is sealed). A write in progress is copied into
  the page cache in file order, but a read racing with it may see a later page written and an
  earlier one not yet: so a failure in an unsealed segment that is not tolerated is read once
  more before it is reported (by then the earlier page has been copied).
* The ``.index``/``.timeindex`` files are caches written without fsync, so they are hints: an
  entry is used only when a batch with the expected base offset starts where it points;
  otherwise the walk starts at byte 0. A torn last entry is left out.

Offsets: ``earliest_offset`` is the first listed segment's base, ``next_offset`` one past the
last record of the last whole batch of the last segment.
"""

from __future__ import annotations

import bisect
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from struct import Struct
from types import TracebackType
from typing import NamedTuple

from meshmq.log.commit_log import LOG_DIRECTORY, META_FILE, META_FORMAT, META_VERSION
from meshmq.log.errors import CorruptBatch, CorruptSegment, IncompleteBatch, LogError
from meshmq.log.files import INDEX_SUFFIX, LOG_SUFFIX, TIMEINDEX_SUFFIX, segment_file_name
from meshmq.log.index import OffsetIndex, TimeIndex
from meshmq.log.locks import LOCK_FILE, is_locked
from meshmq.log.record import (
    HEADER_SIZE,
    BatchHeader,
    Record,
    all_zero,
    decode_batch,
    peek_batch_header,
    read_batch_header,
    verify_batch,
)

WALK_BYTES = 64 * 1024  # header walks (seeks, timestamps, next_offset) read this much at once
ZERO_PROBE_BYTES = 4096  # this many zeros after a failed batch (or to EOF): nothing follows it
LISTING_ATTEMPTS = 8  # retention may delete a listed segment before it is opened

BatchCheck = Callable[[bytes, int], BatchHeader]


class LogDirectoryError(LogError):
    """The directory given is not a log this reader can use (one line, for the user)."""


class NoLogHere(LogDirectoryError):
    """The directory (or its ``log`` subdirectory) holds no ``meta.json``."""


class UnusableMeta(LogDirectoryError):
    """``meta.json`` (at ``path``) is unreadable or describes a log this reader cannot read."""

    def __init__(self, path: Path, reason: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason


# -- the directory ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SegmentFile:
    """One ``.log`` file as listed; it may vanish (retention) before it is opened."""

    partition: int
    base_offset: int
    path: Path

    @property
    def index_path(self) -> Path:
        return self.path.with_suffix(INDEX_SUFFIX)

    @property
    def timeindex_path(self) -> Path:
        return self.path.with_suffix(TIMEINDEX_SUFFIX)

    def read(self, start: int = 0) -> bytes | None:
        """The file's bytes from ``start`` to its current end; None if it was deleted."""
        try:
            with open(self.path, "rb") as file:
                file.seek(start)
                return file.read()
        except FileNotFoundError:
            return None


@dataclass(frozen=True, slots=True)
class LogDirectory:
    """A log directory (the one holding ``meta.json``) and what ``meta.json`` says."""

    path: Path
    partitions: int

    @classmethod
    def locate(cls, given: Path | str) -> LogDirectory:
        """Accept a broker data_dir (``DIR/log/meta.json``) or the log directory itself.

        Raises ``NoLogHere`` when neither holds a log, ``UnusableMeta`` for a ``meta.json``
        this reader cannot use; each with a one-line explanation.
        """
        given = Path(given)
        if not given.is_dir():
            raise NoLogHere(f"{given}: no such directory")
        for candidate in (given, given / LOG_DIRECTORY):
            if (candidate / META_FILE).is_file():
                return cls(candidate, _read_meta(candidate / META_FILE))
        raise NoLogHere(
            f"{given}: no commit log here (neither {given / LOG_DIRECTORY / META_FILE} "
            f"nor {given / META_FILE} exists)")

    def partition_dir(self, partition: int) -> Path:
        return self.path / str(partition)

    def segments(self, partition: int) -> list[SegmentFile]:
        """The partition's segments in offset order (empty if the directory is missing)."""
        directory = self.partition_dir(partition)
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return []
        bases = sorted(int(name[: -len(LOG_SUFFIX)]) for name in names
                       if name.endswith(LOG_SUFFIX) and name[: -len(LOG_SUFFIX)].isdigit())
        return [SegmentFile(partition, base, directory / segment_file_name(base, LOG_SUFFIX))
                for base in bases]

    def is_locked(self) -> bool:
        return log_is_locked(self.path)

    def earliest_offset(self, partition: int) -> int:
        """The lowest offset still stored (0 while the partition has no segment)."""
        listing = self.segments(partition)
        return listing[0].base_offset if listing else 0

    def next_offset(self, partition: int) -> int:
        """One past the last whole batch of the partition (the last one's checksum checked)."""
        for _ in range(LISTING_ATTEMPTS):
            listing = self.segments(partition)
            if not listing:
                return 0
            try:
                segment = OpenSegment(listing[-1], sealed=False)
            except FileNotFoundError:
                continue  # the owner truncated below it meanwhile: list again
            with segment:
                return end_offset(segment)
        raise LogError(f"partition {partition}: its segments keep disappearing")

    def offset_for_timestamp(self, partition: int, timestamp_ms: int) -> int | None:
        """First offset whose record timestamp is >= ``timestamp_ms``; None: all are older,
        start from ``next_offset``. Raises ``CorruptSegment`` on damage on the way."""
        listing = self.segments(partition)
        for i, file in enumerate(listing):
            try:
                segment = OpenSegment(file, sealed=i + 1 < len(listing))
            except FileNotFoundError:
                continue  # deleted by retention since the listing: all of it was older
            with segment:
                found = first_offset_at_or_after(segment, timestamp_ms)
            if found is not None:
                return found
        return None


def _read_meta(path: Path) -> int:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        fmt, version, partitions = meta["format"], meta["format_version"], meta["partitions"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UnusableMeta(path, f"unreadable: {exc}", f"{path} is unreadable: {exc}") from None
    if fmt != META_FORMAT or version != META_VERSION:
        reason = (f"unsupported log format {fmt!r} version {version!r} (this reader knows "
                  f"{META_FORMAT!r} {META_VERSION})")
        raise UnusableMeta(path, reason, f"{path}: {reason}")
    if not isinstance(partitions, int) or partitions < 1:
        reason = f"invalid partition count {partitions!r}"
        raise UnusableMeta(path, reason, f"{path}: {reason}")
    return partitions


def log_is_locked(log_dir: Path) -> bool:
    """Whether a process holds the flock on ``log_dir/.lock`` (a broker has the log open)."""
    return is_locked(log_dir / LOCK_FILE)


# -- one segment --------------------------------------------------------------------------------


class OpenSegment:
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

    @property
    def path(self) -> Path:
        return self.file.path

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def deleted(self) -> bool:
        """Whether retention unlinked the file (the fd still reads it)."""
        return os.fstat(self.fd).st_nlink == 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OpenSegment:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

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
    key, value = entry.unpack_from(raw, i * entry.size)
    return key, value


def _count_entries(raw: bytes, entry: Struct, key: int) -> int:
    """How many leading entries of an index (keys increasing) have a key <= ``key``; a torn
    entry being written at the end is left out."""
    return bisect.bisect_right(range(len(raw) // entry.size), key,
                               key=lambda i: _entry(raw, entry, i)[0])


# -- walking the batches of a segment -----------------------------------------------------------


class Walked(NamedTuple):
    """A batch found by a ``Walk``: ``data[at:]`` holds it; it starts at byte ``position``."""

    header: BatchHeader
    data: bytes
    at: int
    position: int


@dataclass(frozen=True, slots=True)
class Tail:
    """Where a walk stopped before the end of the segment, and why.

    ``cut_short``: the file ends inside the batch; ``reaches_end``: the failed batch ends
    exactly at the end of the file; ``unwritten``: only zeros follow it (the preallocated
    space; at ``position`` itself when nothing was written there). Any of them, in a segment
    not known to be sealed, may be a write in progress, the end of the written data or a torn
    tail the owner truncates when it next opens the log: ``tolerated``.
    """

    path: Path
    position: int
    reason: str
    cut_short: bool
    reaches_end: bool
    sealed: bool
    unwritten: bool = False

    @property
    def tolerated(self) -> bool:
        return not self.sealed and (self.cut_short or self.reaches_end or self.unwritten)

    def error(self) -> CorruptSegment:
        return CorruptSegment(self.path, self.position, self.reason)


class Walk:
    """The whole batches of a segment from byte ``start`` up to its size when the walk began,
    read ``chunk`` bytes at a time (more for a longer batch); each passes ``check``.

    Iterating yields ``Walked`` batches. When the walk stops before the end, ``tail`` says
    where and why (``None``: it reached the end, or the caller stopped early).
    """

    def __init__(self, segment: OpenSegment, start: int, chunk: int = WALK_BYTES, *,
                 check: BatchCheck = read_batch_header) -> None:
        self.segment = segment
        self.start = start
        self.chunk = chunk
        self.check = check
        self.size = segment.size()
        self.tail: Tail | None = None
        self._read_again = -1  # the position last read once more after a failure

    def __iter__(self) -> Iterator[Walked]:
        position, chunk = self.start, self.chunk
        while position < self.size:
            data = os.pread(self.segment.fd, min(chunk, self.size - position), position)
            at, again = 0, False
            while True:
                try:
                    header = self.check(data, at)
                except IncompleteBatch:
                    break  # the buffer ends inside this batch
                except CorruptBatch as exc:
                    tail = self.failed(position + at, data, at, exc)
                    if tail.tolerated or not self.read_again(position + at):
                        self.tail = tail
                        return
                    again = True  # from this batch on, read afresh
                    break
                yield Walked(header, data, at, position + at)
                at += header.batch_length
            if again:
                position += at
                continue
            if at == 0:  # the first batch is longer than ``chunk``, or the file ends inside it
                if len(data) < chunk or position + len(data) >= self.size:
                    self.tail = self._tail(position, "the file ends inside this batch",
                                           cut_short=True)
                    return
                chunk = peek_batch_header(data).batch_length
            position += at

    def failed(self, position: int, data: bytes, at: int, exc: LogError) -> Tail:
        """The ``Tail`` for the batch at ``data[at:]`` (file byte ``position``) failing a
        check: the walk's own, or a later one such as decoding its records."""
        if isinstance(exc, IncompleteBatch):
            return self._tail(position, str(exc), cut_short=True)
        try:
            end = position + peek_batch_header(data, at).batch_length
            after = end
        except (CorruptBatch, IncompleteBatch):
            end, after = -1, position + HEADER_SIZE  # a header being written: only it
        return self._tail(position, str(exc), reaches_end=end == self.size,
                          unwritten=self._zeros_from(after, data, position - at))

    def _zeros_from(self, start: int, data: bytes, data_start: int) -> bool:
        """Whether the file holds only zeros in the ``ZERO_PROBE_BYTES`` from byte ``start``
        (or up to its end), from ``data`` (file bytes from ``data_start``) when it has them."""
        end = min(self.size, start + ZERO_PROBE_BYTES)
        if start >= end:
            return True
        if data_start <= start and end <= data_start + len(data):
            return all_zero(data, start - data_start, end - data_start)
        probe = os.pread(self.segment.fd, end - start, start)
        return all_zero(probe, 0, len(probe))

    def read_again(self, position: int) -> bool:
        """Whether to read the batch at ``position`` once more before reporting its damage:
        once per position, in a segment not known to be sealed (see the module docstring)."""
        if self.segment.sealed or position == self._read_again:
            return False
        self._read_again = position
        return True

    def _tail(self, position: int, reason: str, *, cut_short: bool = False,
              reaches_end: bool = False, unwritten: bool = False) -> Tail:
        return Tail(self.segment.path, position, reason, cut_short, reaches_end,
                    self.segment.sealed, unwritten)

    def raise_unless_tolerated(self) -> None:
        """After the walk: raise ``CorruptSegment`` for damage that cannot be a write in
        progress."""
        if self.tail is not None and not self.tail.tolerated:
            raise self.tail.error()


def decode_walked(walk: Walk, walked: Walked) -> list[Record] | None:
    """The records of a walked batch; None when it fails in a way that may be a write in
    progress (the walk's ``tail`` then says so). Raises ``CorruptSegment`` otherwise."""
    data, at = walked.data, walked.at
    while True:
        try:
            return decode_batch(data, at)[0]
        except (CorruptBatch, IncompleteBatch) as exc:
            tail = walk.failed(walked.position, data, at, exc)
        if tail.tolerated:
            walk.tail = tail
            return None
        if not walk.read_again(walked.position):
            walk.tail = tail
            raise tail.error()
        data, at = os.pread(walk.segment.fd, walked.header.batch_length, walked.position), 0


def batches_from(segment: OpenSegment, offset: int, end: int | None = None, *,
                 chunk: int = WALK_BYTES) -> Iterator[Walked]:
    """The checksummed batches of ``segment`` holding offsets in ``[offset, end)`` (no upper
    limit when ``end`` is None), started near ``offset`` with the index. Stops quietly at a
    tolerated tail; raises ``CorruptSegment`` at any other damage."""
    walk = Walk(segment, segment.index_start(offset)[0], chunk, check=verify_batch)
    for walked in walk:
        if walked.header.last_offset < offset:
            continue
        if end is not None and walked.header.base_offset >= end:
            return
        yield walked
    walk.raise_unless_tolerated()


def end_offset(segment: OpenSegment) -> int:
    """One past the segment's last whole checksummed batch, walking from its last good index
    entry. Raises ``CorruptSegment`` for damage that cannot be a write in progress."""
    position, end = segment.index_start(sys.maxsize)
    walk = Walk(segment, position, check=verify_batch)
    for walked in walk:
        end = walked.header.last_offset + 1
    walk.raise_unless_tolerated()
    return end


def first_offset_at_or_after(segment: OpenSegment, timestamp_ms: int) -> int | None:
    """The segment's first offset with a timestamp >= ``timestamp_ms``, or None."""
    walk = Walk(segment, segment.time_index_start(timestamp_ms))
    for walked in walk:
        if walked.header.max_timestamp >= timestamp_ms:
            batch = decode_walked(walk, walked)
            if batch is None:
                return None  # being written
            return next(r.offset for r in batch if r.timestamp_ms >= timestamp_ms)
    walk.raise_unless_tolerated()
    return None
