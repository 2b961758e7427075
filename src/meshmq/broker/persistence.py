"""The broker's side of the commit log: which publishes persist, and acks once durable.

Theory of operation
-------------------
``Persistence.append()`` encodes a ``Message`` into its partition's record batch of the
current loop turn at once (``AppendBatch``: log/writer.py, ``BatchBuilder``: log/record.py)
and returns; the outcome is typed (``Stored``, ``Refused``: broker/interfaces.py) and comes
later. At the end of the turn (one ``call_soon`` per turn) the turn's batches, one per
partition, go to the log together:

* when nothing handed to the writer thread is still pending, they are written here
  (``write_now``: one page-cache write per partition, never a roll), and the partitions
  holding ``always`` batches are fsynced here too, once each, after all the writes (group
  commit by loop turn; from ``log.syncfs_min_partitions`` partitions on, one ``syncfs`` of
  the log's file system instead: log/commit_log.py); the turn completes at once, in the same
  loop turn, and the acks and deliveries its completions queued are written right after them
  (``after_completions``: the broker's ``flush_output``), not after the loop's next poll and
  the reads it brings (with ``always``, the publishes that arrived during the fsync).
  Fsyncing on the loop stalls every connection of it for the fsync, so it holds only while
  the writer says fsyncs are quick (``LogWriter.fsync_allowed``: a moving average under
  ``log.fsync_inline_max_ms``, 2 ms, tried again after a wait once it was over;
  log/inline_guard.py);
* otherwise (slow fsyncs and ``always`` in the turn, a segment to roll, earlier turns still
  in the writer) they go to the ``LogWriter`` thread in one submission (what ``write_now``
  wrote already is not written again); when it has made them as durable as the fsync policy
  promises it calls back on its own thread, and completions are queued and delivered to the
  event loop in one ``call_soon_threadsafe`` per burst (a deque append and a flag test: see
  ``_written``). When fsyncs may run on the loop (again) while turns are still in the writer,
  the publishes of the turns after them keep gathering in one turn, which goes to the log on
  the loop once the writer's turns are back (they would have completed after those anyway):
  so the loop's fsyncs come back even under a load that never lets the writer go idle.

Turns complete in the order they were appended, and each turn's publishes in their order, so
the broker routes the message and sends PUBACK/PUBREC only in that callback, and:

* an acknowledged message is in the log under the configured policy (``always``: fsynced);
* subscribers only ever see messages that are in the log;
* messages of one publisher keep their order, and so do its acknowledgements.

A full queue is backpressure: ``append()`` returns False when the records waiting for the
writer (this turn's and the writer's queue) reach ``log.queue_size``, and the broker refuses
the publish (5.0: 0x97 Quota exceeded) rather than buffering without bound.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import time
from collections import deque
from collections.abc import Callable, Collection
from functools import partial
from pathlib import Path
from typing import Final

from meshmq.broker.interfaces import Completion, Refused, Stored
from meshmq.broker.message import Message
from meshmq.config import LogSettings
from meshmq.log.commit_log import CommitLog
from meshmq.log.config import LogConfig
from meshmq.log.errors import LogClosed, LogConfigError
from meshmq.log.files import filesystem_sync
from meshmq.log.partition import TARGET_BATCH_BYTES
from meshmq.log.record import Record, new_message_id, wall_clock_ms
from meshmq.log.writer import AppendBatch, FsyncPolicy, LogWriter
from meshmq.memo import remember
from meshmq.mqtt.errors import RemoteProtocolError
from meshmq.mqtt.reason_codes import ReasonCode
from meshmq.mqtt.topics import topic_matches, validate_topic_filter
from meshmq.mypycattr import mypyc_attr

log: Final = logging.getLogger("meshmq.persistence")
SYNCFS: Final = filesystem_sync()  # None where syncfs cannot be trusted (commit_log.py)


@mypyc_attr(allow_interpreted_subclasses=True)  # cluster/partitions.py: PartitionedLog
class LogAccess:
    """What every ``PartitionLog`` shares: which publishes persist, and the high watermark."""

    high_watermark: list[int]

    def __init__(self, settings: LogSettings) -> None:
        self.settings = settings
        self.filters = [f.strip() for f in settings.persist_filters.split(",") if f.strip()]
        self._cache: dict[str, bool] = {}

    def wants(self, topic: str, qos: int) -> bool:
        """Is a publish on ``topic`` at ``qos`` persisted? (cached per topic)"""
        if not qos and not self.settings.persist_qos0:
            return False
        decision = self._cache.get(topic)
        if decision is None:
            decision = remember(self._cache, topic,
                                any(topic_matches(f, topic) for f in self.filters))
        return decision

    def routed(self, partition: int, offset: int) -> None:
        """The record at ``offset`` is being routed: advance that partition's high watermark."""
        if offset >= self.high_watermark[partition]:
            self.high_watermark[partition] = offset + 1


