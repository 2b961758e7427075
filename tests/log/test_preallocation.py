"""Preallocated active segments: appends inside the file, fdatasync once the size is durable,
and every reader of the files (recovery, LogView, the Spark source's reader, the tools) stopping
at the last batch before the zeros. Real files in tmp_path, real fsync and fdatasync calls."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from meshmq.log.browse import Cursor, Follower, Selection
from meshmq.log.commit_log import CommitLog
from meshmq.log.config import LogConfig
from meshmq.log.errors import CorruptSegment
from meshmq.log.files import segment_file_name
from meshmq.log.inspect import summarize_segment
from meshmq.log.partition import Partition
from meshmq.log.reader import LogDirectory, OpenSegment, SegmentFile, batches_from
from meshmq.log.record import Record, decode_batches, encode_batch
from meshmq.log.verify import verify
from meshmq.log.view import LogView

T0 = 1_700_000_000_000
CHUNK = 64 * 1024
CONFIG = LogConfig(partitions=1, segment_bytes=1 << 20, index_interval_bytes=200,
                   preallocate_bytes=CHUNK)


def records(start: int, count: int) -> list[Record]:
    return [Record.new("sensors/a", b"%08d" % (start + i) + bytes(40), T0 + start + i)
            for i in range(count)]


def active_path(directory: Path, partition: Partition) -> Path:
    return directory / segment_file_name(partition.segment_base_offsets()[-1], ".log")


class Syncs:
    """fsync and fdatasync that do the real call and note, for each, the file's size then."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def fsync(self, fd: int) -> None:
        os.fsync(fd)
        self.calls.append(("fsync", os.fstat(fd).st_size))

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)
        self.calls.append(("fdatasync", os.fstat(fd).st_size))

    def take(self) -> list[str]:
        kinds = [kind for kind, _ in self.calls]
        self.calls.clear()
        return kinds


def test_appends_inside_the_preallocated_space_leave_the_file_size_alone(tmp_path: Path) -> None:
    partition = Partition(tmp_path, CONFIG, now_ms=T0)
    partition.append(records(0, 5), T0)
    path = active_path(tmp_path, partition)
    assert path.stat().st_size == CHUNK
    for start in range(5, 100, 5):
        partition.append(records(start, 5), T0)
        assert path.stat().st_size == CHUNK
    written = partition.statistics().size_bytes
    assert 0 < written < CHUNK
    assert path.read_bytes()[written:] == bytes(CHUNK - written)
    assert [r.offset for r in partition.read(0, max_bytes=CHUNK)] == list(range(100))
    partition.close()


def test_a_sync_is_fdatasync_once_the_preallocated_size_is_durable(tmp_path: Path) -> None:
    syncs = Syncs()
    partition = Partition(tmp_path, CONFIG, fsync=syncs.fsync, datasync=syncs.fdatasync,
                          now_ms=T0)
    syncs.take()  # the directory's, at creation
    partition.append(records(0, 5), T0)
    partition.flush()
    assert syncs.calls == [("fsync", CHUNK)]  # the preallocation made durable with the data
    syncs.take()
    for start in range(5, 50, 5):
        partition.append(records(start, 5), T0)
        partition.flush()
    assert set(syncs.take()) == {"fdatasync"}
    while partition.statistics().size_bytes < CHUNK:  # past the first chunk: a full fsync
        partition.append(records(partition.next_offset, 50), T0)
    partition.flush()
    assert syncs.calls == [("fsync", 2 * CHUNK)]
    partition.close()


def test_a_file_system_refusing_fallocate_gets_a_growing_file_and_full_fsyncs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    syncs = Syncs()
    partition = Partition(tmp_path, CONFIG, fsync=syncs.fsync, datasync=syncs.fdatasync,
                          now_ms=T0)
    syncs.take()
    path = active_path(tmp_path, partition)
    for start in range(0, 50, 5):
        partition.append(records(start, 5), T0)
        assert path.stat().st_size == partition.statistics().size_bytes
        partition.flush()
    assert set(syncs.take()) == {"fsync"}
    assert "cannot preallocate" in caplog.text
    assert [r.offset for r in partition.read(0, max_bytes=CHUNK)] == list(range(50))
    partition.close()


