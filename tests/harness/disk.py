"""Disk faults: what a power loss leaves of a partition that had not fsynced its tail.

``kill -9`` loses nothing the broker wrote (the page cache survives the process); a power loss
loses what was not fsynced. ``cut_tail`` plays the power loss on a stopped node: it truncates
the active segment of a partition at a batch boundary, as if the last fsync had come just
before that batch. Cutting at a boundary keeps the file valid (recovery finds a clean end, the
indexes are rebuilt from the ``.log``), so what the checker sees missing is exactly the records
cut, nothing the recovery dropped on its own.

The byte layout is docs/log-format.md; the batches are found with the project's own reader
(``meshmq.log.reader``), not parsed here a second time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from meshmq.log.reader import LogDirectory, OpenSegment, Walk
from meshmq.log.record import verify_batch


@dataclass(frozen=True)
class Cut:
    """What ``cut_tail`` removed: offsets ``[first_offset, end_offset)`` of ``partition``."""

    partition: int
    first_offset: int
    end_offset: int
    path: Path
    size_before: int
    size_after: int

    def offsets(self) -> range:
        return range(self.first_offset, self.end_offset)


def cut_tail(data_dir: Path, partition: int, from_offset: int) -> Cut:
    """Truncate ``partition``'s active segment at the start of the batch holding
    ``from_offset``; every record from that batch on is gone. The node must be stopped."""
    directory = LogDirectory.locate(data_dir)
    segments = directory.segments(partition)
    if not segments or segments[-1].base_offset > from_offset:
        raise ValueError(f"partition {partition}: offset {from_offset} is not in the active "
                         "segment (cut only what an fsync of the active segment covers)")
    with OpenSegment(segments[-1], sealed=False) as segment:
        size, cut_at, end = segment.size(), None, None
        walk = Walk(segment, 0, check=verify_batch)
        for walked in walk:
            if cut_at is None and walked.header.last_offset >= from_offset:
                cut_at, first = walked.position, walked.header.base_offset
            end = walked.header.last_offset + 1
        walk.raise_unless_tolerated()
    if cut_at is None or end is None:
        raise ValueError(f"partition {partition}: no record at or after offset {from_offset}")
    os.truncate(segment.path, cut_at)
    return Cut(partition, first, end, segment.path, size, cut_at)
