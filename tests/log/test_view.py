"""LogView: every read answered as CommitLog answers it, while the CommitLog keeps writing."""

from __future__ import annotations

import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from meshmq.log.commit_log import CommitLog
from meshmq.log.config import UNLIMITED, LogConfig
from meshmq.log.errors import CorruptSegment, OffsetOutOfRange
from meshmq.log.files import segment_file_name
from meshmq.log.partition import DEFAULT_READ_BYTES
from meshmq.log.reader import LogDirectoryError
from meshmq.log.record import Record, encode_batch
from meshmq.log.view import LogView

T0 = 1_700_000_000_000
NOW = T0 + 3_600_000  # appends and retention run at this fake time: no age-based rolls
RECORD_LIMITS = (None, 1, 3, 7, 512)
BYTE_LIMITS = (0, 1, 150, 1_000, 4_096, DEFAULT_READ_BYTES)
TOPICS = ("a", "b/c", "d/e/f", "sensors/42/temperature", "g")


def no_fsync(fd: int) -> None:
    """fsync is not what these tests observe; skipping it keeps them fast."""


def open_log(directory: Path, **settings: int) -> CommitLog:
    config = LogConfig(**{"partitions": 1, "index_interval_bytes": 200, **settings})
    return CommitLog(directory, config, fsync=no_fsync, now_ms=NOW)


def batch(start: int, count: int, payload: int = 20, ts: int = T0) -> list[Record]:
    """``count`` records whose payload starts with their intended offset."""
    return [Record.new("sensors/a", f"{start + i:08d}".encode() + bytes(payload), ts + start + i,
                       qos=(start + i) % 3, client_id=f"c{i}") for i in range(count)]


def fill(log: CommitLog, batches: int, per_batch: int, payload: int = 20,
         partition: int = 0) -> None:
    for _ in range(batches):
        start = log.next_offset(partition)
        log.append_to(partition, batch(start, per_batch, payload), NOW)


Outcome = list[Record] | tuple[str, int, int, int]


def outcome(read: Callable[[], list[Record]]) -> Outcome:
    """The records a read returns, or the OffsetOutOfRange it raises, to compare two readers."""
    try:
        return read()
    except OffsetOutOfRange as exc:
        return ("out of range", exc.offset, exc.earliest_offset, exc.next_offset)


def assert_same_read(log: CommitLog, view: LogView, partition: int, offset: int,
                     max_records: int | None = None,
                     max_bytes: int = DEFAULT_READ_BYTES) -> Outcome:
    expected = outcome(lambda: log.read(partition, offset, max_records, max_bytes=max_bytes))
    got = outcome(lambda: view.read(partition, offset, max_records, max_bytes=max_bytes))
    assert got == expected, (partition, offset, max_records, max_bytes)
    return got


def assert_every_read_matches(log: CommitLog, view: LogView, partition: int = 0) -> None:
    """Every offset with every limit, in an order that mixes cache hits and seeks."""
    for offset in range(log.earliest_offset(partition), log.next_offset(partition) + 1):
        for max_records in RECORD_LIMITS:
            for max_bytes in BYTE_LIMITS:
                assert_same_read(log, view, partition, offset, max_records, max_bytes)


def read_in_chunks(view: LogView, partition: int, offset: int,
                   chunk: int = 512) -> Iterator[list[Record]]:
    """The catch-up's access pattern: each chunk starts where the last one ended."""
    while records := view.read(partition, offset, max_records=chunk):
        yield records
        offset = records[-1].offset + 1


def last_segment_file(data_dir: Path, log: CommitLog, partition: int = 0) -> Path:
    base = log.partition(partition).segment_base_offsets()[-1]
    return data_dir / "log" / str(partition) / segment_file_name(base, ".log")


# -- reads ----------------------------------------------------------------------------------


def test_partition_count_comes_from_meta_json(tmp_path: Path) -> None:
    with pytest.raises(LogDirectoryError):
        LogView(tmp_path)
    with open_log(tmp_path, partitions=3), LogView(tmp_path) as view:
        assert view.partition_count == 3
        assert view.read(2, 0) == []
        assert (view.earliest_offset(2), view.next_offset(2)) == (0, 0)


def test_many_single_record_batches(tmp_path: Path) -> None:
    with open_log(tmp_path) as log, LogView(tmp_path) as view:
        fill(log, 80, per_batch=1)
        assert_every_read_matches(log, view)
        assert view.next_offset(0) == log.next_offset(0) == 80