def test_a_crash_leaves_zeros_that_reopening_reads_as_the_end_of_the_log(tmp_path: Path) -> None:
    partition = Partition(tmp_path, CONFIG, now_ms=T0)
    partition.append(records(0, 30), T0)
    partition.flush()
    path = active_path(tmp_path, partition)
    written = partition.statistics().size_bytes
    assert path.stat().st_size > written  # killed now: no close, the zeros stay
    reopened = Partition(tmp_path, CONFIG, now_ms=T0)
    report = reopened.recovery
    assert (report.clean_shutdown, report.truncated_bytes, report.kept_tail) == (False, 0, None)
    assert not list(tmp_path.glob("repair-backup-*"))
    assert reopened.next_offset == 30 and reopened.statistics().size_bytes == written
    reopened.append(records(30, 5), T0)  # right after the last record, not after the zeros
    assert [r.offset for r in reopened.read(0, max_bytes=CHUNK)] == list(range(35))
    reopened.close()
    partition.close()


def test_rolls_and_close_cut_the_zeros_off(tmp_path: Path) -> None:
    config = LogConfig(partitions=1, segment_bytes=4_000, index_interval_bytes=200,
                       preallocate_bytes=CHUNK)
    partition = Partition(tmp_path, config, now_ms=T0)
    for start in range(0, 300, 10):
        partition.append(records(start, 10), T0)
    bases = partition.segment_base_offsets()
    assert len(bases) > 3
    sizes = {base: (tmp_path / segment_file_name(base, ".log")).stat().st_size for base in bases}
    for base in bases[:-1]:  # sealed: exactly their batches, the last ending at the file's end
        data = (tmp_path / segment_file_name(base, ".log")).read_bytes()
        assert decode_batches(data, base)[-1].offset == bases[bases.index(base) + 1] - 1
    assert sizes[bases[-1]] == config.segment_bytes  # the active one: preallocated (capped)
    partition.close()
    active = tmp_path / segment_file_name(bases[-1], ".log")
    assert decode_batches(active.read_bytes(), bases[-1])[-1].offset == 299


def test_a_sealed_segment_left_with_zeros_is_cut_when_opened(tmp_path: Path) -> None:
    config = LogConfig(partitions=1, segment_bytes=4_000, preallocate_bytes=CHUNK)
    partition = Partition(tmp_path, config, now_ms=T0)
    for start in range(0, 200, 10):
        partition.append(records(start, 10), T0)
    first = tmp_path / segment_file_name(0, ".log")
    partition.close()
    size = first.stat().st_size
    os.truncate(first, size + 8192)  # as if a crash undid the roll's cut
    reopened = Partition(tmp_path, config, now_ms=T0)
    assert first.stat().st_size == size
    assert [r.offset for r in reopened.read(0, max_bytes=1 << 20)] == list(range(200))
    reopened.close()


def preallocated_log(tmp_path: Path) -> tuple[CommitLog, Path]:
    """An open CommitLog whose active segment is followed by (at least 64 KiB of) zeros, as a
    preallocating writer leaves it; the path of that segment."""
    log = CommitLog(tmp_path, CONFIG, now_ms=T0)
    log.append_to(0, records(0, 20), T0)
    log.append_to(0, records(20, 20), T0)
    path = tmp_path / "log" / "0" / segment_file_name(0, ".log")
    written = log.partition(0).statistics().size_bytes
    if path.stat().st_size < written + CHUNK:
        os.truncate(path, written + CHUNK)
    return log, path


