"""``CommitLog``: the broker's partitioned log under ``data_dir/log``.

Theory of operation
-------------------
``data_dir/log/meta.json`` records the format version and the partition count, fixed when the
log is created; opening with another count is a ``LogConfigError`` (records would silently
change partition and lose their order). Each partition lives in ``data_dir/log/{n}/``. A topic
is mapped to a partition by the ``Partitioner`` (stable CRC-32 hash), so all records on a topic
(or on a topic group, with ``key_level``) are totally ordered by offset.

An exclusive ``flock`` on ``data_dir/log/.lock`` keeps a second process (or a second
``CommitLog`` in this one) from opening the same directory. A node of several worker processes
splits the partitions between them: its supervisor holds ``log/.lock`` (``lock_node_log``) and
each worker opens only the partitions it leads (``partitions=``), each under its own
``log/{n}/.lock``. Every method is thread-safe; see
``partition.py`` for what each one blocks on. ``LogWriter`` (``writer.py``) is the intended way
to append from an event loop: it groups appends and fsyncs on its own thread.

Syncing several partitions. ``flush`` syncs each partition's active segment, one
``fdatasync`` (or ``fsync``) after the other, and each is a cache flush of the device and,
when the size changed, a journal commit: a loop turn of a fan-in that touches all 8 partitions
made 8 of them. Given a ``syncfs`` (``files.filesystem_sync()``: Linux 5.8 or later), a flush
of ``LogConfig.syncfs_min_partitions`` partitions or more is instead one ``syncfs`` of the
file system the log is on: every file's data and metadata written before the call, with one
journal commit and one cache flush (``bench/fsync_probe.py --files 8`` on this project's
benchmark machine: 0.3 ms and 0.12 ms of CPU instead of 2.1 ms and 0.7 ms; one partition
costs the same either way). It is at least as durable, but the whole file system is synced,
so also what other programs left dirty on it, and the sync waits for that: with 1 GB of
another program's writes pending, one took 651 ms where an ``fdatasync`` took 0.6 ms. So it
is off by default (``log.syncfs_min_partitions = 0``), for a disk the log has to itself.
Only when every partition directory is on the log directory's file system, and after a
first ``syncfs`` at open succeeded (a sandbox may refuse the call); the segments learn that
their size is durable (``LogSegment.synced``), as after a full ``fsync``.
A write-back error anywhere on that file system then fails the flush, as a failed ``fsync``
would (the writer stops accepting work).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Final

from meshmq.log.config import LogConfig
from meshmq.log.errors import LogConfigError, LogDirectoryLocked, LogError
from meshmq.log.files import FsyncFunction, fsync_directory
from meshmq.log.locks import LOCK_FILE, acquire
from meshmq.log.partition import DEFAULT_READ_BYTES, Partition, PartitionStatistics
from meshmq.log.partitioner import Partitioner
from meshmq.log.record import FORMAT_VERSION, BatchBuilder, Record

log: Final = logging.getLogger("meshmq.log")
LOG_DIRECTORY: Final = "log"
META_FILE: Final = "meta.json"
META_FORMAT: Final = "meshmq-log"
META_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class LogStatistics:
    """A snapshot of every partition's offsets and sizes."""

    partitions: tuple[PartitionStatistics, ...]

    @property
    def size_bytes(self) -> int:
        return sum(p.size_bytes for p in self.partitions)

    @property
    def records(self) -> int:
        """Records currently stored (offsets are dense, so next - earliest per partition)."""
        return sum(p.next_offset - p.earliest_offset for p in self.partitions)