def test_reads_starting_inside_a_batch(tmp_path: Path) -> None:
    with open_log(tmp_path) as log, LogView(tmp_path) as view:
        fill(log, 12, per_batch=10)
        for offset in range(120):
            records = view.read(0, offset, max_records=4)
            assert [r.offset for r in records] == list(range(offset, min(offset + 4, 120)))
        assert_every_read_matches(log, view)


def test_max_bytes_smaller_than_one_batch_still_returns_that_batch(tmp_path: Path) -> None:
    with open_log(tmp_path) as log, LogView(tmp_path) as view:
        fill(log, 3, per_batch=5, payload=500)
        assert [r.offset for r in view.read(0, 2, max_bytes=1)] == [2, 3, 4]
        assert view.read(0, 2, max_bytes=0) == view.read(0, 2, max_records=0) == []
        assert_every_read_matches(log, view)


def test_max_bytes_equal_to_whole_batches_takes_them_all(tmp_path: Path) -> None:
    with open_log(tmp_path, segment_bytes=2_000) as log, LogView(tmp_path) as view:
        fill(log, 30, per_batch=2)  # equal batches, several per segment
        batch_bytes = len(encode_batch(batch(0, 2), base_offset=0))
        for batches in range(1, 12):
            for max_bytes in (batches * batch_bytes - 1, batches * batch_bytes):
                assert_same_read(log, view, 0, 0, max_bytes=max_bytes)
                assert_same_read(log, view, 0, 5, max_bytes=max_bytes)
        assert len(view.read(0, 0, max_bytes=11 * batch_bytes)) == 22


def test_reads_across_segment_rolls(tmp_path: Path) -> None:
    with open_log(tmp_path, segment_bytes=1_500) as log, LogView(tmp_path) as view:
        fill(log, 40, per_batch=4)
        assert len(log.partition(0).segment_base_offsets()) > 8
        assert_every_read_matches(log, view)
        chunks = list(read_in_chunks(view, 0, 0, chunk=7))
        assert [r for chunk in chunks for r in chunk] == log.read(0, 0, max_bytes=1 << 30)


def test_sequential_chunks_follow_appends(tmp_path: Path) -> None:
    with open_log(tmp_path, segment_bytes=4_000) as log, LogView(tmp_path) as view:
        offset, seen = 0, []
        for round_ in range(30):
            fill(log, round_ % 4, per_batch=9)
            for records in read_in_chunks(view, 0, offset, chunk=10):
                seen += records
                offset = records[-1].offset + 1
            assert offset == log.next_offset(0)
        assert seen == log.read(0, 0, max_bytes=1 << 30)


def test_timestamps_match_commit_log(tmp_path: Path) -> None:
    with open_log(tmp_path, segment_bytes=2_000) as log, LogView(tmp_path) as view:
        for i in range(80):  # timestamps go back and forth inside each batch
            start = log.next_offset(0)
            records = batch(start, 3)
            for j, record in enumerate(records):
                record.timestamp_ms = T0 + 10 * i + (7, -4, 2)[j]
            log.append_to(0, records, NOW)
        for timestamp in range(T0 - 20, T0 + 830, 3):
            assert view.offset_for_timestamp(0, timestamp) == log.offset_for_timestamp(
                0, timestamp), timestamp
        assert view.offset_for_timestamp(0, T0 + 10_000) is None


# -- files changing underneath ---------------------------------------------------------------


def test_retention_makes_old_offsets_out_of_range(tmp_path: Path) -> None:
    with open_log(tmp_path, segment_bytes=1_500, retention_bytes=4_000) as log, \
            LogView(tmp_path) as view:
        fill(log, 40, per_batch=4)
        assert len(view.read(0, 0, max_records=5)) == 5  # the view now has segment 0 open
        assert log.enforce_retention(NOW) > 0
        earliest = log.earliest_offset(0)
        assert view.earliest_offset(0) == earliest > 5
        with pytest.raises(OffsetOutOfRange) as raised:
            view.read(0, 5, max_records=5)  # continues the cached read: the file is gone
        assert (raised.value.earliest_offset, raised.value.next_offset) == (
            earliest, log.next_offset(0))
        assert_same_read(log, view, 0, earliest - 1)
        assert_every_read_matches(log, view)