def test_log_view_stops_at_the_zeros_and_reads_on_when_a_batch_is_written(tmp_path: Path) -> None:
    log, path = preallocated_log(tmp_path)
    with LogView(tmp_path) as view:
        assert [r.offset for r in view.read(0, 0)] == list(range(40))
        assert view.read(0, 40) == [] and view.next_offset(0) == 40
        written = log.partition(0).statistics().size_bytes
        batch = encode_batch(records(40, 3), 40)
        half = len(batch) // 2
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, batch[:half], written)  # a write in progress
            assert view.read(0, 40) == [] and view.next_offset(0) == 40
            os.pwrite(fd, batch[half:], written + half)
        finally:
            os.close(fd)
        assert [r.offset for r in view.read(0, 40)] == [40, 41, 42]
        assert view.next_offset(0) == 43
    log.close()


def test_a_batch_written_with_a_gap_still_zero_is_a_write_in_progress(tmp_path: Path) -> None:
    log, path = preallocated_log(tmp_path)
    written = log.partition(0).statistics().size_bytes
    batch = encode_batch(records(40, 60), 40)
    fd = os.open(path, os.O_WRONLY)
    try:  # the header and the end written, a page in the middle not yet: a failed checksum
        os.pwrite(fd, batch[:100], written)
        os.pwrite(fd, batch[-100:], written + len(batch) - 100)
    finally:
        os.close(fd)
    with LogView(tmp_path) as view:
        assert [r.offset for r in view.read(0, 0)] == list(range(40))
        assert view.read(0, 40) == []
    log.close()


def test_the_spark_sources_reader_stops_at_the_zeros_of_the_active_segment(
        tmp_path: Path) -> None:
    log, path = preallocated_log(tmp_path)
    file = SegmentFile(0, 0, path)
    with OpenSegment(file, sealed=False) as segment:
        walked = list(batches_from(segment, 0))
        assert walked[-1].header.last_offset == 39
    with OpenSegment(file, sealed=True) as segment, pytest.raises(CorruptSegment):
        list(batches_from(segment, 0))  # sealed segments are cut at the roll: zeros are damage
    assert LogDirectory.locate(tmp_path).next_offset(0) == 40
    log.close()


def test_the_tools_see_the_zeros_as_the_end_not_as_damage(tmp_path: Path) -> None:
    log, _ = preallocated_log(tmp_path)
    written = log.partition(0).statistics().size_bytes
    directory = LogDirectory.locate(tmp_path)
    summary = summarize_segment(directory.segments(0)[0])
    assert (summary.records, summary.size, summary.unreadable_at) == (40, written, None)
    report = verify(directory, live=False)  # not as a write in progress: as the end
    assert report.clean and report.records == 40, [p.describe() for p in report.problems]
    log.close()


def test_log_tail_follows_across_the_zeros_without_a_warning(tmp_path: Path) -> None:
    log, path = preallocated_log(tmp_path)
    warnings: list[str] = []
    follower = Follower(LogDirectory.locate(tmp_path), [Cursor(0, 0, 0, 0)], Selection((0,)),
                        warnings.append)
    assert [r.offset for _, r in follower.poll()] == list(range(40))
    assert follower.poll() == []
    written = log.partition(0).statistics().size_bytes
    batch = encode_batch(records(40, 3), 40)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, batch[:50], written)  # a write in progress, zeros after it
        assert follower.poll() == []
        os.pwrite(fd, batch[50:], written + 50)
    finally:
        os.close(fd)
    assert [r.offset for _, r in follower.poll()] == [40, 41, 42]
    assert warnings == []
    log.close()


def test_the_first_sync_after_opening_is_a_full_fsync(tmp_path: Path) -> None:
    """A kill -9 between a preallocation and its fsync leaves a size that is not durable: the
    process that opens the segment next must not trust it with an fdatasync."""
    partition = Partition(tmp_path, CONFIG, now_ms=T0)
    partition.append(records(0, 5), T0)  # preallocated, never synced: killed now
    syncs = Syncs()
    reopened = Partition(tmp_path, CONFIG, fsync=syncs.fsync, datasync=syncs.fdatasync,
                         now_ms=T0)
    size = active_path(tmp_path, reopened).stat().st_size
    assert reopened.statistics().size_bytes < CHUNK == size
    syncs.take()
    reopened.append(records(5, 5), T0)
    reopened.flush()
    assert syncs.take() == ["fsync"]
    reopened.append(records(10, 5), T0)
    reopened.flush()
    assert syncs.take() == ["fdatasync"]
    reopened.close()
    partition.close()


