"""``LogConfig``: the settings of a commit log, with Kafka's names and defaults where they fit."""

from __future__ import annotations

from dataclasses import dataclass

from meshmq.log.errors import LogConfigError
from meshmq.log.segment import DEFAULT_INDEX_INTERVAL_BYTES

UNLIMITED = -1
MIB = 1024 * 1024
DAY_MS = 24 * 3600 * 1000
MAX_SEGMENT_BYTES_SETTING = (1 << 31) - 1  # like Kafka's segment.bytes (an int)
DEFAULT_PREALLOCATE_BYTES = 4 * MIB  # one full fsync per 4 MiB appended; the rest fdatasync


@dataclass(frozen=True, slots=True)
class LogConfig:
    """How a commit log is laid out and when its segments roll and expire.

    ``partitions`` is fixed when the log is created (``meta.json`` records it). A segment rolls
    once it would exceed ``segment_bytes`` or is older than ``segment_ms``; whole old segments
    are deleted beyond ``retention_bytes`` per partition or ``retention_ms`` of age (-1: keep
    forever). ``key_level`` picks the topic level hashed to choose a partition (None: the
    whole topic). The active segment's file is extended ``preallocate_bytes`` at a time (at
    most ``segment_bytes``) so that appends leave its size alone and a sync can skip the
    metadata (0: the file grows with each append, and each sync is a full fsync). A flush of
    at least ``syncfs_min_partitions`` partitions is one sync of their file system, when the
    ``CommitLog`` was given one (0, the default: always one sync per partition).
    """

    partitions: int = 8
    segment_bytes: int = 64 * MIB
    segment_ms: int = 7 * DAY_MS
    retention_bytes: int = UNLIMITED
    retention_ms: int = 7 * DAY_MS
    index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES
    key_level: int | None = None
    preallocate_bytes: int = DEFAULT_PREALLOCATE_BYTES
    syncfs_min_partitions: int = 0

    def __post_init__(self) -> None:
        _require(1 <= self.partitions <= 65536, "partitions must be between 1 and 65536")
        _require(1 <= self.segment_bytes <= MAX_SEGMENT_BYTES_SETTING,
                 f"segment_bytes must be between 1 and {MAX_SEGMENT_BYTES_SETTING}")
        _require(self.segment_ms >= 1, "segment_ms must be positive")
        _require(self.retention_bytes == UNLIMITED or self.retention_bytes >= 0,
                 "retention_bytes must be -1 (unlimited) or >= 0")
        _require(self.retention_ms == UNLIMITED or self.retention_ms >= 0,
                 "retention_ms must be -1 (unlimited) or >= 0")
        _require(self.index_interval_bytes >= 0, "index_interval_bytes must be >= 0")
        _require(self.key_level is None or self.key_level >= 0, "key_level must be >= 0")
        _require(self.preallocate_bytes >= 0, "preallocate_bytes must be >= 0")
        _require(self.syncfs_min_partitions >= 0, "syncfs_min_partitions must be >= 0")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise LogConfigError(message)
