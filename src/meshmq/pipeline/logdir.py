"""The Spark source's access to the log files: ``meshmq.log.reader`` with the source's errors.

Listing, opening read-only, the indexes, whole checksummed batches and the torn tail of the
active segment are ``log/reader.py``'s, the one reader of the log for every program that does
not own it (see its theory of operation). This module only turns the reader's errors into the
source's (``LogNotFound``, ``CorruptLog``: one line that Spark shows wrapped in its own error)
and reads in large chunks, as a scan of whole segments wants.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from meshmq.log import reader
from meshmq.log.commit_log import LOG_DIRECTORY, META_FILE
from meshmq.log.errors import CorruptSegment, LogError
from meshmq.log.files import LOG_SUFFIX, segment_file_name
from meshmq.log.reader import OpenSegment, SegmentFile, Walked
from meshmq.pipeline.errors import CorruptLog, LogNotFound

READ_CHUNK_BYTES = 4 * 1024 * 1024


class LogDirectory:
    """A meshmq log directory (the one holding ``meta.json``), opened read-only."""

    def __init__(self, directory: reader.LogDirectory) -> None:
        self._directory = directory
        self.path = directory.path
        self.partitions = directory.partitions

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> LogDirectory:
        """Resolve ``path`` (a broker data_dir, or its ``log`` directory) and read meta.json.

        Raises ``LogNotFound`` when neither holds a meshmq log, ``CorruptLog`` for a meta.json
        this reader cannot use.
        """
        given = Path(path)
        try:
            return cls(reader.LogDirectory.locate(given))
        except reader.NoLogHere:
            raise LogNotFound(
                f"no meshmq commit log at {given} (expected {META_FILE} in "
                f"{given / LOG_DIRECTORY} or in {given})") from None
        except reader.UnusableMeta as exc:
            raise CorruptLog(str(exc.path), 0, exc.reason) from None

    def segment_bases(self, partition: int) -> list[int]:
        """Base offsets of the partition's segments, oldest first (a listing: retention may
        delete the oldest ones at any time)."""
        return [file.base_offset for file in self._directory.segments(partition)]

    def earliest_offset(self, partition: int) -> int:
        """The first offset still stored (0 for a partition that has no segment yet)."""
        return self._directory.earliest_offset(partition)

    def next_offset(self, partition: int) -> int:
        """One past the last record of the last complete batch: the "latest" position."""
        with source_errors(self.path / str(partition)):
            return self._directory.next_offset(partition)

    def offset_for_timestamp(self, partition: int, timestamp_ms: int) -> int | None:
        """First offset whose record timestamp is >= ``timestamp_ms``; None if there is none."""
        with source_errors(self.path / str(partition)):
            return self._directory.offset_for_timestamp(partition, timestamp_ms)


def open_segment(log_dir: str | os.PathLike[str], partition: int, base_offset: int, *,
                 last: bool) -> OpenSegment:
    """One segment opened read-only (``last``: the partition's active segment when planned, so
    its end may be a write in progress). Raises ``FileNotFoundError`` if retention deleted it."""
    path = Path(log_dir) / str(partition) / segment_file_name(base_offset, LOG_SUFFIX)
    return OpenSegment(SegmentFile(partition, base_offset, path), sealed=not last)


def read_batches(segment: OpenSegment, start: int, end: int) -> Iterator[Walked]:
    """The checksummed batches of ``segment`` holding offsets in ``[start, end)``; a torn tail
    ends them quietly in the active segment, any other damage is ``CorruptLog``."""
    with source_errors(segment.path):
        yield from reader.batches_from(segment, start, end, chunk=READ_CHUNK_BYTES)


@contextmanager
def source_errors(where: Path) -> Iterator[None]:
    """The reader's errors as the source's: ``CorruptLog`` naming the file and byte."""
    try:
        yield
    except CorruptSegment as exc:
        raise CorruptLog(str(exc.path), exc.position, exc.reason) from None
    except LogError as exc:  # e.g. segments deleted faster than they can be listed
        raise CorruptLog(str(where), 0, str(exc)) from None