class Persistence(LogAccess):
    """The commit log's partitions this process leads (all of them on a single-process node),
    with their writer thread: the core's ``PartitionLog`` (broker/interfaces.py) on one node.

    ``owned``: the partitions to open (None: all). ``high_watermark``: the list to keep the
    high watermarks in (shared with a caller that holds those of other partitions too)."""

    def __init__(self, settings: LogSettings, data_dir: str, loop: asyncio.AbstractEventLoop,
                 owned: Collection[int] | None = None,
                 high_watermark: list[int] | None = None, *,
                 fsync: Callable[[int], None] = os.fsync,
                 fsync_clock: Callable[[], float] = time.monotonic,
                 syncfs: Callable[[int], None] | None = SYNCFS) -> None:
        """``fsync`` syncs a log file, ``syncfs`` the log's file system (None: each partition
        is synced alone) and ``fsync_clock`` times the syncs (tests give a slow or recording
        disk here: compiled with mypyc, this module's names cannot be patched)."""
        super().__init__(settings)
        self.loop = loop
        self.fsync_rules = parse_fsync_rules(settings.fsync_rules)  # before opening anything
        config = LogConfig(
            partitions=settings.partitions,
            segment_bytes=settings.segment_bytes,
            segment_ms=settings.segment_ms,
            retention_bytes=settings.retention_bytes,
            retention_ms=settings.retention_ms,
            key_level=None if settings.key_level < 0 else settings.key_level,
            syncfs_min_partitions=settings.syncfs_min_partitions,
        )
        self.commit_log = CommitLog(Path(data_dir), config, partitions=owned, fsync=fsync,
                                    syncfs=syncfs)
        self.writer = LogWriter(
            self.commit_log, fsync_policy=settings.fsync,
            fsync_interval_ms=settings.fsync_interval_ms, queue_size=settings.queue_size,
            inline_fsync_slow_ms=settings.fsync_inline_max_ms, fsync_clock=fsync_clock,
        )
        self.queue_size = settings.queue_size
        self._default_policy = FsyncPolicy(settings.fsync)
        self._partition_for = self.commit_log.partitioner.partition_for
        self._entries: list[_Entry] = []  # this turn's publishes, in order
        self._batches: list[AppendBatch] = []  # this turn's batches, in order
        self._open: dict[int, AppendBatch] = {}  # the batch filling, by partition
        self._turn_ms = 0
        self._in_writer = 0  # turns handed to the writer thread and not completed yet
        self._done: deque[list[_Entry]] = deque()  # turns the writer completed
        self._scheduled = False
        self._held = False  # the turn's publishes wait for the writer's turns: see _end_turn
        self._policies: dict[str, FsyncPolicy | None] = {}
        # Called after a turn's completions (set by the broker: write the acks and deliveries
        # they queued now, rather than after the loop's next poll and the reads it brings).
        self.after_completions: Callable[[], None] | None = None
        # Per partition, the offset after the last record routed to subscribers (catchup.py).
        if high_watermark is None:
            high_watermark = [0] * self.commit_log.partition_count
        for partition in self.commit_log.owned:
            high_watermark[partition] = self.commit_log.next_offset(partition)
        self.high_watermark = high_watermark

    @property
    def owned(self) -> tuple[int, ...]:
        return self.commit_log.owned

    def partition_for(self, topic: str) -> int:
        return self.commit_log.partition_for(topic)

    def append(self, message: Message, client_id: str, done: Completion,
               message_id: bytes | None = None) -> bool:
        """Encode ``message`` into this turn's batch for its partition; ``done`` runs on the
        loop once durable (``Stored``) or failed (``Refused``). ``message_id``: the record's
        id (None: a new one).

        Returns False, without calling ``done``, when the log's queue is full.
        """
        entries = self._entries
        if len(entries) + self.writer.queued >= self.queue_size:
            return False
        if entries:
            now_ms = self._turn_ms
        else:
            now_ms = self._turn_ms = wall_clock_ms()
            self.loop.call_soon(self._end_turn)
        topic = message.topic
        partition = self._partition_for(topic)
        policy = (self._policy_for(topic) if self.fsync_rules else None) or self._default_policy
        batch = self._open.get(partition)
        # A new batch when the policy changes too (log.fsync_rules), so that a partition's
        # offsets keep the order of its publishes, as catch-up and replay read them.
        if batch is None or batch.size > TARGET_BATCH_BYTES or batch.policy is not policy:
            batch = self._open[partition] = AppendBatch(partition, policy)
            self._batches.append(batch)
        try:
            index = batch.add(message.topic_bytes, client_id.encode(),
                              message.encoded_properties(), message.payload, message.qos,
                              message.retain, message_id or new_message_id(now_ms), now_ms)
        except ValueError as exc:  # a record the format cannot hold: refused alone
            refused = AppendBatch(partition, batch.policy)
            refused.error = exc
            entries.append((done, refused, 0))
            return True
        entries.append((done, batch, index))
        return True

    def append_many(self, publishes: list[tuple[Message, str, Completion, bytes | None]]
                    ) -> int:
        """``append`` for each (message, client id, done, message id) in order; returns how
        many were taken (the rest found the queue full and their ``done`` is never called)."""
        taken = 0
        for message, client_id, done, message_id in publishes:
            if not self.append(message, client_id, done, message_id):
                break
            taken += 1
        return taken

    def _end_turn(self) -> None:
        """This turn's batches go to the log: written (and fsynced) here while fsyncs are
        quick or none is needed, else handed to the writer thread (see the module
        docstring)."""
        entries, batches = self._entries, self._batches
        if not entries:
            return
        always = any(batch.policy is FsyncPolicy.ALWAYS for batch in batches)
        if self._in_writer and always and self.writer.fsync_allowed():
            # Fsyncs are quick (again) but earlier turns are still in the writer: this turn
            # would complete after them anyway, so it keeps gathering until they are back and
            # then goes to the log here (_drain), instead of into the writer's next group.
            # (Its records keep the timestamp of the turn that started it.)
            self._held = True
            return
        self._entries, self._batches, self._open = [], [], {}
        if not self._in_writer and (not always or self.writer.fsync_allowed()):
            try:
                batches = self.writer.write_now(batches)
            except LogClosed as exc:
                self._fail(batches, exc)
                batches = []
            if not batches:
                self._complete(entries)
                return self._completed()
        try:
            self.writer.submit_batches(batches, partial(self._written, entries))
        except (queue.Full, LogClosed) as exc:
            self._fail(batches, exc)
            self._complete(entries)
            return self._completed()
        self._in_writer += 1

    @staticmethod
    def _fail(batches: list[AppendBatch], error: BaseException) -> None:
        for batch in batches:
            batch.error = error

    def _complete(self, entries: list[_Entry]) -> None:
        """Tell each publish of a turn where it was stored, in order (on the loop)."""
        for done, batch, index in entries:
            error = batch.error
            if error is None:
                done(Stored(batch.partition, batch.base_offset + index))
            else:
                done(Refused(_reason_code(error), f"commit log append failed: {error}"))

    def _completed(self) -> None:
        hook = self.after_completions
        if hook is not None:
            hook()

    def read(self, partition: int, offset: int, max_records: int) -> list[Record]:
        return self.commit_log.read(partition, offset, max_records=max_records)

    def routes_all(self, partition: int) -> bool:
        return True  # it leads every partition it routes

    def earliest_offset(self, partition: int) -> int:
        return self.commit_log.earliest_offset(partition)

    def offset_for_timestamp(self, partition: int, timestamp_ms: int) -> int | None:
        return self.commit_log.offset_for_timestamp(partition, timestamp_ms)

    def sync(self, done: Callable[[], None], timestamp_ms: int | None = None) -> None:
        """The high watermark here is the leader's own: nothing to wait for."""
        done()

    def views_known(self) -> bool:
        return True

    def _policy_for(self, topic: str) -> FsyncPolicy | None:
        """The fsync policy of the first ``log.fsync_rules`` entry matching ``topic``."""
        if not self.fsync_rules:
            return None
        try:
            return self._policies[topic]  # None is a cached "no rule"
        except KeyError:
            pass
        return remember(self._policies, topic, next(
            (rule for pattern, rule in self.fsync_rules if topic_matches(pattern, topic)),
            None,
        ))

    def _written(self, entries: list[_Entry], batches: list[AppendBatch]) -> None:
        """On the writer thread: queue the turn's completion, wake the loop once per burst.

        No lock: the append comes before the flag test here, and ``_drain`` clears the flag
        before it empties the deque, so a completion is either seen by a drain already
        running or schedules a new one. A race only costs an extra, empty drain.
        """
        self._done.append(entries)
        if self._scheduled:
            return
        self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: the broker is gone, nobody to tell
            pass

    def _drain(self) -> None:
        self._scheduled = False
        done = self._done
        while done:
            entries = done.popleft()
            self._in_writer -= 1
            self._complete(entries)
        self._completed()
        if self._held and not self._in_writer:
            self._held = False
            self._end_turn()

    def close(self) -> None:
        """Write this turn's appends (their completions are dropped), finish the writer's
        queue, and close the log."""
        if self._batches:
            try:
                self.writer.submit_batches(self._batches, _dropped)
            except (queue.Full, LogClosed):
                log.warning("commit log closed with %d appends not written",
                            len(self._entries))
            self._entries, self._batches, self._open = [], [], {}
        self.writer.close()
        self.commit_log.close()
        log.info("commit log closed")


_Entry = tuple[Completion, AppendBatch, int]  # a publish of a turn: its batch and index


def _reason_code(error: BaseException) -> int:
    if isinstance(error, queue.Full):
        return ReasonCode.QUOTA_EXCEEDED
    return getattr(error, "reason_code", ReasonCode.UNSPECIFIED_ERROR)


def _dropped(batches: list[AppendBatch]) -> None:
    """Nobody waits for the appends written while closing."""


def parse_fsync_rules(text: str) -> list[tuple[str, FsyncPolicy]]:
    """``"a/#=interval, b/+=always"`` -> [(filter, policy)]; LogConfigError names a bad entry."""
    rules = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        pattern, sep, policy = item.rpartition("=")
        try:
            if not sep:
                raise ValueError
            validate_topic_filter(pattern.strip())
            rules.append((pattern.strip(), FsyncPolicy(policy.strip())))
        except (ValueError, RemoteProtocolError):
            raise LogConfigError(
                f"log.fsync_rules: {item!r} is not FILTER=always|interval|never"
            ) from None
    return rules
