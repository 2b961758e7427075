"""The source's read-only view of the log files (logdir.py, reader.py's read_split) and the
stream reader's planning, called directly without Spark: real logs written by the engine in
tmp_path, torn tails, damaged indexes, corruption, segments deleted under the reader, time
lookups, truncated logs, and a Hypothesis property over truncation."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from meshmq.log.commit_log import CommitLog
from meshmq.log.config import LogConfig
from meshmq.log.record import Record, encode_batch
from meshmq.mqtt.codec import encode_properties
from meshmq.mqtt.properties import PropertyId
from meshmq.pipeline.errors import CorruptLog, DataLossError, LogNotFound
from meshmq.pipeline.logdir import LogDirectory
from meshmq.pipeline.options import parse_options, parse_topics
from meshmq.pipeline.reader import OffsetRange, plan_splits, read_split
from meshmq.pipeline.stream import MeshmqStreamReader

pytestmark = pytest.mark.xdist_group("spark")

T0 = 1_700_000_000_000
Expected = dict[int, list[tuple[int, Record]]]  # partition -> [(offset, record)]


def make_record(i: int, ts: int | None = None) -> Record:
    return Record.new(f"site/{i % 3}/dev{i % 7}", b"payload-%05d" % i,
                      T0 + i * 10 if ts is None else ts, qos=i % 3, retain=i % 11 == 0,
                      client_id=f"client-{i % 4}", properties=b"\x00",
                      message_id=i.to_bytes(16, "big"))


def write_log(data_dir: Path, count: int, *, partitions: int = 2, per_append: int = 5,
              segment_bytes: int = 1200, timestamps: list[int] | None = None) -> Expected:
    """Append ``count`` records, ``per_append`` per batch; return what went where."""
    expected: Expected = {p: [] for p in range(partitions)}
    config = LogConfig(partitions=partitions, segment_bytes=segment_bytes,
                       index_interval_bytes=128)
    with CommitLog(data_dir, config) as log:
        for first in range(0, count, per_append):
            batch = [make_record(i, None if timestamps is None else timestamps[i])
                     for i in range(first, min(first + per_append, count))]
            for record, (partition, offset) in zip(batch, log.append_many(batch), strict=True):
                expected[partition].append((offset, record))
    return expected


def read_rows(log_dir: Path, partition: int, start: int, end: int, **options: str) -> list[dict]:
    directory = LogDirectory.open(log_dir)
    opts = parse_options({"path": str(log_dir), **options}, streaming=False)
    rows: list[dict] = []
    for split in plan_splits(directory, OffsetRange(partition, start, end),
                             opts.fail_on_data_loss):
        for batch in read_split(split, opts):
            assert isinstance(batch, pa.RecordBatch)
            rows += batch.to_pylist()
    return rows


def segment_files(data_dir: Path, partition: int) -> list[Path]:
    return sorted((data_dir / "log" / str(partition)).glob("*.log"))


def test_every_column_holds_what_was_appended(tmp_path: Path) -> None:
    expected = write_log(tmp_path, 120)
    for partition, records in expected.items():
        rows = read_rows(tmp_path, partition, 0, len(records))
        assert [r["offset"] for r in rows] == [offset for offset, _ in records]
        for row, (_, record) in zip(rows, records, strict=True):
            assert row["partition"] == partition
            assert row["timestamp"].timestamp() * 1000 == record.timestamp_ms
            assert str(row["timestamp"].tzinfo) == "UTC"
            assert (row["topic"], row["payload"], row["client_id"]) == (
                record.topic, record.payload, record.client_id)
            assert (row["qos"], row["retain"]) == (record.qos, record.retain)
            assert row["message_id"] == record.message_id.hex() and len(row["message_id"]) == 32
            assert row["properties"] == []


def test_ranges_split_at_segment_boundaries_and_start_mid_segment(tmp_path: Path) -> None:
    expected = write_log(tmp_path, 200, partitions=1)
    directory = LogDirectory.open(tmp_path)  # a data_dir works as well as its log dir
    bases = directory.segment_bases(0)
    assert len(bases) > 3
    splits = plan_splits(directory, OffsetRange(0, 7, 190), True)
    assert [s.segment_base for s in splits] == [b for b in bases if b < 190]
    assert splits[0].start == 7 and splits[-1].end == 190
    assert all(a.end == b.start == b.segment_base for a, b in itertools.pairwise(splits))
    rows = read_rows(tmp_path / "log", 0, 7, 190)
    assert [r["offset"] for r in rows] == list(range(7, 190))
    assert [r["payload"] for r in rows] == [rec.payload for _, rec in expected[0][7:190]]


def test_earliest_and_latest_positions(tmp_path: Path) -> None:
    expected = write_log(tmp_path, 90, partitions=3)
    directory = LogDirectory.open(tmp_path / "log")
    assert directory.partitions == 3
    for partition in range(3):
        assert directory.earliest_offset(partition) == 0
        assert directory.next_offset(partition) == len(expected[partition])


def test_time_lookup_finds_the_first_offset_at_or_after(tmp_path: Path) -> None:
    # Timestamps mostly rise but jump back sometimes (a wall clock stepped back).
    timestamps = [T0 + 10 * i - (35 if i % 13 == 5 else 0) for i in range(150)]
    expected = write_log(tmp_path, 150, partitions=1, timestamps=timestamps)
    directory = LogDirectory.open(tmp_path)
    records = expected[0]
    for wanted in (T0 - 1000, T0, T0 + 1, T0 + 333, T0 + 1000, T0 + 1491, T0 + 10_000):
        first = next((o for o, r in records if r.timestamp_ms >= wanted), None)
        assert directory.offset_for_timestamp(0, wanted) == first, wanted


def test_topic_filters_drop_records_before_columns_are_built(tmp_path: Path) -> None:
    expected = write_log(tmp_path, 100, partitions=1)
    rows = read_rows(tmp_path, 0, 0, 100, topics="site/1/+,site/2/dev3")
    wanted = [o for o, r in expected[0] if parse_topics("site/1/+,site/2/dev3").matches(r.topic)]
    assert [r["offset"] for r in rows] == wanted
    assert 0 < len(rows) < 100


def test_mqtt5_properties_become_a_string_map(tmp_path: Path) -> None:
    props = encode_properties({PropertyId.CONTENT_TYPE: "text/csv",
                               PropertyId.USER_PROPERTY: [("site", "north"), ("site", "south")],
                               PropertyId.CORRELATION_DATA: b"\x01\xab"})
    records = [Record.new("t/a", b"1", T0, properties=props),
               Record.new("t/b", b"2", T0, properties=b""),  # MQTT 3.1.1: no block at all
               Record.new("t/c", b"3", T0, properties=b"\x02\x01")]  # block cut short
    with CommitLog(tmp_path, LogConfig(partitions=1)) as log:
        log.append_many(records)
    rows = read_rows(tmp_path, 0, 0, 3)
    assert [dict(r["properties"]) for r in rows] == [
        {"site": "south", "content_type": "text/csv", "correlation_data": "01ab"}, {},
        {"malformed_properties": "0201"}]


def test_a_record_that_is_not_utf_8_is_reported_with_its_place(tmp_path: Path) -> None:
    write_log(tmp_path, 10, partitions=1)
    batch = bytearray(encode_batch([make_record(10)], base_offset=10))
    topic_at = 43 + 37  # batch header, record prefix
    batch[topic_at] = 0xFF
    batch[5:9] = zlib.crc32(bytes(batch[9:])).to_bytes(4, "big")  # a valid checksum over it
    log_file = segment_files(tmp_path, 0)[-1]
    position = log_file.stat().st_size
    with open(log_file, "ab") as file:
        file.write(batch)
    assert LogDirectory.open(tmp_path).next_offset(0) == 11
    with pytest.raises(CorruptLog, match=f"{log_file.name}: corrupt record batch at byte"
                                         f" {position}: malformed record"):
        read_rows(tmp_path, 0, 0, 11)


def test_large_payloads_span_read_chunks_and_arrow_batches(tmp_path: Path) -> None:
    payloads = [bytes([i]) * (2 * 1024 * 1024 + i) for i in range(40)]  # 80 MiB in all
    with CommitLog(tmp_path, LogConfig(partitions=1, segment_bytes=1 << 30)) as log:
        for first in range(0, 40, 5):  # 10 MiB batches: larger than one read chunk
            log.append_many([Record.new("ota/image", payloads[i], T0 + i)
                             for i in range(first, first + 5)])
    opts = parse_options({"path": str(tmp_path)}, streaming=False)
    (split,) = plan_splits(LogDirectory.open(tmp_path), OffsetRange(0, 3, 40), True)
    batches = list(read_split(split, opts))
    assert len(batches) >= 2  # cut at about ARROW_BATCH_BYTES, never one 2 GiB column
    rows = [row for batch in batches for row in batch.to_pylist()]
    assert [r["offset"] for r in rows] == list(range(3, 40))
    assert [r["payload"] for r in rows] == payloads[3:]


def test_torn_tail_of_the_active_segment_is_a_write_in_progress(tmp_path: Path) -> None:
    expected = write_log(tmp_path, 60, partitions=1, segment_bytes=1 << 20)
    active = segment_files(tmp_path, 0)[-1]
    torn = encode_batch([make_record(999)], base_offset=60)
    with open(active, "ab") as file:
        file.write(torn[: len(torn) // 2])
    directory = LogDirectory.open(tmp_path)
    assert directory.next_offset(0) == 60
    assert len(read_rows(tmp_path, 0, 0, 60)) == len(expected[0])


def test_checksum_failure_at_the_very_end_is_tolerated_elsewhere_reported(tmp_path: Path) -> None:
    write_log(tmp_path, 80, partitions=1, segment_bytes=1 << 20)
    active = segment_files(tmp_path, 0)[-1]
    data = bytearray(active.read_bytes())
    data[-1] ^= 0xFF  # the last batch: a write that did not finish
    active.write_bytes(bytes(data))
    directory = LogDirectory.open(tmp_path)
    last_batch_base = 75  # 5 records per append
    assert directory.next_offset(0) == last_batch_base
    assert len(read_rows(tmp_path, 0, 0, last_batch_base)) == last_batch_base
    data[-1] ^= 0xFF
    data[100] ^= 0xFF  # inside the first batches: bit rot, never a torn write
    active.write_bytes(bytes(data))
    with pytest.raises(CorruptLog, match=rf"{active.name}: corrupt record batch at byte \d+"):
        read_rows(tmp_path, 0, 0, 80)


def test_a_cut_short_sealed_segment_is_corruption(tmp_path: Path) -> None:
    write_log(tmp_path, 100, partitions=1)
    sealed = segment_files(tmp_path, 0)[0]
    os.truncate(sealed, sealed.stat().st_size - 3)
    with pytest.raises(CorruptLog, match=sealed.name):
        read_rows(tmp_path, 0, 0, 100)


def test_damaged_indexes_are_only_hints(tmp_path: Path) -> None:
    write_log(tmp_path, 150, partitions=1, segment_bytes=1 << 20)
    log_file = segment_files(tmp_path, 0)[0]
    index = log_file.with_suffix(".index")
    timeindex = log_file.with_suffix(".timeindex")
    assert index.stat().st_size >= 16
    index.write_bytes(bytes(range(40)))  # entries pointing at nonsense positions
    timeindex.write_bytes(b"\x01" * 25)  # not a whole number of entries
    rows = read_rows(tmp_path, 0, 101, 150)
    assert [r["offset"] for r in rows] == list(range(101, 150))
    assert LogDirectory.open(tmp_path).offset_for_timestamp(0, T0 + 1234) == 124
    index.unlink()
    timeindex.unlink()
    assert [r["offset"] for r in read_rows(tmp_path, 0, 140, 150)] == list(range(140, 150))


def test_segment_deleted_after_planning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_log(tmp_path, 200, partitions=1)
    directory = LogDirectory.open(tmp_path)
    strict = parse_options({"path": str(tmp_path)}, streaming=False)
    lenient = parse_options({"path": str(tmp_path), "failOnDataLoss": "false"}, streaming=False)
    splits = plan_splits(directory, OffsetRange(0, 0, 200), True)
    segment_files(tmp_path, 0)[0].unlink()  # what retention does first
    with pytest.raises(DataLossError, match=rf"partition 0: offsets 0\.\.{splits[0].end - 1} "):
        list(read_split(splits[0], strict))
    with caplog.at_level(logging.WARNING, logger="meshmq.pipeline"):
        assert list(read_split(splits[0], lenient)) == []
    assert f"skipping offsets 0..{splits[0].end - 1}" in caplog.text
    assert sum(b.num_rows for b in read_split(splits[1], strict)) == splits[1].end - splits[1].start


def test_reading_never_writes_and_ignores_the_brokers_lock(tmp_path: Path) -> None:
    write_log(tmp_path, 50, partitions=2)
    orphan = tmp_path / "log" / "0" / ("9" * 20 + ".index")  # left by an interrupted deletion
    orphan.write_bytes(b"")
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in tmp_path.rglob("*")
              if p.is_file()}
    with CommitLog(tmp_path, LogConfig(partitions=2)):  # the broker holds the flock
        after_open = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in tmp_path.rglob("*")
                      if p.is_file()}
        rows = read_rows(tmp_path, 0, 0, LogDirectory.open(tmp_path).next_offset(0))
        assert rows
        assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in tmp_path.rglob("*")
                if p.is_file()} == after_open
    assert orphan in before


def test_not_a_log_gets_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(LogNotFound, match=f"no meshmq commit log at {tmp_path}"):
        LogDirectory.open(tmp_path)
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "meta.json").write_text(
        '{"format": "meshmq-log", "format_version": 2, "partitions": 4}')
    with pytest.raises(CorruptLog, match="unsupported log format 'meshmq-log' version 2"):
        LogDirectory.open(tmp_path)


# -- Hypothesis: however the active segment is cut, the reader sees exactly the whole batches --


class Pristine:
    """A one-segment log of 20 batches: its data_dir, its .log bytes, each batch's end."""

    def __init__(self, data_dir: Path) -> None:
        write_log(data_dir, 100, partitions=1, per_append=5, segment_bytes=1 << 20)
        self.data_dir = data_dir
        self.data = segment_files(data_dir, 0)[0].read_bytes()
        self.ends: list[int] = []
        position = 0
        while position < len(self.data):
            position += int.from_bytes(self.data[position + 1 : position + 5], "big")
            self.ends.append(position)

    def __repr__(self) -> str:
        return f"Pristine({self.data_dir}, {len(self.data)} bytes)"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Pristine:
    return Pristine(tmp_path_factory.mktemp("pristine"))


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_any_truncation_of_the_active_segment_reads_the_whole_batches(
        pristine: Pristine, data: st.DataObject) -> None:
    source, original, ends = pristine.data_dir, pristine.data, pristine.ends
    work = source.parent / "truncated"
    if not work.exists():
        shutil.copytree(source, work)
    cut = data.draw(st.integers(0, len(original)))
    segment_files(work, 0)[0].write_bytes(original[:cut])
    whole = sum(1 for end in ends if end <= cut) * 5  # 5 records per batch
    directory = LogDirectory.open(work)
    assert directory.next_offset(0) == whole
    assert [r["offset"] for r in read_rows(work, 0, 0, whole)] == list(range(whole))


