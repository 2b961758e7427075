"""``spark.readStream.format("meshmq")``: micro-batches of offset ranges, exactly once.

Theory of operation
-------------------
A stream position is a JSON object of partition -> next offset to read, with string keys as
Spark requires (``{"0": 1200, "1": 874}``), covering every partition of the log. Spark asks
``latestOffset(start, limit)`` for the end of the next micro-batch, writes that end to its
checkpoint's offset log *before* running the batch, and then calls ``partitions(start, end)``.
The batch reads exactly the records in ``[start, end)`` of each partition, which the commit log
never changes once written (appends only go after them, retention only deletes whole segments).
So a batch re-run after a failure or a ``kill -9`` of the driver reads the very same records,
and an idempotent sink (the file sink, Delta, ``foreachBatch`` keyed by batch id) gets each
record exactly once. ``commit`` has nothing to release: readers never hold the log back.

``maxRecordsPerTrigger`` caps the offsets per micro-batch (shared between partitions in
proportion to what each has waiting). ``Trigger.AvailableNow`` first calls
``prepareForTriggerAvailableNow``, which pins the latest positions; later batches never go
past them, so the query ends even while devices keep publishing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from meshmq.pipeline.errors import SourceError
from meshmq.pipeline.logdir import LogDirectory
from meshmq.pipeline.options import ReadOptions
from meshmq.pipeline.reader import (
    OffsetRange,
    SegmentSplit,
    plan_splits,
    read_split,
    report_data_loss,
    resolve_position,
)

Offsets = dict[int, int]


def offsets_to_json(offsets: Offsets) -> dict[str, int]:
    """The dict Spark checkpoints: string partition keys, in partition order."""
    return {str(partition): offsets[partition] for partition in sorted(offsets)}


def offsets_from_json(value: dict, partitions: int) -> Offsets:
    """Parse a position Spark hands back (possibly from an old checkpoint); strict."""
    if not isinstance(value, dict):
        raise SourceError(f"stream offset {value!r} is not a meshmq offset (a JSON object)")
    offsets: Offsets = {}
    for key, offset in value.items():
        if not (isinstance(key, str) and key.isdigit()) or isinstance(offset, bool) or not (
                isinstance(offset, int) and offset >= 0):
            raise SourceError(f"stream offset {value!r} is not a meshmq offset"
                              " (partition -> offset >= 0)")
        offsets[int(key)] = offset
    if set(offsets) != set(range(partitions)):
        raise SourceError(
            f"stream offset {value!r} does not cover partitions 0..{partitions - 1} of this log;"
            " was the checkpoint made for another log?")
    return offsets


def cap_offsets(start: Offsets, end: Offsets, max_records: int) -> Offsets:
    """Move ``end`` back so that at most ``max_records`` offsets lie between ``start`` and it,
    shared in proportion to what each partition has waiting (at least one record overall)."""
    waiting = {p: max(end[p] - start[p], 0) for p in start}
    total = sum(waiting.values())
    if total <= max_records:
        return dict(end)
    capped = {p: start[p] + waiting[p] * max_records // total if waiting[p] else end[p]
              for p in start}  # an end moved back (after data loss) is kept as it is
    spare = max_records - sum(capped[p] - start[p] for p in start if waiting[p])
    for p in sorted(start, key=lambda p: waiting[p] - (capped[p] - start[p]), reverse=True):
        if spare <= 0:
            break
        if waiting[p] and capped[p] < start[p] + waiting[p]:
            capped[p] += 1
            spare -= 1
    return capped


class MeshmqStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """The streaming reader; one instance lives on the driver for the whole query."""

    def __init__(self, options: ReadOptions) -> None:
        self.options = options
        self._target: Offsets | None = None  # pinned by Trigger.AvailableNow

    def _directory(self) -> LogDirectory:
        return LogDirectory.open(self.options.path)

    def _latest(self, directory: LogDirectory) -> Offsets:
        return {p: directory.next_offset(p) for p in range(directory.partitions)}

    def initialOffset(self) -> dict:
        directory = self._directory()
        starting = self.options.starting
        starting.check_partitions(directory.partitions)
        return offsets_to_json({
            p: resolve_position(directory, p, starting.for_partition(p))
            for p in range(directory.partitions)
        })

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        directory = self._directory()
        current = offsets_from_json(start, directory.partitions)
        end = {}
        for p, latest in self._latest(directory).items():
            if latest < current[p]:  # the log was truncated or replaced under the stream
                report_data_loss(p, latest, current[p], "the log now ends before the stream's"
                                 " position: truncated or replaced",
                                 self.options.fail_on_data_loss)
                end[p] = latest  # carry on from the new end of the log
            elif self._target is not None:
                end[p] = max(current[p], min(latest, self._target[p]))
            else:
                end[p] = latest
        if isinstance(limit, ReadMaxRows):
            end = cap_offsets(current, end, limit.max_rows)
        return offsets_to_json(end)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_records_per_trigger is not None:
            return ReadMaxRows(self.options.max_records_per_trigger)
        return ReadAllAvailable()

    def reportLatestOffset(self) -> dict | None:
        return offsets_to_json(self._latest(self._directory()))

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._latest(self._directory())

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        directory = self._directory()
        first = offsets_from_json(start, directory.partitions)
        last = offsets_from_json(end, directory.partitions)
        splits: list[InputPartition] = []
        for p in range(directory.partitions):
            wanted = OffsetRange(p, first[p], last[p])
            splits += plan_splits(directory, wanted, self.options.fail_on_data_loss)
        return splits

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SegmentSplit)
        return read_split(partition, self.options)

    def commit(self, end: dict) -> None:
        """Nothing to release: the broker's retention does not wait for readers."""
