"""File helpers shared by the log: names, positional writes, read-only maps, durable metadata."""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

FsyncFunction = Callable[[int], None]  # os.fsync, or a wrapper a test injects

SYNCFS_MIN_LINUX = (5, 8)  # syncfs(2) reports write-back errors from Linux 5.8 on

LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
TIMEINDEX_SUFFIX = ".timeindex"
SEGMENT_SUFFIXES = (LOG_SUFFIX, INDEX_SUFFIX, TIMEINDEX_SUFFIX)


def segment_file_name(base_offset: int, suffix: str) -> str:
    """``00000000000000000042.log``: 20 digits, so names sort in offset order."""
    return f"{base_offset:020d}{suffix}"


def write_at(fd: int, data: bytes, position: int) -> None:
    """Write all of ``data`` at ``position`` (``os.pwrite`` may write less than asked)."""
    view = memoryview(data)
    written = 0
    while written < len(data):
        written += os.pwrite(fd, view[written:], position + written)


IOV_MAX = 1024  # buffers per pwritev call (Linux's UIO_MAXIOV)


def write_all_at(fd: int, buffers: list[bytes], position: int) -> None:
    """Write ``buffers`` one after the other from ``position``: one ``pwritev`` call per
    ``IOV_MAX`` buffers in the usual case, and whatever a short write left, written again."""
    for start in range(0, len(buffers), IOV_MAX):
        chunk = buffers[start:start + IOV_MAX]
        wanted = sum(len(b) for b in chunk)
        written = os.pwritev(fd, chunk, position)
        if written < wanted:  # rare (a signal, a full disk): finish it the simple way
            write_at(fd, b"".join(chunk)[written:], position + written)
        position += wanted


@contextmanager
def mapped(fd: int, size: int) -> Iterator[mmap.mmap]:
    """The first ``size`` (> 0) bytes of a file, mapped read-only for the ``with`` block."""
    mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    try:
        yield mapping
    finally:
        mapping.close()


def fsync_directory(directory: Path, fsync: FsyncFunction = os.fsync) -> None:
    """fsync a directory so file creations, renames and deletions in it are durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def create_durably(path: Path, fsync: FsyncFunction = os.fsync) -> None:
    """Create an empty marker file whose existence survives a power loss."""
    path.touch()
    fsync_directory(path.parent, fsync)


def list_segment_bases(directory: Path) -> list[int]:
    """Base offsets of the segments in ``directory``, sorted; orphan index files are removed
    (a deletion interrupted after the ``.log`` went)."""
    bases = sorted(int(p.stem) for p in directory.glob(f"*{LOG_SUFFIX}") if p.stem.isdigit())
    known = set(bases)
    for suffix in (INDEX_SUFFIX, TIMEINDEX_SUFFIX):
        for path in directory.glob(f"*{suffix}"):
            if path.stem.isdigit() and int(path.stem) not in known:
                path.unlink()
    return bases


def kernel_at_least(release: str, wanted: tuple[int, int]) -> bool:
    """Is the Linux ``release`` (``os.uname().release``, "6.1.0-18-amd64") ``wanted`` or
    later? False when it does not start with MAJOR.MINOR."""
    found = re.match(r"(\d+)\.(\d+)", release)
    return found is not None and (int(found[1]), int(found[2])) >= wanted


def filesystem_sync() -> FsyncFunction | None:
    """``syncfs(2)``: given any descriptor on a file system, make everything written to that
    file system durable (every file's data and metadata, one journal commit and one cache
    flush of the device), raising ``OSError`` when that failed. None where it cannot be
    trusted to say so: other systems than Linux, and Linux before 5.8 (whose ``syncfs``
    returned 0 after a failed write-back)."""
    if not sys.platform.startswith("linux") or not kernel_at_least(os.uname().release,
                                                                   SYNCFS_MIN_LINUX):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).syncfs  # (releases the GIL: a call)
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int

    def syncfs(fd: int) -> None:
        if function(fd) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"syncfs: {os.strerror(error)}")

    return syncfs
