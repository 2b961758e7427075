"""LogWriter: group commit on a thread, fsync policies, callbacks, and a kill -9 test."""

from __future__ import annotations

import asyncio
import collections
import errno
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

from meshmq.log.commit_log import CommitLog
from meshmq.log.config import LogConfig
from meshmq.log.errors import LogClosed, LogError
from meshmq.log.record import Record
from meshmq.log.writer import AppendBatch, AppendResult, FsyncPolicy, LogWriter

SRC = Path(__file__).resolve().parents[2] / "src"
T0 = 1_700_000_000_000
WAIT = 10.0


class Callbacks:
    """Collects ``done`` outcomes, keyed by a request label, from the writer thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: dict[object, list[AppendResult | BaseException]] = defaultdict(list)
        self.threads: set[str] = set()
        self.count = 0
        self.all_done = threading.Event()
        self.expected = -1

    def for_label(self, label: object):
        def done(outcome: AppendResult | BaseException) -> None:
            with self.lock:
                self.outcomes[label].append(outcome)
                self.threads.add(threading.current_thread().name)
                self.count += 1
                if self.count == self.expected:
                    self.all_done.set()
        return done



def size_recording_fsync(synced: dict[int, int]) -> Callable[[int], None]:
    """``os.fsync``, noting in ``synced`` each file's size (by inode) when it was fsynced."""
    def fsync(fd: int) -> None:
        status = os.fstat(fd)
        os.fsync(fd)
        synced[status.st_ino] = status.st_size

    return fsync


def flaky_fsync(failing: threading.Event) -> Callable[[int], None]:
    """``os.fsync``, failing with EIO once ``failing`` is set."""
    def fsync(fd: int) -> None:
        if failing.is_set():
            raise OSError(errno.EIO, "I/O error")
        os.fsync(fd)

    return fsync

def record(label: str, i: int) -> Record:
    return Record.new(f"devices/{i % 7}/t", f"{label}:{i}".encode(), T0 + i)


