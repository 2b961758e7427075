"""spark.read.format("meshmq"): batch reads through the shared local SparkSession, over a log
written by the real broker (paho publishes) and over logs written with the engine directly
(several segments and partitions, chosen timestamps, retention gaps)."""

from __future__ import annotations

import zlib
from datetime import UTC, datetime
from pathlib import Path

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pyspark.sql import functions as F

from meshmq.log.commit_log import CommitLog
from meshmq.log.config import LogConfig
from meshmq.log.record import Record
from meshmq.pipeline import SCHEMA, SCHEMA_DDL, register

pytestmark = pytest.mark.xdist_group("spark")

T0 = 1_700_000_000_000


@pytest.fixture(scope="module")
def spark(spark):
    register(spark)
    return spark


def publish_properties(i: int) -> Properties:
    props = Properties(PacketTypes.PUBLISH)
    props.UserProperty = [("device", f"d{i}"), ("unit", "C")]
    props.ContentType = "application/json"
    props.ResponseTopic = f"replies/{i}"
    props.CorrelationData = bytes([i, 0xFF, 0x00])
    props.PayloadFormatIndicator = 1
    props.MessageExpiryInterval = 3600 + i
    return props


def test_batch_read_of_everything_the_broker_persisted(broker_factory, client_factory,
                                                       spark) -> None:
    broker = broker_factory()
    v5 = client_factory("sensor-v5", version=5)
    v5.connect(broker.port)
    v311 = client_factory("sensor-v311", version=4)
    v311.connect(broker.port)
    before_ms = int(datetime.now(UTC).timestamp() * 1000)
    published = {}  # payload -> (topic, qos, retain, client, properties or None)
    for i in range(30):
        topic, payload = f"plant/line{i % 4}/dev{i}/temp", b'{"t": %d}' % i
        v5.publish(topic, payload, qos=1 + i % 2, retain=i % 10 == 0,
                   properties=publish_properties(i))
        published[payload] = (topic, 1 + i % 2, i % 10 == 0, "sensor-v5", i)
    for i in range(20):
        topic, payload = f"plant/line{i % 4}/legacy{i}", bytes([0x80 + i, 0, 0xFE])  # not UTF-8
        v311.publish(topic, payload, qos=1)
        published[payload] = (topic, 1, False, "sensor-v311", None)
    v5.publish("plant/empty", b"", qos=1)
    published[b""] = ("plant/empty", 1, False, "sensor-v5", None)
    after_ms = int(datetime.now(UTC).timestamp() * 1000)

    df = spark.read.format("meshmq").load(str(broker.data_dir))  # while the broker runs
    assert df.schema == SCHEMA
    rows = df.collect()
    assert sorted(r.payload for r in rows) == sorted(published)
    by_partition: dict[int, list[int]] = {}
    for row in rows:
        topic, qos, retain, client, i = published[bytes(row.payload)]
        assert (row.topic, row.qos, row.retain, row.client_id) == (topic, qos, retain, client)
        assert row.partition == zlib.crc32(topic.encode()) % 8  # docs/log-format.md
        by_partition.setdefault(row.partition, []).append(row.offset)
        stamp_ms = round(row.timestamp.replace(tzinfo=UTC).timestamp() * 1000)
        assert before_ms <= stamp_ms <= after_ms
        assert len(row.message_id) == 32 and int(row.message_id[:12], 16) == stamp_ms
        if i is None:
            assert row.properties == {}
        else:
            assert row.properties == {
                "device": f"d{i}", "unit": "C", "content_type": "application/json",
                "response_topic": f"replies/{i}", "correlation_data": f"{i:02x}ff00",
                "payload_format": "1", "message_expiry": str(3600 + i)}
    for offsets in by_partition.values():
        assert sorted(offsets) == list(range(len(offsets)))
    assert len({r.message_id for r in rows}) == len(rows)

    # The log directory itself works too, and `topics` keeps exactly what MQTT would deliver.
    log_dir = str(broker.data_dir / "log")
    pushed = spark.read.format("meshmq").option("topics", "plant/+/dev3/#,plant/line2/#") \
        .load(log_dir)
    sql = df.where("topic rlike '^plant/[^/]*/dev3(/.*)?$' or topic rlike '^plant/line2(/.*)?$'")
    pushed_rows = pushed.collect()
    assert sorted((r.partition, r.offset) for r in pushed_rows) == sorted(
        (r.partition, r.offset) for r in sql.select("partition", "offset").collect())
    assert {r.topic for r in pushed_rows} == {
        t for t, *_ in published.values() if t.split("/")[1] == "line2" or
        t.split("/")[2:3] == ["dev3"]}


def write_log(data_dir: Path, count: int, partitions: int = 3, segment_bytes: int = 2048,
              **config: int) -> dict[int, list[tuple[int, Record]]]:
    """``count`` records, 10 ms apart from T0, 4 per append; partition -> [(offset, record)]."""
    expected: dict[int, list[tuple[int, Record]]] = {p: [] for p in range(partitions)}
    log_config = LogConfig(partitions=partitions, segment_bytes=segment_bytes, **config)
    with CommitLog(data_dir, log_config) as log:
        for first in range(0, count, 4):
            batch = [Record.new(f"fleet/truck{i % 9}/gps", b"%d" % i, T0 + 10 * i, qos=1,
                                client_id=f"truck{i % 9}") for i in range(first, first + 4)]
            for record, (p, offset) in zip(batch, log.append_many(batch), strict=True):
                expected[p].append((offset, record))
    return expected


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    data_dir = tmp_path_factory.mktemp("fleet")
    return data_dir, write_log(data_dir, 600)


