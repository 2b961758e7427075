"""LogSegment: appends, reads, lookups, indexes, truncation and crash recovery."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from meshmq.log.errors import CorruptSegment
from meshmq.log.files import segment_file_name
from meshmq.log.record import Record, decode_batches, encode_batch, read_batch_header
from meshmq.log.segment import LogSegment

BASE = 100
INTERVAL = 256  # small, so a few dozen batches produce many index entries


def make_records(first_offset: int, count: int, first_ts: int = 10_000) -> list[Record]:
    return [Record.new(f"dev/{(first_offset + i) % 5}/t", b"payload-%d" % (first_offset + i),
                       first_ts + first_offset + i, qos=i % 3, client_id="c",
                       message_id=(first_offset + i).to_bytes(16, "big"))
            for i in range(count)]


def fill(segment: LogSegment, batches: int, per_batch: int = 3) -> list[int]:
    """Append ``batches`` batches; return each batch's byte position."""
    positions = []
    for _ in range(batches):
        first = segment.next_offset
        records = make_records(first, per_batch)
        batch = encode_batch(records, base_offset=first)
        header = read_batch_header(batch)
        positions.append(segment.append(batch, first, header.last_offset, header.max_timestamp))
    return positions


def open_segment(directory: Path) -> LogSegment:
    return LogSegment(directory, BASE, index_interval_bytes=INTERVAL, now_ms=0)


def read_all(segment: LogSegment, start: int | None = None) -> list[Record]:
    start = segment.base_offset if start is None else start
    return decode_batches(segment.read(start, 1 << 30), start)


def files(directory: Path) -> dict[str, bytes]:
    return {p.suffix: p.read_bytes() for p in directory.iterdir()}


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, list[int], list[Record]]:
    """A closed segment of 40 batches of 3 records; its directory, positions and records."""
    directory = tmp_path / "original"
    directory.mkdir()
    segment = open_segment(directory)
    positions = fill(segment, 40)
    records = read_all(segment)
    segment.flush()
    segment.flush_indexes()
    segment.close()
    return directory, positions, records


def copy_log(source: Path, target: Path, cut: int | None = None,
             flip_at: int | None = None) -> Path:
    """Copy only the ``.log`` file (indexes must be rebuilt), truncated or with a bit flipped."""
    target.mkdir()
    data = bytearray((source / segment_file_name(BASE, ".log")).read_bytes())
    if flip_at is not None:
        data[flip_at] ^= 0x10
    (target / segment_file_name(BASE, ".log")).write_bytes(bytes(data[:cut]))
    return target


def test_append_read_and_offsets(tmp_path: Path) -> None:
    segment = open_segment(tmp_path)
    assert (segment.is_empty, segment.next_offset, segment.max_timestamp) == (True, BASE, -1)
    fill(segment, 10)
    records = read_all(segment)
    assert [r.offset for r in records] == list(range(BASE, BASE + 30))
    assert [r.payload for r in records] == [r.payload for r in make_records(BASE, 30)]
    assert segment.next_offset == BASE + 30
    assert segment.max_timestamp == records[-1].timestamp_ms
    assert segment.created_at == 0  # the now_ms it was created at
    assert segment.index_entries > 0


def test_read_returns_whole_batches_and_at_least_one(tmp_path: Path) -> None:
    segment = open_segment(tmp_path)
    positions = fill(segment, 5)
    first_batch = positions[1] - positions[0]
    assert len(segment.read(BASE, 1)) == first_batch
    assert len(segment.read(BASE + 4, first_batch * 2 + 5)) == first_batch * 2
    assert [r.offset for r in decode_batches(segment.read(BASE + 4, 10**6), BASE + 4)] == list(
        range(BASE + 4, BASE + 15))
    assert segment.read(BASE + 15, 100) == b""