def test_many_threads_every_callback_once_dense_ordered_offsets(tmp_path: Path) -> None:
    log = CommitLog(tmp_path, LogConfig(partitions=3, segment_bytes=20_000))
    writer = LogWriter(log, fsync_policy="interval", fsync_interval_ms=5, queue_size=64)
    callbacks = Callbacks()
    callbacks.expected = 4 * 500

    def produce(label: str) -> None:
        for i in range(500):
            writer.submit(record(label, i), callbacks.for_label((label, i)))

    threads = [threading.Thread(target=produce, args=(f"p{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert callbacks.all_done.wait(WAIT)
    writer.close()
    assert callbacks.threads == {"meshmq-log-writer"}
    assert all(len(v) == 1 and isinstance(v[0], AppendResult)
               for v in callbacks.outcomes.values())
    by_partition: dict[int, list[tuple[int, str, int]]] = defaultdict(list)
    for (label, i), [result] in callbacks.outcomes.items():
        by_partition[result.partition].append((result.offset, label, i))
    for partition, entries in by_partition.items():
        entries.sort()
        assert [offset for offset, _, _ in entries] == list(range(len(entries)))
        for label in {label for _, label, _ in entries}:
            sequence = [i for _, lab, i in entries if lab == label]
            assert sequence == sorted(sequence)  # each producer's order is kept
        stored = log.read(partition, 0, max_bytes=10**8)
        assert [r.payload for r in stored] == [f"{lab}:{i}".encode() for _, lab, i in entries]
    log.close()


def test_always_completes_only_after_the_partition_was_fsynced(tmp_path: Path) -> None:
    synced: dict[int, int] = {}  # inode -> file size when it was fsynced
    # Groups of at most 50 records: at least 40 batches whatever the machine's load (a loaded
    # machine would otherwise group all 2,000 into one or two batches, and a batch never
    # splits across segments), so 8 KB segments roll several times.
    log = CommitLog(tmp_path, LogConfig(partitions=4, segment_bytes=8_000),
                    fsync=size_recording_fsync(synced))
    violations: list[str] = []

    def check(outcome: AppendResult | BaseException) -> None:
        assert isinstance(outcome, AppendResult)
        path = log.partition(outcome.partition).active_segment.log_path
        now = os.stat(path)
        if synced.get(now.st_ino) != now.st_size:
            violations.append(f"{outcome}: {now.st_size} bytes, fsynced {synced.get(now.st_ino)}")

    with LogWriter(log, fsync_policy="always", max_group_records=50) as writer:
        for i in range(2_000):
            writer.submit(record("a", i), check)
    assert violations == []
    assert log.statistics().records == 2_000
    assert sum(s.segments for s in log.statistics().partitions) > 4  # rolls were exercised
    log.close()


def test_interval_completes_on_write_and_fsyncs_later(tmp_path: Path) -> None:
    fsynced = threading.Event()

    def hook(fd: int) -> None:
        os.fsync(fd)
        fsynced.set()

    log = CommitLog(tmp_path, LogConfig(partitions=1), fsync=hook)
    fsynced.clear()  # forget the fsyncs of opening the log
    callbacks = Callbacks()
    callbacks.expected = 1
    with LogWriter(log, fsync_policy="interval", fsync_interval_ms=50) as writer:
        writer.submit(record("a", 0), callbacks.for_label(0))
        assert callbacks.all_done.wait(WAIT)
        assert fsynced.wait(WAIT)  # the idle writer fsyncs once the interval has passed
    log.close()


@pytest.mark.parametrize("policy", ["interval", "never"])
def test_no_fsync_before_completion_without_always(tmp_path: Path, policy: str) -> None:
    calls: list[int] = []
    log = CommitLog(tmp_path, LogConfig(partitions=2),
                    fsync=lambda fd: calls.append(fd) or os.fsync(fd))
    calls.clear()
    callbacks = Callbacks()
    callbacks.expected = 200
    writer = LogWriter(log, fsync_policy=policy, fsync_interval_ms=600_000)
    for i in range(200):
        writer.submit(record("a", i), callbacks.for_label(i))
    assert callbacks.all_done.wait(WAIT)
    assert calls == []
    writer.close()  # drains, then fsyncs everything once
    assert len(calls) == 2
    log.close()


def test_close_drains_the_queue_and_later_submits_fail(tmp_path: Path) -> None:
    log = CommitLog(tmp_path, LogConfig(partitions=2))
    callbacks = Callbacks()
    writer = LogWriter(log, fsync_policy="never", queue_size=10)
    for i in range(300):
        writer.submit(record("a", i), callbacks.for_label(i))
    writer.close()
    assert callbacks.count == 300
    with pytest.raises(LogClosed):
        writer.submit(record("a", 0), callbacks.for_label("late"))
    writer.close()  # idempotent
    log.close()


def busy_writer(tmp_path: Path, queue_size: int
                ) -> tuple[CommitLog, LogWriter, threading.Event]:
    """A writer stuck in the callback of record ("a", 0) until the returned event is set, so
    that its queue fills."""
    log = CommitLog(tmp_path, LogConfig(partitions=1))
    entered, release = threading.Event(), threading.Event()

    def blocking(outcome: AppendResult | BaseException) -> None:
        entered.set()
        release.wait(WAIT)

    writer = LogWriter(log, queue_size=queue_size, fsync_policy="never")
    writer.submit(record("a", 0), blocking)
    assert entered.wait(WAIT)
    return log, writer, release


def test_submit_nowait_raises_when_full(tmp_path: Path) -> None:
    log, writer, release = busy_writer(tmp_path, 2)
    callbacks = Callbacks()
    writer.submit_nowait(record("a", 1), callbacks.for_label(1))
    writer.submit_nowait(record("a", 2), callbacks.for_label(2))
    with pytest.raises(queue.Full):
        writer.submit_nowait(record("a", 3), callbacks.for_label(3))
    with pytest.raises(queue.Full):
        writer.submit(record("a", 3), callbacks.for_label(3), timeout=0.01)
    release.set()
    writer.close()
    assert callbacks.count == 2
    log.close()


def test_submit_many_queues_what_fits_in_order_and_says_how_many(tmp_path: Path) -> None:
    log, writer, release = busy_writer(tmp_path, 3)  # the writer is busy: the queue fills
    callbacks = Callbacks()
    batch = [(record("b", i), callbacks.for_label(i), None) for i in range(5)]
    assert writer.submit_many_nowait(batch) == 3  # the room there was, the first three
    assert writer.submit_many_nowait(batch[3:]) == 0
    release.set()
    callbacks.expected = 3
    assert callbacks.all_done.wait(WAIT)
    assert sorted(callbacks.outcomes) == [0, 1, 2]
    offsets = [callbacks.outcomes[i][0].offset for i in range(3)]  # type: ignore[union-attr]
    assert offsets == sorted(offsets) and offsets[0] == 1  # after the blocking one, in order
    assert writer.submit_many_nowait(batch[3:]) == 2  # room again
    writer.close()
    assert callbacks.count == 5
    assert [r.payload for r in log.read(0, 0, max_records=10)] == [
        b"a:0", b"b:0", b"b:1", b"b:2", b"b:3", b"b:4"]
    with pytest.raises(LogClosed):
        writer.submit_many_nowait(batch)
    log.close()


def test_fsync_failure_fails_the_group_and_everything_after(tmp_path: Path) -> None:
    failing = threading.Event()
    log = CommitLog(tmp_path, LogConfig(partitions=1), fsync=flaky_fsync(failing))
    callbacks = Callbacks()
    callbacks.expected = 1
    writer = LogWriter(log, fsync_policy="always")
    failing.set()
    writer.submit(record("a", 0), callbacks.for_label(0))
    assert callbacks.all_done.wait(WAIT)
    failing.clear()  # the disk "recovers", but the writer must not trust it again
    callbacks.expected = 2
    callbacks.all_done.clear()
    writer.submit(record("a", 1), callbacks.for_label(1))
    assert callbacks.all_done.wait(WAIT)
    assert all(isinstance(v[0], LogError) for v in callbacks.outcomes.values())
    assert writer.statistics().failed
    writer.close()
    log.close()


def test_a_raising_callback_does_not_stop_the_writer(tmp_path: Path) -> None:
    log = CommitLog(tmp_path, LogConfig(partitions=1))
    callbacks = Callbacks()
    callbacks.expected = 2

    def bad(outcome: AppendResult | BaseException) -> None:
        raise RuntimeError("callback bug")

    with LogWriter(log, fsync_policy="never") as writer:
        writer.submit(record("a", 0), bad)
        for i in (1, 2):
            writer.submit(record("a", i), callbacks.for_label(i))
        assert callbacks.all_done.wait(WAIT)

        def chain(outcome: AppendResult | BaseException) -> None:  # submits from the writer
            writer.submit(record("a", 4), callbacks.for_label(4))

        callbacks.expected = 3
        callbacks.all_done.clear()
        writer.submit(record("a", 3), chain)
        assert callbacks.all_done.wait(WAIT)
    assert log.next_offset(0) == 5
    log.close()


CHILD = """
import sys
from meshmq.log import CommitLog, LogConfig, LogWriter, Record

log = CommitLog(sys.argv[1], LogConfig(partitions=3, segment_bytes=20_000))
writer = LogWriter(log, fsync_policy="always", queue_size=100)

def done_for(i):
    def done(result):
        if isinstance(result, BaseException):
            print("ERR", result, flush=True)
        else:
            print(result.partition, result.offset, i, flush=True)
    return done

i = 0
while True:
    writer.submit(Record.new(f"dev/{i % 5}", b"payload-%d" % i + bytes(i % 300), 1000 + i),
                  done_for(i))
    i += 1
"""


def test_kill_9_loses_no_acknowledged_record(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path / "data")], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    acked: list[tuple[int, int, int]] = []
    deadline = time.monotonic() + 30
    try:
        assert child.stdout is not None
        while len(acked) < 1_500 and time.monotonic() < deadline:
            line = child.stdout.readline().decode()
            assert line, child.stderr.read().decode()  # EOF: the child died on its own
            assert not line.startswith("ERR"), line
            acked.append(tuple(map(int, line.split())))  # type: ignore[arg-type]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(WAIT)
    # Lines printed before the kill are still in the pipe (or in stdout's read buffer: read
    # through the same file object, not communicate()). A cut-off last line is dropped.
    rest = child.stdout.read().decode()
    child.stdout.close()
    child.stderr.close()
    acked += [tuple(map(int, line.split())) for line in rest.split("\n")[:-1]]
    assert len(acked) >= 1_500
    assert all(len(a) == 3 for a in acked)
    with CommitLog(tmp_path / "data", LogConfig(partitions=3, segment_bytes=20_000)) as log:
        assert not any(log.partition(p).recovery.clean_shutdown for p in range(3))
        for partition, offset, i in acked:
            [stored] = log.read(partition, offset, 1)
            assert stored.payload == b"payload-%d" % i + bytes(i % 300)


def test_event_loop_integration_with_one_wakeup_per_group(tmp_path: Path) -> None:
    """The pattern the broker is expected to use: callbacks queue completions, and the loop
    is woken once per group by ``on_group_done``."""
    log = CommitLog(tmp_path, LogConfig(partitions=2))
    completed: collections.deque[tuple[asyncio.Future, object]] = collections.deque()
    wakeups = [0]

    async def main() -> list[object]:
        loop = asyncio.get_running_loop()

        def drain() -> None:
            while completed:
                future, outcome = completed.popleft()
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

        def group_done() -> None:
            wakeups[0] += 1
            loop.call_soon_threadsafe(drain)

        writer = LogWriter(log, fsync_policy="always", on_group_done=group_done)
        futures = []
        for i in range(500):
            future = loop.create_future()
            writer.submit_nowait(record("a", i),
                                 lambda outcome, f=future: completed.append((f, outcome)))
            futures.append(future)
        results = await asyncio.wait_for(asyncio.gather(*futures), WAIT)
        await loop.run_in_executor(None, writer.close)
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, AppendResult) for r in results)
    assert sorted((r.partition, r.offset) for r in results) == sorted(
        (p, o) for p in range(2) for o in range(log.next_offset(p)))
    assert 1 <= wakeups[0] <= 500
    log.close()


