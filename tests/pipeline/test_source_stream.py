"""spark.readStream.format("meshmq"): micro-batches with checkpoints. Trigger.AvailableNow then
more data then a restart (no duplicates, no gaps), a processing-time trigger while a real broker
appends, retention gaps, and exactly-once output after a kill -9 of the whole driver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from conftest import wait_for
from meshmq.log.commit_log import CommitLog
from meshmq.log.config import LogConfig
from meshmq.log.record import Record
from meshmq.pipeline import register

pytestmark = pytest.mark.xdist_group("spark")

T0 = 1_700_000_000_000
QUERY_TIMEOUT = 120  # seconds a streaming query may take to finish on a busy machine


@pytest.fixture(scope="module")
def spark(spark):
    register(spark)
    return spark


def append(data_dir: Path, first: int, count: int, partitions: int = 3,
           **config: int) -> dict[tuple[int, int], str]:
    """Append records ``first`` .. ``first + count - 1``; return (partition, offset) -> id."""
    written = {}
    with CommitLog(data_dir, LogConfig(partitions=partitions, **config)) as log:
        for start in range(first, first + count, 10):
            batch = [Record.new(f"vehicles/v{i % 13}/speed", b"%d" % i, T0 + i, qos=1,
                                client_id=f"v{i % 13}") for i in range(start, start + 10)]
            for record, position in zip(batch, log.append_many(batch), strict=True):
                written[position] = record.message_id.hex()
    return written


def run_available_now(spark, data_dir: Path, out: Path, checkpoint: Path,
                      **options: str) -> list[dict]:
    """One Trigger.AvailableNow run into a Parquet sink; return its progress reports."""
    reader = spark.readStream.format("meshmq").option("startingOffsets", "earliest")
    for key, value in options.items():
        reader = reader.option(key, value)
    query = reader.load(str(data_dir)).writeStream.format("parquet") \
        .option("path", str(out)).option("checkpointLocation", str(checkpoint)) \
        .trigger(availableNow=True).start()
    try:
        finished = query.awaitTermination(QUERY_TIMEOUT)
    finally:
        query.stop()
    assert finished, "the AvailableNow query did not finish"
    if query.exception() is not None:
        raise query.exception()
    return [p for p in query.recentProgress if p["numInputRows"]]


def sink_rows(spark, out: Path) -> dict[tuple[int, int], str]:
    """(partition, offset) -> message id of every row the sink committed; fails on duplicates."""
    rows = spark.read.parquet(str(out)).select("partition", "offset", "message_id").collect()
    found = {(r.partition, r.offset): r.message_id for r in rows}
    assert len(found) == len(rows), "duplicate records in the sink"
    return found


def test_available_now_then_more_data_then_restart(tmp_path: Path, spark) -> None:
    data_dir, out, checkpoint = tmp_path / "data", tmp_path / "out", tmp_path / "checkpoint"
    written = append(data_dir, 0, 400, segment_bytes=16384)
    progress = run_available_now(spark, data_dir, out, checkpoint, maxRecordsPerTrigger="250")
    assert [p["numInputRows"] for p in progress] == [250, 150]  # capped, then the rest
    assert sink_rows(spark, out) == written

    written |= append(data_dir, 400, 250, segment_bytes=16384)
    progress = run_available_now(spark, data_dir, out, checkpoint)
    assert [p["numInputRows"] for p in progress] == [250]  # only what is new
    assert sink_rows(spark, out) == written  # no duplicates, no gaps

    assert run_available_now(spark, data_dir, out, checkpoint) == []  # nothing new: no batch
    assert sink_rows(spark, out) == written


def test_retention_gap_in_a_stream(tmp_path: Path, spark) -> None:
    data_dir, out, checkpoint = tmp_path / "data", tmp_path / "out", tmp_path / "checkpoint"
    config = {"partitions": 1, "segment_bytes": 1024, "retention_bytes": 3000}
    written = append(data_dir, 0, 50, **config)
    run_available_now(spark, data_dir, out, checkpoint)
    assert sink_rows(spark, out) == written
    later = append(data_dir, 50, 300, **config)  # read by nobody before retention runs
    with CommitLog(data_dir, LogConfig(**config)) as log:
        log.enforce_retention()
        earliest = log.earliest_offset(0)
    assert earliest > 50
    with pytest.raises(Exception, match=rf"partition 0: offsets 50\.\.{earliest - 1} are no"
                                        " longer in the log"):
        run_available_now(spark, data_dir, out, checkpoint)
    run_available_now(spark, data_dir, out, checkpoint, failOnDataLoss="false")
    kept = {key: value for key, value in later.items() if key[1] >= earliest}
    assert sink_rows(spark, out) == written | kept


def test_processing_time_trigger_while_the_broker_appends(broker_factory, client_factory,
                                                          spark) -> None:
    broker = broker_factory("[log]\nsegment_bytes = 2048\npartitions = 4\n")
    publisher = client_factory("meter-1")
    publisher.connect(broker.port)
    published: list[bytes] = []
    stop = threading.Event()
    query = spark.readStream.format("meshmq").option("startingOffsets", "earliest") \
        .load(str(broker.data_dir)).writeStream.format("memory").queryName("appending") \
        .trigger(processingTime="200 milliseconds").start()

    def publish() -> None:  # until the stream has taken several bites out of the flow
        for i in range(100_000):
            if stop.is_set():
                return
            payload = b"reading-%d" % i
            publisher.publish(f"meters/m{i % 7}/kwh", payload, qos=1)  # waits for the PUBACK
            published.append(payload)

    def batches_with_data() -> list[dict]:
        return [p for p in query.recentProgress if p["numInputRows"]]

    thread = threading.Thread(target=publish)
    try:
        thread.start()
        wait_for(lambda: len(batches_with_data()) >= 2, timeout=90,
                 what="two micro-batches while the broker appends")
        stop.set()
        thread.join()
        wait_for(lambda: sum(p["numInputRows"] for p in batches_with_data()) >= len(published),
                 timeout=60, what="the stream to catch up")
        rows = spark.table("appending").collect()
    finally:
        stop.set()
        query.stop()
        thread.join()
    assert sorted(bytes(r.payload) for r in rows) == sorted(published)
    offsets: dict[int, list[int]] = {}
    for row in rows:
        offsets.setdefault(row.partition, []).append(row.offset)
    assert all(sorted(o) == list(range(len(o))) for o in offsets.values())
    assert len(list((broker.data_dir / "log").glob("*/*.log"))) > 4  # segments rolled meanwhile


DRIVER = textwrap.dedent("""
    import os, sys
    from pyspark.sql import SparkSession
    from meshmq.pipeline import register

    data_dir, out, checkpoint, mode = sys.argv[1:5]
    spark = (SparkSession.builder.master("local[1]").appName("meshmq-kill-test")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             # A short-lived JVM: C1 only and a serial GC halve start-up on a busy machine.
             .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    reader = spark.readStream.format("meshmq").option("startingOffsets", "earliest")
    if mode == "first":
        reader = reader.option("maxRecordsPerTrigger", "300")
    writer = (reader.load(data_dir).writeStream.format("parquet").option("path", out)
              .option("checkpointLocation", checkpoint))
    if mode == "first":
        writer = writer.trigger(processingTime="0 seconds")
    else:
        writer = writer.trigger(availableNow=True)
    writer.start().awaitTermination()
""")


def batch_ids(directory: Path) -> set[int]:
    try:
        return {int(p.name) for p in directory.iterdir() if p.name.isdigit()}
    except FileNotFoundError:
        return set()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_kill_9_of_the_driver_mid_stream_then_restart_is_exactly_once(
        tmp_path: Path, spark) -> None:
    data_dir, out, checkpoint = tmp_path / "data", tmp_path / "out", tmp_path / "checkpoint"
    written = append(data_dir, 0, 2000, segment_bytes=16384)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
           "PYSPARK_DRIVER_PYTHON": sys.executable}

    def start(mode: str) -> subprocess.Popen:
        with open(tmp_path / f"driver-{mode}.log", "wb") as log:
            return subprocess.Popen(
                [sys.executable, str(script), str(data_dir), str(out), str(checkpoint), mode],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    driver = start("first")
    try:
        def batch_in_flight() -> set[int]:
            if driver.poll() is not None:
                pytest.fail((tmp_path / "driver-first.log").read_text())
            committed = batch_ids(checkpoint / "commits")
            return batch_ids(checkpoint / "offsets") - committed if committed else set()

        # Kill right after Spark logged a batch's offsets and before it committed the batch.
        wait_for(batch_in_flight, timeout=240, what="a micro-batch planned but not committed")
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the Python driver, its JVM and its workers
        driver.wait()
    assert 0 < len(sink_rows(spark, out)) < len(written)

    restarted = start("finish")
    try:
        assert restarted.wait(timeout=300) == 0, (tmp_path / "driver-finish.log").read_text()
    finally:
        if restarted.poll() is None:
            os.killpg(restarted.pid, signal.SIGKILL)
            restarted.wait()
    assert sink_rows(spark, out) == written  # every record of the log, exactly once
