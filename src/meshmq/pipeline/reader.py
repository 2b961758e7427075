"""Planning and reading offset ranges: the batch ``DataSourceReader`` and the shared pieces.

Theory of operation
-------------------
A read is a half-open offset range ``[start, end)`` per log partition. On the driver,
``resolve_range`` turns the options into such ranges (``earliest``/``latest``/offsets/times,
with the time index for timestamps) and ``plan_splits`` cuts each one at segment boundaries:
one ``SegmentSplit`` (a Spark input partition, one task) per log segment it touches. The
ranges are fixed at planning, so a task reads the same records however often Spark retries
it, and records the broker appends meanwhile are left to the next read.

On an executor ``read_split`` opens the segment read-only, jumps close to ``start`` with the
offset index, decodes the checksummed batches into Arrow columns (``columns.py``) and yields
a ``pyarrow.RecordBatch`` every ``ARROW_BATCH_ROWS`` records (or ``ARROW_BATCH_BYTES``).

Retention may delete records that a plan refers to, before planning (``start`` below the
partition's first offset) or between planning and reading (the segment file is gone). With
``failOnDataLoss`` (default) that is a ``DataLossError`` naming the partition and the offsets;
otherwise a warning is logged and the lost offsets are skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, InputPartition

from meshmq.pipeline.columns import ColumnBuilder
from meshmq.pipeline.errors import DataLossError, SourceOptionError
from meshmq.pipeline.logdir import LogDirectory, open_segment, read_batches
from meshmq.pipeline.options import EARLIEST, LATEST, Position, ReadOptions, Timestamp

log = logging.getLogger("meshmq.pipeline")

ARROW_BATCH_ROWS = 32_768
ARROW_BATCH_BYTES = 64 * 1024 * 1024  # and at most about this much (large payloads)


@dataclass(frozen=True)
class OffsetRange:
    """Offsets ``[start, end)`` of one log partition."""

    partition: int
    start: int
    end: int

    def __len__(self) -> int:
        return max(self.end - self.start, 0)


@dataclass(frozen=True)
class SegmentSplit(InputPartition):
    """One Spark task: offsets ``[start, end)`` of the segment ``segment_base`` of a partition."""

    log_dir: str
    partition: int
    segment_base: int
    start: int
    end: int
    last: bool = False  # the partition's active segment when planned


def resolve_position(directory: LogDirectory, partition: int, position: Position) -> int:
    """The offset a ``Position`` stands for in ``partition`` right now."""
    if isinstance(position, Timestamp):
        found = directory.offset_for_timestamp(partition, position.ms)
        return directory.next_offset(partition) if found is None else found
    if position == EARLIEST:
        return directory.earliest_offset(partition)
    if position == LATEST:
        return directory.next_offset(partition)
    return position


def resolve_range(directory: LogDirectory, options: ReadOptions) -> list[OffsetRange]:
    """The batch ranges asked for by ``options``, one per log partition."""
    options.starting.check_partitions(directory.partitions)
    options.ending.check_partitions(directory.partitions)
    ranges = []
    for partition in range(directory.partitions):
        start = resolve_position(directory, partition, options.starting.for_partition(partition))
        end = resolve_position(directory, partition, options.ending.for_partition(partition))
        latest = directory.next_offset(partition)
        if end > latest:
            raise SourceOptionError(
                f"endingOffsets: offset {end} for partition {partition} is beyond the end of"
                f" the log ({latest})")
        if start > end:
            raise SourceOptionError(
                f"partition {partition}: the starting offset {start} is after the ending"
                f" offset {end}")
        ranges.append(OffsetRange(partition, start, end))
    return ranges


def plan_splits(directory: LogDirectory, wanted: OffsetRange,
                fail_on_data_loss: bool) -> list[SegmentSplit]:
    """Cut ``wanted`` at segment boundaries; check that retention has not deleted its start."""
    if not len(wanted):
        return []
    bases = directory.segment_bases(wanted.partition)
    earliest = bases[0] if bases else wanted.end
    start = wanted.start
    if start < earliest:
        lost_to = min(earliest, wanted.end)
        report_data_loss(wanted.partition, start, lost_to, f"the earliest offset is {earliest}",
                         fail_on_data_loss)
        start = lost_to
    splits = []
    for i, base in enumerate(bases):
        segment_end = bases[i + 1] if i + 1 < len(bases) else wanted.end
        low, high = max(start, base), min(wanted.end, segment_end)
        if low < high:
            splits.append(SegmentSplit(str(directory.path), wanted.partition, base, low, high,
                                       last=i == len(bases) - 1))
    return splits


def report_data_loss(partition: int, start: int, end: int, detail: str,
                     fail_on_data_loss: bool) -> None:
    """Raise ``DataLossError`` for offsets ``[start, end)``, or log it and carry on."""
    if fail_on_data_loss:
        raise DataLossError(partition, start, end - 1, detail)
    log.warning("partition %d: skipping offsets %d..%d, no longer in the log (%s)",
                partition, start, end - 1, detail)


def read_split(split: SegmentSplit, options: ReadOptions) -> Iterator[pa.RecordBatch]:
    """Every wanted record of ``split`` as Arrow batches of up to ``ARROW_BATCH_ROWS`` rows."""
    try:
        segment = open_segment(split.log_dir, split.partition, split.segment_base,
                               last=split.last)
    except FileNotFoundError:
        report_data_loss(split.partition, split.start, split.end,
                         f"segment {split.segment_base} was deleted by retention",
                         options.fail_on_data_loss)
        return
    builder = ColumnBuilder(split.partition, options.topics)
    seen = split.start
    with segment:
        # The plan never asks for more than was whole when it was made: in a sealed segment
        # a batch cut short is corruption, in the active one it lies after the range.
        for header, data, at, position in read_batches(segment, split.start, split.end):
            builder.add_batch(header, data, at, split.start, split.end, str(segment.path),
                              position)
            seen = header.last_offset + 1
            if len(builder) >= ARROW_BATCH_ROWS or builder.nbytes >= ARROW_BATCH_BYTES:
                yield builder.build()
    if len(builder):
        yield builder.build()
    if seen < split.end:
        log.warning("partition %d: offsets %d..%d were planned but are not in %s (truncated"
                    " by the broker's crash recovery?)", split.partition, seen, split.end - 1,
                    segment.path)


class MeshmqBatchReader(DataSourceReader):
    """``spark.read.format("meshmq")``: ranges fixed when Spark plans the query."""

    def __init__(self, options: ReadOptions) -> None:
        self.options = options

    def partitions(self) -> Sequence[InputPartition]:
        directory = LogDirectory.open(self.options.path)
        splits: list[InputPartition] = []
        for wanted in resolve_range(directory, self.options):
            splits += plan_splits(directory, wanted, self.options.fail_on_data_loss)
        return splits or [SegmentSplit(str(directory.path), 0, 0, 0, 0)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SegmentSplit)
        if partition.start < partition.end:
            yield from read_split(partition, self.options)