def test_per_record_policy_overrides_the_writer_default(tmp_path: Path) -> None:
    """With the default ``never``, a record submitted with ``always`` completes only after its
    partition was fsynced; ``never`` records cause no fsync at all."""
    synced: dict[int, int] = {}  # inode -> file size when it was last fsynced
    log = CommitLog(tmp_path, LogConfig(partitions=2), fsync=size_recording_fsync(synced))
    outcomes: queue.Queue = queue.Queue()
    with LogWriter(log, fsync_policy="never") as writer:
        writer.submit(Record.new("lazy/t", b"x", T0), outcomes.put)
        assert isinstance(outcomes.get(timeout=WAIT), AppendResult)
        assert writer.statistics().fsyncs == 0

        def check(outcome: AppendResult | BaseException) -> None:
            assert isinstance(outcome, AppendResult)
            path = log.partition(outcome.partition).active_segment.log_path
            now = os.stat(path)
            outcomes.put(synced.get(now.st_ino) == now.st_size)

        writer.submit(Record.new("cmd/t", b"y", T0), check, policy=FsyncPolicy.ALWAYS)
        assert outcomes.get(timeout=WAIT) is True
        assert writer.statistics().fsyncs == 1
    log.close()


def test_fsync_latency_histogram_counts_every_fsync(tmp_path: Path) -> None:
    """The operations plane's fsync histogram (WriterStatistics): one bucket count per fsync,
    summing to ``fsyncs``, with the time they took."""
    log = CommitLog(tmp_path, LogConfig(partitions=2))
    with LogWriter(log, fsync_policy="always") as writer:
        for i in range(20):
            writer.submit(record("h", i), lambda outcome: None)
    stats = writer.statistics()
    assert stats.fsyncs >= 1
    assert sum(stats.fsync_buckets) == stats.fsyncs
    assert stats.fsync_seconds > 0
    assert stats.appended == 20
    assert stats.appended_bytes == sum(len(record("h", i).payload) for i in range(20))
    log.close()


