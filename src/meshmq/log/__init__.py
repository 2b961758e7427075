"""meshmq's commit log: partitioned, segmented, checksummed storage of every persisted publish.

Layers, bottom up: ``record`` (the batch codec), ``index`` and ``segment`` (one ``.log`` file
and its sparse indexes), ``partition`` (an ordered list of segments), ``commit_log`` (N
partitions and the topic ``partitioner``), ``writer`` (a background thread with group commit
and an fsync policy). Nothing here uses asyncio; ``docs/log-format.md`` describes the files.
"""

from meshmq.log.commit_log import CommitLog, LogStatistics
from meshmq.log.config import LogConfig
from meshmq.log.errors import (
    CorruptBatch,
    CorruptSegment,
    IncompleteBatch,
    LogClosed,
    LogConfigError,
    LogDirectoryLocked,
    LogError,
    OffsetOutOfRange,
)
from meshmq.log.partition import Partition, PartitionStatistics, RecoveryReport
from meshmq.log.partitioner import Partitioner
from meshmq.log.record import Record, decode_batch, decode_batches, encode_batch, new_message_id
from meshmq.log.segment import LogSegment
from meshmq.log.writer import AppendResult, FsyncPolicy, LogWriter, WriterStatistics

__all__ = [
    "AppendResult",
    "CommitLog",
    "CorruptBatch",
    "CorruptSegment",
    "FsyncPolicy",
    "IncompleteBatch",
    "LogClosed",
    "LogConfig",
    "LogConfigError",
    "LogDirectoryLocked",
    "LogError",
    "LogSegment",
    "LogStatistics",
    "LogWriter",
    "OffsetOutOfRange",
    "Partition",
    "PartitionStatistics",
    "Partitioner",
    "Record",
    "RecoveryReport",
    "WriterStatistics",
    "decode_batch",
    "decode_batches",
    "encode_batch",
    "new_message_id",
]
