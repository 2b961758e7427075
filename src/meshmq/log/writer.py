"""``LogWriter``: appends to a ``CommitLog`` on one background thread, with group commit.

Theory of operation
-------------------
Two ways in. Records one at a time: ``submit(record, done)`` (blocking while the bounded
queue is full), ``submit_nowait`` (raising ``queue.Full``), ``submit_many_nowait``; each
``done`` gets an ``AppendResult`` or an exception. Or batches encoded already by the caller
(``AppendBatch``, a ``BatchBuilder`` with a partition and a policy, one per partition and
loop turn): ``submit_batches(batches, done)`` calls ``done(batches)`` once for them all, each
batch with its ``base_offset`` or its ``error``. The writer thread takes everything waiting
(up to ``max_group_records``), appends it in order with one write per partition, applies the
fsync policy, and then calls the ``done`` callbacks in the order the work was submitted,
**on the writer thread**. An asyncio caller queues what it gets and wakes its loop once
(``on_group_done``, or a flag: broker/persistence.py).

``write_now(batches)`` appends batches on the calling thread instead, one write per
partition, so an event loop completes them in the same turn without a round trip through this
thread. Batches that wait for no fsync (``interval``, ``never``) cost a page-cache write and
nothing else. Batches under ``always`` are fsynced there too, once per partition after all the
writes (group commit by loop turn: everything the turn gathered shares the fsync; several
partitions may share one ``syncfs``: ``CommitLog.flush``), before ``write_now`` returns. It
never rolls a segment (a roll fsyncs the sealed one and creates a file): a batch that would
roll is left for the thread, with the later batches of its partition.

Fsync on the caller's thread, and its guard. Handing an ``always`` batch to this thread and
back costs the queue, the thread's wake-up, the GIL hand-over twice and the loop's wake-up
(some tens of µs in-process on the benchmark machine, more when the loop is busy and the
thread waits for the GIL), on top of the fsync; so an event loop fsyncs inline while the
disk is quick, and gives up the overlap of its own work with the fsync that the thread
allows. While it does, every connection of the loop waits for the disk, so
``fsync_allowed()`` asks an ``InlineGuard`` (log/inline_guard.py): a
moving average of the inline fsyncs over ``inline_fsync_slow_ms`` (default 2 ms) sends the
``always`` batches to this thread again, and inline fsyncs are tried again after a wait (1 s,
doubled after each failed try up to 16 s). ``inline_fsync_slow_ms=0``: never inline.

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
the timed set (so do those ``write_now`` wrote).

After an fsync fails (here or in ``write_now``) the state of the page cache is unknown, so
the writer stops accepting work: that group's requests (the batches of that ``write_now``) and
every later one fail with ``LogError``. Retention, rolls and the interval's fsyncs run on this
thread (retention every ``retention_check_interval_ms``); the only other mutations,
``write_now``'s append and fsync, take the partition's locks like any other (an fsync holds
none: ``Partition.flush`` fsyncs a duplicate of the descriptor), and the counters both threads
update take ``_stats_lock``.

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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType
from typing import ClassVar, Final, NamedTuple

from meshmq.log.commit_log import CommitLog
from meshmq.log.errors import LogClosed, LogError
from meshmq.log.inline_guard import InlineGuard
from meshmq.log.record import BatchBuilder, Record

log: Final = logging.getLogger("meshmq.log")


class FsyncPolicy(StrEnum):
    ALWAYS = "always"
    INTERVAL = "interval"
    NEVER = "never"


class AppendResult(NamedTuple):
    partition: int
    offset: int


DoneCallback = Callable[[AppendResult | BaseException], None]


class AppendBatch(BatchBuilder):
    """Records for one partition, encoded as they come (``BatchBuilder.add``), appended with
    one fsync ``policy``. After the append: ``base_offset`` (record ``i`` is at
    ``base_offset + i``), or ``error`` when it failed."""

    __slots__ = ("error", "partition", "policy")

    def __init__(self, partition: int, policy: FsyncPolicy) -> None:
        super().__init__()
        self.partition = partition
        self.policy = policy
        self.error: BaseException | None = None


BatchesDone = Callable[[list[AppendBatch]], None]


@dataclass(slots=True)
class _Request:
    record: Record
    done: DoneCallback
    policy: FsyncPolicy
    outcome: AppendResult | BaseException | None = field(default=None)

    # A property, not a ClassVar: compiled by mypyc, the dataclass would take that for a field.
    @property
    def records(self) -> int:
        return 1


@dataclass(slots=True)
class _Submission:
    batches: list[AppendBatch]
    done: BatchesDone
    records: int


class _Signal:
    """Work that is no work: stop the thread, or wake it to look at its deadlines again."""

    records: ClassVar[int] = 0


_STOP: Final = _Signal()
_WAKE: Final = _Signal()
_Work = _Request | _Submission | _Signal


class _Inbox:
    """The writer's queue: work in submission order, bounded by the records it holds (a
    single piece of work larger than the bound is let in when the queue is empty)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # <= 0: no bound
        self.records = 0  # read without the lock by producers checking for room
        self._items: deque[_Work] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)

    def _room(self, records: int) -> bool:
        return self.limit <= 0 or not self.records or self.records + records <= self.limit

    def put(self, item: _Work, block: bool = False, timeout: float | None = None) -> None:
        """Queue ``item``; ``queue.Full`` if there is no room (after ``timeout`` when
        blocking). A signal always goes in."""
        with self._lock:
            if item.records and not self._room(item.records):
                if not block:
                    raise queue.Full
                if not self._not_full.wait_for(lambda: self._room(item.records), timeout):
                    raise queue.Full
            self._items.append(item)
            self.records += item.records
            self._not_empty.notify()

    def put_many(self, items: list[_Request]) -> int:
        """Queue as many of ``items`` as there is room for, in order; return how many."""
        with self._lock:
            room = len(items) if self.limit <= 0 else self.limit - self.records
            count = max(0, min(room, len(items)))
            self._items.extend(items[:count])
            self.records += count
            if count:
                self._not_empty.notify()
        return count

    def take(self, limit: int, timeout: float) -> list[_Work] | None:
        """Wait up to ``timeout`` for work; then everything waiting, up to ``limit`` records
        (at least one piece). None when nothing came."""
        with self._lock:
            items = self._items
            if not items and not self._not_empty.wait(timeout) and not items:
                return None
            taken: list[_Work] = []
            records = 0
            while items and (not taken or records + items[0].records <= limit):
                item = items.popleft()
                taken.append(item)
                records += item.records
            self.records -= records
            self._not_full.notify_all()
        return taken

    def take_all(self) -> list[_Work]:
        with self._lock:
            taken = list(self._items)
            self._items.clear()
            self.records = 0
            self._not_full.notify_all()
        return taken