def batch_of(partition: int, policy: FsyncPolicy, label: str, start: int,
             count: int) -> AppendBatch:
    """A batch as the broker builds one in a loop turn: records encoded as they come."""
    batch = AppendBatch(partition, policy)
    for i in range(start, start + count):
        batch.add_record(Record.new(f"devices/{partition}/t", f"{label}:{i}".encode(), T0 + i))
    return batch


def test_submitted_batches_complete_in_order_after_the_fsync_always_needs(
        tmp_path: Path) -> None:
    synced: dict[int, int] = {}  # inode -> file size when it was fsynced
    log = CommitLog(tmp_path, LogConfig(partitions=2, segment_bytes=8_000),
                    fsync=size_recording_fsync(synced))
    completed: list[tuple[int, list[tuple[int, int]]]] = []
    violations: list[str] = []

    def done_for(turn: int):
        def done(batches: list[AppendBatch]) -> None:
            for batch in batches:
                assert batch.error is None, batch.error
                path = log.partition(batch.partition).active_segment.log_path
                now = os.stat(path)
                if synced.get(now.st_ino) != now.st_size:
                    violations.append(f"turn {turn}: {now.st_size} bytes, "
                                      f"fsynced {synced.get(now.st_ino)}")
            completed.append((turn, [(b.partition, b.base_offset) for b in batches]))
        return done

    with LogWriter(log, fsync_policy="always", max_group_records=40) as writer:
        for turn in range(100):  # 20 records a turn, two partitions: 8 KB segments roll
            writer.submit_batches([batch_of(p, FsyncPolicy.ALWAYS, f"t{turn}", 10 * p, 10)
                                   for p in (0, 1)], done_for(turn))
    assert violations == []
    assert [turn for turn, _ in completed] == list(range(100))  # in submission order
    assert [offsets for _, offsets in completed] == [
        [(0, 10 * turn), (1, 10 * turn)] for turn in range(100)]
    for partition in (0, 1):
        payloads = [r.payload for r in log.read(partition, 0, max_bytes=10**8)]
        assert payloads == [f"t{turn}:{i}".encode() for turn in range(100)
                            for i in range(10 * partition, 10 * partition + 10)]
    assert sum(s.segments for s in log.statistics().partitions) > 4  # rolls were exercised
    log.close()