def test_the_source_does_not_import_the_broker_runtime() -> None:
    code = ("import sys, meshmq.pipeline.source, meshmq.pipeline.stream, meshmq.pipeline.reader;"
            " print(sorted(m for m in sys.modules if m == 'asyncio' or m.startswith("
            "'meshmq.broker')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=60)
    assert result.stdout.strip() == "[]"


# -- the stream reader's planning, called as Spark calls it (no Spark needed) ------------------


def stream_reader(data_dir: Path, **options: str) -> MeshmqStreamReader:
    return MeshmqStreamReader(parse_options({"path": str(data_dir), **options}, streaming=True))


def test_stream_positions_and_available_now_pinning(tmp_path: Path) -> None:
    write_log(tmp_path, 100, partitions=2)
    latest = {str(p): LogDirectory.open(tmp_path).next_offset(p) for p in range(2)}
    assert stream_reader(tmp_path).initialOffset() == latest  # Kafka's default: latest
    reader = stream_reader(tmp_path, startingOffsets="earliest", maxRecordsPerTrigger="30")
    start = reader.initialOffset()
    assert start == {"0": 0, "1": 0}
    reader.prepareForTriggerAvailableNow()
    with CommitLog(tmp_path, LogConfig(partitions=2)) as log:  # arrives after the pin
        log.append_many([make_record(i) for i in range(100, 140)])
    ends = []
    while (end := reader.latestOffset(start, reader.getDefaultReadLimit())) != start:
        assert sum(end[p] - start[p] for p in end) <= 30
        ends.append(end)
        start = end
    assert ends[-1] == latest and len(ends) == 4  # 100 offsets, 30 at a time, then stopped
    assert stream_reader(tmp_path).latestOffset(start, ReadAllAvailable()) != latest


def test_stream_over_a_truncated_log_is_data_loss(tmp_path: Path) -> None:
    write_log(tmp_path, 60, partitions=1)
    position = {"0": 60}
    with CommitLog(tmp_path, LogConfig(partitions=1)) as log:
        log.partition(0).truncate_to(45)
    with pytest.raises(DataLossError, match=r"partition 0: offsets 45\.\.59 .* truncated"):
        stream_reader(tmp_path).latestOffset(position, ReadAllAvailable())
    lenient = stream_reader(tmp_path, failOnDataLoss="false")
    end = lenient.latestOffset(position, ReadMaxRows(10))
    assert end == {"0": 45}
    assert lenient.partitions(position, end) == []


def test_stream_batch_whose_start_was_deleted_by_retention(tmp_path: Path) -> None:
    write_log(tmp_path, 200, partitions=1, segment_bytes=1200)
    with CommitLog(tmp_path, LogConfig(partitions=1, segment_bytes=1200,
                                       retention_bytes=3000)) as log:
        log.enforce_retention()
        earliest, latest = log.earliest_offset(0), log.next_offset(0)
    start, end = {"0": 10}, {"0": latest}
    with pytest.raises(DataLossError, match=rf"offsets 10\.\.{earliest - 1} are no longer"):
        stream_reader(tmp_path).partitions(start, end)
    splits = stream_reader(tmp_path, failOnDataLoss="false").partitions(start, end)
    assert splits[0].start == earliest and splits[-1].end == latest
    with pytest.raises(Exception, match="another log"):
        stream_reader(tmp_path).partitions({"0": 1, "1": 2}, {"0": 3, "1": 4})