def keys(df) -> list[tuple[int, int]]:
    return sorted((r.partition, r.offset) for r in df.select("partition", "offset").collect())


def test_starting_and_ending_offsets(fleet, spark) -> None:
    data_dir, expected = fleet
    sizes = {p: len(records) for p, records in expected.items()}
    read = spark.read.format("meshmq").option("startingOffsets", '{"0": 10, "2": -1}') \
        .option("endingOffsets", '{"0": 25, "1": -1}').load(str(data_dir))
    assert keys(read) == [(0, o) for o in range(10, 25)] + [(1, o) for o in range(sizes[1])]
    everything = spark.read.format("meshmq").option("startingOffsets", "earliest") \
        .option("endingOffsets", "latest").load(str(data_dir))
    assert everything.count() == 600
    with pytest.raises(Exception, match="beyond the end of the log"):
        spark.read.format("meshmq").option("endingOffsets", '{"1": 100000}') \
            .load(str(data_dir)).count()


def test_starting_and_ending_timestamps_use_the_time_index(fleet, spark) -> None:
    data_dir, expected = fleet
    start_ms, end_ms = T0 + 1234, T0 + 4321  # records are 10 ms apart: 1240 .. 4320
    wanted = sorted((p, o) for p, records in expected.items() for o, r in records
                    if start_ms <= r.timestamp_ms < end_ms)
    iso = datetime.fromtimestamp(end_ms / 1000, UTC).isoformat()
    read = spark.read.format("meshmq").option("startingTimestamp", str(start_ms)) \
        .option("endingTimestamp", iso).load(str(data_dir))
    assert keys(read) == wanted
    assert read.agg({"timestamp": "min"}).first()[0] == datetime(2023, 11, 14, 22, 13, 21, 240000)
    per_partition = spark.read.format("meshmq") \
        .option("startingOffsetsByTimestamp", f'{{"1": {start_ms}}}').load(str(data_dir))
    assert keys(per_partition) == sorted(
        (p, o) for p, records in expected.items() for o, r in records
        if p != 1 or r.timestamp_ms >= start_ms)


def test_work_is_split_by_partition_and_segment(fleet, spark) -> None:
    data_dir, expected = fleet
    segments = sum(len(list((data_dir / "log" / str(p)).glob("*.log"))) for p in expected)
    assert segments > 6
    df = spark.read.format("meshmq").load(str(data_dir))
    assert df.rdd.getNumPartitions() == segments
    tasks = df.selectExpr("spark_partition_id() as task", "partition", "offset") \
        .groupBy("task").agg(F.countDistinct("partition").alias("partitions"),
                             F.min("offset").alias("first"), F.max("offset").alias("last"),
                             F.count("*").alias("rows")).collect()
    assert len(tasks) == segments
    for task in tasks:
        assert task.partitions == 1  # one log partition per task
        assert task.rows == task.last - task.first + 1  # one contiguous offset range
    assert sum(t.rows for t in tasks) == 600


def test_retention_gap_fails_or_is_skipped_as_asked(tmp_path: Path, spark,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    write_log(tmp_path, 400, partitions=1, segment_bytes=2048, retention_bytes=6000)
    with CommitLog(tmp_path, LogConfig(partitions=1, segment_bytes=2048,
                                       retention_bytes=6000)) as log:
        assert log.enforce_retention() > 0
        earliest, latest = log.earliest_offset(0), log.next_offset(0)
    assert earliest > 0
    asked = spark.read.format("meshmq").option("startingOffsets", '{"0": 0}')
    with pytest.raises(Exception, match=rf"partition 0: offsets 0\.\.{earliest - 1} are no longer"
                                        " in the log"):
        asked.load(str(tmp_path)).count()
    skipped = asked.option("failOnDataLoss", "false").load(str(tmp_path))
    assert keys(skipped) == [(0, o) for o in range(earliest, latest)]
    assert spark.read.format("meshmq").load(str(tmp_path)).count() == latest - earliest


def test_bad_input_gets_one_clear_line(tmp_path: Path, fleet, spark) -> None:
    with pytest.raises(Exception, match=f"no meshmq commit log at {tmp_path}"):
        spark.read.format("meshmq").load(str(tmp_path)).count()
    data_dir, _ = fleet
    with pytest.raises(Exception, match="startingOffsets: partition 7 does not exist"):
        spark.read.format("meshmq").option("startingOffsets", '{"7": 0}') \
            .load(str(data_dir)).count()
    with pytest.raises(Exception, match="unknown option 'startingoffset'"):
        spark.read.format("meshmq").option("startingOffset", "earliest") \
            .load(str(data_dir)).count()
    with pytest.raises(Exception, match="fixed schema"):
        spark.read.format("meshmq").schema("topic STRING").load(str(data_dir)).count()
    assert spark.read.format("meshmq").schema(SCHEMA_DDL).load(str(data_dir)).count() == 600