def test_write_now_writes_on_the_callers_thread_and_the_interval_fsyncs_later(
        tmp_path: Path) -> None:
    calls: list[int] = []
    fsynced = threading.Event()

    def hook(fd: int) -> None:
        os.fsync(fd)
        calls.append(fd)
        fsynced.set()

    log = CommitLog(tmp_path, LogConfig(partitions=2), fsync=hook)
    calls.clear()
    fsynced.clear()
    with LogWriter(log, fsync_policy="never", fsync_interval_ms=300) as writer:
        lazy = batch_of(0, FsyncPolicy.NEVER, "n", 0, 5)
        assert writer.write_now([lazy]) == []
        assert lazy.error is None and lazy.base_offset == 0
        assert log.next_offset(0) == 5  # written at once, on this thread
        assert calls == [] and writer.statistics().appended == 5
        started = time.monotonic()
        timed = batch_of(1, FsyncPolicy.INTERVAL, "i", 0, 3)
        assert writer.write_now([timed]) == []
        assert timed.base_offset == 0 and log.next_offset(1) == 3
        assert fsynced.wait(WAIT)  # the writer thread was woken: the interval runs
        assert len(calls) == 1  # partition 1 only: the "never" batch asks for no fsync
        assert time.monotonic() - started < WAIT
    assert [r.payload for r in log.read(1, 0)] == [b"i:0", b"i:1", b"i:2"]
    log.close()


def test_write_now_never_rolls_and_fails_everything_once_an_fsync_failed(
        tmp_path: Path) -> None:
    failing = threading.Event()
    log = CommitLog(tmp_path, LogConfig(partitions=1, segment_bytes=2_000),
                    fsync=flaky_fsync(failing))
    writer = LogWriter(log, fsync_policy="interval", fsync_interval_ms=600_000)
    assert writer.write_now([batch_of(0, FsyncPolicy.INTERVAL, "a", 0, 10)]) == []
    big = batch_of(0, FsyncPolicy.INTERVAL, "a", 10, 30)  # with the 10 above, over 2 KB
    assert writer.write_now([big]) == [big]  # left for the writer thread, which may fsync
    assert big.error is None and log.next_offset(0) == 10
    outcomes: queue.Queue = queue.Queue()
    writer.submit_batches([big], outcomes.put)
    assert outcomes.get(timeout=WAIT) == [big]
    assert big.error is None and big.base_offset == 10
    assert log.statistics().partitions[0].segments == 2
    failing.set()
    writer.submit_batches([batch_of(0, FsyncPolicy.ALWAYS, "b", 0, 1)], outcomes.put)
    [failed] = outcomes.get(timeout=WAIT)
    assert isinstance(failed.error, LogError)
    later = batch_of(0, FsyncPolicy.INTERVAL, "c", 0, 1)
    assert writer.write_now([later]) == []
    assert isinstance(later.error, LogError)  # not written: the page cache is not trusted
    writer.close()
    failing.clear()
    log.close()
    with CommitLog(tmp_path, LogConfig(partitions=1, segment_bytes=2_000)) as reopened:
        payloads = [r.payload for r in reopened.read(0, 38, max_records=5)]
    assert payloads[:2] == [b"a:38", b"a:39"] and b"c:0" not in payloads


