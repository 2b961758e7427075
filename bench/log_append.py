"""Append throughput of meshmq's commit log, beside the disk's own sequential write speed.

Usage::

    PYTHONPATH=src python bench/log_append.py [--records N] [--batch B] [--dir DIR]

For 100 B and 4 KB payloads it appends ``N`` records (default 100 000) to an 8-partition log:

* ``append_many``: the storage engine alone, ``CommitLog.append_many`` in batches of ``B``
  records from one thread, one ``flush()`` at the end (included);
* ``writer``: the broker's path, one producer thread calling ``LogWriter.submit`` with the fsync
  policy shown; the clock stops when the last completion callback fires (for ``never`` and
  ``interval`` the data may then still be in the page cache: that is what those policies
  promise).

Two baselines write the same number of bytes the log put on disk: a Python loop of 1 MiB
``os.write`` calls ending with one ``fsync`` (included), and ``dd if=/dev/zero bs=1M
oflag=direct`` when ``dd`` is available. The ratio columns divide the log's on-disk MB/s by
each baseline. MB = 10**6 bytes. Runs in well under 60 s with the defaults on an SSD.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from meshmq.log import CommitLog, LogConfig, LogWriter, Record

SIZES = (100, 4096)
T0 = 1_700_000_000_000
MIB = 1024 * 1024


@dataclass
class Row:
    size: int
    path: str
    policy: str
    records: int
    seconds: float
    disk_bytes: int

    def cells(self, write_mbs: float, dd_mbs: float | None) -> list[str]:
        disk_mbs = self.disk_bytes / self.seconds / 1e6
        payload_mbs = self.records * self.size / self.seconds / 1e6
        return [
            f"{self.size} B", self.path, self.policy, f"{self.records:,}", f"{self.seconds:.2f}",
            f"{self.records / self.seconds:,.0f}", f"{payload_mbs:.1f}",
            f"{disk_mbs:.1f}", f"{disk_mbs / write_mbs:.2f}",
            f"{disk_mbs / dd_mbs:.2f}" if dd_mbs else "n/a",
        ]


def make_records(count: int, size: int) -> list[Record]:
    payload = os.urandom(size)
    return [Record.new(f"devices/{i % 100}/telemetry", payload, T0 + i // 100, qos=1,
                       client_id=f"device-{i % 100}") for i in range(count)]


def log_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*.log"))


def bench_append_many(work: Path, records: list[Record], batch: int) -> tuple[float, int]:
    with CommitLog(work, LogConfig()) as log:
        start = time.perf_counter()
        for i in range(0, len(records), batch):
            log.append_many(records[i : i + batch])
        log.flush()
        elapsed = time.perf_counter() - start
    return elapsed, log_bytes(work)


def bench_writer(work: Path, records: list[Record], policy: str) -> tuple[float, int]:
    finished = threading.Event()
    remaining = [len(records)]

    def done(outcome: object) -> None:
        if isinstance(outcome, BaseException):
            raise SystemExit(f"append failed: {outcome!r}")
        remaining[0] -= 1
        if not remaining[0]:
            finished.set()

    with CommitLog(work, LogConfig()) as log:
        writer = LogWriter(log, fsync_policy=policy, fsync_interval_ms=100)
        start = time.perf_counter()
        for record in records:
            writer.submit(record, done)
        finished.wait()
        elapsed = time.perf_counter() - start
        writer.close()
    return elapsed, log_bytes(work)


def write_loop_mbs(work: Path, total: int) -> float:
    chunk = os.urandom(MIB)
    path = work / "baseline.bin"
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(-(-total // MIB)):
            os.write(fd, chunk)
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    path.unlink()
    return -(-total // MIB) * MIB / elapsed / 1e6


def dd_mbs(work: Path, total: int) -> float | None:
    if shutil.which("dd") is None:
        return None
    path = work / "dd.bin"
    count = -(-total // MIB)
    result = subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={count}", "oflag=direct"],
        capture_output=True, text=True, check=False)
    path.unlink(missing_ok=True)
    match = re.search(r"copied, ([\d.]+) s", result.stderr)
    if result.returncode or not match:
        return None
    return count * MIB / float(match.group(1)) / 1e6


Result = tuple[list[Row], float, float | None]  # rows, write-loop MB/s, dd MB/s


def run_size(root: Path, size: int, count: int, batch: int) -> Result:
    records = make_records(count, size)
    rows = []
    plans = [("append_many", "never", None), ("writer", "never", "never"),
             ("writer", "interval", "interval"), ("writer", "always", "always")]
    for path_name, policy_name, policy in plans:
        work = Path(tempfile.mkdtemp(prefix="log-bench-", dir=root))
        try:
            if policy is None:
                seconds, disk = bench_append_many(work, records, batch)
            else:
                seconds, disk = bench_writer(work, records, policy)
        finally:
            shutil.rmtree(work)
        rows.append(Row(size, path_name, policy_name, count, seconds, disk))
    total = max(row.disk_bytes for row in rows)
    work = Path(tempfile.mkdtemp(prefix="disk-bench-", dir=root))
    try:
        return rows, write_loop_mbs(work, total), dd_mbs(work, total)
    finally:
        shutil.rmtree(work)


def print_table(results: list[Result]) -> None:
    header = ["record", "path", "fsync", "records", "s", "records/s", "payload MB/s",
              "disk MB/s", "x write+fsync", "x dd direct"]
    lines = [header]
    for rows, write_mbs, dd in results:
        lines += [row.cells(write_mbs, dd) for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for n, line in enumerate(lines):
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)))
        if n == 0:
            print("  ".join("-" * width for width in widths))
    print()
    for rows, write_mbs, dd in results:
        dd_text = f"{dd:.1f} MB/s" if dd else "n/a"
        total = max(row.disk_bytes for row in rows)
        print(f"disk baseline for {rows[0].size} B runs ({total / 1e6:.0f} MB): "
              f"write loop + fsync {write_mbs:.1f} MB/s, dd oflag=direct {dd_text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=100_000, help="records per run")
    parser.add_argument("--batch", type=int, default=100, help="records per append_many call")
    parser.add_argument("--dir", type=Path, default=Path.cwd(),
                        help="where to write (default: the current directory, not /tmp)")
    args = parser.parse_args()
    started = time.perf_counter()
    results = [run_size(args.dir, size, args.records, args.batch) for size in SIZES]
    print_table(results)
    print(f"total run time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
