"""The ``report`` job: one PNG and one HTML page for people who would rather look than read.

Theory of operation
-------------------
Spark aggregates; only small results reach the driver (``ReportData``), where
``report_plot`` draws the PNG (matplotlib, Agg backend: no display needed) and
``report_html`` writes the page around it.

From the commit log (``--data-dir``, the whole log or the range the source options name):

* the message rate in broker time (when the broker appended each record), in buckets chosen
  so the run has at most ``MAX_POINTS`` of them, one count per bucket from the first record
  to the last (empty buckets are zeros, not gaps), split by topic root;
* the alerts the ``alerts`` job published (JSON on ``ALERTS_PREFIX/#``): rule, threshold,
  device, window, the value that crossed, and the broker time it was published.

From the telemetry output (``--telemetry``): per field and device the mean per window (the
busiest fields and devices only, so the plot stays legible), the per-device statistics over
all windows, and the quarantine counts. Rules (``--rules``) add the thresholds of rules that
did not fire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from meshmq.pipeline.jobs.common import (
    JobError,
    is_local,
    matches_any,
    qualify,
    read_log,
)
from meshmq.pipeline.jobs.report_model import (
    Alert,
    DeviceStats,
    ReportData,
    rate_series,
    thresholds_of,
)
from meshmq.pipeline.jobs.rules import Rule
from meshmq.pipeline.jobs.telemetry import AGGREGATES_SCHEMA

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

BUCKETS = (1, 5, 10, 30, 60, 300, 900, 3600, 21600, 86400)  # seconds
MAX_POINTS = 200
MAX_DEVICES = 8
MAX_FIELDS = 4
MAX_ROOTS = 20
MAX_ALERTS = 1000  # alert rows brought to the driver; the counts cover every alert
ALERT_SCHEMA = ("alert_id string, rule string, device string, field string, stat string, "
                "op string, threshold double, value double, topic string, "
                "window_start string, window_end string")


@dataclass(frozen=True)
class ReportOptions:
    output: str
    data_dir: str | None = None
    telemetry: str | None = None
    title: str = "meshmq report"
    description: str = ""  # a paragraph under the title (the demo says what it simulated)
    source_options: dict[str, str] = field(default_factory=dict)  # which part of the log
    rules: tuple[Rule, ...] = ()
    units: dict[str, str] = field(default_factory=dict)  # field -> unit, for axes and tables
    alerts_prefix: str = "alerts"


@dataclass(frozen=True)
class ReportResult:
    png: Path
    html: Path
    data: ReportData

    def summary(self) -> str:
        return f"report: {self.html} (plots in {self.png.name})"


def _utc(micros: int) -> datetime:
    return datetime.fromtimestamp(micros / 1_000_000, UTC)


def pick_bucket(span_seconds: float) -> int:
    """The smallest bucket in ``BUCKETS`` giving at most ``MAX_POINTS`` buckets over the span."""
    for bucket in BUCKETS:  # buckets are aligned to the epoch: the span may touch one more
        if span_seconds / bucket <= MAX_POINTS - 1:
            return bucket
    return BUCKETS[-1]


# ---------------------------------------------------------------- the log


def collect_log(spark: SparkSession, data_dir: str, options: ReportOptions,
                data: ReportData) -> None:
    """Records, broker-time range, rates by topic root and the alerts published."""
    from pyspark.sql import functions as F

    log = read_log(spark, data_dir, options=options.source_options)
    is_alert = matches_any(F.col("topic"), (f"{options.alerts_prefix}/#",))
    records = log.select(
        F.unix_micros("timestamp").alias("us"),
        F.split("topic", "/", 2).getItem(0).alias("root"),
        F.when(is_alert, F.col("payload").cast("string")).alias("alert")).persist()
    try:
        (span,) = records.agg(F.count(F.lit(1)).alias("n"), F.min("us").alias("lo"),
                              F.max("us").alias("hi")).collect()  # a global aggregate: one row
        data.log_read, data.records = True, span["n"]
        if not data.records:
            return
        data.broker_first, data.broker_last = _utc(span["lo"]), _utc(span["hi"])
        roots = records.groupBy("root").count().orderBy(F.desc("count"), "root")
        data.roots = [(r["root"], r["count"]) for r in roots.collect()]
        bucket = pick_bucket((span["hi"] - span["lo"]) / 1_000_000)
        counts = (records.groupBy((F.floor(F.col("us") / (bucket * 1_000_000))).alias("b"),
                                  "root").count().collect())
        data.rates = rate_series({(r["b"], r["root"]): r["count"] for r in counts}, bucket,
                                 span["lo"], span["hi"], [name for name, _ in data.roots])
        data.roots = data.roots[:MAX_ROOTS]
        _collect_alerts(records, data)
    finally:
        records.unpersist()


def _collect_alerts(records: DataFrame, data: ReportData) -> None:
    """Alerts as the ``alerts`` job published them (anything else on the prefix is ignored)."""
    from pyspark.sql import functions as F

    parsed = (records.where(F.col("alert").isNotNull())
              .select("us", F.from_json("alert", ALERT_SCHEMA).alias("a")).select("us", "a.*"))
    required = ("rule", "device", "field", "stat", "op", "threshold", "value",
                "window_start", "window_end")
    for name in required:
        parsed = parsed.where(F.col(name).isNotNull())
    counts = parsed.groupBy("rule", "device").count().collect()
    data.alert_counts = {(r["rule"], r["device"]): r["count"] for r in counts}
    rows = parsed.orderBy("window_start", "rule", "device", "us").limit(MAX_ALERTS).collect()
    data.alerts = [Alert(
        rule=r["rule"], device=r["device"], field=r["field"], stat=r["stat"], op=r["op"],
        threshold=r["threshold"], value=r["value"], topic=r["topic"] or "",
        window_start=_parse_time(r["window_start"]), window_end=_parse_time(r["window_end"]),
        published=_utc(r["us"])) for r in rows]


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


# ---------------------------------------------------------------- telemetry


def collect_telemetry(spark: SparkSession, telemetry: str, data: ReportData,
                      wanted_fields: list[str]) -> None:
    """Per-device statistics, the window length and range, the series and the quarantine.

    ``wanted_fields`` (fields with rules or alerts) are plotted first, then the busiest.
    """
    from pyspark.sql import functions as F

    base = qualify(telemetry)
    aggregates = spark.read.schema(AGGREGATES_SCHEMA).parquet(f"{base}/aggregates")
    per_device = (aggregates.groupBy("device", "field")
                  .agg(F.sum("count").alias("count"), F.min("min").alias("min"),
                       F.max("max").alias("max"),
                       (F.sum("sum") / F.sum("count")).alias("mean"),
                       F.countDistinct("window_start").alias("windows"),
                       F.unix_micros(F.min("window_start")).alias("first"),
                       F.unix_micros(F.max("window_end")).alias("last"),
                       F.max(F.unix_micros("window_end") - F.unix_micros("window_start"))
                       .alias("length"))
                  .orderBy("field", "device").collect())
    data.stats = [DeviceStats(r["device"], r["field"], r["count"], r["windows"], r["min"],
                              r["mean"], r["max"]) for r in per_device]
    if per_device:
        data.window_seconds = max(r["length"] for r in per_device) // 1_000_000
        data.event_first = _utc(min(r["first"] for r in per_device))
        data.event_last = _utc(max(r["last"] for r in per_device))
    fields = _ordered(data.stats, "field", wanted_fields)[:MAX_FIELDS]
    devices = _ordered(data.stats, "device", [])[:MAX_DEVICES]
    series = (aggregates.where(F.col("field").isin(fields) & F.col("device").isin(devices))
              .groupBy("field", "device", "window_start", "window_end")
              .agg((F.sum("sum") / F.sum("count")).alias("mean"))
              .select("field", "device", F.unix_micros("window_start").alias("start"),
                      F.unix_micros("window_end").alias("end"), "mean")
              .orderBy("field", "device", "start"))
    data.series = {name: {} for name in fields}
    for row in series.collect():
        middle = _utc((row["start"] + row["end"]) // 2)
        data.series[row["field"]].setdefault(row["device"], []).append((middle, row["mean"]))
    data.quarantine_path = f"{base}/quarantine"
    data.quarantine = _quarantine(spark, data.quarantine_path)


def _quarantine(spark: SparkSession, path: str) -> dict[str, int]:
    if is_local(path) and not Path(path.removeprefix("file://")).is_dir():
        return {}
    counts = spark.read.parquet(path).groupBy("reason").count().collect()
    return {row["reason"]: row["count"] for row in counts}


def _ordered(stats: list[DeviceStats], key: str, first: list[str]) -> list[str]:
    """Names under ``key`` ("field" or "device"): those in ``first``, then by readings."""
    totals: dict[str, int] = {}
    for row in stats:
        name = getattr(row, key)
        totals[name] = totals.get(name, 0) + row.count
    return sorted(totals, key=lambda name: (name not in first, -totals[name], name))


# ---------------------------------------------------------------- the job


def _check_inputs(options: ReportOptions) -> None:
    if options.data_dir is None and options.telemetry is None:
        raise JobError("report: give --data-dir, --telemetry or both")
    if options.telemetry is not None:
        aggregates = Path(qualify(options.telemetry)) / "aggregates"
        if is_local(str(aggregates)) and not aggregates.is_dir():
            raise JobError(f"{aggregates}: no telemetry aggregates (run `meshmq pipeline "
                           "telemetry` first)")


def collect(spark: SparkSession, options: ReportOptions) -> ReportData:
    """Everything the report shows, aggregated by Spark."""
    _check_inputs(options)
    data = ReportData(units=dict(options.units), alerts_prefix=options.alerts_prefix)
    if options.data_dir is not None:
        collect_log(spark, options.data_dir, options, data)
    data.thresholds = thresholds_of(options.rules, data.alerts)
    if options.telemetry is not None:
        wanted = [t.field for t in data.thresholds]
        collect_telemetry(spark, options.telemetry, data, wanted)
    return data


def run(spark: SparkSession, options: ReportOptions) -> ReportResult:
    """Collect, draw and write ``report.png`` and ``report.html`` under the output directory."""
    from meshmq.pipeline.jobs.report_html import render_html
    from meshmq.pipeline.jobs.report_plot import draw

    data = collect(spark, options)
    output = Path(options.output).expanduser().resolve()
    png, page = output / "report.png", output / "report.html"
    draw(data, png, options.title)
    page.write_text(render_html(data, png.name, options.title, options.description),
                    encoding="utf-8")
    return ReportResult(png, page, data)