def test_submit_batches_raises_when_the_records_do_not_fit(tmp_path: Path) -> None:
    log, writer, release = busy_writer(tmp_path, 10)
    outcomes: queue.Queue = queue.Queue()
    writer.submit_batches([batch_of(0, FsyncPolicy.NEVER, "a", 1, 6)], outcomes.put)
    assert writer.queued == 6
    with pytest.raises(queue.Full):
        writer.submit_batches([batch_of(0, FsyncPolicy.NEVER, "b", 0, 5)], outcomes.put)
    writer.submit_batches([batch_of(0, FsyncPolicy.NEVER, "c", 0, 4)], outcomes.put)
    release.set()
    assert [b.base_offset for b in outcomes.get(timeout=WAIT)] == [1]
    assert [b.base_offset for b in outcomes.get(timeout=WAIT)] == [7]
    writer.close()
    with pytest.raises(LogClosed):
        writer.submit_batches([batch_of(0, FsyncPolicy.NEVER, "d", 0, 1)], outcomes.put)
    with pytest.raises(LogClosed):
        writer.write_now([batch_of(0, FsyncPolicy.NEVER, "d", 0, 1)])
    log.close()


def test_write_now_leaves_the_later_batches_of_a_partition_that_must_roll(
        tmp_path: Path) -> None:
    """A small batch after one that waits for a roll would fit the old segment, but written
    first it would take lower offsets than the publishes before it."""
    log = CommitLog(tmp_path, LogConfig(partitions=2, segment_bytes=2_000))
    writer = LogWriter(log, fsync_policy="interval", fsync_interval_ms=600_000)
    assert writer.write_now([batch_of(0, FsyncPolicy.INTERVAL, "a", 0, 10)]) == []
    big = batch_of(0, FsyncPolicy.INTERVAL, "a", 10, 30)  # 1,603 bytes after 563: roll first
    small = batch_of(0, FsyncPolicy.INTERVAL, "a", 40, 1)  # 95 bytes: would still fit
    other = batch_of(1, FsyncPolicy.INTERVAL, "b", 0, 1)  # another partition goes ahead
    assert writer.write_now([big, other, small]) == [big, small]
    assert log.next_offset(0) == 10 and other.base_offset == 0
    outcomes: queue.Queue = queue.Queue()
    writer.submit_batches([big, small], outcomes.put)
    assert outcomes.get(timeout=WAIT) == [big, small]
    assert (big.base_offset, small.base_offset) == (10, 40)
    writer.close()
    assert [r.payload for r in log.read(0, 0, max_bytes=10**6)] == [
        b"a:%d" % i for i in range(41)]
    log.close()


