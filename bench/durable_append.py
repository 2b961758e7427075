"""What one durable append costs the commit log itself: append, then sync, timed together.

Usage::

    PYTHONPATH=src .venv/bin/python bench/durable_append.py [--appends N] [--dir D]

Opens a fresh ``CommitLog`` (default ``LogConfig``: 8 partitions) in a temporary directory in
``D`` and times, ``N`` times each:

* ``one``: one 64-byte record appended to partition 0, then ``flush([0])`` (what fsync
  ``always`` does for a loop turn of one publish);
* ``turn8``: one record appended to each of the 8 partitions, then ``flush`` of all 8 (a
  fan-in turn touches every partition).

Prints the p50 and p99 of each in µs. No event loop, no sockets: compare two trees by running
it with ``PYTHONPATH`` to each in turn, alternating, in the same minutes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from meshmq.log.commit_log import CommitLog
from meshmq.log.record import Record

T0 = 1_700_000_000_000


def timed(log: CommitLog, partitions: list[int], appends: int) -> list[float]:
    timings = []
    for n in range(appends):
        started = time.perf_counter()
        for partition in partitions:
            log.append_to(partition, [Record.new("bench/t", bytes(64), T0 + n)], T0 + n)
        log.flush(partitions)
        timings.append(time.perf_counter() - started)
    return sorted(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--appends", type=int, default=2000)
    parser.add_argument("--dir", default=None, help="directory on the disk to use")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as directory, CommitLog(directory) as log:
        for name, partitions in (("one", [0]), ("turn8", list(range(8)))):
            timings = timed(log, partitions, args.appends)
            p99 = timings[int(len(timings) * 0.99)]
            print(f"{name:6s} p50 {statistics.median(timings) * 1e6:7.1f} µs  "
                  f"p99 {p99 * 1e6:7.1f} µs")


if __name__ == "__main__":
    main()