class CommitLog:
    """The partitioned commit log; see the module docstring."""

    def __init__(self, data_dir: Path | str, config: LogConfig | None = None, *,
                 fsync: FsyncFunction = os.fsync, now_ms: int | None = None,
                 partitions: Collection[int] | None = None,
                 syncfs: FsyncFunction | None = None) -> None:
        """Open or create ``data_dir/log``, recovering every partition (or only
        ``partitions``: those this process leads, the others being led by other processes of
        the node).

        ``fsync`` replaces ``os.fsync`` everywhere the log syncs, and ``os.fdatasync`` too
        (tests wrap it to observe durability; with the default, a segment's data is synced
        with ``fdatasync`` while its preallocated size is durable). ``syncfs`` syncs the file
        system of a descriptor (``files.filesystem_sync()``, or a test's): flushes of at least
        ``config.syncfs_min_partitions`` partitions use it (None: never; see the module
        docstring). Raises ``LogConfigError``
        on a partition-count or format mismatch, ``LogDirectoryLocked`` if the directory (or
        one of ``partitions``) is in use, ``CorruptSegment`` on corruption.
        """
        self.config = config or LogConfig()
        self.directory = Path(data_dir) / LOG_DIRECTORY
        self.directory.mkdir(parents=True, exist_ok=True)
        self.partitioner = Partitioner(self.config.partitions, self.config.key_level)
        self._partitions: dict[int, Partition] = {}
        self._syncfs: FsyncFunction | None = None  # set once the partitions are open
        self._directory_fd = -1  # the descriptor syncfs is given
        # The whole log's lock (one process has it all), or, for a subset, the node's
        # supervisor holds it (node_lock) and each partition has its own.
        self._lock_fds: list[int] = []
        if partitions is None:
            self._lock_fds.append(_lock_directory(self.directory / LOCK_FILE))
        self.owned = tuple(range(self.config.partitions)) if partitions is None else tuple(
            sorted(partitions))
        try:
            _check_meta(self.directory, self.config.partitions, fsync)
            for n in self.owned:
                directory = self.directory / str(n)
                if partitions is not None:
                    directory.mkdir(exist_ok=True)
                    self._lock_fds.append(_lock_directory(directory / LOCK_FILE))
                self._partitions[n] = Partition(directory, self.config, fsync=fsync,
                                                now_ms=now_ms)
            for directory in (self.directory, self.directory.parent):  # new directory entries
                fsync_directory(directory, fsync)
            if syncfs is not None and self.config.syncfs_min_partitions and _one_file_system(
                    self.directory, self.owned):
                self._use_syncfs(syncfs)
        except BaseException:
            self.close()
            raise

    def _use_syncfs(self, syncfs: FsyncFunction) -> None:
        """Sync the file system once now: where that is refused (a sandbox's ENOSYS or EPERM,
        or anything else), the log keeps one sync per partition."""
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            syncfs(fd)
        except OSError as exc:
            os.close(fd)
            log.warning("syncfs of the log's file system failed, syncing each partition "
                        "instead directory=%s error=%s", self.directory, exc)
            return
        self._directory_fd = fd
        self._syncfs = syncfs

    @property
    def partition_count(self) -> int:
        return self.config.partitions

    def partition(self, partition: int) -> Partition:
        """The ``Partition`` object, for cursors that read one partition repeatedly."""
        found = self._partitions.get(partition)
        if found is None:
            raise LogError(f"partition {partition} is not open in this process "
                           f"(it leads {list(self.owned)})")
        return found

    def partition_for(self, topic: str) -> int:
        """The partition records on ``topic`` go to (stable across processes and restarts)."""
        return self.partitioner.partition_for(topic)

    # -- appending ------------------------------------------------------------------------

    def append(self, topic: str, qos: int, retain: bool, properties: bytes, payload: bytes,
               client_id: str, timestamp_ms: int, *,
               message_id: bytes | None = None) -> tuple[int, int]:
        """Append one record; return (partition, offset). Not durable until ``flush()``."""
        record = Record.new(topic, payload, timestamp_ms, qos=qos, retain=retain,
                            properties=properties, client_id=client_id, message_id=message_id)
        partition = self.partition_for(topic)
        return partition, self.partition(partition).append([record], timestamp_ms)[0]

    def append_many(self, records: Sequence[Record],
                    now_ms: int | None = None) -> list[tuple[int, int]]:
        """Append records (offsets ignored), one batch per partition; return (partition,
        offset) for each, in input order. Not durable until ``flush()``."""
        groups: dict[int, list[int]] = {}
        for i, record in enumerate(records):
            groups.setdefault(self.partition_for(record.topic), []).append(i)
        results: list[tuple[int, int]] = [(0, 0)] * len(records)
        for partition, indexes in groups.items():
            base, _ = self.append_to(partition, [records[i] for i in indexes], now_ms)
            for n, i in enumerate(indexes):
                results[i] = (partition, base + n)
        return results

    def append_to(self, partition: int, records: Sequence[Record],
                  now_ms: int | None = None) -> tuple[int, int]:
        """Append records to one partition whatever their topics; return (first, last) offset."""
        return self.partition(partition).append(records, now_ms)

    def append_built(self, partition: int, batches: Sequence[BatchBuilder],
                     now_ms: int | None = None, *, roll: bool = True) -> bool:
        """Append batches encoded already to one partition; see ``Partition.append_built``."""
        return self.partition(partition).append_built(batches, now_ms, roll=roll)

    # -- reading --------------------------------------------------------------------------

    def read(self, partition: int, offset: int, max_records: int | None = None, *,
             max_bytes: int = DEFAULT_READ_BYTES) -> list[Record]:
        """Records of ``partition`` from ``offset`` on; see ``Partition.read``."""
        return self.partition(partition).read(offset, max_records=max_records,
                                              max_bytes=max_bytes)

    def earliest_offset(self, partition: int) -> int:
        return self.partition(partition).earliest_offset

    def next_offset(self, partition: int) -> int:
        return self.partition(partition).next_offset

    def offset_for_timestamp(self, partition: int, timestamp_ms: int) -> int | None:
        """First offset at or after ``timestamp_ms``; None: all older, use ``next_offset``."""
        return self.partition(partition).offset_for_timestamp(timestamp_ms)

    # -- maintenance ----------------------------------------------------------------------

    def enforce_retention(self, now_ms: int | None = None) -> int:
        """Apply retention to every partition; return the number of segments deleted."""
        return sum(p.enforce_retention(now_ms) for p in self._partitions.values())

    def flush(self, partitions: Iterable[int] | None = None) -> bool:
        """Sync the given partitions (all by default): what was appended is now durable.
        True when that was one sync of the file system (see the module docstring)."""
        chosen = self.owned if partitions is None else tuple(partitions)
        syncfs = self._syncfs
        if syncfs is None or len(chosen) < self.config.syncfs_min_partitions:
            for n in chosen:
                self.partition(n).flush()
            return False
        points = [self.partition(n).sync_point() for n in chosen]  # (LogClosed once closed)
        syncfs(self._directory_fd)
        for segment, size_changes in points:
            segment.synced(size_changes)
        return True

    @property
    def syncs_file_system(self) -> bool:
        """Does a flush of several partitions sync their file system once (``syncfs``)?"""
        return self._syncfs is not None

    def statistics(self) -> LogStatistics:
        return LogStatistics(tuple(p.statistics() for p in self._partitions.values()))

    def close(self) -> None:
        """Flush and close every partition, then release the locks. Idempotent."""
        try:
            for partition in self._partitions.values():
                partition.close()
        finally:
            for fd in self._lock_fds:
                os.close(fd)  # releases the flock
            self._lock_fds = []
            self._syncfs = None
            if self._directory_fd >= 0:
                os.close(self._directory_fd)
                self._directory_fd = -1

    def __enter__(self) -> CommitLog:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def lock_node_log(data_dir: Path | str, partitions: int) -> int:
    """For a node's supervisor: create or check ``data_dir/log`` (its ``meta.json``) and hold
    its lock while the workers open their partitions. Returns the lock's fd (close it to
    release); raises as ``CommitLog`` does."""
    directory = Path(data_dir) / LOG_DIRECTORY
    directory.mkdir(parents=True, exist_ok=True)
    fd = _lock_directory(directory / LOCK_FILE)
    try:
        _check_meta(directory, partitions, os.fsync)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _one_file_system(directory: Path, partitions: Iterable[int]) -> bool:
    """Are the partitions' directories on the file system of ``directory`` (no mount point
    or link elsewhere among them)?"""
    device = directory.stat().st_dev
    return all((directory / str(n)).stat().st_dev == device for n in partitions)


