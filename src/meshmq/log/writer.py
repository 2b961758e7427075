"""``LogWriter``: appends to a ``CommitLog`` on one background thread, with group commit.

Theory of operation
-------------------
Producers call ``submit(record, done)`` (blocking while the bounded queue is full) or
``submit_nowait`` (raising ``queue.Full``). The writer thread takes everything waiting (up to
``max_group_records``), appends it as one batch per partition, applies the fsync policy, and
then calls each request's ``done`` **on the writer thread** with an ``AppendResult`` or an
exception. An asyncio caller hops back with ``loop.call_soon_threadsafe(future.set_result, r)``.

Fsync policies (what a completed request promises):

* ``always``: the record's partition was fsynced after it was written and before ``done``.
  Nothing acknowledged is lost, even on power loss. One fsync per partition per group, so the
  cost is shared by everything queued meanwhile.
* ``interval``: ``done`` fires once the record is written to the OS; the written partitions
  are fsynced at most every ``fsync_interval_ms`` (and when the writer goes idle past that
  deadline). A process crash (even ``kill -9``) loses nothing: the OS has the data. A power
  loss or kernel crash loses up to ``fsync_interval_ms`` of acknowledged records.
* ``never``: like ``interval`` without the timer; data reaches disk when the OS writes it
  back, when a segment rolls, or at ``close()``. A power loss can lose any amount.

The policy is the writer's default; ``submit(..., policy=...)`` overrides it per record (the
broker chooses by topic pattern). A group fsyncs the partitions holding ``always`` records
before completing any of its requests; partitions written only by ``interval`` records join
the timed set.

After an fsync fails the state of the page cache is unknown, so the writer stops accepting
work: that group's requests and every later one fail with ``LogError``. Retention runs on this
thread every ``retention_check_interval_ms``, so every mutation of the log happens here.

``done`` must be quick and must not raise (exceptions are logged and swallowed). A ``done``
that submits more work must use ``submit_nowait``: blocking the writer thread on its own full
queue would deadlock, so ``submit`` from the writer thread behaves like ``submit_nowait``.
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType
from typing import NamedTuple

from meshmq.log.commit_log import CommitLog
from meshmq.log.errors import LogClosed, LogError
from meshmq.log.record import Record

log = logging.getLogger("meshmq.log")


class FsyncPolicy(StrEnum):
    ALWAYS = "always"
    INTERVAL = "interval"
    NEVER = "never"


class AppendResult(NamedTuple):
    partition: int
    offset: int


DoneCallback = Callable[[AppendResult | BaseException], None]


@dataclass(slots=True)
class _Request:
    record: Record
    done: DoneCallback
    policy: FsyncPolicy
    outcome: AppendResult | BaseException | None = field(default=None)


_STOP = object()


# Upper bounds (seconds) of the fsync latency histogram's buckets (the last bucket: above them).
FSYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True, slots=True)
class WriterStatistics:
    queued: int
    appended: int
    groups: int
    fsyncs: int
    failed: bool
    appended_bytes: int = 0  # payload bytes of the appended records
    fsync_buckets: tuple[int, ...] = ()  # fsyncs per FSYNC_BUCKETS bucket (not cumulative)
    fsync_seconds: float = 0.0  # the time all fsyncs took


class LogWriter:
    """A background thread appending to ``commit_log``; started by the constructor."""

    def __init__(self, commit_log: CommitLog, *, fsync_policy: FsyncPolicy | str = "always",
                 fsync_interval_ms: int = 1000, queue_size: int = 10_000,
                 max_group_records: int = 10_000,
                 retention_check_interval_ms: int = 300_000,
                 on_group_done: Callable[[], None] | None = None) -> None:
        """Start the writer thread. ``on_group_done`` (optional) runs on the writer thread after
        each group's callbacks: an event loop can have the callbacks append to a deque and
        wake itself once per group here, instead of one ``call_soon_threadsafe`` per record.
        """
        self.log = commit_log
        self.on_group_done = on_group_done
        self.fsync_policy = FsyncPolicy(fsync_policy)
        self.fsync_interval = fsync_interval_ms / 1000
        self.retention_check_interval = retention_check_interval_ms / 1000
        self.max_group_records = max_group_records
        self._queue: queue.Queue[_Request | object] = queue.Queue(maxsize=queue_size)
        self._close_lock = threading.Lock()
        self._closed = False  # no new submissions
        self._finished = False  # the writer thread has stopped taking requests
        self._failure: LogError | None = None
        self._dirty: set[int] = set()
        self._last_fsync = self._last_retention = time.monotonic()
        self._counts = {"appended": 0, "groups": 0, "fsyncs": 0, "appended_bytes": 0}
        self._fsync_buckets = [0] * (len(FSYNC_BUCKETS) + 1)  # written by the writer thread
        self._fsync_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="meshmq-log-writer", daemon=True)
        self._thread.start()

    # -- producer side (any thread) -------------------------------------------------------

    def submit(self, record: Record, done: DoneCallback, timeout: float | None = None,
               policy: FsyncPolicy | None = None) -> None:
        """Queue ``record`` for appending, waiting for room; ``done`` fires exactly once.

        ``policy`` overrides the writer's fsync policy for this record (per topic pattern).
        Raises ``LogClosed`` after ``close()`` and ``queue.Full`` if ``timeout`` expires.
        """
        blocking = threading.current_thread() is not self._thread
        self._enqueue(_Request(record, done, policy or self.fsync_policy), blocking, timeout)

    def submit_nowait(self, record: Record, done: DoneCallback,
                      policy: FsyncPolicy | None = None) -> None:
        """Like ``submit`` but raises ``queue.Full`` at once when the queue is full."""
        self._enqueue(_Request(record, done, policy or self.fsync_policy), False, None)

    def submit_many_nowait(self, requests: Sequence[tuple[Record, DoneCallback,
                                                          FsyncPolicy | None]]) -> int:
        """Queue as many of ``requests`` (record, done, policy) as there is room for, in order,
        under one lock round trip (a batch from another process: an APPEND frame); return how
        many were queued. The callbacks of the others never fire. ``LogClosed`` after
        ``close()``. Uses ``queue.Queue``'s ``mutex``/``queue``/``not_empty``, as
        ``_take_waiting`` does."""
        if self._closed:
            raise LogClosed("the log writer is closed")
        waiting = self._queue
        default = self.fsync_policy
        with waiting.mutex:
            room = len(requests) if waiting.maxsize <= 0 else waiting.maxsize - len(waiting.queue)
            count = max(0, min(room, len(requests)))
            put = waiting.queue.append
            for record, done, policy in requests[:count]:
                put(_Request(record, done, policy or default))
            if count:
                waiting.unfinished_tasks += count
                waiting.not_empty.notify()
        if self._finished:  # raced with close(): see _enqueue
            self._fail_leftovers()
        return count

    def _enqueue(self, request: _Request, block: bool, timeout: float | None) -> None:
        if self._closed:
            raise LogClosed("the log writer is closed")
        self._queue.put(request, block, timeout)
        if self._finished:  # raced with close(): the writer may never see this request
            self._fail_leftovers()

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting work, complete everything queued, fsync, and join the thread.

        Closes the writer only; close the ``CommitLog`` afterwards. Idempotent. A request
        racing with ``close()`` may instead fail with ``LogClosed``, on the submitting thread.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def statistics(self) -> WriterStatistics:
        counts = self._counts
        return WriterStatistics(self._queue.qsize(), counts["appended"], counts["groups"],
                                counts["fsyncs"], self._failure is not None,
                                counts["appended_bytes"], tuple(self._fsync_buckets),
                                self._fsync_seconds)

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        while not stop:
            try:
                first = self._queue.get(timeout=self._idle_timeout())
            except queue.Empty:
                self._housekeeping(time.monotonic())
                continue
            batch = [first, *self._take_waiting(self.max_group_records - 1)]
            stop = any(item is _STOP for item in batch)
            self._process([item for item in batch if isinstance(item, _Request)])
            self._housekeeping(time.monotonic())
        self._finished = True  # set before the last drain: see _enqueue
        self._fail_leftovers()
        self._sync(set(self.log.owned))

    def _idle_timeout(self) -> float:
        deadline = self._last_retention + self.retention_check_interval
        if self._dirty:  # only partitions written under the interval policy are dirty
            deadline = min(deadline, self._last_fsync + self.fsync_interval)
        return max(deadline - time.monotonic(), 0.0)

    def _take_waiting(self, limit: int) -> list[_Request | object]:
        """Everything queued (up to ``limit``) under one lock round trip, instead of one
        ``get_nowait`` per item; uses ``queue.Queue``'s ``mutex``/``queue``/``not_full``."""
        waiting = self._queue
        with waiting.mutex:
            count = min(limit, len(waiting.queue))
            items = [waiting.queue.popleft() for _ in range(count)]
            if count:
                waiting.not_full.notify(count)
        return items

    def _fail_leftovers(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Request):
                self._notify(item, LogClosed("the log writer is closed"))

    def _process(self, group: list[_Request]) -> None:
        if not group:
            return
        if self._failure is None:
            self._append(group)
            now_sync: set[int] = set()
            later: set[int] = set()
            for request in group:
                outcome = request.outcome
                if isinstance(outcome, AppendResult):
                    if request.policy is FsyncPolicy.ALWAYS:
                        now_sync.add(outcome.partition)
                    elif request.policy is FsyncPolicy.INTERVAL:
                        later.add(outcome.partition)
            if now_sync:
                self._sync(now_sync, timed=False)
            self._dirty |= later - now_sync
            self._counts["groups"] += 1
        self._complete(group)

    def _complete(self, group: list[_Request]) -> None:
        failure = self._failure  # set now if this group's fsync failed: nothing is durable
        for request in group:
            outcome = request.outcome
            if failure is not None and not isinstance(outcome, BaseException):
                outcome = failure
            self._notify(request, outcome if outcome is not None else LogError("not appended"))
        if self.on_group_done is not None:
            try:
                self.on_group_done()
            except Exception:
                log.exception("log writer on_group_done raised")

    def _append(self, group: list[_Request]) -> set[int]:
        """Append each partition's requests as one call; return the partitions written."""
        written: set[int] = set()
        for partition, requests in self._by_partition(group).items():
            try:
                base, _ = self.log.append_to(partition, [r.record for r in requests])
            except Exception as exc:  # this partition only; the others go ahead
                for request in requests:
                    request.outcome = exc
                continue
            written.add(partition)
            self._counts["appended"] += len(requests)
            self._counts["appended_bytes"] += sum(len(r.record.payload) for r in requests)
            for n, request in enumerate(requests):
                request.outcome = AppendResult(partition, base + n)
        return written

    def _by_partition(self, group: list[_Request]) -> dict[int, list[_Request]]:
        by_partition: dict[int, list[_Request]] = {}
        for request in group:
            try:
                partition = self.log.partition_for(request.record.topic)
            except Exception as exc:  # not a record: fail this request alone
                request.outcome = exc
                continue
            by_partition.setdefault(partition, []).append(request)
        return by_partition

    def _housekeeping(self, now: float) -> None:
        interval_due = now - self._last_fsync >= self.fsync_interval
        if self._dirty and interval_due:
            self._sync(self._dirty)
        if now - self._last_retention >= self.retention_check_interval:
            self._last_retention = now
            try:
                self.log.enforce_retention()
            except Exception:
                log.exception("retention failed; will retry")

    def _sync(self, partitions: set[int], timed: bool = True) -> None:
        """fsync ``partitions``; ``timed``: this is the interval policy's periodic fsync."""
        if partitions and self._failure is None:
            started = time.monotonic()
            try:
                self.log.flush(sorted(partitions))
            except Exception as exc:
                log.exception("fsync failed; the log writer stops accepting work")
                self._failure = LogError(f"log fsync failed: {exc}")
                self._failure.__cause__ = exc
            self._counts["fsyncs"] += 1
            self._time_fsync(time.monotonic() - started)
        if timed:
            self._last_fsync = time.monotonic()
        self._dirty -= partitions

    def _time_fsync(self, elapsed: float) -> None:
        """Count one fsync in the latency histogram (read by the operations plane)."""
        self._fsync_seconds += elapsed
        self._fsync_buckets[bisect.bisect_left(FSYNC_BUCKETS, elapsed)] += 1

    def _notify(self, request: _Request, outcome: AppendResult | BaseException) -> None:
        try:
            request.done(outcome)
        except Exception:
            log.exception("log writer completion callback raised")
