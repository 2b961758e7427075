"""The broker's side of the commit log: which publishes persist, and acks once durable.

Theory of operation
-------------------
``Persistence.append()`` turns a ``Message`` into a log ``Record`` and hands it to the
``LogWriter`` thread without blocking; the outcome is typed (``Stored``, ``Refused``:
broker/interfaces.py). When the writer has made the record as durable as the
fsync policy promises it calls back on its own thread; completions are queued and delivered to
the event loop in one ``call_soon_threadsafe`` per burst, in the order the writer finished them
(which is the order they were submitted). Queuing a completion takes no lock: a deque append
and a flag test (see ``_completed``). The broker routes the message and sends PUBACK/PUBREC
only in that callback, so:

* an acknowledged message is in the log under the configured policy (``always``: fsynced);
* subscribers only ever see messages that are in the log;
* messages of one publisher keep their order.

A full writer queue is backpressure: ``append()`` returns False and the broker refuses the
publish (5.0: 0x97 Quota exceeded) rather than buffering without bound.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Collection
from functools import partial
from pathlib import Path

from meshmq.broker.interfaces import Completion, Refused, Stored
from meshmq.broker.message import Message
from meshmq.config import LogSettings
from meshmq.log.commit_log import CommitLog
from meshmq.log.config import LogConfig
from meshmq.log.errors import LogConfigError
from meshmq.log.record import Record
from meshmq.log.writer import AppendResult, FsyncPolicy, LogWriter
from meshmq.memo import remember
from meshmq.mqtt.errors import RemoteProtocolError
from meshmq.mqtt.reason_codes import ReasonCode
from meshmq.mqtt.topics import topic_matches, validate_topic_filter

log = logging.getLogger("meshmq.persistence")

_Outcome = AppendResult | BaseException


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
                 high_watermark: list[int] | None = None) -> None:
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
        )
        self.commit_log = CommitLog(Path(data_dir), config, partitions=owned)
        self.writer = LogWriter(
            self.commit_log, fsync_policy=settings.fsync,
            fsync_interval_ms=settings.fsync_interval_ms, queue_size=settings.queue_size,
        )
        self._done: deque[tuple[Completion, _Outcome]] = deque()
        self._scheduled = False
        self._policies: dict[str, FsyncPolicy | None] = {}
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
        """Queue ``message`` for the log; ``done`` runs on the loop once durable (``Stored``)
        or failed (``Refused``). ``message_id``: the record's id (None: a new one).

        Returns False, without calling ``done``, when the writer's queue is full.
        """
        try:
            self.writer.submit_nowait(*self._request(message, client_id, done,
                                                     int(time.time() * 1000), message_id))
        except queue.Full:
            return False
        return True

    def append_many(self, publishes: list[tuple[Message, str, Completion, bytes | None]]
                    ) -> int:
        """``append`` for each (message, client id, done, message id) in order, under one
        lock round trip of the writer's queue; returns how many were queued (the rest found
        it full and their ``done`` is never called)."""
        now_ms = int(time.time() * 1000)
        return self.writer.submit_many_nowait(
            [self._request(message, client_id, done, now_ms, message_id)
             for message, client_id, done, message_id in publishes])

    def _request(self, message: Message, client_id: str, done: Completion, now_ms: int,
                 message_id: bytes | None = None
                 ) -> tuple[Record, Callable[[_Outcome], None], FsyncPolicy | None]:
        record = Record.new(
            message.topic, message.payload, now_ms, qos=message.qos, retain=message.retain,
            properties=message.encoded_properties(), client_id=client_id,
            message_id=message_id,
        )
        return record, partial(self._completed, done), self._policy_for(message.topic)

    def read(self, partition: int, offset: int, max_records: int) -> list[Record]:
        return self.commit_log.read(partition, offset, max_records=max_records)

    def routes_all(self, partition: int) -> bool:
        return True  # it leads every partition it routes

    def earliest_offset(self, partition: int) -> int:
        return self.commit_log.earliest_offset(partition)

    def offset_for_timestamp(self, partition: int, timestamp_ms: int) -> int | None:
        return self.commit_log.offset_for_timestamp(partition, timestamp_ms)

    def sync(self, done: Callable[[], None]) -> None:
        """The high watermark here is the leader's own: nothing to wait for."""
        done()

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

    def _completed(self, done: Completion, outcome: _Outcome) -> None:
        """On the writer thread: queue the completion, wake the loop once per burst.

        No lock: the append comes before the flag test here, and ``_drain`` clears the flag
        before it empties the deque, so a completion is either seen by a drain already
        running or schedules a new one. A race only costs an extra, empty drain.
        """
        self._done.append((done, outcome))
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
            callback, outcome = done.popleft()
            if isinstance(outcome, BaseException):
                callback(Refused(getattr(outcome, "reason_code", ReasonCode.UNSPECIFIED_ERROR),
                                 f"commit log append failed: {outcome}"))
            else:
                callback(Stored(outcome.partition, outcome.offset))

    def close(self) -> None:
        """Finish queued appends (their completions are dropped) and close the log."""
        self.writer.close()
        self.commit_log.close()
        log.info("commit log closed")


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