def test_a_read_moves_past_a_segment_deleted_under_it(tmp_path: Path) -> None:
    with open_log(tmp_path, segment_bytes=1_500) as log, LogView(tmp_path) as view:
        fill(log, 20, per_batch=4)
        second = log.partition(0).segment_base_offsets()[1]
        assert view.read(0, second - 1, max_records=1)  # cached: the end of segment 0
        for suffix in (".log", ".index", ".timeindex"):  # as retention deletes, oldest first
            (tmp_path / "log" / "0" / segment_file_name(0, suffix)).unlink()
        assert view.read(0, second, max_records=512) == log.read(0, second, max_records=512)
        assert view.earliest_offset(0) == second
        with pytest.raises(OffsetOutOfRange) as raised:
            view.read(0, second - 1)
        assert (raised.value.earliest_offset, raised.value.next_offset) == (second, 80)


def test_torn_tail_is_not_returned_nor_reported(tmp_path: Path) -> None:
    with open_log(tmp_path) as log, LogView(tmp_path) as view:
        fill(log, 10, per_batch=3)
        log.flush()
        torn = encode_batch(batch(30, 3), base_offset=30)
        with open(last_segment_file(tmp_path, log), "ab") as file:
            file.write(torn[: len(torn) // 2])  # half a batch: being written, or a crash
        assert view.read(0, 0) == log.read(0, 0)
        assert view.read(0, 30) == []
        assert view.next_offset(0) == 30
        fill(log, 1, per_batch=3)  # the owner writes the batch over the torn bytes
        assert view.read(0, 30) == log.read(0, 30)
        assert view.next_offset(0) == 33


def test_batch_failing_its_checksum_at_the_end_is_a_write_in_progress(tmp_path: Path) -> None:
    with open_log(tmp_path) as log, LogView(tmp_path) as view:
        fill(log, 5, per_batch=3)
        partial = bytearray(encode_batch(batch(15, 3), base_offset=15))
        partial[-5:] = b"\xff" * 5  # the last bytes not written yet (page cache garbage)
        with open(last_segment_file(tmp_path, log), "ab") as file:
            file.write(partial)
        assert view.read(0, 0) == log.read(0, 0)
        assert view.read(0, 15) == []
        assert view.next_offset(0) == 15


def test_corruption_in_a_sealed_segment_is_reported(tmp_path: Path) -> None:
    with open_log(tmp_path, segment_bytes=1_500) as log, LogView(tmp_path) as view:
        fill(log, 20, per_batch=4)
        path = tmp_path / "log" / "0" / segment_file_name(0, ".log")
        data = bytearray(path.read_bytes())
        data[60] ^= 0xFF  # inside the first record of the first batch
        path.write_bytes(data)
        with pytest.raises(CorruptSegment):
            log.read(0, 0)
        with pytest.raises(CorruptSegment) as raised:
            view.read(0, 0)
        assert (raised.value.path, raised.value.position) == (path, 0)


def test_a_new_segment_appearing_after_the_view_cached_the_old_one(tmp_path: Path) -> None:
    with open_log(tmp_path) as log, LogView(tmp_path) as view:
        fill(log, 5, per_batch=3)
        assert len(view.read(0, 0)) == 15
        assert view.read(0, 15) == []  # cached: the end of the active segment
        fill(log, 1, per_batch=3)  # appended to the old segment before the roll
        log.partition(0).roll(NOW)
        fill(log, 2, per_batch=3)
        assert log.partition(0).segment_base_offsets() == [0, 18]
        assert view.read(0, 15) == log.read(0, 15)
        assert [r.offset for r in view.read(0, 15)] == list(range(15, 24))
        assert view.next_offset(0) == 24


def test_the_view_does_not_lock_the_log(tmp_path: Path) -> None:
    open_log(tmp_path).close()
    with LogView(tmp_path) as view, open_log(tmp_path) as log:
        fill(log, 2, per_batch=2)
        assert view.read(0, 0) == log.read(0, 0)


# -- properties ------------------------------------------------------------------------------


OPERATIONS = ("append", "append", "append", "read", "read", "continue", "continue",
              "timestamp", "flush", "roll", "retention", "retention")


@settings(max_examples=60)
@given(data=st.data())
def test_random_appends_and_reads_match_commit_log(data: st.DataObject) -> None:
    segment_bytes = data.draw(st.sampled_from([400, 1_500, 8_000]), label="segment_bytes")
    retention = data.draw(st.sampled_from([UNLIMITED, 1_000, 1_000]), label="retention_bytes")
    index_interval = data.draw(st.sampled_from([0, 100, 4_096]), label="index_interval")
    with tempfile.TemporaryDirectory() as directory, \
            open_log(Path(directory), partitions=2, segment_bytes=segment_bytes,
                     retention_bytes=retention, index_interval_bytes=index_interval) as log, \
            LogView(directory) as view:
        _run_operations(data, log, view)


def _run_operations(data: st.DataObject, log: CommitLog, view: LogView) -> None:
    now, resume = T0, [0, 0]
    for partition in (0, 1):  # something for retention to delete from the start
        fill(log, data.draw(st.integers(0, 15)), data.draw(st.integers(1, 5)), 40, partition)
    for _ in range(data.draw(st.integers(1, 40), label="operations")):
        operation = data.draw(st.sampled_from(OPERATIONS))
        partition = data.draw(st.integers(0, 1))
        if operation == "append":
            now += data.draw(st.integers(0, 50))
            log.append_many(data.draw(st.lists(_records(now), min_size=1, max_size=8)), NOW)
        elif operation in ("read", "continue"):
            if operation == "read":
                resume[partition] = data.draw(st.integers(0, log.next_offset(partition)))
            max_records = data.draw(st.sampled_from(RECORD_LIMITS))
            max_bytes = data.draw(st.sampled_from(BYTE_LIMITS[1:]))
            got = assert_same_read(log, view, partition, resume[partition], max_records,
                                   max_bytes)
            event(f"{operation}: {'out of range' if isinstance(got, tuple) else len(got) > 0}")
            if isinstance(got, list) and got:
                resume[partition] = got[-1].offset + 1
        elif operation == "timestamp":
            timestamp = data.draw(st.integers(T0 - 10, now + 10))
            assert view.offset_for_timestamp(partition, timestamp) == log.offset_for_timestamp(
                partition, timestamp)
        elif operation == "flush":
            log.flush()
        elif operation == "roll":
            log.partition(partition).roll(NOW)
        else:
            log.enforce_retention(NOW)
        assert view.earliest_offset(partition) == log.earliest_offset(partition)
        assert view.next_offset(partition) == log.next_offset(partition)


def _records(now: int) -> st.SearchStrategy[Record]:
    return st.builds(
        lambda topic, size, jitter: Record.new(topic, bytes(size), now + jitter, client_id="c"),
        st.sampled_from(TOPICS), st.integers(0, 300), st.integers(-5, 5))


def test_follows_a_writer_thread(tmp_path: Path) -> None:
    """Reads race real appends, rolls and retention: every record comes back whole, in order,
    and a gap only ever follows an OffsetOutOfRange."""
    with open_log(tmp_path, segment_bytes=8_000, retention_bytes=16_000) as log, \
            LogView(tmp_path) as view:
        done = threading.Event()
        writer = threading.Thread(target=_write_for_a_while, args=(log, done))
        writer.start()
        offset, read = 0, 0
        try:
            while not (done.is_set() and offset == log.next_offset(0)):
                try:
                    records = view.read(0, offset, 20)
                except OffsetOutOfRange as exc:
                    assert exc.earliest_offset > offset
                    offset = exc.earliest_offset
                    continue
                assert [r.offset for r in records] == list(range(offset, offset + len(records)))
                assert all(int(r.payload[:8]) == r.offset for r in records)
                offset += len(records)
                read += len(records)
        finally:
            writer.join()
        assert read > 0 and log.statistics().partitions[0].segments > 1


def _write_for_a_while(log: CommitLog, done: threading.Event) -> None:
    rng = random.Random(7)
    try:
        for _ in range(1_500):
            fill(log, 1, per_batch=rng.randint(1, 20), payload=rng.randint(0, 200))
            if rng.random() < 0.05:
                log.enforce_retention(NOW)
    finally:
        done.set()


# -- throughput ------------------------------------------------------------------------------


def test_sequential_read_throughput(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Prints the rate of the catch-up's pattern (not asserted: the machine is shared)."""
    total, per_batch = 200_000, 100
    with open_log(tmp_path, segment_bytes=8 * 1024 * 1024,
                  index_interval_bytes=4096) as log, LogView(tmp_path) as view:
        for start in range(0, total, per_batch):
            log.append_to(0, batch(start, per_batch, payload=60), NOW)
        rates: dict[str, float] = {}
        for name, read in 2 * (("LogView", view.read), ("CommitLog", log.read)):
            started, count, offset = time.perf_counter(), 0, 0
            while records := read(0, offset, 512):
                count += len(records)
                offset = records[-1].offset + 1
            rate = count / (time.perf_counter() - started)
            rates[name] = max(rates.get(name, 0.0), rate)  # the best of two: a shared machine
            assert count == total
        segments = len(log.partition(0).segment_base_offsets())
    with capsys.disabled():
        print(f"\n{total} records ({segments} segments) in 512-record chunks: "
              + ", ".join(f"{name} {rate:,.0f} records/s" for name, rate in rates.items()))
