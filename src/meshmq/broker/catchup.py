"""Catch-up: a session reading persisted messages from the commit log instead of holding copies.

Theory of operation
-------------------
Persisted messages are routed in log order: when an append is durable the broker moves that
partition's *high watermark* (``Persistence.high_watermark[p]``, the offset after the last routed
record) and routes the message, all on the event loop. So at any moment, every persisted
message a session should have seen is either below the high watermark (it was routed) or not
routed yet.

A session uses a ``CatchUp`` when live delivery is not enough:

* a persistent session that goes offline, or whose bounded queue overflows, switches to its
  cursor: it stops taking copies of persisted messages, and later reads them from the log from
  where it stopped (``from_positions``);
* a client asks to replay history on SUBSCRIBE (docs/replay.md): that filter reads from the
  requested offsets up to the high watermark before it goes live.

Each ``ReplayFilter`` has its own start offset per partition (so two replays, or a resume and a
replay, never deliver the same record twice for one filter), and the catch-up's cursor per
partition is the lowest start still ahead. While a catch-up is active, a live persisted message
that one of its filters will read is skipped by the session (``covers``); the catch-up reaches
it later, in order. When every cursor reaches the high watermark the catch-up is finished and the
session is live again. Reading happens in chunks, only while the session's queue has room, so a
catch-up of millions of records holds a bounded number of them in memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshmq.broker.message import Message
from meshmq.log.errors import OffsetOutOfRange
from meshmq.log.record import Record
from meshmq.memo import remember
from meshmq.mqtt.codec import decode_properties
from meshmq.mqtt.properties import PacketKind, Properties, PropertyId, get_property
from meshmq.mqtt.topics import topic_matches

if TYPE_CHECKING:
    from meshmq.broker.interfaces import PartitionLog
    from meshmq.broker.session import Subscription

log = logging.getLogger("meshmq.catchup")

CHUNK_RECORDS = 512  # records read from one partition per step


@dataclass(slots=True)
class ReplayFilter:
    """One topic filter read from the log, from ``start[p]`` on in each partition ``p``."""

    topic_filter: str
    subscription: Subscription | None  # None: use the session's current subscription
    start: list[int]


@dataclass(slots=True)
class CatchUp:
    persistence: PartitionLog
    filters: list[ReplayFilter] = field(default_factory=list)
    dup_below: list[int] | None = None  # records below these offsets may have been sent before
    lost: int = 0  # records deleted by retention before this session could read them
    syncing: int = 0  # waiting for the leaders' high watermarks (PartitionLog.sync)
    _skipped: dict[int, int] = field(default_factory=dict)
    _matched: dict[tuple[str, str], bool] = field(default_factory=dict)

    def _matches(self, topic_filter: str, topic: str) -> bool:
        """``topic_matches``, cached per (filter, topic): a catch-up sees the same few topics
        over and over."""
        key = (topic_filter, topic)
        found = self._matched.get(key)
        if found is None:
            found = remember(self._matched, key, topic_matches(topic_filter, topic))
        return found

    # ------------------------------------------------------------------ construction

    def add(self, topic_filter: str, subscription: Subscription | None, start: list[int]) -> None:
        """Read ``topic_filter`` from ``start`` (replaces an earlier entry for that filter)."""
        self.filters = [f for f in self.filters if f.topic_filter != topic_filter]
        self.filters.append(ReplayFilter(topic_filter, subscription, list(start)))

    def cursor(self) -> list[int]:
        """Per partition: the lowest offset some filter still has to read."""
        high = self.persistence.high_watermark
        if not self.filters:
            return list(high)
        return [min(f.start[p] for f in self.filters) for p in range(len(high))]

    # ------------------------------------------------------------------ live traffic

    def covers(self, topic: str, position: tuple[int, int]) -> bool:
        """Will this catch-up deliver the persisted message at ``position`` on ``topic``?"""
        partition, offset = position
        return any(
            f.start[partition] <= offset and self._matches(f.topic_filter, topic)
            for f in self.filters
        )

    # ------------------------------------------------------------------ reading

    @property
    def finished(self) -> bool:
        if self.syncing:
            return False
        high = self.persistence.high_watermark
        return all(f.start[p] >= high[p] for f in self.filters for p in range(len(high)))

    def step(
        self, budget: int, subscriptions: dict[str, Subscription],
        deliver: Callable[[Message, Subscription, bool], bool], loop_now: float,
    ) -> int:
        """Read up to ``budget`` records and ``deliver`` the matching ones; return records read.

        ``deliver(message, subscription, dup)`` gets each match in log order per partition and
        returns False when the session cannot take it now: reading stops there, and that record
        is read again by the next step.
        """
        if self.syncing:
            return 0
        high = self.persistence.high_watermark
        cursor = self.cursor()
        read = 0
        for partition, end in enumerate(high):
            if read >= budget:
                break
            offset = cursor[partition]
            if offset >= end:
                continue
            done = offset
            for record in self._read(partition, offset, min(budget - read, end - offset)):
                if record.offset >= end:
                    break
                if not self._deliver(record, partition, subscriptions, deliver, loop_now):
                    budget = 0
                    break
                read += 1
                done = record.offset + 1
            else:
                done = max(done, self._after_gap(partition, offset))
            for f in self.filters:
                f.start[partition] = max(f.start[partition], done)
        return read

    def _after_gap(self, partition: int, offset: int) -> int:
        """Where reading continues when a read returned nothing (a retention gap skipped)."""
        return self._skipped.pop(partition, offset)

    def _read(self, partition: int, offset: int, limit: int) -> list[Record]:
        log_ = self.persistence
        try:
            return log_.read(partition, offset, min(limit, CHUNK_RECORDS))
        except OffsetOutOfRange:
            earliest = log_.earliest_offset(partition)
            if earliest <= offset:
                raise
            self.lost += earliest - offset
            log.warning("catch-up skipped records deleted by retention partition=%d "
                        "offsets=%d..%d", partition, offset, earliest - 1)
            self._skipped[partition] = earliest
            return []

    def _deliver(
        self, record: Record, partition: int, subscriptions: dict[str, Subscription],
        deliver: Callable[[Message, Subscription, bool], bool], loop_now: float,
    ) -> bool:
        offset = record.offset
        chosen: Subscription | None = None
        for f in self.filters:
            if f.start[partition] > offset or not self._matches(f.topic_filter, record.topic):
                continue
            sub = f.subscription or subscriptions.get(f.topic_filter)
            if sub is None:
                continue
            if chosen is None or sub.options.qos > chosen.options.qos:
                chosen = sub
        if chosen is None:
            return True
        message = message_from_record(record, partition, loop_now)
        if message is None:
            return True  # expired (MQTT-3.3.2-5)
        dup = self.dup_below is not None and offset < self.dup_below[partition]
        return deliver(message, chosen, dup)


def message_from_record(record: Record, partition: int, loop_now: float) -> Message | None:
    """Rebuild the ``Message`` a log record holds; None when its expiry interval has passed.

    The record's property block is the 5.0 PUBLISH block as published (length prefix
    included); a remaining expiry is counted from the record's timestamp (MQTT-3.3.2-6).
    """
    properties: Properties = {}
    if record.properties:
        properties, _ = decode_properties(
            record.properties, 0, len(record.properties), PacketKind.PUBLISH
        )
    expiry = get_property(properties, PropertyId.MESSAGE_EXPIRY_INTERVAL)
    if expiry is not None:
        age = (int(time.time() * 1000) - record.timestamp_ms) // 1000
        remaining = expiry - max(age, 0)
        if remaining <= 0:
            return None
        properties[PropertyId.MESSAGE_EXPIRY_INTERVAL] = remaining
    message = Message(
        record.topic, record.payload, record.qos, record.retain, properties,
        record.client_id or None, loop_now,
    )
    message.set_position(partition, record.offset)
    return message
