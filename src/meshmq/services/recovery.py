"""Where a dispatcher's state comes back from after a crash: checkpoints, and the replay.

Theory of operation
-------------------
A partition's *checkpoint* is an offset below which none of its services' records is needed
any more: every request below it is done and out of its deduplication window. It is kept in
``data_dir/services/partition-P.json`` (written to a temporary file and renamed), by the
partition's leader only:

* before the first request of a partition is acknowledged, if the file does not exist yet
  (so no acknowledged request is ever below a missing checkpoint);
* then every ``CHECKPOINT_INTERVAL`` seconds, as the lowest offset of a request its
  dispatchers still follow (the high watermark when none).

A checkpoint that is behind only costs a longer replay; one is never written ahead of a record
still needed. A file that cannot be read is logged and the replay starts at the partition's
earliest record. At start-up the leader of a partition with a checkpoint reads the partition
from there to its end (``replay``) and feeds each service's records, in log order, to that
service's new dispatcher: requests, assignments, completions; then ``Dispatcher.recovered``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from meshmq.broker.interfaces import PartitionLog
from meshmq.log.errors import OffsetOutOfRange
from meshmq.services.records import Replayed, read_record

log = logging.getLogger("meshmq.services")

CHECKPOINT_INTERVAL = 5.0  # seconds between checkpoints of a partition whose services moved
READ_CHUNK = 1000  # records per read of a replay


class Checkpoints:
    """The checkpoint files of the partitions this worker leads."""

    def __init__(self, data_dir: str) -> None:
        self.directory = Path(data_dir) / "services"
        self.written: dict[int, int] = {}  # partition -> the offset last written

    def path(self, partition: int) -> Path:
        return self.directory / f"partition-{partition}.json"

    def partitions(self) -> list[int]:
        """The partitions that have a checkpoint (ever had a service request)."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.glob("partition-*.json"):
            number = path.stem.removeprefix("partition-")
            if number.isdigit():
                found.append(int(number))
        return sorted(found)

    def read(self, partition: int) -> int | None:
        """The checkpoint of ``partition`` (None: none; 0 if it cannot be read: everything
        is replayed, as retention kept it)."""
        path = self.path(partition)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            offset = data["offset"]
            if not isinstance(offset, int) or offset < 0:
                raise ValueError("offset is not a non-negative integer")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.error("services checkpoint unreadable, replaying partition %d from its "
                      "earliest record path=%s: %s", partition, path, error)
            return 0
        self.written[partition] = offset
        return offset

    def write(self, partition: int, offset: int) -> None:
        """Record ``offset`` for ``partition`` (a file write and a rename; no fsync: a file
        that did not reach the disk leaves an older checkpoint, which is safe)."""
        if self.written.get(partition) == offset:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(partition)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps({"offset": offset}), encoding="utf-8")
        os.replace(temporary, path)
        self.written[partition] = offset


def replay(persistence: PartitionLog, partition: int, start: int, end: int, now: float,
           each: Callable[[Replayed], None]) -> int:
    """Read ``partition`` from ``start`` (or its earliest record) up to ``end`` and pass
    every service record to ``each`` in log order; returns the records read."""
    offset = max(start, persistence.earliest_offset(partition))
    read = 0
    while offset < end:
        try:
            records = persistence.read(partition, offset, READ_CHUNK)
        except OffsetOutOfRange:  # retention moved meanwhile
            offset = persistence.earliest_offset(partition)
            continue
        if not records:
            break
        for record in records:
            if record.offset >= end:
                return read
            read += 1
            replayed = read_record(record, partition, now)
            if replayed is not None:
                each(replayed)
        offset = records[-1].offset + 1
    return read