def test_write_now_fsyncs_always_batches_on_the_callers_thread_once_per_partition(
        tmp_path: Path) -> None:
    """Group commit by loop turn: one write and one fsync per partition, on the calling
    thread, before write_now returns; the offsets follow the batches' order."""
    synced: list[tuple[str, int, int]] = []  # thread, inode, file size when fsynced

    def recording_fsync(fd: int) -> None:
        status = os.fstat(fd)
        os.fsync(fd)
        synced.append((threading.current_thread().name, status.st_ino, status.st_size))

    log = CommitLog(tmp_path, LogConfig(partitions=3), fsync=recording_fsync)
    synced.clear()
    with LogWriter(log, fsync_policy="always") as writer:
        assert writer.fsync_allowed()
        for turn in range(3):
            batches = [batch_of(0, FsyncPolicy.ALWAYS, f"a{turn}", 0, 4),
                       batch_of(1, FsyncPolicy.ALWAYS, f"b{turn}", 0, 2),
                       batch_of(0, FsyncPolicy.INTERVAL, f"c{turn}", 0, 3),
                       batch_of(2, FsyncPolicy.NEVER, f"d{turn}", 0, 1)]
            assert writer.write_now(batches) == []
            assert [(b.error, b.base_offset) for b in batches] == [
                (None, 7 * turn), (None, 2 * turn), (None, 7 * turn + 4), (None, turn)]
            # Partitions 0 and 1 fsynced once each, covering every byte written to them.
            this_turn = synced[2 * turn:]
            assert len(this_turn) == 2
            assert {name for name, _, _ in this_turn} == {threading.current_thread().name}
            sizes = {os.stat(log.partition(p).active_segment.log_path).st_ino:
                     os.stat(log.partition(p).active_segment.log_path).st_size for p in (0, 1)}
            assert {inode: size for _, inode, size in this_turn} == sizes
        stats = writer.statistics()
        assert (stats.groups, stats.fsyncs, stats.inline_fsyncs) == (0, 3, 3)
        assert stats.appended == 30
    assert [r.payload for r in log.read(0, 0)] == [
        f"{label}{turn}:{i}".encode() for turn in range(3)
        for label, count in (("a", 4), ("c", 3)) for i in range(count)]
    log.close()


