"""The sparse indexes of a segment: ``OffsetIndex`` (.index), ``TimeIndex`` (.timeindex) and
``SegmentIndex``, which writes both in lockstep.

Invariants
----------
* Both files are arrays of fixed-size big-endian entries, appended one entry per write; a
  file whose size is not a multiple of the entry size is damaged and is rebuilt.
* ``OffsetIndex`` entry = (relative offset u32, position u32): the batch starting at byte
  ``position`` of the ``.log`` file has base offset ``segment.base_offset + relative offset``.
  Both fields strictly increase. Position 0 is implied and never needs an entry.
* ``TimeIndex`` entry = (timestamp u64, relative offset u32): every record in the batches up
  to and including the one at that relative offset has a timestamp <= ``timestamp``.
  Timestamps never decrease; relative offsets strictly increase.
* ``SegmentIndex`` writes the two in lockstep (entry *i* of each names the same batch), so
  they always hold the same number of entries with the same relative offsets.
* Which batches get an entry is a pure function of the batch positions: a batch is indexed
  when it starts ``interval_bytes`` or more after the last indexed batch (byte 0 counts as
  indexed). An index rebuilt from the log is therefore byte-for-byte the one appends wrote.

The index is a cache of the log: the segment can rebuild it from the ``.log`` file at any
time, so these files are fsynced only when a segment is rolled or closed.
"""

from __future__ import annotations

import bisect
import os
import struct
from array import array
from pathlib import Path
from typing import ClassVar

from meshmq.log.files import INDEX_SUFFIX, TIMEINDEX_SUFFIX, FsyncFunction, segment_file_name


class _EntryFile:
    """A file of (key, value) entries mirrored in two in-memory arrays."""

    ENTRY: ClassVar[struct.Struct]  # (a class attribute: compiled, an annotation alone is a slot)

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.keys = array("Q")
        self.values = array("Q")

    def __len__(self) -> int:
        return len(self.keys)

    def load(self) -> bool:
        """Read the file into memory; return False (and hold nothing) when its size is wrong."""
        self.keys, self.values = array("Q"), array("Q")
        size = os.fstat(self._fd).st_size
        if size % self.ENTRY.size:
            return False
        data = os.pread(self._fd, size, 0)
        for key, value in self.ENTRY.iter_unpack(data):
            self.keys.append(key)
            self.values.append(value)
        return len(data) == size

    def append(self, key: int, value: int) -> None:
        """Add one entry at the end of the file (the OS has it; no fsync)."""
        os.pwrite(self._fd, self.ENTRY.pack(key, value), len(self.keys) * self.ENTRY.size)
        self.keys.append(key)
        self.values.append(value)

    def truncate_entries(self, count: int) -> None:
        """Keep the first ``count`` entries, in memory and on disk."""
        del self.keys[count:]
        del self.values[count:]
        os.ftruncate(self._fd, count * self.ENTRY.size)

    def flush(self, fsync: FsyncFunction) -> None:
        fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def delete(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


class OffsetIndex(_EntryFile):
    """Sparse map from relative offset to the byte position of the batch starting there."""

    ENTRY = struct.Struct(">II")

    @property
    def relative_offsets(self) -> array:
        return self.keys

    @property
    def positions(self) -> array:
        return self.values

    def floor(self, relative_offset: int) -> int:
        """Number of entries with relative offset <= ``relative_offset`` (0: start at byte 0)."""
        return bisect.bisect_right(self.keys, relative_offset)

    def is_sane(self, log_size: int) -> bool:
        """Both columns strictly increase and every position lies inside the log."""
        return _strictly_increasing(self.keys) and _strictly_increasing(self.values) and (
            not self.values or self.values[-1] < log_size
        )


class TimeIndex(_EntryFile):
    """Sparse map from "largest timestamp so far" to the relative offset of a batch."""

    ENTRY = struct.Struct(">QI")

    @property
    def timestamps(self) -> array:
        return self.keys

    @property
    def relative_offsets(self) -> array:
        return self.values

    def count_below(self, timestamp_ms: int) -> int:
        """Number of entries whose timestamp is < ``timestamp_ms``: all their batches are older."""
        return bisect.bisect_left(self.keys, timestamp_ms)

    def is_sane(self, offsets: OffsetIndex) -> bool:
        """In lockstep with ``offsets``, with timestamps that never decrease."""
        keys = self.keys
        return self.values == offsets.relative_offsets and all(
            keys[i] <= keys[i + 1] for i in range(len(keys) - 1)
        )


def _strictly_increasing(values: array) -> bool:
    return all(values[i] < values[i + 1] for i in range(len(values) - 1))


class SegmentIndex:
    """Both indexes of the segment starting at ``base_offset``; see the module invariants."""

    def __init__(self, directory: Path, base_offset: int, interval_bytes: int) -> None:
        self.base_offset = base_offset
        self.interval_bytes = interval_bytes
        self.offsets = OffsetIndex(directory / segment_file_name(base_offset, INDEX_SUFFIX))
        try:
            self.times = TimeIndex(directory / segment_file_name(base_offset, TIMEINDEX_SUFFIX))
        except BaseException:
            self.offsets.close()
            raise

    def __len__(self) -> int:
        return len(self.offsets)

    def load(self, log_size: int) -> bool:
        """Read both files; when they are damaged or disagree, empty them and return False."""
        offsets, times = self.offsets, self.times
        if offsets.load() and times.load() and offsets.is_sane(log_size) and times.is_sane(
                offsets):
            return True
        self.truncate_entries(0)
        return False

    def maybe_add(self, position: int, last_indexed: int, base_offset: int,
                  max_timestamp: int) -> bool:
        """Index the batch at ``position`` if the interval rule says so; True if it did."""
        if position - last_indexed < self.interval_bytes:
            return False
        relative = base_offset - self.base_offset
        self.offsets.append(relative, position)
        self.times.append(max_timestamp, relative)
        return True

    def last_entry(self) -> tuple[int, int, int] | None:
        """(relative offset, position, max timestamp so far) of the last entry, if any."""
        if not len(self.offsets):
            return None
        return (self.offsets.relative_offsets[-1], self.offsets.positions[-1],
                self.times.timestamps[-1])

    def start_for_offset(self, offset: int) -> tuple[int, int | None]:
        """Where to start scanning for ``offset``: (position, relative offset of that entry)."""
        i = self.offsets.floor(offset - self.base_offset)
        if not i:
            return 0, None
        return self.offsets.positions[i - 1], self.offsets.relative_offsets[i - 1]

    def start_for_timestamp(self, timestamp_ms: int) -> int:
        """A position before which every record is older than ``timestamp_ms``."""
        i = self.times.count_below(timestamp_ms)
        return self.offsets.positions[i - 1] if i else 0

    def truncate_entries(self, count: int) -> None:
        self.offsets.truncate_entries(count)
        self.times.truncate_entries(count)

    def truncate_at(self, position: int) -> None:
        """Drop the entries of batches at or after byte ``position``."""
        self.truncate_entries(bisect.bisect_left(self.offsets.positions, position))

    def flush(self, fsync: FsyncFunction) -> None:
        self.offsets.flush(fsync)
        self.times.flush(fsync)

    def close(self) -> None:
        self.offsets.close()
        self.times.close()

    def delete(self) -> None:
        self.offsets.delete()
        self.times.delete()