def _lock_directory(path: Path) -> int:
    fd = acquire(path)
    if fd is None:
        raise LogDirectoryLocked(f"{path.parent} is in use by another log")
    return fd


def _check_meta(directory: Path, partitions: int, fsync: FsyncFunction) -> None:
    path = directory / META_FILE
    if not path.exists():
        _refuse_orphan_partitions(directory, partitions)
        _write_meta(path, partitions, fsync)
        return
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        fmt, version, stored = meta["format"], meta["format_version"], meta["partitions"]
    except (ValueError, KeyError, TypeError) as exc:
        raise LogConfigError(f"{path} is unreadable: {exc}") from None
    if fmt != META_FORMAT or version != META_VERSION:
        raise LogConfigError(f"{path}: unsupported log format {fmt!r} version {version!r}")
    if stored != partitions:
        raise LogConfigError(
            f"{directory} was created with {stored} partitions; the configuration asks for "
            f"{partitions}. The count cannot change: configure {stored} or use a new data_dir."
        )


def _refuse_orphan_partitions(directory: Path, partitions: int) -> None:
    found = [p.name for p in directory.iterdir() if p.is_dir() and p.name.isdigit()]
    if any(int(name) >= partitions for name in found):
        raise LogConfigError(f"{directory} holds partitions but no {META_FILE}; restore it")


def _write_meta(path: Path, partitions: int, fsync: FsyncFunction) -> None:
    meta = {"format": META_FORMAT, "format_version": META_VERSION, "partitions": partitions,
            "batch_magic": FORMAT_VERSION, "partitioner": "crc32"}
    temporary = path.with_suffix(".tmp")
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(meta, file, indent=2)
        file.write("\n")
        file.flush()
        fsync(file.fileno())
    os.replace(temporary, path)
    fsync_directory(path.parent, fsync)