def test_lookup_finds_the_batch_of_every_offset(written) -> None:
    directory, positions, records = written
    segment = open_segment(directory)
    for record in records:
        position = segment.lookup(record.offset)
        assert position == positions[(record.offset - BASE) // 3]
    assert segment.lookup(records[-1].offset + 1) is None
    assert segment.lookup(0) == 0


def test_find_offset_by_timestamp(tmp_path: Path) -> None:
    segment = open_segment(tmp_path)
    fill(segment, 30)
    records = read_all(segment)
    for target in [0, records[0].timestamp_ms, records[7].timestamp_ms + 1,
                   records[-1].timestamp_ms]:
        expected = next(r.offset for r in records if r.timestamp_ms >= target)
        assert segment.find_offset_by_timestamp(target) == expected
    assert segment.find_offset_by_timestamp(records[-1].timestamp_ms + 1) is None


def test_reopen_gives_identical_reads_and_state(written) -> None:
    directory, _, records = written
    before = files(directory)
    segment = open_segment(directory)
    assert read_all(segment) == records
    assert segment.damage is None
    assert segment.created_at == records[0].timestamp_ms  # reopened: its first timestamp
    assert (segment.next_offset, segment.size) == (records[-1].offset + 1, len(before[".log"]))
    assert files(directory) == before


@pytest.mark.parametrize(
    "damage", ["missing", "garbage", "odd-size", "shorter", "both-shorter", "empty"])
def test_damaged_indexes_are_rebuilt(written, damage: str) -> None:
    directory, positions, records = written
    original = files(directory)
    for suffix in (".index", ".timeindex"):
        path = directory / segment_file_name(BASE, suffix)
        data = path.read_bytes()
        if damage == "missing":
            path.unlink()
        elif damage == "garbage":
            path.write_bytes(bytes(reversed(data)))
        elif damage == "odd-size":
            path.write_bytes(data + b"\x01")
        elif damage == "shorter":
            path.write_bytes(data[: len(data) // 2 // 8 * 8] if suffix == ".index" else data)
        elif damage == "both-shorter":  # a consistent prefix: the tail scan extends it
            entry = 8 if suffix == ".index" else 12
            path.write_bytes(data[: 3 * entry])
        else:
            path.write_bytes(b"")
    segment = open_segment(directory)
    assert segment.damage is None
    assert all(segment.lookup(r.offset) == positions[(r.offset - BASE) // 3] for r in records)
    assert segment.find_offset_by_timestamp(records[50].timestamp_ms) == records[50].offset
    assert files(directory) == original


def test_torn_tail_at_every_byte_of_the_last_batch_is_truncated(written, tmp_path: Path) -> None:
    directory, positions, records = written
    log_size = (directory / segment_file_name(BASE, ".log")).stat().st_size
    last = positions[-1]
    for cut in range(last, log_size):
        copy = copy_log(directory, tmp_path / f"cut{cut}", cut=cut)
        segment = open_segment(copy)
        assert segment.damage is not None or cut == last
        assert segment.recover() == cut - last
        assert segment.size == last
        assert read_all(segment) == records[:-3]
        assert segment.next_offset == records[-3].offset
        segment.close()
        shutil.rmtree(copy)


def test_recovery_keeps_appending_after_the_cut(written, tmp_path: Path) -> None:
    directory, positions, records = written
    segment = open_segment(copy_log(directory, tmp_path / "c", cut=positions[-1] + 7))
    segment.recover()
    fill(segment, 1)
    assert [r.offset for r in read_all(segment)] == [r.offset for r in records]


@pytest.mark.parametrize("byte", [0, 1, 2, 4, 5, 9, 12, 20, 30, 40, 45, 60, 80])
def test_flipped_bit_mid_segment_raises_corrupt_segment(written, tmp_path: Path,
                                                        byte: int) -> None:
    directory, positions, _ = written
    middle = positions[20]
    copy = copy_log(directory, tmp_path / "flip", flip_at=middle + byte)
    segment = open_segment(copy)
    with pytest.raises(CorruptSegment) as caught:
        segment.recover()
    assert caught.value.path == copy / segment_file_name(BASE, ".log")
    assert caught.value.position == middle
    assert str(middle) in str(caught.value) and str(caught.value.path) in str(caught.value)
    with pytest.raises(CorruptSegment):
        fill(segment, 1)  # a damaged segment refuses appends


@pytest.mark.parametrize("byte", [0, 1, 3, 5, 9, 15, 43, 60, -1])
def test_flipped_bit_in_the_last_batch_is_truncated(written, tmp_path: Path, byte: int) -> None:
    directory, positions, records = written
    log_size = (directory / segment_file_name(BASE, ".log")).stat().st_size
    where = positions[-1] + byte if byte >= 0 else log_size - 1
    segment = open_segment(copy_log(directory, tmp_path / "flip", flip_at=where))
    assert segment.recover() == log_size - positions[-1]
    assert read_all(segment) == records[:-3]


def test_a_cut_tail_is_kept_beside_the_log_as_repair_does(written, tmp_path: Path) -> None:
    """Recovery never drops bytes silently: the file as it was goes to repair-backup-<time>/,
    the same place and name ``meshmq log repair`` uses, and the live file is the good part."""
    directory, positions, records = written
    copy = copy_log(directory, tmp_path / "torn", cut=positions[-1] + 11)
    torn = (copy / segment_file_name(BASE, ".log")).read_bytes()
    segment = open_segment(copy)
    assert segment.recover() == 11
    kept = segment.kept_tail
    assert kept is not None and kept.parent.parent == copy
    assert kept.parent.name.startswith("repair-backup-") and kept.name == segment.log_path.name
    assert kept.read_bytes() == torn
    assert segment.log_path.read_bytes() == torn[: positions[-1]]
    fill(segment, 1)  # appends go to the new file, after the cut
    assert [r.offset for r in read_all(segment)] == [r.offset for r in records]
    assert kept.read_bytes() == torn
    segment.close()


def test_a_tail_that_cannot_be_kept_is_not_cut(written, tmp_path: Path) -> None:
    directory, positions, _ = written
    copy = copy_log(directory, tmp_path / "torn", cut=positions[-1] + 11)
    torn = (copy / segment_file_name(BASE, ".log")).read_bytes()

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    segment = LogSegment(copy, BASE, index_interval_bytes=INTERVAL, now_ms=0,
                         fsync=failing_fsync)
    with pytest.raises(CorruptSegment, match="not cut off, as no copy of it could be kept"):
        segment.recover()
    assert segment.log_path.read_bytes() == torn
    with pytest.raises(CorruptSegment):
        fill(segment, 1)
    segment.close()


def test_recover_without_truncation_refuses_a_torn_tail(written, tmp_path: Path) -> None:
    directory, positions, _ = written
    segment = open_segment(copy_log(directory, tmp_path / "c", cut=positions[-1] + 3))
    with pytest.raises(CorruptSegment) as caught:
        segment.recover(allow_truncation=False)
    assert caught.value.position == positions[-1]


def test_a_zero_tail_is_preallocated_space_not_a_torn_tail(written, tmp_path: Path) -> None:
    directory, _, records = written
    copy = copy_log(directory, tmp_path / "zeros")
    log_file = copy / segment_file_name(BASE, ".log")
    size = log_file.stat().st_size
    log_file.write_bytes(log_file.read_bytes() + bytes(4096))
    segment = open_segment(copy)
    assert segment.damage is None and segment.recover() == 0 and segment.kept_tail is None
    assert segment.size == size and read_all(segment) == records
    assert log_file.stat().st_size == size + 4096  # kept for the next appends
    segment.trim()
    assert log_file.stat().st_size == size


@pytest.mark.parametrize("offset", [BASE, BASE + 1, BASE + 3, BASE + 61, BASE + 119, BASE + 500])
def test_truncate_to(written, offset: int) -> None:
    directory, _, records = written
    segment = open_segment(directory)
    segment.truncate_to(offset)
    kept = [r for r in records if r.offset < offset]
    assert read_all(segment) == kept
    assert segment.next_offset == (kept[-1].offset + 1 if kept else BASE)
    assert segment.max_timestamp == (max(r.timestamp_ms for r in kept) if kept else -1)
    fill(segment, 2)
    after = files(directory)
    segment.close()
    rebuilt = open_segment(directory)
    rebuilt.recover()
    assert files(directory) == after  # the truncated index equals one rebuilt from scratch
    assert [r.offset for r in read_all(rebuilt)] == list(range(BASE, rebuilt.next_offset))


def test_append_checks_its_arguments(tmp_path: Path) -> None:
    segment = open_segment(tmp_path)
    batch = encode_batch(make_records(BASE, 2), base_offset=BASE)
    with pytest.raises(ValueError, match="disagrees"):
        segment.append(batch, BASE, BASE, 0)
    header = read_batch_header(batch)
    segment.append(batch, BASE, BASE + 1, header.max_timestamp)
    with pytest.raises(ValueError, match="next offset"):
        segment.append(batch, BASE, BASE + 1, header.max_timestamp)
    far = encode_batch(make_records(0, 1), base_offset=BASE + 2**32)
    with pytest.raises(ValueError, match="roll"):
        segment.append(far, BASE + 2**32, BASE + 2**32, read_batch_header(far).max_timestamp)


def test_age_and_delete(tmp_path: Path) -> None:
    segment = LogSegment(tmp_path, 0, now_ms=5_000)
    assert segment.age(7_500) == 2_500
    segment.delete()
    assert list(tmp_path.iterdir()) == []
