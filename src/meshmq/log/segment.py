"""``LogSegment``: one ``.log`` file of record batches and its two sparse indexes.

Theory of operation
-------------------
A segment holds batches from ``base_offset`` on in ``{base_offset:020d}.log``, ``.index`` and
``.timeindex``; batches are only appended (or cut off the end by ``truncate_to``/``recover``).
The live state (size, next offset, max timestamp, last indexed position) is a ``_ScanState``
that appends and load-time scans advance with the same function, so an index rebuilt from the
log is byte-for-byte the one appends wrote (``index.py`` has the indexing rule).

Preallocation. With ``preallocate_bytes`` > 0 the ``.log`` file is extended ahead of the
appends (``os.posix_fallocate``, that many bytes at a time), so most appends write inside the
file and leave its size alone. Then the durability sync can be ``os.fdatasync``: it skips the
metadata not needed to read the data back, and the size, the one piece that is needed, is
already durable. ``flush()`` uses a full ``os.fsync`` whenever the size changed since the last
full one (a preallocation, a truncation, or a write past the end when preallocation is off),
``fdatasync`` otherwise. The preallocated bytes read as zeros; no batch starts with a 0 byte,
so the batches end where only zeros follow (``record.all_zero``): loading and ``recover()``
stop there without calling it damage, after a crash too. ``trim()`` cuts the zeros off (a roll
and ``close()`` do, so a sealed segment is exactly its batches). A file system that refuses
``fallocate`` turns preallocation off for the segment: the file grows with each append.

Opening a segment loads and checks the indexes (a bad one is rebuilt), then verifies the
batches after the last index entry. A bad batch there is recorded in ``damage`` and appends are
refused; the owner calls ``recover()`` (segment may hold unflushed writes) or raises ``damage``.

``recover()`` verifies every batch from byte 0. At the first bad batch, if any valid batch
(checksum good, offsets after the last good one) starts later in the file, the damage is in the
middle and ``CorruptSegment`` is raised; otherwise the bad bytes are a torn or corrupt tail and
are cut off. Never silently: the file as it was is first kept in ``repair-backup-<UTC time>/``
beside it, by the code ``meshmq log repair`` uses (``backup.py``), and the warning names it.

Invariants
----------
* Bytes ``[0, size)`` of the ``.log`` file are whole, verified batches with increasing offsets
  between ``base_offset`` and ``base_offset + 2**32 - 1``; the file is ``file_size`` long and
  bytes ``[size, file_size)`` are zeros (preallocated), unless ``damage`` is set.
* ``size_changes`` counts the changes of the file's size since it was opened; a full fsync
  after the change numbered ``n`` makes ``durable_size_changes`` >= ``n`` (-1 until the
  first: the size found at open is not known to be durable); a sync of data written at change
  ``n`` is an ``fdatasync`` only when ``n <= durable_size_changes``.
* Every index entry names the start of a batch in ``[0, size)`` (see ``index.py``).
* Not thread-safe: the owning ``Partition`` serializes every call.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from meshmq.log.backup import cut_file
from meshmq.log.errors import CorruptBatch, CorruptSegment, IncompleteBatch, LogClosed
from meshmq.log.files import (
    LOG_SUFFIX,
    FsyncFunction,
    mapped,
    segment_file_name,
    write_all_at,
    write_at,
)
from meshmq.log.index import SegmentIndex
from meshmq.log.record import (
    HEADER_SIZE,
    NO_TIMESTAMP,
    BatchHeader,
    Record,
    all_zero,
    decode_batch,
    encode_batch,
    find_verified_batch,
    peek_batch_header,
    read_batch_header,
    verify_batch,
    wall_clock_ms,
    whole_batches,
    zero_tail_start,
)

log: Final = logging.getLogger("meshmq.log")

PAGE_BYTES: Final = 4096  # the unit in which the kernel writes a file's data back

MAX_RELATIVE_OFFSET: Final = 0xFFFF_FFFF  # relative offsets are u32 in the indexes
MAX_SEGMENT_BYTES: Final = 0xFFFF_FFFF  # positions are u32 in the offset index
DEFAULT_INDEX_INTERVAL_BYTES: Final = 4096


@dataclass(slots=True)
class _ScanState:
    position: int  # end of the verified batches: the segment's size
    next_offset: int
    max_timestamp: int = NO_TIMESTAMP
    last_indexed: int = 0  # position of the last indexed batch; byte 0 is implicitly indexed


class LogSegment:
    """A segment of a partition; see the module docstring for its rules."""

    def __init__(self, directory: Path | str, base_offset: int, *,
                 index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES,
                 fsync: FsyncFunction = os.fsync, datasync: FsyncFunction | None = None,
                 preallocate_bytes: int = 0, now_ms: int | None = None) -> None:
        """Open the segment's files, creating them if missing, and load its state.

        ``datasync`` syncs the data of a file whose size is durable already (default:
        ``os.fdatasync``, or ``fsync`` when a test injected another ``fsync``: what it observes
        or fails must see every sync). ``preallocate_bytes``: extend the file this much at a
        time ahead of the appends (0: let it grow with each). Check ``damage`` next: when set,
        call ``recover()`` or report the corruption.
        """
        self.directory = Path(directory)
        self.base_offset = base_offset
        self.log_path = self.directory / segment_file_name(base_offset, LOG_SUFFIX)
        self._fsync = fsync
        self._datasync = datasync or (os.fdatasync if fsync is os.fsync else fsync)
        self._preallocate = preallocate_bytes
        self.file_size = 0  # the .log file's length: size plus the preallocated zeros
        self.size_changes = 0
        # The size found at open may not be durable (a preallocation, then kill -9 before its
        # fsync): the first sync is a full one.
        self.durable_size_changes = -1
        self._state = _ScanState(0, base_offset)
        self.damage: CorruptSegment | None = None
        self.kept_tail: Path | None = None  # where ``recover()`` kept the file it cut
        self._fd = -1
        self._index = SegmentIndex(self.directory, base_offset, index_interval_bytes)
        try:
            self._fd = os.open(self.log_path, os.O_RDWR | os.O_CREAT, 0o644)
            self._load()
        except BaseException:
            self.close()
            raise
        self.created_at = self._first_timestamp(now_ms)

    # -- state ----------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Bytes of verified batches in the ``.log`` file."""
        return self._state.position

    @property
    def next_offset(self) -> int:
        """The offset the next appended record gets (``base_offset`` when empty)."""
        return self._state.next_offset

    @property
    def max_timestamp(self) -> int:
        """Largest record timestamp in the segment, ``NO_TIMESTAMP`` (-1) when empty."""
        return self._state.max_timestamp

    @property
    def is_empty(self) -> bool:
        return self._state.position == 0

    @property
    def index_entries(self) -> int:
        return len(self._index)

    def age(self, now_ms: int) -> int:
        """Milliseconds since ``created_at`` (the first batch's timestamp, or the open time)."""
        return now_ms - self.created_at

    def fileno(self) -> int:
        """The ``.log`` file descriptor; ``os.dup`` it to fsync outside the owner's lock."""
        self._check_open()
        return self._fd

    # -- writing --------------------------------------------------------------------------

    def append(self, batch: bytes, first_offset: int, last_offset: int,
               max_timestamp: int) -> int:
        """Append one encoded batch; return the byte position it was written at.

        The batch's header must agree with the arguments, start at or after ``next_offset``
        and ``fits()`` (the owner rolls a new segment first when it does not). The data is in
        the OS page cache on return, readable at once; call ``flush()`` for durability.
        """
        self._check_writable()
        header = read_batch_header(batch)
        if (header.base_offset, header.last_offset, header.max_timestamp) != (
                first_offset, last_offset, max_timestamp) or header.batch_length != len(batch):
            raise ValueError("batch header disagrees with the append arguments")
        if first_offset < self._state.next_offset:
            raise ValueError(f"offset {first_offset} < next offset {self.next_offset}")
        if not self.fits(len(batch), last_offset):
            raise ValueError("batch does not fit this segment: roll a new one")
        position = self._state.position
        self._make_room(position + len(batch))
        try:
            write_at(self._fd, batch, position)
        except OSError:
            self._undo_write(position)
            raise
        self._note_written(position + len(batch))
        self._advance(self._state, position, header)
        return position

    def append_sealed(self, buffers: list[bytes], headers: list[BatchHeader]) -> None:
        """Append sealed batches (``BatchBuilder.seal``): ``headers`` parsed, ``buffers`` their
        bytes (header and body of each, in order), in one vectored write.

        The caller built the headers, so they are trusted; the offsets must follow
        ``next_offset`` and everything must ``fits()``, as for ``append``.
        """
        self._check_writable()
        first, last = headers[0].base_offset, headers[-1].last_offset
        total = sum(header.batch_length for header in headers)
        if first < self._state.next_offset:
            raise ValueError(f"offset {first} < next offset {self.next_offset}")
        if not self.fits(total, last):
            raise ValueError("batches do not fit this segment: roll a new one")
        position = self._state.position
        self._make_room(position + total)
        try:
            write_all_at(self._fd, buffers, position)
        except OSError:
            self._undo_write(position)
            raise
        self._note_written(position + total)
        for header in headers:
            self._advance(self._state, position, header)
            position += header.batch_length

    def fits(self, batch_length: int, last_offset: int) -> bool:
        """Whether a batch of this size ending at ``last_offset`` may still be appended."""
        return (last_offset - self.base_offset <= MAX_RELATIVE_OFFSET
                and self._state.position + batch_length <= MAX_SEGMENT_BYTES)

    def _make_room(self, end: int) -> None:
        """Preallocate past ``end`` when the file is shorter (a no-op when preallocation is
        off, or after the file system refused it: the write then grows the file)."""
        if end <= self.file_size or not self._preallocate:
            return
        start = self.file_size
        target = max(end, start + self._preallocate)
        try:
            os.posix_fallocate(self._fd, start, target - start)
        except OSError as exc:
            log.warning("%s: cannot preallocate (%s); the file grows with each append and "
                        "each sync is a full fsync", self.log_path, exc)
            self._preallocate = 0
            self._set_file_size(start)  # whatever a partial preallocation added must go
            return
        self.file_size = target
        self.size_changes += 1

    def _note_written(self, end: int) -> None:
        if end > self.file_size:  # grown by the write: preallocation is off
            self.file_size = end
            self.size_changes += 1

    def _set_file_size(self, size: int) -> None:
        os.ftruncate(self._fd, size)
        self.file_size = size
        self.size_changes += 1

    def _undo_write(self, position: int) -> None:
        try:  # zeros again from ``position`` (a preallocation is redone by the next append)
            self._set_file_size(position)
        except OSError as exc:
            self.damage = CorruptSegment(self.log_path, position, f"failed write: {exc}")

    def _advance(self, state: _ScanState, position: int, header: BatchHeader) -> None:
        state.max_timestamp = max(state.max_timestamp, header.max_timestamp)
        if self._index.maybe_add(position, state.last_indexed, header.base_offset,
                                 state.max_timestamp):
            state.last_indexed = position
        state.position = position + header.batch_length
        state.next_offset = header.last_offset + 1

    def truncate_to(self, offset: int) -> int:
        """Remove every record at or after ``offset``; return how many bytes were removed.

        A batch straddling ``offset`` is rewritten with only its earlier records. Call
        ``flush()`` afterwards to make the truncation durable.
        """
        self._check_writable()
        if offset >= self._state.next_offset or self.is_empty:
            return 0
        old_size = self._state.position
        position = self.lookup(max(offset, self.base_offset)) or 0
        keep = [r for r in self._batch_at(position) if r.offset < offset]
        self._set_file_size(position)
        self._index.truncate_at(position)
        self._restore_state(position)
        if keep:
            self.append(encode_batch(keep), keep[0].offset, keep[-1].offset,
                        max(r.timestamp_ms for r in keep))
        return old_size - self._state.position

    def flush(self) -> None:
        """Sync the ``.log`` file: everything appended so far survives a power loss."""
        self.sync(self.fileno(), self.size_changes)

    def sync(self, fd: int, size_changes: int) -> None:
        """Make what was written to the ``.log`` file durable, through ``fd`` (this segment's
        descriptor or a duplicate of it: the owner may call this outside its lock), when the
        file's size has changed ``size_changes`` times (read under the lock when the data to
        make durable was written). A full fsync when the size may not be durable yet,
        ``fdatasync`` when it is."""
        if size_changes <= self.durable_size_changes:
            self._datasync(fd)
            return
        self._fsync(fd)
        self.synced(size_changes)

    def synced(self, size_changes: int) -> None:
        """A full sync (this file's ``fsync``, or a ``syncfs`` of its file system) made the
        file's size durable as it was after change number ``size_changes``."""
        # Two threads may race here; the larger count wins but a smaller one may overwrite it,
        # which only costs a later full fsync (never an fdatasync the size was not ready for).
        self.durable_size_changes = max(self.durable_size_changes, size_changes)

    def trim(self) -> None:
        """Cut the preallocated zeros off the ``.log`` file (before sealing or closing it);
        ``flush()`` afterwards makes the new size durable."""
        self._check_open()
        if self.file_size > self._state.position and self.damage is None:
            self._set_file_size(self._state.position)

    def flush_indexes(self) -> None:
        """fsync both index files (done when a segment is rolled or closed)."""
        self._check_open()
        self._index.flush(self._fsync)

    def close(self) -> None:
        """Close the files (no fsync: call ``flush()`` first if it matters). Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._index.close()

    def delete(self) -> None:
        """Close and remove the three files (the ``.log`` first: no orphan data)."""
        self.close()
        self.log_path.unlink(missing_ok=True)
        self._index.delete()

    # -- reading --------------------------------------------------------------------------

    def lookup(self, offset: int) -> int | None:
        """Byte position of the batch holding ``offset`` (or the first batch after it when
        ``offset`` falls in a gap); ``None`` when ``offset >= next_offset``."""
        self._check_open()
        if offset >= self._state.next_offset:
            return None
        position, relative = self._index.start_for_offset(offset)
        if relative is not None and not self._entry_matches(position, relative):
            log.warning("%s: index entry for %d is wrong; scanning from byte 0",
                        self.log_path, self.base_offset + relative)
            position = 0
        return self._scan_headers(position, lambda h: h.last_offset >= offset)

    def find_offset_by_timestamp(self, timestamp_ms: int) -> int | None:
        """The first offset whose record timestamp is >= ``timestamp_ms``; ``None`` if none."""
        self._check_open()
        if self._state.max_timestamp < timestamp_ms:
            return None
        start = self._index.start_for_timestamp(timestamp_ms)
        position = self._scan_headers(start, lambda h: h.max_timestamp >= timestamp_ms)
        if position is None:
            return None
        return next(r.offset for r in self._batch_at(position) if r.timestamp_ms >= timestamp_ms)

    def read(self, start_offset: int, max_bytes: int) -> bytes:
        """Whole batches from the one holding ``start_offset``, up to ``max_bytes`` (but at
        least one batch). Decode them with ``record.decode_batches(data, start_offset)``."""
        return self.read_batches(start_offset, max_bytes)[1]

    def read_batches(self, start_offset: int, max_bytes: int, max_records: int | None = None,
                     *, at_least_one: bool = True) -> tuple[int, bytes, int]:
        """Like ``read``; return (position, bytes, records at or after ``start_offset``).

        Stops after the batch that brings the record count to ``max_records``; with
        ``at_least_one=False`` a first batch larger than ``max_bytes`` is not returned.
        """
        position = self.lookup(start_offset)
        if position is None:
            return self._state.position, b"", 0
        available = self._state.position - position
        data = os.pread(self._fd, min(max_bytes, available), position)
        cut, count = whole_batches(data, start_offset, max_records)
        if cut == 0 and at_least_one:
            header = self._header_at(position)
            data = os.pread(self._fd, min(header.batch_length, available), position)
            cut, count = len(data), header.last_offset - max(header.base_offset, start_offset) + 1
        return position, data[:cut], count

    def _batch_at(self, position: int) -> list[Record]:
        header = self._header_at(position)
        try:
            return decode_batch(os.pread(self._fd, header.batch_length, position))[0]
        except (CorruptBatch, IncompleteBatch) as exc:
            raise CorruptSegment(self.log_path, position, str(exc)) from None

    def _header_at(self, position: int) -> BatchHeader:
        try:
            return peek_batch_header(os.pread(self._fd, HEADER_SIZE, position))
        except (CorruptBatch, IncompleteBatch) as exc:
            raise CorruptSegment(self.log_path, position, str(exc)) from None

    def _entry_matches(self, position: int, relative_offset: int) -> bool:
        try:
            return self._header_at(position).base_offset == self.base_offset + relative_offset
        except CorruptSegment:
            return False

    def _scan_headers(self, position: int,
                      found: Callable[[BatchHeader], bool]) -> int | None:
        while position < self._state.position:
            header = self._header_at(position)
            if found(header):
                return position
            position += header.batch_length
        return None

    # -- loading and recovery -------------------------------------------------------------

    def recover(self, *, allow_truncation: bool = True) -> int:
        """Verify every batch, rebuild both indexes, and cut off a torn or corrupt tail.

        Returns the number of bytes cut (preallocated zeros after the torn batch included);
        ``kept_tail`` is then the copy of the file as it was.
        Raises ``CorruptSegment`` when a bad batch is followed by valid data, unless a page of
        zeros lies between them (a page never written back before a power loss: nothing from
        there on was acknowledged, since every acknowledgement follows a sync of everything
        written before it), or when ``allow_truncation`` is False, or no copy could be kept:
        the segment then keeps ``damage`` set and refuses appends.
        """
        self._check_open()
        file_size = os.fstat(self._fd).st_size
        self._index.truncate_entries(0)
        self._state = _ScanState(0, self.base_offset)
        self.damage = damage = self._scan(self._state, file_size)
        if damage is None:
            return 0
        if not allow_truncation:
            raise damage
        later = self._valid_batch_after(damage.position, file_size)
        if later is not None:
            unwritten = self._unwritten_page(damage.position, later)
            if unwritten is None:
                raise damage
            log.warning("%s: a page never written back before the stop (zeros at byte %d) "
                        "precedes batches at byte %d and after: with log.fsync = \"always\" "
                        "none of them was acknowledged (every acknowledgement follows a sync of "
                        "all written before it); they are cut with the tail", self.log_path,
                        unwritten, later)
        with mapped(self._fd, file_size) as buf:
            zeros = file_size - zero_tail_start(buf, damage.position, file_size)
        self.kept_tail = self._cut_tail(damage)
        self.damage = None
        log.warning("%s: cut %d bytes of torn or corrupt tail at byte %d (%s; the last %d of "
                    "them zeros, as preallocated); the file as it was is kept in %s (delete "
                    "it once the log is known to be good)", self.log_path,
                    file_size - damage.position, damage.position, damage.reason, zeros,
                    self.kept_tail)
        return file_size - damage.position

    def _cut_tail(self, damage: CorruptSegment) -> Path:
        """Keep a copy of the file, replace it by its first ``damage.position`` bytes, reopen."""
        try:
            kept = cut_file(self.log_path, [(0, damage.position)], fsync=self._fsync)
        except OSError as exc:
            raise CorruptSegment(self.log_path, damage.position,
                                 f"{damage.reason}; not cut off, as no copy of it could be "
                                 f"kept ({exc})") from None
        os.close(self._fd)
        self._fd = -1
        self._fd = os.open(self.log_path, os.O_RDWR)
        self.file_size = damage.position
        self.size_changes += 1  # (cut_file fsynced it; counting it only costs a full fsync)
        return kept

    def _load(self) -> None:
        self.file_size = file_size = os.fstat(self._fd).st_size
        if not self._index.load(file_size):
            log.info("%s: rebuilding the indexes", self.log_path)
        self.damage = self._restore_state(file_size)

    def _restore_state(self, file_size: int) -> CorruptSegment | None:
        """Rebuild the live state from the last index entry (or byte 0) by scanning to EOF."""
        state = self._state_at_last_entry()
        if state is None:
            self._index.truncate_entries(0)
            state = _ScanState(0, self.base_offset)
        self._state = state
        return self._scan(state, file_size)

    def _state_at_last_entry(self) -> _ScanState | None:
        entry = self._index.last_entry()
        if entry is None:
            return _ScanState(0, self.base_offset)
        relative, position, max_timestamp = entry
        try:
            head = os.pread(self._fd, HEADER_SIZE, position)
            header = verify_batch(head + os.pread(
                self._fd, peek_batch_header(head).batch_length - HEADER_SIZE,
                position + HEADER_SIZE))
        except (CorruptBatch, IncompleteBatch):
            return None
        if header.base_offset != self.base_offset + relative or (
                max_timestamp < header.max_timestamp):
            return None
        return _ScanState(position + header.batch_length, header.last_offset + 1,
                          max_timestamp, position)

    def _scan(self, state: _ScanState, file_size: int) -> CorruptSegment | None:
        """Verify batches from ``state.position`` to EOF, advancing ``state`` (and the indexes).

        Returns the first bad batch as a ``CorruptSegment`` (not raised), or None.
        """
        if state.position >= file_size:
            return None
        with mapped(self._fd, file_size) as buf:
            while state.position < file_size:
                try:
                    header = verify_batch(buf, state.position)
                    self._check_sequence(header, state)
                except (CorruptBatch, IncompleteBatch) as exc:
                    if all_zero(buf, state.position, file_size):
                        return None  # preallocated, never written: the batches end here
                    return CorruptSegment(self.log_path, state.position, str(exc))
                self._advance(state, state.position, header)
        return None

    def _check_sequence(self, header: BatchHeader, state: _ScanState) -> None:
        if header.base_offset < state.next_offset:
            raise CorruptBatch(f"offset {header.base_offset} goes backwards "
                               f"(expected >= {state.next_offset})")
        if header.last_offset - self.base_offset > MAX_RELATIVE_OFFSET:
            raise CorruptBatch(f"offset {header.last_offset} is outside this segment")

    def _valid_batch_after(self, position: int, file_size: int) -> int | None:
        """Where the first verifiable batch with plausible offsets after ``position`` starts
        (None: none does)."""
        def plausible(header: BatchHeader) -> bool:
            return (header.base_offset >= self._state.next_offset
                    and header.last_offset - self.base_offset <= MAX_RELATIVE_OFFSET)

        with mapped(self._fd, file_size) as buf:
            return find_verified_batch(buf, position + 1, plausible)

    def _unwritten_page(self, start: int, end: int) -> int | None:
        """The first page-aligned ``PAGE_BYTES`` of zeros in ``[start, end)``, if any: a page
        the kernel never wrote back before a power loss (pages of one file may reach the disk
        in any order; a preallocated file reads as zeros where they did not). Only the active
        segment's recovery asks: a sealed segment was synced whole before the next one
        existed."""
        page = (start + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES
        if page + PAGE_BYTES > end:
            return None
        with mapped(self._fd, end) as buf:
            while page + PAGE_BYTES <= end:
                if all_zero(buf, page, page + PAGE_BYTES):
                    return page
                page += PAGE_BYTES
        return None

    def _first_timestamp(self, now_ms: int | None) -> int:
        if not self.is_empty:
            try:
                return self._header_at(0).first_timestamp
            except CorruptSegment:
                pass
        return now_ms if now_ms is not None else wall_clock_ms()

    def _check_open(self) -> None:
        if self._fd < 0:
            raise LogClosed(f"{self.log_path} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.damage is not None:
            raise self.damage
