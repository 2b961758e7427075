"""How long one durability sync of a small append takes, by file layout and sync call.

Usage::

    .venv/bin/python bench/fsync_probe.py [--appends N] [--size B] [--files F] [--repeat R]
        [--dir D]

Each mode appends ``N`` writes of ``B`` bytes to each of ``F`` fresh files in ``D`` and, after
each round of writes, syncs the files one after the other, as the log does under ``fsync =
always`` for a loop turn that touched ``F`` partitions (timed: the round's syncs together):

* ``grow+fsync``: the file grows with every write, ``os.fsync`` (the log before
  preallocation);
* ``grow+fdatasync``: the same with ``os.fdatasync`` (still commits the size);
* ``fallocate+fdatasync``: the file was extended with ``os.posix_fallocate`` and fsynced
  first; writes land in unwritten extents, which the file system must mark written;
* ``zeroed+fdatasync``: the file was filled with written zeros and fsynced first; writes
  overwrite allocated, written blocks (no metadata at all to commit);
* ``fallocate+syncfs``: as ``fallocate+fdatasync``, but one ``syncfs`` of the file system
  per round instead of a sync per file, as the log does for a flush of several partitions
  (``log.syncfs_min_partitions``; where ``syncfs`` is not trusted, the mode is left out).

Prints the median and 99th percentile per mode and run, and the CPU time (this process's,
user and system) per round, modes alternating within a run, and each mode's median as a ratio
of ``grow+fsync``'s in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from meshmq.log.files import filesystem_sync

CHUNK = 4 * 1024 * 1024


def _prepare(path: str, mode: str, total: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    size = max(CHUNK, total)
    if mode.startswith("fallocate"):
        os.posix_fallocate(fd, 0, size)
        os.fsync(fd)
    elif mode.startswith("zeroed"):
        os.pwrite(fd, bytes(size), 0)
        os.fsync(fd)
    return fd


def one_mode(directory: str, mode: str, appends: int, size: int,
             files: int) -> tuple[list[float], float]:
    """The rounds' sync times, and the CPU time per round."""
    paths = [os.path.join(directory, f"probe-{mode}-{n}") for n in range(files)]
    fds = [_prepare(path, mode, appends * size) for path in paths]
    sync: Callable[[int], None] = os.fsync if mode == "grow+fsync" else os.fdatasync
    syncfs = filesystem_sync() if mode.endswith("syncfs") else None
    data = os.urandom(size)
    timings = []
    cpu = time.process_time()
    try:
        for n in range(appends):
            for fd in fds:
                os.pwrite(fd, data, n * size)
            started = time.perf_counter()
            if syncfs is not None:
                syncfs(fds[0])
            else:
                for fd in fds:
                    sync(fd)
            timings.append(time.perf_counter() - started)
        cpu = time.process_time() - cpu
    finally:
        for fd, path in zip(fds, paths, strict=True):
            os.close(fd)
            os.unlink(path)
    return timings, cpu / appends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--appends", type=int, default=2000)
    parser.add_argument("--size", type=int, default=200)
    parser.add_argument("--files", type=int, default=1, help="files synced per round")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="directory on the disk to probe")
    args = parser.parse_args()
    modes = ["grow+fsync", "grow+fdatasync", "fallocate+fdatasync", "zeroed+fdatasync"]
    if filesystem_sync() is not None:
        modes.append("fallocate+syncfs")
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for run in range(args.repeat):
            order = modes if run % 2 == 0 else modes[::-1]
            medians = {}
            for mode in order:
                timings, cpu = one_mode(directory, mode, args.appends, args.size, args.files)
                timings.sort()
                medians[mode] = statistics.median(timings)
                p99 = timings[int(len(timings) * 0.99)]
                print(f"run {run} {mode:22s} p50 {medians[mode] * 1e6:7.1f} µs  "
                      f"p99 {p99 * 1e6:7.1f} µs  CPU {cpu * 1e6:6.1f} µs a round")
            base = medians["grow+fsync"]
            print("   ratios to grow+fsync: " + ", ".join(
                f"{mode} {medians[mode] / base:.2f}x" for mode in modes))


if __name__ == "__main__":
    main()
