"""log/reader.py, the one read-only reader of the log files: real logs written by CommitLog in
tmp_path, read back whole, up to a limit, with a torn tail, with a corrupt batch, with a damaged
index, and directories that hold no usable log."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshmq.log.commit_log import CommitLog
from meshmq.log.config import LogConfig
from meshmq.log.errors import CorruptSegment
from meshmq.log.reader import (
    LogDirectory,
    NoLogHere,
    OpenSegment,
    UnusableMeta,
    Walk,
    batches_from,
    end_offset,
    first_offset_at_or_after,
)
from meshmq.log.record import Record, decode_batch, encode_batch, verify_batch

T0 = 1_700_000_000_000
NOW = T0 + 3_600_000
PER_BATCH = 4


def no_fsync(fd: int) -> None:
    """fsync is not what these tests observe; skipping it keeps them fast."""


def write_log(data_dir: Path, batches: int, *, partitions: int = 1,
              segment_bytes: int = 1 << 20) -> CommitLog:
    """A closed log of ``batches`` batches of ``PER_BATCH`` records in each partition; the
    returned CommitLog is closed (its answers were read before)."""
    config = LogConfig(partitions=partitions, segment_bytes=segment_bytes,
                       index_interval_bytes=150)
    log = CommitLog(data_dir, config, fsync=no_fsync, now_ms=NOW)
    with log:
        for partition in range(partitions):
            for _ in range(batches):
                start = log.next_offset(partition)
                records = [Record.new(f"t/{partition}", b"%08d" % (start + i), T0 + start + i)
                           for i in range(PER_BATCH)]
                log.append_to(partition, records, NOW)
    return log


def batch_positions(path: Path) -> list[int]:
    """Where each batch of a segment starts, from the length field of each header
    (docs/log-format.md: magic byte, then a 4-byte big-endian length)."""
    data, positions, position = path.read_bytes(), [], 0
    while position < len(data):
        positions.append(position)
        position += int.from_bytes(data[position + 1 : position + 5], "big")
    return positions


def only_segment(data_dir: Path) -> OpenSegment:
    (file,) = LogDirectory.locate(data_dir).segments(0)
    return OpenSegment(file, sealed=False)


def offsets(segment: OpenSegment, start: int, end: int | None = None) -> list[int]:
    return [record.offset for walked in batches_from(segment, start, end)
            for record in decode_batch(walked.data, walked.at)[0]]


def test_lists_partitions_and_segments_and_answers_as_the_owner_did(tmp_path: Path) -> None:
    write_log(tmp_path, 30, partitions=2, segment_bytes=1_000)
    directory = LogDirectory.locate(tmp_path)
    assert directory == LogDirectory.locate(tmp_path / "log")  # a data_dir or its log dir
    assert directory.partitions == 2
    for partition in range(2):
        files = sorted((tmp_path / "log" / str(partition)).glob("*.log"))
        listed = directory.segments(partition)
        assert [s.path for s in listed] == files and len(files) > 2
        assert [s.base_offset for s in listed] == [int(f.stem) for f in files]
        assert directory.earliest_offset(partition) == 0
        assert directory.next_offset(partition) == 30 * PER_BATCH
    assert directory.segments(5) == []  # no such partition directory: nothing listed


def test_reads_whole_batches_from_an_offset_up_to_a_limit(tmp_path: Path) -> None:
    write_log(tmp_path, 40)
    with only_segment(tmp_path) as segment:
        assert offsets(segment, 0) == list(range(40 * PER_BATCH))
        # The batches holding offsets 37..101: whole batches, so from 36 to 103.
        assert offsets(segment, 37, 102) == list(range(36, 104))
        assert offsets(segment, 160) == []  # at the end: nothing yet


def test_index_lookup_lands_on_a_batch_and_a_damaged_index_is_only_a_hint(
        tmp_path: Path) -> None:
    write_log(tmp_path, 40)
    positions = batch_positions(sorted((tmp_path / "log" / "0").glob("*.log"))[0])
    with only_segment(tmp_path) as segment:
        position, base = segment.index_start(120)
        assert position in positions and position > 0  # the index skipped the first batches
        assert base == positions.index(position) * PER_BATCH <= 120
        segment.file.index_path.write_bytes(bytes(range(40)))  # entries pointing at nonsense
        assert segment.index_start(120) == (0, 0)  # an active segment's index is reread
        assert offsets(segment, 120, 124) == [120, 121, 122, 123]


def test_a_torn_tail_is_a_tolerated_tail_unless_the_segment_is_sealed(tmp_path: Path) -> None:
    write_log(tmp_path, 10)
    path = sorted((tmp_path / "log" / "0").glob("*.log"))[0]
    whole_size = path.stat().st_size
    torn = encode_batch([Record.new("t/0", b"torn", T0)], base_offset=40)
    with open(path, "ab") as file:
        file.write(torn[: len(torn) // 2])
    with only_segment(tmp_path) as segment:
        walk = Walk(segment, 0)
        assert sum(1 for _ in walk) == 10
        assert walk.tail is not None
        assert (walk.tail.position, walk.tail.cut_short, walk.tail.tolerated) == (
            whole_size, True, True)
        assert offsets(segment, 0) == list(range(40))
        assert end_offset(segment) == 40
        segment.sealed = True  # a later segment exists: nobody is writing this one
        with pytest.raises(CorruptSegment, match=f"{path.name}: corrupt record batch at byte "
                                                 f"{whole_size}: the file ends inside"):
            offsets(segment, 0)


def test_a_corrupt_batch_is_tolerated_only_as_the_end_of_the_active_segment(
        tmp_path: Path) -> None:
    write_log(tmp_path, 10)
    path = sorted((tmp_path / "log" / "0").glob("*.log"))[0]
    positions = batch_positions(path)
    pristine = path.read_bytes()
    path.write_bytes(pristine[:-1] + bytes([pristine[-1] ^ 0xFF]))  # the last batch's checksum
    with only_segment(tmp_path) as segment:
        assert offsets(segment, 0) == list(range(36))
        assert end_offset(segment) == 36
        assert LogDirectory.locate(tmp_path).next_offset(0) == 36
    damaged = bytearray(pristine)
    damaged[positions[3] + 50] ^= 0xFF  # inside the fourth batch: bit rot, not a write
    path.write_bytes(bytes(damaged))
    with only_segment(tmp_path) as segment:
        walk = Walk(segment, 0, check=verify_batch)
        assert sum(1 for _ in walk) == 3
        assert walk.tail is not None and not walk.tail.tolerated
        assert walk.tail.reason.startswith("checksum mismatch")
        with pytest.raises(CorruptSegment, match=f"at byte {positions[3]}: checksum mismatch"):
            offsets(segment, 0)
        assert offsets(segment, 0, 8) == list(range(8))  # stops before reaching the damage


def test_time_lookup_finds_the_first_record_at_or_after(tmp_path: Path) -> None:
    write_log(tmp_path, 20)
    with only_segment(tmp_path) as segment:
        assert first_offset_at_or_after(segment, T0 - 5) == 0
        assert first_offset_at_or_after(segment, T0 + 57) == 57
        assert first_offset_at_or_after(segment, T0 + 80) is None
    assert LogDirectory.locate(tmp_path).offset_for_timestamp(0, T0 + 33) == 33


def test_directories_without_a_usable_log_get_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(NoLogHere, match="no such directory"):
        LogDirectory.locate(tmp_path / "nope")
    with pytest.raises(NoLogHere, match="no commit log here"):
        LogDirectory.locate(tmp_path)
    (tmp_path / "log").mkdir()
    meta = tmp_path / "log" / "meta.json"
    meta.write_text('{"format": "meshmq-log", "format_version": 9, "partitions": 2}')
    with pytest.raises(UnusableMeta, match="unsupported log format 'meshmq-log' version 9"):
        LogDirectory.locate(tmp_path)
    meta.write_text('{"format": "meshmq-log", "format_version": 1, "partitions": 0}')
    with pytest.raises(UnusableMeta, match="invalid partition count 0"):
        LogDirectory.locate(tmp_path)
