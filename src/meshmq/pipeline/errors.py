"""Exceptions raised by the ``meshmq`` Spark data source.

    SourceError
    ├── SourceOptionError    an option is missing, unknown or malformed (names the option)
    ├── LogNotFound          the path holds no meshmq commit log
    ├── DataLossError        a requested offset range was deleted by retention
    └── CorruptLog           a sealed part of a segment fails its checksum

Every message is one line that names the problem (option, partition, offsets, file and byte),
because Spark shows it to the user wrapped in its own error.
"""

from __future__ import annotations


class SourceError(Exception):
    """Root of every error the meshmq data source raises."""


class SourceOptionError(SourceError, ValueError):
    """A reader option is unknown or its value cannot be used."""


class LogNotFound(SourceError, FileNotFoundError):
    """The path given to ``load()`` is neither a data_dir nor a log directory."""


class DataLossError(SourceError):
    """Records the query asked for are gone (retention deleted their segment).

    Raised only with ``failOnDataLoss=true`` (the default); with ``false`` the gap is logged
    as a warning and skipped.
    """

    def __init__(self, partition: int, first: int, last: int, detail: str) -> None:
        super().__init__(
            f"partition {partition}: offsets {first}..{last} are no longer in the log ({detail});"
            " set failOnDataLoss=false to skip them"
        )
        self.partition = partition
        self.first = first
        self.last = last


class CorruptLog(SourceError):
    """A batch that must be whole fails its checks (bit rot, or a file edited by hand)."""

    def __init__(self, path: str, position: int, reason: str) -> None:
        super().__init__(f"{path}: corrupt record batch at byte {position}: {reason}")
        self.path = path
        self.position = position
