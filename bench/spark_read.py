"""Read throughput of the ``meshmq`` Spark data source, beside Spark's JSON-lines reader.

Usage::

    PYTHONPATH=src python bench/spark_read.py [--records N] [--repeat R] [--dir DIR]
                                              [--master local[*]]

It writes ``N`` records (default 1 000 000) with ~100 B JSON telemetry payloads to an
8-partition commit log with the storage engine (``CommitLog.append_many``), and the very same
records (every column, payload as a string) as JSON lines, one file per log partition. Then, in
one local SparkSession, it runs the same query over both::

    SELECT partition, count(*), sum(length(payload)), max(timestamp), max(offset)
    GROUP BY partition                      -- a full read: every record, several columns

``meshmq``: ``spark.read.format("meshmq").load(log)``; ``json``: ``spark.read.json`` with the
equivalent explicit schema (no inference pass). One untimed warm-up query per reader starts
the Python workers and the JIT; then each query runs ``R`` times (default 3) and the best time
counts. It prints records/s for both and the ratio meshmq / json, with the load average, since
a shared machine skews both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from meshmq.log import CommitLog, LogConfig, Record

PARTITIONS = 8
T0 = 1_700_000_000_000
QUERY = ("SELECT partition, count(*) AS n, sum(length(payload)) AS bytes, max(timestamp) AS last,"
         " max(offset) AS top FROM {table} GROUP BY partition")
JSON_SCHEMA = ("partition INT, offset BIGINT, timestamp TIMESTAMP, topic STRING, qos INT, "
               "retain BOOLEAN, payload STRING, client_id STRING, message_id STRING")


def make_record(i: int) -> Record:
    device = f"dev{i % 5000:05d}"
    payload = json.dumps({"device": device, "temp": round(15 + (i % 997) / 50, 2),
                          "humidity": round(30 + (i % 613) / 20, 2), "battery": i % 100,
                          "status": "ok", "fw": "1.4.2", "seq": i},
                         separators=(",", ":")).encode()
    return Record.new(f"sites/s{i % 40}/{device}/telemetry", payload, T0 + i, qos=1,
                      client_id=device)


def iso_time(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def write_inputs(directory: Path, count: int) -> tuple[float, int]:
    """Write the log and the JSON lines; return (seconds spent, total payload bytes)."""
    started, payload_bytes = time.perf_counter(), 0
    lines = {p: open(directory / "json" / f"part-{p}.json", "w", encoding="utf-8")  # noqa: SIM115
             for p in range(PARTITIONS)}
    try:
        with CommitLog(directory / "data", LogConfig(partitions=PARTITIONS)) as log:
            for first in range(0, count, 2000):
                batch = [make_record(i) for i in range(first, min(first + 2000, count))]
                for record, (p, offset) in zip(batch, log.append_many(batch), strict=True):
                    payload_bytes += len(record.payload)
                    lines[p].write(json.dumps({
                        "partition": p, "offset": offset,
                        "timestamp": iso_time(record.timestamp_ms), "topic": record.topic,
                        "qos": record.qos, "retain": record.retain,
                        "payload": record.payload.decode(), "client_id": record.client_id,
                        "message_id": record.message_id.hex()}) + "\n")
    finally:
        for file in lines.values():
            file.close()
    return time.perf_counter() - started, payload_bytes


def best_time(spark, table: str, repeat: int) -> tuple[float, list]:
    """Best wall time of ``repeat`` runs of QUERY over ``table``, and its result."""
    best, rows = float("inf"), []
    for _ in range(repeat):
        started = time.perf_counter()
        rows = spark.sql(QUERY.format(table=table)).collect()
        best = min(best, time.perf_counter() - started)
    return best, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: temp)")
    parser.add_argument("--master", default="local[*]")
    args = parser.parse_args()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    work = Path(tempfile.mkdtemp(prefix="meshmq-bench-", dir=args.dir))
    try:
        (work / "json").mkdir()
        seconds, payload_bytes = write_inputs(work, args.records)
        print(f"wrote {args.records:,} records ({payload_bytes / args.records:.0f} B payloads) "
              f"to the log and as JSON lines in {seconds:.1f} s")
        log_mb = sum(f.stat().st_size for f in (work / "data" / "log").rglob("*.log")) / 1e6
        json_mb = sum(f.stat().st_size for f in (work / "json").iterdir()) / 1e6
        print(f"on disk: log {log_mb:.0f} MB, JSON lines {json_mb:.0f} MB")
        run_spark(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_spark(work: Path, args: argparse.Namespace) -> None:
    from pyspark.sql import SparkSession

    from meshmq.pipeline import register

    spark = (SparkSession.builder.master(args.master).appName("meshmq-bench")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "8")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.sql.session.timeZone", "UTC").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    spark.read.format("meshmq").load(str(work / "data")).createOrReplaceTempView("meshmq")
    spark.read.schema(JSON_SCHEMA).json(str(work / "json")).createOrReplaceTempView("json")
    load_before = os.getloadavg()
    results = {}
    for table in ("meshmq", "json"):
        spark.sql(f"SELECT count(*) FROM {table} WHERE offset < 1000").collect()  # warm-up
        results[table] = best_time(spark, table, args.repeat)
    load_after = os.getloadavg()
    assert sorted(results["meshmq"][1]) == sorted(results["json"][1]), "readers disagree"
    assert sum(r.n for r in results["meshmq"][1]) == args.records
    print(f"query: {QUERY.format(table='<reader>')}")
    print(f"{'reader':<8} {'best s':>8} {'records/s':>12}")
    rates = {}
    for table, (seconds, _) in results.items():
        rates[table] = args.records / seconds
        print(f"{table:<8} {seconds:>8.2f} {rates[table]:>12,.0f}")
    print(f"ratio meshmq / json: {rates['meshmq'] / rates['json']:.2f}")
    print(f"Spark {spark.version}, master {args.master}, {os.cpu_count()} CPUs, load average "
          f"{load_before[0]:.1f} before / {load_after[0]:.1f} after (a shared machine skews both"
          " readers)")
    spark.stop()


if __name__ == "__main__":
    main()
