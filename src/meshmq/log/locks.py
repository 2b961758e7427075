"""One owner per directory: an exclusive ``flock`` on its ``.lock`` file, and a way to look.

The broker holds the lock of the commit log's directory and of each state directory it has
open; ``meshmq log repair`` and ``meshmq state repair`` take the same lock, so a repair and a
broker never work on one directory at once. The read-only tools only *look* (``is_locked``):
taking even a shared lock could make a broker starting at that moment fail.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if sys.platform == "win32":  # pragma: no cover - no flock on this platform: no locking
    fcntl = None
else:
    import fcntl

LOCK_FILE = ".lock"


def acquire(path: Path) -> int | None:
    """Open ``path`` (created if missing) and take its exclusive flock.

    Returns the file descriptor (closing it releases the lock), or None when another open
    file (another process, or another owner in this one) holds the lock.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if fcntl is None:  # pragma: no cover
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def is_locked(path: Path) -> bool:
    """Whether a process holds the flock on ``path``, without taking it.

    Reads ``/proc/locks``; where that is missing, tries a shared lock and drops it at once.
    """
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return False
    try:
        with open("/proc/locks", encoding="ascii") as file:
            lines = file.read().splitlines()
    except OSError:  # pragma: no cover - systems without /proc/locks
        return _try_shared_lock(path)
    wanted = (os.major(stat.st_dev), os.minor(stat.st_dev), stat.st_ino)
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and "->" not in fields:
            major, minor, inode = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == wanted:
                return True
    return False


def _try_shared_lock(path: Path) -> bool:  # pragma: no cover - systems without /proc/locks
    if fcntl is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock if it was taken
    return False
