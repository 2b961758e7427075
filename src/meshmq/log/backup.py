"""Cutting bytes out of a stored file without losing them: ``repair-backup-<UTC time>/``.

Theory of operation
-------------------
Whatever drops stored bytes goes through here: ``meshmq log repair``, ``meshmq state repair``,
and the broker's start-up recovery when it cuts the torn tail a crash left in the active log
segment or in the state journal. Each keeps the file *as it was* in a ``repair-backup-<UTC
time>/`` directory beside it (``-2``, ``-3``... when that name is taken), then replaces the
file by the byte ranges that survive. The operator finds every cut in one place, under one
name, and deletes those directories once the data is known to be good; the broker ignores them.

Crash safety, in order: the backup directory is created and fsynced with its parent; the file is
hard-linked into it (the rewrite gives the live name a new inode, so the link keeps the old
bytes for free) or, where links fail, copied and fsynced; the surviving ranges are written to
``.<name>.repair-tmp`` and fsynced; the temporary file is renamed over the original and the
directory fsynced. A crash leaves the old file or the new one, and perhaps a temporary file
that nothing reads (``meshmq log|state repair`` remove it).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

from meshmq.log.files import FsyncFunction, fsync_directory

BACKUP_PREFIX = "repair-backup-"
REPAIR_TEMP_SUFFIX = ".repair-tmp"  # ".{name}.repair-tmp", renamed over {name}
COPY_CHUNK_BYTES = 1 << 20
ByteRange = tuple[int, int]  # [start, end) of a file


def backup_stamp(now: datetime | None = None) -> str:
    """The ``<UTC time>`` part of a backup directory's name: ``20261123T152621Z``."""
    return (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")


def make_backup_dir(parent: Path, stamp: str, fsync: FsyncFunction = os.fsync) -> Path:
    """Create ``parent/repair-backup-<stamp>`` (or ``-2``, ``-3``... if taken), durably."""
    path, n = parent / f"{BACKUP_PREFIX}{stamp}", 1
    while True:
        try:
            path.mkdir()
            break
        except FileExistsError:
            n += 1
            path = parent / f"{BACKUP_PREFIX}{stamp}-{n}"
    fsync_directory(parent, fsync)
    return path


def keep_copy(source: Path, backup: Path, fsync: FsyncFunction = os.fsync) -> Path:
    """Keep ``source`` as it is now in ``backup``: a hard link, or a copy where links fail.

    A hard link shares the inode, so the caller must replace ``source`` by a new file
    (``rewrite_keeping``), never change it in place. Returns the kept path.
    """
    target = backup / source.name
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
        with open(target, "rb") as file:
            fsync(file.fileno())
    fsync_directory(backup, fsync)
    return target


def rewrite_keeping(path: Path, keep: Sequence[ByteRange],
                    fsync: FsyncFunction = os.fsync) -> None:
    """Replace ``path`` by the concatenation of its ``keep`` ranges, atomically and durably."""
    temporary = path.parent / f".{path.name}{REPAIR_TEMP_SUFFIX}"
    with open(path, "rb") as source, open(temporary, "wb") as target:
        for start, end in keep:
            _copy_range(source, target, start, end)
        target.flush()
        fsync(target.fileno())
    os.replace(temporary, path)
    fsync_directory(path.parent, fsync)


def cut_file(path: Path, keep: Sequence[ByteRange], *, stamp: str | None = None,
             fsync: FsyncFunction = os.fsync) -> Path:
    """Keep ``path`` as it is in a new backup directory beside it, then reduce it to ``keep``.

    Returns the kept copy. Open file descriptors of ``path`` still see the old file: reopen it.
    """
    backup = make_backup_dir(path.parent, stamp or backup_stamp(), fsync)
    kept = keep_copy(path, backup, fsync)
    rewrite_keeping(path, keep, fsync)
    return kept


def _copy_range(source: BinaryIO, target: BinaryIO, start: int, end: int) -> None:
    source.seek(start)
    remaining = end - start
    while remaining:
        chunk = source.read(min(remaining, COPY_CHUNK_BYTES))
        if not chunk:
            raise OSError(f"{source.name} shrank while it was being cut")
        target.write(chunk)
        remaining -= len(chunk)