# Upper bounds (seconds) of the fsync latency histogram's buckets (the last bucket: above them).
FSYNC_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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
    inline_fsyncs: int = 0  # of ``fsyncs``, those ``write_now`` made on its caller's thread
    fsync_inline: bool = False  # are ``always`` batches fsynced inline (write_now) now?
    filesystem_syncs: int = 0  # of ``fsyncs``, those that were one syncfs (commit_log.py)


class LogWriter:
    """A background thread appending to ``commit_log``; started by the constructor."""

    def __init__(self, commit_log: CommitLog, *, fsync_policy: FsyncPolicy | str = "always",
                 fsync_interval_ms: int = 1000, queue_size: int = 10_000,
                 max_group_records: int = 10_000,
                 retention_check_interval_ms: int = 300_000,
                 on_group_done: Callable[[], None] | None = None,
                 inline_fsync_slow_ms: float = 2.0,
                 fsync_clock: Callable[[], float] = time.monotonic) -> None:
        """Start the writer thread. ``on_group_done`` (optional) runs on the writer thread after
        each group's callbacks: an event loop can have the callbacks append to a deque and
        wake itself once per group here, instead of one ``call_soon_threadsafe`` per record.
        ``inline_fsync_slow_ms``: the average inline fsync above which ``fsync_allowed()``
        turns False for a while (0: never inline); ``fsync_clock`` times the fsyncs and the
        backoff (seconds; tests inject one).
        """
        self.log = commit_log
        self.on_group_done = on_group_done
        self.fsync_policy = FsyncPolicy(fsync_policy)
        self.fsync_interval = fsync_interval_ms / 1000
        self.retention_check_interval = retention_check_interval_ms / 1000
        self.max_group_records = max_group_records
        self._inbox = _Inbox(queue_size)
        self._close_lock = threading.Lock()
        self._closed = False  # no new submissions
        self._finished = False  # the writer thread has stopped taking requests
        self._failure: LogError | None = None
        self._dirty: set[int] = set()  # written under ``interval``, not fsynced yet
        self._dirty_lock = threading.Lock()  # write_now adds to _dirty from another thread
        self._last_fsync = self._last_retention = time.monotonic()
        self._counts = {"appended": 0, "groups": 0, "fsyncs": 0, "appended_bytes": 0}
        self._now_counts = [0, 0]  # records and payload bytes write_now appended
        self._fsync_buckets = [0] * (len(FSYNC_BUCKETS) + 1)  # written by the writer thread
        self._fsync_seconds = 0.0
        self._inline_fsyncs = 0
        self._filesystem_syncs = 0
        self._stats_lock = threading.Lock()  # fsync counters: write_now's and the thread's
        self._fsync_clock = fsync_clock
        self._guard = InlineGuard(inline_fsync_slow_ms / 1000, fsync_clock)
        # Not "_thread": mypyc names the C struct field "__thread", a C keyword (a build error).
        self._writer_thread = threading.Thread(target=self._run, name="meshmq-log-writer",
                                               daemon=True)
        self._writer_thread.start()

    # -- producer side (any thread) -------------------------------------------------------

    @property
    def queued(self) -> int:
        """Records waiting for the writer thread (read without a lock: a snapshot)."""
        return self._inbox.records

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def submit(self, record: Record, done: DoneCallback, timeout: float | None = None,
               policy: FsyncPolicy | None = None) -> None:
        """Queue ``record`` for appending, waiting for room; ``done`` fires exactly once.

        ``policy`` overrides the writer's fsync policy for this record (per topic pattern).
        Raises ``LogClosed`` after ``close()`` and ``queue.Full`` if ``timeout`` expires.
        """
        blocking = threading.current_thread() is not self._writer_thread
        self._enqueue(_Request(record, done, policy or self.fsync_policy), blocking, timeout)

    def submit_nowait(self, record: Record, done: DoneCallback,
                      policy: FsyncPolicy | None = None) -> None:
        """Like ``submit`` but raises ``queue.Full`` at once when the queue is full."""
        self._enqueue(_Request(record, done, policy or self.fsync_policy), False, None)

    def submit_many_nowait(self, requests: Sequence[tuple[Record, DoneCallback,
                                                          FsyncPolicy | None]]) -> int:
        """Queue as many of ``requests`` (record, done, policy) as there is room for, in order,
        under one lock round trip; return how many were queued. The callbacks of the others
        never fire. ``LogClosed`` after ``close()``."""
        if self._closed:
            raise LogClosed("the log writer is closed")
        default = self.fsync_policy
        count = self._inbox.put_many([_Request(record, done, policy or default)
                                      for record, done, policy in requests])
        if self._finished:  # raced with close(): see _enqueue
            self._fail_leftovers()
        return count

    def submit_batches(self, batches: list[AppendBatch], done: BatchesDone) -> None:
        """Queue encoded batches (at most one per partition is usual, in any order); once all
        are appended and as durable as their policies promise, ``done(batches)`` runs on the
        writer thread, each batch with its ``base_offset`` or its ``error``. Raises
        ``queue.Full`` (nothing queued) when the records do not fit, ``LogClosed`` after
        ``close()``."""
        self._enqueue(_Submission(batches, done, sum(b.count for b in batches)), False, None)

    def fsync_allowed(self) -> bool:
        """May the caller give ``write_now`` batches under ``always`` now (fsyncs are quick)?
        For the one thread that calls ``write_now``."""
        return self._guard.allows()

    def write_now(self, batches: Sequence[AppendBatch]) -> list[AppendBatch]:
        """Append ``batches`` on the calling thread, one write per partition, from the one
        thread that submits (the caller keeps them in order with its submissions), and fsync
        the partitions of the ``always`` batches before returning (call it with those only
        when ``fsync_allowed()`` says so: the caller waits for the disk). Returns those not
        appended because their partition's segment must roll first, with the other batches of
        that partition (so that its offsets keep their order), in their order: submit them. A
        partition whose append fails gets its batches' ``error`` set; once an fsync failed
        (here or on the thread), every batch's. Raises ``LogClosed`` after ``close()``."""
        if self._closed:
            raise LogClosed("the log writer is closed")
        if self._failure is None:
            by_partition: dict[int, list[AppendBatch]] = {}
            for batch in batches:
                if batch.error is None and batch.count:
                    by_partition.setdefault(batch.partition, []).append(batch)
            left: set[int] = set()  # partitions whose batches are left for the writer thread
            synced: set[int] = set()
            dirty: list[int] = []
            for partition, group in by_partition.items():
                try:
                    if not self.log.append_built(partition, group, roll=False):
                        left.add(partition)
                        continue
                except Exception as exc:  # this partition only; the others go ahead
                    for batch in group:
                        batch.error = exc
                    continue
                counts = self._now_counts
                for batch in group:
                    counts[0] += batch.count
                    counts[1] += batch.payload_bytes
                    if batch.policy is FsyncPolicy.ALWAYS:
                        synced.add(partition)
                    elif batch.policy is FsyncPolicy.INTERVAL:
                        dirty.append(partition)
            if synced:
                self._sync(synced, timed=False, inline=True)
            # ``failed``, not ``self._failure``: the type checker still narrows that to None
            # after _sync, and mypyc-compiled code checks the narrowed type (a TypeError).
            if not self.failed:
                if dirty:
                    self._mark_dirty(dirty)
                return [batch for batch in batches if batch.partition in left]
        failure = self._failure  # nothing written since it failed is trusted, nor left
        for batch in batches:
            batch.error = failure
        return []

    def _mark_dirty(self, partitions: list[int]) -> None:
        with self._dirty_lock:
            wake = not self._dirty
            self._dirty.update(partitions)
        if wake:  # the idle writer sleeps until retention is due: the interval starts now
            self._inbox.put(_WAKE)

    def _enqueue(self, work: _Request | _Submission, block: bool,
                 timeout: float | None) -> None:
        if self._closed:
            raise LogClosed("the log writer is closed")
        self._inbox.put(work, block, timeout)
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
        self._inbox.put(_STOP)
        self._writer_thread.join(timeout)

    def statistics(self) -> WriterStatistics:
        counts, now_counts = self._counts, self._now_counts
        with self._stats_lock:
            return WriterStatistics(
                self._inbox.records, counts["appended"] + now_counts[0], counts["groups"],
                counts["fsyncs"], self._failure is not None,
                counts["appended_bytes"] + now_counts[1], tuple(self._fsync_buckets),
                self._fsync_seconds, self._inline_fsyncs, self._guard.inline,
                self._filesystem_syncs)

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        while not stop:
            group = self._inbox.take(self.max_group_records, self._idle_timeout())
            if group is None:
                self._housekeeping(time.monotonic())
                continue
            stop = any(item is _STOP for item in group)
            self._process([item for item in group if not isinstance(item, _Signal)])
            self._housekeeping(time.monotonic())
        self._finished = True  # set before the last drain: see _enqueue
        self._fail_leftovers()
        with self._dirty_lock:
            self._dirty.clear()
        self._sync(set(self.log.owned))

    def _idle_timeout(self) -> float:
        deadline = self._last_retention + self.retention_check_interval
        if self._dirty:  # only partitions written under the interval policy are dirty
            deadline = min(deadline, self._last_fsync + self.fsync_interval)
        return max(deadline - time.monotonic(), 0.0)

    def _fail_leftovers(self) -> None:
        closed = LogClosed("the log writer is closed")
        for item in self._inbox.take_all():
            if isinstance(item, _Request):
                self._notify(item, closed)
            elif isinstance(item, _Submission):
                for batch in item.batches:
                    batch.error = closed
                self._notify_batches(item)

    def _process(self, group: list[_Request | _Submission]) -> None:
        if not group:
            return
        if self._failure is None:
            now_sync: set[int] = set()
            later: set[int] = set()
            start = 0
            while start < len(group):  # runs of one kind, in order
                kind = type(group[start])
                end = start + 1
                while end < len(group) and type(group[end]) is kind:
                    end += 1
                if kind is _Request:
                    self._append_requests(group[start:end], now_sync, later)  # type: ignore[arg-type]
                else:
                    self._append_batches(group[start:end], now_sync, later)  # type: ignore[arg-type]
                start = end
            if now_sync:
                self._sync(now_sync, timed=False)
            later -= now_sync
            if later:
                with self._dirty_lock:
                    self._dirty |= later
            self._counts["groups"] += 1
        self._complete(group)

    def _complete(self, group: list[_Request | _Submission]) -> None:
        failure = self._failure  # set now if this group's fsync failed: nothing is durable
        for item in group:
            if isinstance(item, _Submission):
                if failure is not None:
                    for batch in item.batches:
                        if batch.error is None:
                            batch.error = failure
                self._notify_batches(item)
                continue
            outcome = item.outcome
            if failure is not None and not isinstance(outcome, BaseException):
                outcome = failure
            self._notify(item, outcome if outcome is not None else LogError("not appended"))
        if self.on_group_done is not None:
            try:
                self.on_group_done()
            except Exception:
                log.exception("log writer on_group_done raised")

    def _append_requests(self, group: list[_Request], now_sync: set[int],
                         later: set[int]) -> None:
        """Append each partition's records as one call; note which partitions to fsync."""
        for partition, requests in self._by_partition(group).items():
            try:
                base, _ = self.log.append_to(partition, [r.record for r in requests])
            except Exception as exc:  # this partition only; the others go ahead
                for request in requests:
                    request.outcome = exc
                continue
            self._counts["appended"] += len(requests)
            self._counts["appended_bytes"] += sum(len(r.record.payload) for r in requests)
            for n, request in enumerate(requests):
                request.outcome = AppendResult(partition, base + n)
                if request.policy is FsyncPolicy.ALWAYS:
                    now_sync.add(partition)
                elif request.policy is FsyncPolicy.INTERVAL:
                    later.add(partition)

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

    def _append_batches(self, group: list[_Submission], now_sync: set[int],
                        later: set[int]) -> None:
        """Append every partition's batches of the run with one write each (in order)."""
        by_partition: dict[int, list[AppendBatch]] = {}
        for submission in group:
            for batch in submission.batches:
                if batch.error is None and batch.count:
                    by_partition.setdefault(batch.partition, []).append(batch)
        for partition, batches in by_partition.items():
            try:
                self.log.append_built(partition, batches)
            except Exception as exc:  # this partition only; the others go ahead
                for batch in batches:
                    batch.error = exc
                continue
            counts = self._counts
            for batch in batches:
                counts["appended"] += batch.count
                counts["appended_bytes"] += batch.payload_bytes
                if batch.policy is FsyncPolicy.ALWAYS:
                    now_sync.add(partition)
                elif batch.policy is FsyncPolicy.INTERVAL:
                    later.add(partition)

    def _housekeeping(self, now: float) -> None:
        interval_due = now - self._last_fsync >= self.fsync_interval
        if self._dirty and interval_due:
            with self._dirty_lock:
                dirty, self._dirty = self._dirty, set()
            self._sync(dirty)
        if now - self._last_retention >= self.retention_check_interval:
            self._last_retention = now
            try:
                self.log.enforce_retention()
            except Exception:
                log.exception("retention failed; will retry")

    def _sync(self, partitions: set[int], timed: bool = True, inline: bool = False) -> None:
        """fsync ``partitions``; ``timed``: this is the interval policy's periodic fsync (else
        one for ``always``); ``inline``: on ``write_now``'s thread."""
        if partitions and self._failure is None:
            clock = self._fsync_clock
            started = clock()
            whole = False
            try:
                whole = self.log.flush(sorted(partitions))
            except Exception as exc:
                log.exception("fsync failed; the log writer stops accepting work")
                failure = LogError(f"log fsync failed: {exc}")
                failure.__cause__ = exc
                self._failure = failure
            elapsed = clock() - started
            with self._stats_lock:
                self._counts["fsyncs"] += 1
                self._inline_fsyncs += inline
                self._filesystem_syncs += whole
                self._fsync_seconds += elapsed
                self._fsync_buckets[bisect.bisect_left(FSYNC_BUCKETS, elapsed)] += 1
            if inline:
                self._guard.note(elapsed)
        if timed:  # (an fsync for ``always`` leaves the dirty set alone: write_now may
            self._last_fsync = time.monotonic()  # have written since it started)

    def _notify(self, request: _Request, outcome: AppendResult | BaseException) -> None:
        try:
            request.done(outcome)
        except Exception:
            log.exception("log writer completion callback raised")

    def _notify_batches(self, submission: _Submission) -> None:
        try:
            submission.done(submission.batches)
        except Exception:
            log.exception("log writer completion callback raised")

