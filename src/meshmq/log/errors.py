"""Exceptions raised by the commit log.

    LogError
    ├── CorruptBatch            a record batch fails its checksum or structure checks
    ├── IncompleteBatch         the buffer ends inside a record batch (a torn tail)
    ├── CorruptSegment          a segment holds corruption recovery must not paper over
    ├── OffsetOutOfRange        a read asked for an offset the partition does not hold
    ├── LogConfigError          bad configuration, or a directory written with other settings
    ├── LogDirectoryLocked      another process has the log directory open
    └── LogClosed               the log or the writer was used after close()

``CorruptBatch`` and ``IncompleteBatch`` come from the batch codec (``record.py``); the segment
turns them into truncation (a torn or corrupt tail) or ``CorruptSegment`` (anything else).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path


def _data_dir_option(data_dir: str) -> str:
    """``--data-dir DIR`` ready to paste: absolute (the tool may run elsewhere), shell-quoted."""
    return f"--data-dir {shlex.quote(os.path.abspath(data_dir))}"


class LogError(Exception):
    """Root of every error the commit log raises."""

    def remedy(self, data_dir: str) -> str:
        """What to run next when a broker with this ``data_dir`` cannot open its log."""
        return f"see `meshmq log verify {_data_dir_option(data_dir)}`"


class CorruptBatch(LogError):
    """The bytes at this position are not a valid record batch (checksum, magic, lengths)."""


class IncompleteBatch(LogError):
    """The buffer ends before the record batch does: read more bytes, or treat it as torn."""


class CorruptSegment(LogError):
    """A segment is damaged in a way recovery refuses to repair by dropping data.

    ``path`` is the ``.log`` file and ``position`` the byte where the first bad batch starts.
    An operator restores the file (from a replica or a backup) or runs ``meshmq log repair``,
    which removes only the damaged batches and reports the offsets lost.
    """

    def __init__(self, path: Path | str, position: int, reason: str) -> None:
        super().__init__(f"{path}: corrupt record batch at byte {position}: {reason}")
        self.path = Path(path)
        self.position = position
        self.reason = reason

    def remedy(self, data_dir: str) -> str:
        option = _data_dir_option(data_dir)
        return (f"the broker will not drop data that is followed by good records: run "
                f"`meshmq log verify {option}` to see every damaged spot, then "
                f"`meshmq log repair {option}` to remove only the damaged batches (it keeps the "
                "damaged files in repair-backup-<time>/ and reports the offsets lost)")


class OffsetOutOfRange(LogError):
    """The requested offset is below ``earliest_offset`` or above ``next_offset``.

    Retention may have deleted the records a cursor pointed at: restart the cursor from
    ``earliest_offset`` (skip the gap) or report the loss, as the caller's policy says.
    """

    def __init__(self, offset: int, earliest_offset: int, next_offset: int) -> None:
        super().__init__(
            f"offset {offset} is out of range [{earliest_offset}, {next_offset}]"
        )
        self.offset = offset
        self.earliest_offset = earliest_offset
        self.next_offset = next_offset


class LogConfigError(LogError):
    """The configuration is invalid or disagrees with what is recorded on disk."""


class LogDirectoryLocked(LogError):
    """Another process holds the lock on this log directory; only one may open it."""

    def remedy(self, data_dir: str) -> str:
        return "another broker (or a `meshmq log repair`) is using this data_dir"


class LogClosed(LogError):
    """The log, partition or writer has been closed."""