class SlowDisk:
    """An fsync whose duration the test chooses, seen through an injected clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.seconds = 0.0001  # each fsync "takes" this long

    def fsync(self, fd: int) -> None:
        os.fsync(fd)
        self.now += self.seconds

    def clock(self) -> float:
        return self.now


def test_slow_inline_fsyncs_go_to_the_thread_and_a_quick_try_brings_them_back(
        tmp_path: Path) -> None:
    disk = SlowDisk()
    log = CommitLog(tmp_path, LogConfig(partitions=1), fsync=disk.fsync)
    writer = LogWriter(log, fsync_policy="always", fsync_clock=disk.clock)
    outcomes: queue.Queue = queue.Queue()
    offset = 0

    def inline_turn() -> None:
        nonlocal offset
        assert writer.fsync_allowed()
        batch = batch_of(0, FsyncPolicy.ALWAYS, "x", offset, 1)
        assert writer.write_now([batch]) == [] and batch.base_offset == offset
        offset += 1

    def thread_turn() -> None:
        nonlocal offset
        assert not writer.fsync_allowed()
        writer.submit_batches([batch_of(0, FsyncPolicy.ALWAYS, "x", offset, 1)], outcomes.put)
        [batch] = outcomes.get(timeout=WAIT)
        assert batch.error is None and batch.base_offset == offset
        offset += 1

    for _ in range(20):  # quick: 0.1 ms each, far under the 2 ms limit
        inline_turn()
    disk.seconds = 0.009
    inline_turn()
    inline_turn()  # two slow ones among quick ones: the average is under 2 ms
    assert writer.fsync_allowed()
    inline_turn()  # a third in a row: over it
    assert not writer.fsync_allowed()
    stats = writer.statistics()
    assert (stats.inline_fsyncs, stats.fsyncs, stats.fsync_inline) == (23, 23, False)
    thread_turn()  # the slow disk now stalls only what waits for it, on the thread
    disk.now += 0.9
    thread_turn()  # still within the first second
    disk.now += 0.2
    inline_turn()  # a try: the average starts at 1 ms, one slow fsync does not end it
    inline_turn()  # two do: back to the thread, for twice as long
    assert not writer.fsync_allowed()
    disk.now += 1.5
    thread_turn()
    disk.now += 0.6
    disk.seconds = 0.0001  # quick again: the next try stays
    for _ in range(20):
        inline_turn()
    assert writer.statistics().fsync_inline
    disk.seconds = 0.009  # slow again after a settled while: the wait is 1 s again
    for _ in range(3):
        inline_turn()
    assert not writer.fsync_allowed()
    disk.now += 1.0
    inline_turn()
    stats = writer.statistics()
    assert (stats.inline_fsyncs, stats.fsyncs - stats.inline_fsyncs) == (49, 3)
    writer.close()
    assert [r.payload for r in log.read(0, 0, max_bytes=10**6)] == [
        b"x:%d" % i for i in range(offset)]
    log.close()


def test_never_inline_when_the_limit_is_zero(tmp_path: Path) -> None:
    log = CommitLog(tmp_path, LogConfig(partitions=1))
    with LogWriter(log, fsync_policy="always", inline_fsync_slow_ms=0) as writer:
        assert not writer.fsync_allowed()
        writer.submit_batches([batch_of(0, FsyncPolicy.ALWAYS, "x", 0, 1)], lambda b: None)
    assert not writer.statistics().fsync_inline
    log.close()


def test_an_inline_fsync_failure_fails_that_write_and_everything_after(
        tmp_path: Path) -> None:
    failing = threading.Event()
    log = CommitLog(tmp_path, LogConfig(partitions=2), fsync=flaky_fsync(failing))
    writer = LogWriter(log, fsync_policy="always")
    first = [batch_of(0, FsyncPolicy.ALWAYS, "a", 0, 2), batch_of(1, FsyncPolicy.INTERVAL,
                                                                 "b", 0, 2)]
    assert writer.write_now(first) == [] and [b.error for b in first] == [None, None]
    failing.set()
    second = [batch_of(0, FsyncPolicy.ALWAYS, "a", 2, 2), batch_of(1, FsyncPolicy.NEVER,
                                                                  "b", 2, 2)]
    assert writer.write_now(second) == []
    assert all(isinstance(b.error, LogError) for b in second)  # none is durable, nor trusted
    assert writer.statistics().failed
    failing.clear()  # the disk "recovers", but the writer must not trust it again
    later = batch_of(1, FsyncPolicy.NEVER, "c", 0, 1)
    assert writer.write_now([later]) == [] and isinstance(later.error, LogError)
    outcomes: queue.Queue = queue.Queue()
    writer.submit_batches([batch_of(0, FsyncPolicy.ALWAYS, "d", 0, 1)], outcomes.put)
    [on_thread] = outcomes.get(timeout=WAIT)
    assert isinstance(on_thread.error, LogError)
    callbacks = Callbacks()
    callbacks.expected = 1
    writer.submit(record("e", 0), callbacks.for_label(0))
    assert callbacks.all_done.wait(WAIT)
    assert isinstance(callbacks.outcomes[0][0], LogError)
    writer.close()
    log.close()


def test_an_always_batch_that_must_roll_is_left_for_the_thread_which_seals_durably(
        tmp_path: Path) -> None:
    synced: dict[int, int] = {}  # inode -> file size when it was last fsynced
    log = CommitLog(tmp_path, LogConfig(partitions=2, segment_bytes=2_000),
                    fsync=size_recording_fsync(synced))
    writer = LogWriter(log, fsync_policy="always")
    assert writer.write_now([batch_of(0, FsyncPolicy.ALWAYS, "a", 0, 10)]) == []
    big = batch_of(0, FsyncPolicy.ALWAYS, "a", 10, 30)  # with the 10 above, over 2 KB: roll
    small = batch_of(0, FsyncPolicy.ALWAYS, "a", 40, 1)
    other = batch_of(1, FsyncPolicy.ALWAYS, "b", 0, 1)
    assert writer.write_now([big, other, small]) == [big, small]
    assert log.next_offset(0) == 10 and other.base_offset == 0 and other.error is None
    other_file = os.stat(log.partition(1).active_segment.log_path)
    assert synced[other_file.st_ino] == other_file.st_size  # fsynced inline
    assert writer.statistics().inline_fsyncs == 2
    outcomes: queue.Queue = queue.Queue()
    writer.submit_batches([big, small], outcomes.put)
    assert outcomes.get(timeout=WAIT) == [big, small]
    assert (big.error, small.error, big.base_offset, small.base_offset) == (None, None, 10, 40)
    segments = sorted((tmp_path / "log" / "0").glob("*.log"))
    assert len(segments) == 2
    for path in segments:  # the sealed one by the roll, the new one for ``always``
        status = os.stat(path)
        assert synced[status.st_ino] == status.st_size
    writer.close()
    assert [r.payload for r in log.read(0, 0, max_bytes=10**6)] == [
        b"a:%d" % i for i in range(41)]
    log.close()
