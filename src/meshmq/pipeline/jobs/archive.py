"""The ``archive`` job: every raw record to Parquet, partitioned by date and topic root.

Layout: ``OUTPUT/date=YYYY-MM-DD/topic_root=ROOT/part-*.parquet``, where ``date`` is the UTC
day of the record's log timestamp and ``topic_root`` the topic's first level. Every column of
the source is kept as read (payload bytes included), so the archive can replace the log once
retention deletes it. Spark escapes unusual characters in partition directory names; a topic
whose first level is empty (``/a/b``) is filed under ``topic_root=__HIVE_DEFAULT_PARTITION__``
and reads back with a null ``topic_root`` (its ``topic`` column is intact).

Batch mode rewrites the archive from the whole log. Streaming mode appends new records with a
checkpoint, exactly once (the Parquet file sink commits each batch in ``_spark_metadata``);
run it with ``--trigger available-now`` from cron, or with an interval to run continuously.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from meshmq.pipeline.jobs.common import (
    StreamSettings,
    apply_trigger,
    await_queries,
    check_not_streaming_output,
    qualify,
    read_log,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

PARTITION_COLUMNS = ("date", "topic_root")


@dataclass(frozen=True)
class ArchiveOptions:
    data_dir: str
    output: str
    topics: tuple[str, ...] = ()
    source_options: dict[str, str] = field(default_factory=dict)


def with_partitions(records: DataFrame) -> DataFrame:
    """The records plus ``date`` (UTC day of ``timestamp``) and ``topic_root`` (first level)."""
    from pyspark.sql import functions as F

    return (records
            .withColumn("date", F.date_format(F.col("timestamp"), "yyyy-MM-dd"))
            .withColumn("topic_root", F.split(F.col("topic"), "/", 2).getItem(0)))


def run_batch(spark: SparkSession, options: ArchiveOptions) -> str:
    """Rewrite the archive from the whole log; return a one-line summary."""
    output = qualify(options.output)
    check_not_streaming_output(output)
    records = read_log(spark, options.data_dir, options.topics, False, options.source_options)
    (with_partitions(records).write.mode("overwrite").partitionBy(*PARTITION_COLUMNS)
     .parquet(output))
    written = spark.read.parquet(output).count()
    return f"archive: {written} records in {output}"


def start_stream(spark: SparkSession, options: ArchiveOptions, stream: StreamSettings) -> Any:
    """Start the archiving query; the caller awaits or stops it."""
    records = read_log(spark, options.data_dir, options.topics, True, options.source_options)
    writer = (with_partitions(records).writeStream.format("parquet").outputMode("append")
              .partitionBy(*PARTITION_COLUMNS).option("path", qualify(options.output))
              .option("checkpointLocation", qualify(stream.checkpoint))
              .queryName("archive"))
    return apply_trigger(writer, stream.trigger).start()


def run_stream(spark: SparkSession, options: ArchiveOptions, stream: StreamSettings) -> str:
    query = start_stream(spark, options, stream)
    await_queries([query])
    appended = sum(progress.numInputRows for progress in query.recentProgress)
    return f"archive: {appended} records appended to {qualify(options.output)}"
