"""The ``telemetry`` job: JSON telemetry payloads -> per-device, per-field window aggregates.

Theory of operation
-------------------
Every record read from the commit log is *classified* once (``classify``): its payload is
parsed as JSON with Spark's ``try_parse_json`` (a VARIANT, so integers, decimals and doubles
keep their JSON type and a quoted ``"21.5"`` is not mistaken for a number), its numeric
top-level fields are kept as ``map<string, double>``, its event time is taken from an optional
``"ts"`` field (Unix seconds or milliseconds, or an ISO 8601 string) or else the record's log
timestamp, and its device id is one level of its topic. A record that fails any step gets a
``reason`` and nothing else; nothing raises, so one bad device cannot stop the job.

Good records are exploded to one row per (device, topic, field, value) and aggregated in
event-time tumbling windows: count, min, max, mean and sum. Bad records, untouched, go to the
quarantine table with their reason. The two outputs are:

``OUTPUT/aggregates``  window_start, window_end, device, topic, field, count, min, max, mean,
                       sum (Parquet)
``OUTPUT/quarantine``  every column of the source record, plus ``reason`` (Parquet)

Batch mode rewrites both tables from the whole log. Streaming mode runs two queries over the
``meshmq`` source, each with its own checkpoint: the aggregation drops events older than the
watermark and appends a window once the watermark passes its end, so each window is written
exactly once (the Parquet file sink commits files per batch in ``_spark_metadata``); the
quarantine query appends bad records as they come. A window still open when an
``available-now`` run stops is written by a later run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from meshmq.pipeline.jobs.common import (
    StreamSettings,
    apply_trigger,
    await_queries,
    check_not_streaming_output,
    matches_any,
    qualify,
    read_log,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

AGGREGATES_SCHEMA = (
    "window_start timestamp, window_end timestamp, device string, topic string, field string, "
    "count long, min double, max double, mean double, sum double"
)
# Why a record is quarantined, in the order the checks run.
REASONS = {
    "empty": "the payload is empty",
    "not_utf8": "the payload is not UTF-8 text",
    "not_json": "the payload is not valid JSON (duplicate keys included)",
    "not_object": "the JSON value is not an object",
    "no_device": "the topic has no level at the device position",
    "no_numeric_field": "no top-level field holds a finite number",
    "bad_ts": "\"ts\" is neither a number nor an ISO 8601 timestamp",
}
EVENT_TIME_FIELD = "ts"
# A numeric "ts" at or above this is in milliseconds (1e11 s is the year 5138).
MILLISECONDS_FROM = 100_000_000_000
_NUMERIC_VARIANT = r"^(TINYINT|SMALLINT|INT|BIGINT|FLOAT|DOUBLE|DECIMAL.*)$"


@dataclass(frozen=True)
class TelemetryOptions:
    """Where the log is, where the tables go, and how to window and key the telemetry."""

    data_dir: str
    output: str
    window: str = "1 minute"
    watermark: str = "2 minutes"
    device_level: int = 1
    topics: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ("alerts/#",)
    source_options: dict[str, str] = field(default_factory=dict)

    @property
    def aggregates_path(self) -> str:
        return qualify(self.output) + "/aggregates"

    @property
    def quarantine_path(self) -> str:
        return qualify(self.output) + "/quarantine"


@dataclass
class TelemetryResult:
    """What a run did: records read and quarantined (by reason) and where the tables are."""

    records: int = 0
    quarantined: dict[str, int] = field(default_factory=dict)
    # streaming: Spark's numRowsDroppedByWatermark (rows after partial aggregation, so a lower
    # bound of the late readings dropped)
    late: int = 0
    aggregates_path: str = ""
    quarantine_path: str = ""

    @property
    def quarantined_total(self) -> int:
        return sum(self.quarantined.values())

    def summary(self) -> str:
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(self.quarantined.items()))
        return (f"telemetry: {self.records} records, {self.quarantined_total} quarantined"
                + (f" ({reasons})" if reasons else "")
                + (f", {self.late} late rows dropped by the watermark" if self.late else "")
                + f"; aggregates in {self.aggregates_path}, quarantine in {self.quarantine_path}")


# ---------------------------------------------------------------- transformations


def device_column(topic: Column, level: int) -> Column:
    """Level ``level`` (0-based) of the topic; null when the topic is shorter or it is empty."""
    from pyspark.sql import functions as F

    value = F.get(F.split(topic, "/", -1), level)
    return F.when(value != "", value)


def event_time_column(fields: Column, fallback: Column) -> Column:
    """``fields["ts"]`` as a timestamp, ``fallback`` when absent, null when unusable."""
    from pyspark.sql import functions as F

    ts = fields.getItem(EVENT_TIME_FIELD)
    kind = F.schema_of_variant(ts)
    number = F.try_variant_get(ts, "$", "double")
    seconds = F.when(F.abs(number) >= MILLISECONDS_FROM, number / 1000).otherwise(number)
    as_timestamp = F.timestamp_micros(F.round(seconds * 1_000_000).cast("long"))
    from_text = F.try_to_timestamp(F.try_variant_get(ts, "$", "string"))
    return (F.when(ts.isNull(), fallback)
            .when(kind.rlike(_NUMERIC_VARIANT), F.when(F.abs(seconds) < 1e13, as_timestamp))
            .when(kind == "STRING", from_text))


def classify(records: DataFrame, device_level: int = 1) -> DataFrame:
    """Every source column plus ``device``, ``event_time``, ``values`` and ``reason``.

    ``values`` (map<string, double>) holds the finite numeric top-level fields except "ts";
    ``reason`` is null for a good record, else one key of ``REASONS`` (and the other new
    columns may be null). The caller splits the result with ``good_values`` and ``quarantine``.
    """
    from pyspark.sql import functions as F

    text = F.col("payload").cast("string")
    doc = F.try_parse_json(text)
    fields = F.try_variant_get(doc, "$", "map<string,variant>")
    numeric = F.map_filter(
        fields, lambda k, v: (k != EVENT_TIME_FIELD) & F.schema_of_variant(v).rlike(
            _NUMERIC_VARIANT))
    values = F.map_filter(
        F.transform_values(numeric, lambda _k, v: F.try_variant_get(v, "$", "double")),
        lambda _k, v: v.isNotNull() & (F.abs(v) < float("inf")))
    staged = (records
              .withColumn("_fields", fields)
              .withColumn("device", device_column(F.col("topic"), device_level))
              .withColumn("values", values)
              .withColumn("event_time", event_time_column(F.col("_fields"), F.col("timestamp"))))
    reason = (F.when(F.length("payload") == 0, "empty")
              .when(~F.is_valid_utf8(text), "not_utf8")
              # Spark's parser takes a raw NUL as the end of the text ("0\r\x00" parses as 0);
              # JSON allows no raw control character anywhere (RFC 8259, sections 2 and 7).
              .when(doc.isNull() | F.contains(text, F.lit("\u0000")), "not_json")
              .when(F.col("_fields").isNull(), "not_object")
              .when(F.col("device").isNull(), "no_device")
              .when(F.size("values") == 0, "no_numeric_field")
              .when(F.col("event_time").isNull(), "bad_ts"))
    return staged.withColumn("reason", reason).drop("_fields")


def good_values(classified: DataFrame) -> DataFrame:
    """One row per numeric field of each good record: device, topic, event_time, field, value."""
    from pyspark.sql import functions as F

    return (classified.where(F.col("reason").isNull())
            .select("device", "topic", "event_time", F.explode("values").alias("field", "value")))


def quarantine(classified: DataFrame, source_columns: list[str]) -> DataFrame:
    """The bad records exactly as read, plus their ``reason``."""
    from pyspark.sql import functions as F

    return classified.where(F.col("reason").isNotNull()).select(*source_columns, "reason")


def aggregate(values: DataFrame, window: str) -> DataFrame:
    """Count, min, max, mean and sum per (tumbling event-time window, device, topic, field)."""
    from pyspark.sql import functions as F

    return (values.groupBy(F.window("event_time", window).alias("w"), "device", "topic", "field")
            .agg(F.count("value").alias("count"), F.min("value").alias("min"),
                 F.max("value").alias("max"), F.avg("value").alias("mean"),
                 F.sum("value").alias("sum"))
            .select(F.col("w.start").alias("window_start"), F.col("w.end").alias("window_end"),
                    "device", "topic", "field", "count", "min", "max", "mean", "sum"))


def _records(spark: SparkSession, options: TelemetryOptions, streaming: bool) -> DataFrame:
    records = read_log(spark, options.data_dir, options.topics, streaming,
                       options.source_options)
    if options.exclude:
        records = records.where(~matches_any(records["topic"], options.exclude))
    return records


# ---------------------------------------------------------------- runs


def run_batch(spark: SparkSession, options: TelemetryOptions) -> TelemetryResult:
    """Aggregate the whole log; rewrite ``aggregates`` and ``quarantine`` under the output."""
    result = TelemetryResult(aggregates_path=options.aggregates_path,
                             quarantine_path=options.quarantine_path)
    for path in (result.aggregates_path, result.quarantine_path):
        check_not_streaming_output(path)
    records = _records(spark, options, streaming=False)
    classified = classify(records, options.device_level).persist()
    try:
        counts = classified.groupBy("reason").count().collect()
        result.records = sum(row["count"] for row in counts)
        result.quarantined = {row["reason"]: row["count"] for row in counts if row["reason"]}
        aggregates = aggregate(good_values(classified), options.window)
        aggregates.write.mode("overwrite").parquet(result.aggregates_path)
        quarantine(classified, records.columns).write.mode("overwrite").parquet(
            result.quarantine_path)
    finally:
        classified.unpersist()
    return result


def start_stream(spark: SparkSession, options: TelemetryOptions,
                 stream: StreamSettings) -> list[Any]:
    """Start the aggregation and quarantine queries; the caller awaits or stops them.

    Each query checkpoints under ``stream.checkpoint`` (``aggregates/``, ``quarantine/``).
    The quarantine query reports ``records`` and ``quarantined`` per batch as observed
    metrics named ``telemetry`` (``StreamingQueryProgress.observedMetrics``).
    """
    from pyspark.sql import functions as F

    checkpoint = qualify(stream.checkpoint)
    records = _records(spark, options, streaming=True)
    classified = classify(records, options.device_level)
    aggregates = aggregate(
        good_values(classified).withWatermark("event_time", options.watermark), options.window)
    counters = [F.count_if(F.col("reason") == reason).alias(reason) for reason in REASONS]
    bad = quarantine(
        classified.observe("telemetry", F.count(F.lit(1)).alias("records"), *counters),
        records.columns)
    queries = []
    for name, frame, path in (("aggregates", aggregates, options.aggregates_path),
                              ("quarantine", bad, options.quarantine_path)):
        writer = (frame.writeStream.format("parquet").outputMode("append")
                  .option("path", path).option("checkpointLocation", f"{checkpoint}/{name}")
                  .queryName(f"telemetry-{name}"))
        queries.append(apply_trigger(writer, stream.trigger).start())
    return queries


def run_stream(spark: SparkSession, options: TelemetryOptions,
               stream: StreamSettings) -> TelemetryResult:
    """Run both streaming queries until done (available-now) or stopped (Ctrl-C)."""
    queries = start_stream(spark, options, stream)
    await_queries(queries)
    result = TelemetryResult(aggregates_path=options.aggregates_path,
                             quarantine_path=options.quarantine_path)
    # recentProgress holds the last 100 batches (spark.sql.streaming.numRecentProgressUpdates).
    for progress in queries[0].recentProgress:
        result.late += sum(op.numRowsDroppedByWatermark for op in progress.stateOperators)
    for progress in queries[1].recentProgress:
        metrics = progress.observedMetrics.get("telemetry")
        if metrics is None:
            continue
        result.records += metrics["records"]
        for reason in REASONS:
            if metrics[reason]:
                result.quarantined[reason] = result.quarantined.get(reason, 0) + metrics[reason]
    return result
