"""``Partitioner``: which partition a topic's records go to.

The mapping must be identical in every process and on every run, because ordering is only
guaranteed within a partition: it uses ``zlib.crc32`` of the UTF-8 key, never Python's
``hash()`` (randomized per process). The key is the whole topic, or with ``key_level`` only
that topic level (0-based): with ``key_level=1``, ``devices/42/temp`` and ``devices/42/gps``
share a partition, so one device's messages stay in order. A topic with too few levels is
hashed whole.

    partition = zlib.crc32(key.encode("utf-8")) % partitions

Every publish asks (on its worker, at its partition's leader, and in the writer thread), and a
fleet publishes on the same topics again and again: answers are kept per topic
(``meshmq/memo.py``).
"""

from __future__ import annotations

import zlib

from meshmq.memo import remember


class Partitioner:
    """Stable topic -> partition mapping; see the module docstring for the rule."""

    def __init__(self, partitions: int, key_level: int | None = None) -> None:
        if partitions < 1:
            raise ValueError("partitions must be >= 1")
        self.partitions = partitions
        self.key_level = key_level
        self._cache: dict[str, int] = {}

    def key_for(self, topic: str) -> str:
        """The part of ``topic`` that is hashed."""
        if self.key_level is None:
            return topic
        levels = topic.split("/")
        return levels[self.key_level] if self.key_level < len(levels) else topic

    def partition_for(self, topic: str) -> int:
        """The partition every record on ``topic`` is appended to."""
        partition = self._cache.get(topic)
        if partition is None:
            partition = remember(self._cache, topic,
                                 zlib.crc32(self.key_for(topic).encode("utf-8")) % self.partitions)
        return partition
