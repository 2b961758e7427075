"""One ``syncfs`` for a flush of several partitions (``log.syncfs_min_partitions``): when the
log uses it, what it replaces, what it leaves the segments knowing, and what its failure does.
Real files in tmp_path and the real ``syncfs`` (wrapped to record its calls)."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from meshmq.log.commit_log import CommitLog
from meshmq.log.config import LogConfig
from meshmq.log.errors import LogConfigError, LogError
from meshmq.log.files import filesystem_sync, kernel_at_least
from meshmq.log.record import Record
from meshmq.log.writer import AppendBatch, FsyncPolicy, LogWriter

T0 = int(time.time() * 1000)  # now: no segment is old enough to roll
SYNCFS = filesystem_sync()
needs_syncfs = pytest.mark.skipif(SYNCFS is None, reason="no trusted syncfs (Linux < 5.8?)")


class Disk:
    """The real fsync and syncfs, each call noted (the descriptor syncfs was given, too)."""

    def __init__(self) -> None:
        self.fsyncs = 0
        self.syncfs_fds: list[int] = []

    def fsync(self, fd: int) -> None:
        os.fsync(fd)
        self.fsyncs += 1

    def syncfs(self, fd: int) -> None:
        assert SYNCFS is not None
        SYNCFS(fd)
        self.syncfs_fds.append(fd)


def open_log(tmp_path: Path, disk: Disk, **config: int) -> CommitLog:
    config = {"syncfs_min_partitions": 2, **config}
    log = CommitLog(tmp_path, LogConfig(partitions=4, **config), fsync=disk.fsync,
                    syncfs=disk.syncfs, now_ms=T0)
    disk.fsyncs = 0  # the directories' and meta.json's, at creation
    disk.syncfs_fds.clear()  # the first syncfs, at open
    return log


def append(log: CommitLog, partition: int, count: int = 3) -> None:
    log.append_to(partition, [Record.new(f"t/{partition}", b"x" * 50, T0) for _ in range(count)])


@pytest.mark.parametrize(("release", "at_least_5_8"), [
    ("5.8.0", True), ("5.7.19", False), ("5.10.0-30-amd64", True), ("6.18.44-fc-v595", True),
    ("4.19.0-17-amd64", False), ("10.0", True), ("5", False), ("", False), ("abc", False),
])
def test_kernel_release_comparison_is_numeric(release: str, at_least_5_8: bool) -> None:
    assert kernel_at_least(release, (5, 8)) is at_least_5_8


@needs_syncfs
def test_the_platform_syncfs_syncs_a_file_system_and_raises_on_a_bad_descriptor(
        tmp_path: Path) -> None:
    assert SYNCFS is not None
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        SYNCFS(fd)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as info:
        SYNCFS(fd)  # closed now
    assert info.value.errno == errno.EBADF


@needs_syncfs
def test_a_flush_of_several_partitions_is_one_syncfs_and_no_fsync(tmp_path: Path) -> None:
    disk = Disk()
    with open_log(tmp_path, disk) as log:
        assert log.syncs_file_system
        for partition in range(4):
            append(log, partition)
        assert log.flush([0, 1, 2]) is True
        assert disk.fsyncs == 0
        assert len(disk.syncfs_fds) == 1
        assert os.path.samestat(os.fstat(disk.syncfs_fds[0]), os.stat(tmp_path / "log"))
        assert log.flush() is True  # all four
        assert len(disk.syncfs_fds) == 2 and disk.fsyncs == 0


@needs_syncfs
def test_a_flush_of_fewer_partitions_than_the_setting_syncs_each_one(tmp_path: Path) -> None:
    disk = Disk()
    with open_log(tmp_path, disk, syncfs_min_partitions=3) as log:
        for partition in range(4):
            append(log, partition)
        assert log.flush([2]) is False
        assert log.flush([0, 1]) is False
        assert disk.fsyncs == 3 and disk.syncfs_fds == []
        assert log.flush([0, 1, 3]) is True
        assert disk.fsyncs == 3 and len(disk.syncfs_fds) == 1


@needs_syncfs
def test_zero_turns_syncfs_off(tmp_path: Path) -> None:
    disk = Disk()
    with open_log(tmp_path, disk, syncfs_min_partitions=0) as log:
        assert not log.syncs_file_system
        for partition in range(4):
            append(log, partition)
        assert log.flush() is False
        assert disk.fsyncs == 4 and disk.syncfs_fds == []


def test_a_log_given_no_syncfs_syncs_each_partition(tmp_path: Path) -> None:
    disk = Disk()
    with CommitLog(tmp_path, LogConfig(partitions=4), fsync=disk.fsync, now_ms=T0) as log:
        disk.fsyncs = 0
        assert not log.syncs_file_system
        append(log, 0)
        append(log, 1)
        assert log.flush([0, 1]) is False
        assert disk.fsyncs == 2


def test_it_is_off_by_default(tmp_path: Path) -> None:
    """syncfs also waits for other programs' dirty data: a log opts in."""
    assert LogConfig().syncfs_min_partitions == 0
    disk = Disk()
    with CommitLog(tmp_path, LogConfig(partitions=4), fsync=disk.fsync, syncfs=disk.syncfs,
                   now_ms=T0) as log:
        assert not log.syncs_file_system and disk.syncfs_fds == []


