"""Streaming runs of the jobs over a real broker's log: telemetry restarted in the middle of a
window with more data (every window written once, none missing, equal to what was published;
late data dropped and counted), and
the archive under a processing-time trigger while the broker takes more, then restarted."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from test_jobs import (
    T0,
    aggregate_rows,
    assert_same_aggregates,
    expected_aggregates,
    make_readings,
    publish_all,
    start_broker,
    telemetry_messages,
    wait_for,
)

from meshmq.pipeline.jobs import archive, telemetry
from meshmq.pipeline.jobs.common import StreamSettings

# Spark start-up and first reads are slow on a busy 2-core machine: more than the default 120 s.
pytestmark = [pytest.mark.xdist_group("spark"), pytest.mark.timeout(300)]


def window_starts(spark, path: Path) -> set[int]:
    if not (path / "_spark_metadata").exists():
        return set()
    return {int(row["window_start"].timestamp())
            for row in spark.read.parquet(str(path)).select("window_start").collect()}


@pytest.mark.slow
def test_telemetry_stream_restarts_without_duplicates_or_gaps(spark, tmp_path: Path) -> None:
    broker = start_broker(tmp_path)
    try:
        readings = make_readings(30)  # 4 devices, 3 readings a minute, 10 minutes
        first, second = readings[:14 * 4], readings[14 * 4:]  # split inside minute 4
        options = telemetry.TelemetryOptions(str(broker.data_dir), str(tmp_path / "out"))
        stream = StreamSettings(str(tmp_path / "checkpoint"))
        out = tmp_path / "out" / "aggregates"

        publish_all(broker.port, telemetry_messages(first))
        run1 = telemetry.run_stream(spark, options, stream)
        assert (run1.records, run1.quarantined) == (len(first), {})
        # The watermark (newest event - 2 minutes) closed minutes 0 and 1, and only those.
        assert window_starts(spark, out) == {T0, T0 + 60}

        # The rest, a reading for minute 0 (closed: it is dropped), a bad payload, and an
        # event an hour later that moves the watermark past every minute published.
        late = [("d1", float(T0 + 10), {"temp": 99.0})]
        flush = [("d0", float(T0 + 3600), {"temp": 0.0})]
        publish_all(broker.port, [*telemetry_messages(second + late),
                                  ("devices/d1/telemetry", b"{oops"),
                                  *telemetry_messages(flush)])
        run2 = telemetry.run_stream(spark, options, stream)
        assert (run2.records, run2.quarantined) == (len(second) + 3, {"not_json": 1})
        assert run2.late == 1

        got = aggregate_rows(spark, str(out))  # fails on any duplicate window
        assert_same_aggregates(got, expected_aggregates(readings))
        bad = spark.read.parquet(str(tmp_path / "out" / "quarantine")).collect()
        assert [(r["reason"], bytes(r["payload"])) for r in bad] == [("not_json", b"{oops")]
    finally:
        broker.stop()


def archived_rows(query) -> int:
    return sum(progress.numInputRows for progress in query.recentProgress)


@pytest.mark.slow
def test_archive_stream_with_processing_time_trigger_then_restart(spark, tmp_path: Path) -> None:
    broker = start_broker(tmp_path)
    published: list[tuple[str, bytes]] = []

    def publish(count: int) -> None:
        batch = [(f"plant{i % 3}/line/{i}", json.dumps({"n": len(published) + i}).encode())
                 for i in range(count)]
        publish_all(broker.port, batch)
        published.extend(batch)

    try:
        options = archive.ArchiveOptions(str(broker.data_dir), str(tmp_path / "archive"))
        stream = StreamSettings(str(tmp_path / "checkpoint"), trigger="1 seconds")
        publish(20)
        query = archive.start_stream(spark, options, stream)
        try:
            wait_for(lambda: archived_rows(query) >= 20, timeout=120, what="first 20 archived")
            publish(10)  # while the query runs
            wait_for(lambda: archived_rows(query) >= 30, timeout=120, what="10 more archived")
        finally:
            query.stop()
        publish(5)
        summary = archive.run_stream(spark, options, StreamSettings(stream.checkpoint))
        assert summary == f"archive: 5 records appended to {tmp_path / 'archive'}"
        rows = spark.read.parquet(str(tmp_path / "archive")).collect()
        assert Counter((r["topic"], bytes(r["payload"])) for r in rows) == Counter(published)
        assert len({r["message_id"] for r in rows}) == len(published)
        assert {r["topic_root"] for r in rows} == {"plant0", "plant1", "plant2"}
    finally:
        broker.stop()
