"""Partition: offsets, rolling, retention, reads across segments, recovery on open."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from meshmq.log.config import LogConfig
from meshmq.log.errors import CorruptSegment, LogClosed, OffsetOutOfRange
from meshmq.log.files import segment_file_name
from meshmq.log.partition import CLEAN_SHUTDOWN_FILE, Partition
from meshmq.log.record import BatchBuilder, Record

T0 = 1_700_000_000_000
SMALL = LogConfig(partitions=1, segment_bytes=2_000, index_interval_bytes=200)


def records(count: int, start: int = 0, ts: int = T0, size: int = 20) -> list[Record]:
    return [Record.new("sensors/a", b"%06d" % (start + i) + bytes(size), ts + start + i)
            for i in range(count)]


def payload_numbers(recs: list[Record]) -> list[int]:
    return [int(r.payload[:6]) for r in recs]


def fill(partition: Partition, batches: int, per_batch: int = 5, now_ms: int = T0) -> None:
    for _ in range(batches):
        start = partition.next_offset
        partition.append(records(per_batch, start), now_ms)


def crash(partition: Partition) -> None:
    """Close, then forget the clean shutdown: what the disk looks like after kill -9."""
    partition.close()
    (partition.directory / CLEAN_SHUTDOWN_FILE).unlink()


def log_file(partition_dir: Path, base: int) -> Path:
    return partition_dir / segment_file_name(base, ".log")


def test_append_assigns_dense_offsets_and_reads_them_back(tmp_path: Path) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    assert partition.append(records(3), T0) == (0, 2)
    assert partition.append(records(2, 3), T0) == (3, 4)
    got = partition.read(0)
    assert [r.offset for r in got] == [0, 1, 2, 3, 4]
    assert payload_numbers(got) == [0, 1, 2, 3, 4]
    assert partition.read(5) == []
    assert [r.offset for r in partition.read(2, max_records=2)] == [2, 3]


def test_roll_by_size_and_reads_across_segments(tmp_path: Path) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    fill(partition, 40)
    bases = partition.segment_base_offsets()
    assert len(bases) > 5
    assert all(s <= SMALL.segment_bytes for s in _segment_sizes(tmp_path))
    assert payload_numbers(partition.read(0, max_bytes=10**7)) == list(range(200))
    for start in (bases[2] - 1, bases[2], bases[3] + 2):
        got = partition.read(start, max_records=30)
        assert [r.offset for r in got] == list(range(start, start + 30))


def _segment_sizes(directory: Path) -> list[int]:
    return [p.stat().st_size for p in directory.glob("*.log")]


def test_read_budget_in_bytes_spans_segments_but_stops_at_whole_batches(tmp_path: Path) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    fill(partition, 40)
    got = partition.read(0, max_bytes=5_000)
    assert 2_000 // 300 < len(got) < 5_000 // 50
    assert [r.offset for r in got] == list(range(len(got)))
    assert len(partition.read(7, max_bytes=1)) == 3  # at least the batch holding offset 7


def test_roll_by_age_uses_the_injected_clock(tmp_path: Path) -> None:
    config = LogConfig(partitions=1, segment_ms=60_000)
    partition = Partition(tmp_path, config, now_ms=T0)
    partition.append(records(1), now_ms=T0)
    partition.append(records(1, 1), now_ms=T0 + 60_000)
    assert partition.segment_base_offsets() == [0]
    partition.append(records(1, 2), now_ms=T0 + 60_001)
    assert partition.segment_base_offsets() == [0, 2]
    partition.append(records(1, 3), now_ms=T0 + 100_000)
    assert partition.segment_base_offsets() == [0, 2]
    assert payload_numbers(partition.read(0)) == [0, 1, 2, 3]


def test_explicit_roll_skips_an_empty_segment(tmp_path: Path) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    partition.roll()
    assert partition.segment_base_offsets() == [0]
    fill(partition, 1)
    partition.roll()
    partition.roll()
    assert partition.segment_base_offsets() == [0, 5]


def test_retention_by_size_deletes_whole_oldest_segments(tmp_path: Path) -> None:
    config = LogConfig(partitions=1, segment_bytes=2_000, retention_bytes=5_000)
    partition = Partition(tmp_path, config, now_ms=T0)
    fill(partition, 40)
    before = partition.segment_base_offsets()
    deleted = partition.enforce_retention(T0)
    after = partition.segment_base_offsets()
    assert deleted > 0 and after == before[deleted:]
    assert 5_000 <= sum(_segment_sizes(tmp_path)) < 5_000 + 2_000
    assert partition.earliest_offset == after[0]
    assert payload_numbers(partition.read(after[0], max_bytes=10**7)) == list(
        range(after[0], 200))


def test_retention_by_age_never_deletes_the_active_segment(tmp_path: Path) -> None:
    config = LogConfig(partitions=1, segment_bytes=2_000, retention_ms=1_000)
    partition = Partition(tmp_path, config, now_ms=T0)
    fill(partition, 40)
    bases = partition.segment_base_offsets()
    oldest_max = T0 + bases[1] - 1  # segment 0 holds offsets below bases[1], ts = T0 + offset
    assert partition.enforce_retention(oldest_max + 1_000) == 0
    assert partition.enforce_retention(oldest_max + 1_001) == 1
    assert partition.enforce_retention(T0 + 10**9) == len(bases) - 2
    assert partition.segment_base_offsets() == [bases[-1]]
    assert partition.read(bases[-1])[0].offset == bases[-1]


def test_reading_below_earliest_raises_offset_out_of_range(tmp_path: Path) -> None:
    config = LogConfig(partitions=1, segment_bytes=2_000, retention_bytes=1)
    partition = Partition(tmp_path, config, now_ms=T0)
    fill(partition, 40)
    partition.enforce_retention(T0)
    earliest = partition.earliest_offset
    with pytest.raises(OffsetOutOfRange) as caught:
        partition.read(0)
    assert (caught.value.earliest_offset, caught.value.next_offset) == (earliest, 200)
    with pytest.raises(OffsetOutOfRange):
        partition.read(201)
    assert partition.read(earliest)[0].offset == earliest


def test_offset_for_timestamp_across_segments(tmp_path: Path) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    fill(partition, 40)
    for offset in (0, 1, 57, 123, 199):
        assert partition.offset_for_timestamp(T0 + offset) == offset
    assert partition.offset_for_timestamp(0) == 0
    assert partition.offset_for_timestamp(T0 + 200) is None


def test_reopen_after_close_gives_identical_reads(tmp_path: Path) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    fill(partition, 40)
    before = partition.read(0, max_bytes=10**7)
    bases = partition.segment_base_offsets()
    partition.close()
    with pytest.raises(LogClosed):
        partition.read(0)
    reopened = Partition(tmp_path, SMALL)
    assert reopened.recovery.clean_shutdown and reopened.recovery.truncated_bytes == 0
    assert not (tmp_path / CLEAN_SHUTDOWN_FILE).exists()
    assert reopened.read(0, max_bytes=10**7) == before
    assert reopened.segment_base_offsets() == bases
    assert reopened.append(records(1, 200), T0) == (200, 200)


def test_unclean_reopen_truncates_a_torn_tail(tmp_path: Path) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    fill(partition, 12)
    last_base = partition.segment_base_offsets()[-1]
    crash(partition)
    path = log_file(tmp_path, last_base)
    path.write_bytes(path.read_bytes()[:-10])
    reopened = Partition(tmp_path, SMALL)
    assert not reopened.recovery.clean_shutdown
    assert reopened.recovery.truncated_bytes > 0
    assert reopened.next_offset == 55
    assert payload_numbers(reopened.read(0, max_bytes=10**7)) == list(range(55))


def test_unclean_reopen_keeps_the_cut_tail_and_reports_where(tmp_path: Path) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    fill(partition, 12)
    last_base = partition.segment_base_offsets()[-1]
    crash(partition)
    path = log_file(tmp_path, last_base)
    torn = path.read_bytes()[:-10]
    path.write_bytes(torn)
    reopened = Partition(tmp_path, SMALL)
    kept = reopened.recovery.kept_tail
    assert kept == next(tmp_path.glob("repair-backup-*")) / path.name
    assert kept.read_bytes() == torn
    assert path.read_bytes() == torn[: len(torn) - reopened.recovery.truncated_bytes]
    reopened.close()
    clean = Partition(tmp_path, SMALL)
    assert clean.recovery.kept_tail is None  # nothing cut: nothing kept
    clean.close()


def test_unclean_reopen_refuses_corruption_mid_active_segment(tmp_path: Path) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    fill(partition, 3)
    crash(partition)
    path = log_file(tmp_path, 0)
    data = bytearray(path.read_bytes())
    data[30] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptSegment) as caught:
        Partition(tmp_path, SMALL)
    assert (caught.value.path, caught.value.position) == (path, 0)


def test_damage_in_a_sealed_segment_is_never_truncated(tmp_path: Path) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    fill(partition, 40)
    sealed = partition.segment_base_offsets()[1]
    partition.close()
    path = log_file(tmp_path, sealed)
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0x80]))  # its last batch
    with pytest.raises(CorruptSegment) as caught:
        Partition(tmp_path, SMALL)
    assert caught.value.path == path
    assert path.stat().st_size == len(data)


def test_bit_rot_behind_the_index_is_reported_by_reads(tmp_path: Path) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    fill(partition, 40)
    partition.close()
    path = log_file(tmp_path, 0)
    data = bytearray(path.read_bytes())
    data[100] ^= 0x04
    path.write_bytes(bytes(data))
    reopened = Partition(tmp_path, SMALL)  # clean shutdown: only segment tails are verified
    with pytest.raises(CorruptSegment) as caught:
        reopened.read(0)
    assert caught.value.path == path


@pytest.mark.parametrize("offset", [0, 3, 62, 100, 150])
def test_truncate_to(tmp_path: Path, offset: int) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    fill(partition, 40)
    partition.truncate_to(offset)
    assert partition.next_offset == offset
    assert payload_numbers(partition.read(0, max_bytes=10**7)) == list(range(offset))
    partition.append(records(2, 1000), T0)
    got = partition.read(0, max_bytes=10**7)
    assert [r.offset for r in got] == list(range(offset + 2))
    assert payload_numbers(got[offset:]) == [1000, 1001]


def test_truncate_below_earliest_restarts_the_partition(tmp_path: Path) -> None:
    config = LogConfig(partitions=1, segment_bytes=2_000, retention_bytes=1)
    partition = Partition(tmp_path, config, now_ms=T0)
    fill(partition, 40)
    partition.enforce_retention(T0)
    partition.truncate_to(3)
    assert (partition.earliest_offset, partition.next_offset) == (3, 3)
    assert partition.segment_base_offsets() == [3]
    partition.append(records(1), T0)
    assert partition.read(3)[0].offset == 3


def test_statistics(tmp_path: Path) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    fill(partition, 40)
    stats = partition.statistics()
    assert (stats.earliest_offset, stats.next_offset, stats.max_timestamp) == (0, 200, T0 + 199)
    assert stats.segments == len(partition.segment_base_offsets())
    partition.close()  # cuts the active segment's preallocated zeros off
    assert stats.size_bytes == sum(_segment_sizes(tmp_path))


def test_readers_run_concurrently_with_an_appender(tmp_path: Path) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    errors: list[BaseException] = []
    done = threading.Event()

    def reader() -> None:
        try:
            while not done.is_set():
                start = max(partition.next_offset - 40, 0)
                got = partition.read(start, max_bytes=10**7)
                assert [r.offset for r in got] == list(range(start, start + len(got)))
                assert payload_numbers(got) == [r.offset for r in got]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    fill(partition, 200, per_batch=2)
    done.set()
    for thread in threads:
        thread.join()
    assert errors == []
    assert partition.next_offset == 400


def built(recs: list[Record]) -> BatchBuilder:
    builder = BatchBuilder()
    for record in recs:
        builder.add_record(record)
    return builder


def test_append_built_gives_dense_offsets_in_order_and_rolls_when_due(
        tmp_path: Path) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    expected: list[int] = []
    for turn in range(12):  # three batches of four records per call: ~1 KB, 2 KB segments
        batches = [built(records(4, turn * 12 + n * 4)) for n in range(3)]
        base = partition.next_offset
        assert partition.append_built(batches, T0)
        assert [b.base_offset for b in batches] == [base, base + 4, base + 8]
        expected += range(turn * 12, turn * 12 + 12)
    got = partition.read(0, max_bytes=10**8)
    assert [r.offset for r in got] == list(range(len(expected)))
    assert payload_numbers(got) == expected
    assert partition.statistics().segments > 3  # rolls were exercised
    crash(partition)  # what is on disk reopens the same, indexes included
    reopened = Partition(tmp_path, SMALL, now_ms=T0)
    assert payload_numbers(reopened.read(0, max_bytes=10**8)) == expected
    assert payload_numbers(reopened.read(30, max_records=1)) == [30]
    reopened.close()


def test_append_built_without_roll_appends_nothing_when_the_segment_must_roll(
        tmp_path: Path) -> None:
    partition = Partition(tmp_path, SMALL, now_ms=T0)
    fill(partition, 2, per_batch=10)  # 1,526 bytes of the 2,000-byte segment
    segments, next_offset = partition.statistics().segments, partition.next_offset
    batch = built(records(10, next_offset))  # 763 bytes: does not fit
    assert not partition.append_built([batch], T0, roll=False)  # a roll would fsync
    assert partition.next_offset == next_offset and partition.statistics().segments == segments
    assert partition.append_built([built(records(1, next_offset))], T0, roll=False)  # fits
    assert not partition.append_built([built(records(1, next_offset + 1))],
                                      T0 + SMALL.segment_ms + 1, roll=False)  # too old
    assert partition.append_built([batch], T0)
    assert batch.base_offset == next_offset + 1
    assert partition.statistics().segments == segments + 1
    assert payload_numbers(partition.read(next_offset, max_bytes=10**6)) == [
        next_offset, *range(next_offset, next_offset + 10)]
    partition.close()