def test_a_negative_setting_is_refused() -> None:
    with pytest.raises(LogConfigError, match="syncfs_min_partitions must be >= 0"):
        LogConfig(syncfs_min_partitions=-1)


@needs_syncfs
def test_after_a_syncfs_the_segments_sizes_count_as_durable(tmp_path: Path) -> None:
    """A preallocation changes the file's size, so the next sync of one partition would be a
    full fsync; after a syncfs (which commits every file's metadata) it is an fdatasync."""
    disk = Disk()
    with open_log(tmp_path, disk) as log:
        for partition in range(4):
            append(log, partition)
        points = [log.partition(n).sync_point() for n in range(4)]
        assert all(segment.durable_size_changes < changes for segment, changes in points)
        log.flush()
        points = [log.partition(n).sync_point() for n in range(4)]
        assert all(segment.durable_size_changes >= changes for segment, changes in points)


@needs_syncfs
def test_what_a_syncfs_flushed_is_read_back_after_reopening(tmp_path: Path) -> None:
    disk = Disk()
    with open_log(tmp_path, disk) as log:
        for partition in range(4):
            append(log, partition, 5)
        log.flush()
    with CommitLog(tmp_path, LogConfig(partitions=4), now_ms=T0) as log:
        for partition in range(4):
            assert [r.payload for r in log.read(partition, 0)] == [b"x" * 50] * 5


@needs_syncfs
def test_a_partition_on_another_file_system_keeps_one_sync_per_partition(
        tmp_path: Path) -> None:
    """syncfs syncs one file system: a partition directory that is a link to another one
    (/dev/shm, a tmpfs) turns it off for the whole log."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no /dev/shm on another file system")
    elsewhere = shm / f"meshmq-test-{os.getpid()}-{tmp_path.name}"
    elsewhere.mkdir()
    try:
        (tmp_path / "log").mkdir()
        (tmp_path / "log" / "2").symlink_to(elsewhere)
        disk = Disk()
        with open_log(tmp_path, disk) as log:
            assert not log.syncs_file_system
            append(log, 1)
            append(log, 2)
            assert log.flush([1, 2]) is False
            assert disk.fsyncs == 2 and disk.syncfs_fds == []
    finally:
        for path in elsewhere.iterdir():
            path.unlink()
        elsewhere.rmdir()


@needs_syncfs
def test_a_failed_syncfs_fails_the_writer_like_a_failed_fsync(tmp_path: Path) -> None:
    """The page cache's state is unknown after a failed sync: the turn's batches fail, and so
    does everything after (LogWriter)."""
    failing = [False]

    def syncfs(fd: int) -> None:
        if failing[0]:
            raise OSError(errno.EIO, "syncfs: Input/output error")
        assert SYNCFS is not None
        SYNCFS(fd)

    log = CommitLog(tmp_path, LogConfig(partitions=4, syncfs_min_partitions=2), syncfs=syncfs,
                    now_ms=T0)
    writer = LogWriter(log, fsync_policy="always")
    try:
        def turn(tag: bytes) -> list[AppendBatch]:
            batches = []
            for partition in (0, 3):
                batch = AppendBatch(partition, FsyncPolicy.ALWAYS)
                batch.add(b"t", b"c", b"", tag, 1, False, bytes(16), T0)
                batches.append(batch)
            return batches

        good = turn(b"good")
        assert writer.write_now(good) == []
        assert all(b.error is None for b in good)
        assert writer.statistics().filesystem_syncs == 1
        failing[0] = True
        bad = turn(b"bad")
        assert writer.write_now(bad) == []
        assert all(isinstance(b.error, LogError) for b in bad)
        assert "log fsync failed" in str(bad[0].error)
        assert writer.failed
        failing[0] = False
        later = turn(b"later")
        writer.write_now(later)
        assert all(isinstance(b.error, LogError) for b in later)
    finally:
        writer.close()
        log.close()


def test_a_syncfs_refused_at_open_leaves_one_sync_per_partition(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A sandbox (seccomp) may refuse the call: the log finds out when it opens, says so, and
    syncs each partition; nothing fails."""
    calls: list[int] = []

    def refused(fd: int) -> None:
        calls.append(fd)
        raise OSError(errno.ENOSYS, "syncfs: Function not implemented")

    disk = Disk()
    with CommitLog(tmp_path, LogConfig(partitions=4, syncfs_min_partitions=2),
                   fsync=disk.fsync, syncfs=refused, now_ms=T0) as log:
        disk.fsyncs = 0
        assert not log.syncs_file_system and len(calls) == 1
        append(log, 0)
        append(log, 1)
        assert log.flush([0, 1]) is False
        assert disk.fsyncs == 2 and len(calls) == 1
    assert "syncfs of the log's file system failed, syncing each partition instead" in (
        caplog.text)