class RacingRead:
    """``os.pread`` whose first large read of a segment sees a few bytes in the middle of a
    batch as still zero, as a read racing with the copy of a write can (an earlier page not
    yet copied, a later one already); every later read sees the file as it is."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.raced = False
        self.pread = os.pread

    def __call__(self, fd: int, length: int, offset: int) -> bytes:
        data = self.pread(fd, length, offset)
        if self.raced or len(data) < 1000 or not offset <= self.at < offset + len(data) - 20:
            return data
        self.raced = True
        at = self.at - offset
        return data[:at] + bytes(20) + data[at + 20:]


def test_a_read_racing_with_a_write_is_read_again_not_reported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log, path = preallocated_log(tmp_path)
    racing = RacingRead(60)  # in the records of the first of two batches
    monkeypatch.setattr(os, "pread", racing)
    with OpenSegment(SegmentFile(0, 0, path), sealed=False) as segment:
        assert [w.header.last_offset for w in batches_from(segment, 0)][-1] == 39
    assert racing.raced
    racing.raced = False
    with LogView(tmp_path) as view:  # its walk checks headers; decoding finds the damage
        assert [r.offset for r in view.read(0, 0)] == list(range(40))
    assert racing.raced
    log.close()


def test_a_page_never_written_back_before_later_batches_is_cut_with_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """After a power loss the pages of a file may have reached the disk in any order: a page
    of zeros inside a batch, then whole later batches. None of them was acknowledged (every
    acknowledgement follows a sync of all that was written before it), so recovery cuts the
    tail there (keeping a copy) instead of refusing to open."""
    partition = Partition(tmp_path, CONFIG, now_ms=T0)
    partition.append(records(0, 40), T0)
    partition.flush()  # acknowledged up to here
    torn_at = partition.statistics().size_bytes
    partition.append([Record.new("sensors/a", bytes(300) + b"%08d" % n, T0 + n)
                      for n in range(40, 80)], T0)
    later = partition.statistics().size_bytes
    partition.append(records(80, 5), T0)  # written, not synced: never acknowledged
    path = active_path(tmp_path, partition)
    page = (torn_at + 4095) // 4096 * 4096
    assert page + 4096 <= later  # the page lies inside the unsynced batch
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(4096), page)  # that page never reached the disk
    finally:
        os.close(fd)
    reopened = Partition(tmp_path, CONFIG, now_ms=T0)
    report = reopened.recovery
    assert reopened.next_offset == 40
    assert report.truncated_bytes > 0 and report.kept_tail is not None
    assert "a page never written back before the stop" in caplog.text
    assert [r.offset for r in reopened.read(0, max_bytes=CHUNK)] == list(range(40))
    reopened.close()
    partition.close()


def test_damage_that_is_not_an_unwritten_page_before_later_batches_still_refuses(
        tmp_path: Path) -> None:
    """Garbage (not zeros) in a batch followed by good batches is damage, not a stop: the
    partition refuses to open (``meshmq log repair`` decides)."""
    partition = Partition(tmp_path, CONFIG, now_ms=T0)
    partition.append(records(0, 40), T0)
    torn_at = partition.statistics().size_bytes
    partition.append([Record.new("sensors/a", bytes(300) + b"%08d" % n, T0 + n)
                      for n in range(40, 80)], T0)
    partition.append(records(80, 5), T0)
    partition.flush()
    page = (torn_at + 4095) // 4096 * 4096
    fd = os.open(active_path(tmp_path, partition), os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xff" * 4096, page)
    finally:
        os.close(fd)
    with pytest.raises(CorruptSegment):
        Partition(tmp_path, CONFIG, now_ms=T0)
    partition.close()
