"""The ``report`` job: one PNG and one HTML page for people who would rather look than read.

From the commit log (``--data-dir``): message rate over time (broker timestamps, in buckets
chosen so the plot has at most ~200 points) and message counts per topic root. From the
telemetry output (``--telemetry``): per device, the mean of each field per window (the
busiest fields and devices only, so the plot stays legible), a per-device summary table and
the quarantine counts by reason. Spark does the aggregation; only the small results come back
to the driver, where matplotlib (Agg backend, no display needed) draws them.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshmq.pipeline.jobs.common import JobError, is_local, qualify, read_log
from meshmq.pipeline.jobs.telemetry import AGGREGATES_SCHEMA

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

BUCKETS = (1, 5, 10, 30, 60, 300, 900, 3600, 21600, 86400)  # seconds
MAX_POINTS = 200
MAX_DEVICES = 8
MAX_FIELDS = 4
MAX_ROOTS = 20


@dataclass(frozen=True)
class ReportOptions:
    output: str
    data_dir: str | None = None
    telemetry: str | None = None
    title: str = "meshmq report"


@dataclass
class ReportData:
    """What the report shows, already aggregated (small)."""

    records: int = 0
    bucket_seconds: int = 1
    rates: list[tuple[datetime, float]] = field(default_factory=list)
    roots: list[tuple[str, int]] = field(default_factory=list)
    # field -> device -> [(window start, mean)]
    series: dict[str, dict[str, list[tuple[datetime, float]]]] = field(default_factory=dict)
    devices: list[dict[str, Any]] = field(default_factory=list)
    quarantine: dict[str, int] = field(default_factory=dict)


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
    """The smallest bucket in ``BUCKETS`` giving at most ``MAX_POINTS`` points over the span."""
    for bucket in BUCKETS:
        if span_seconds / bucket <= MAX_POINTS:
            return bucket
    return BUCKETS[-1]


def collect_log(spark: SparkSession, data_dir: str, data: ReportData) -> None:
    from pyspark.sql import functions as F

    records = read_log(spark, data_dir).select("timestamp", "topic").persist()
    try:
        span = records.agg(F.count(F.lit(1)).alias("n"), F.min("timestamp").alias("lo"),
                           F.max("timestamp").alias("hi")).first()
        data.records = span["n"]
        if not data.records:
            return
        data.bucket_seconds = pick_bucket((span["hi"] - span["lo"]).total_seconds())
        bucket = f"{data.bucket_seconds} seconds"
        rates = (records.groupBy(F.window("timestamp", bucket).alias("w")).count()
                 .select(F.unix_micros("w.start").alias("start"), "count").orderBy("start"))
        data.rates = [(_utc(r["start"]), r["count"] / data.bucket_seconds)
                      for r in rates.collect()]
        roots = (records.groupBy(F.split("topic", "/", 2).getItem(0).alias("root")).count()
                 .orderBy(F.desc("count"), "root").limit(MAX_ROOTS))
        data.roots = [(r["root"], r["count"]) for r in roots.collect()]
    finally:
        records.unpersist()


def collect_telemetry(spark: SparkSession, telemetry: str, data: ReportData) -> None:
    from pyspark.sql import functions as F

    base = qualify(telemetry)
    aggregates = spark.read.schema(AGGREGATES_SCHEMA).parquet(f"{base}/aggregates")
    per_device = (aggregates.groupBy("device", "field")
                  .agg(F.sum("count").alias("count"), F.min("min").alias("min"),
                       F.max("max").alias("max"),
                       (F.sum("sum") / F.sum("count")).alias("mean"),
                       F.count(F.lit(1)).alias("windows"))
                  .orderBy("device", "field"))
    data.devices = [row.asDict() for row in per_device.collect()]
    fields = _busiest(data.devices, "field", MAX_FIELDS)
    devices = _busiest(data.devices, "device", MAX_DEVICES)
    series = (aggregates.where(F.col("field").isin(fields) & F.col("device").isin(devices))
              .groupBy("field", "device", "window_start")
              .agg((F.sum("sum") / F.sum("count")).alias("mean"))
              .select("field", "device", F.unix_micros("window_start").alias("start"), "mean")
              .orderBy("field", "device", "start"))
    for row in series.collect():
        points = data.series.setdefault(row["field"], {}).setdefault(row["device"], [])
        points.append((_utc(row["start"]), row["mean"]))
    quarantine = f"{base}/quarantine"
    if not is_local(quarantine) or Path(quarantine.removeprefix("file://")).is_dir():
        counts = spark.read.parquet(quarantine).groupBy("reason").count().collect()
        data.quarantine = {row["reason"]: row["count"] for row in counts}


def _busiest(rows: list[dict[str, Any]], key: str, limit: int) -> list[str]:
    totals: dict[str, int] = {}
    for row in rows:
        totals[row[key]] = totals.get(row[key], 0) + row["count"]
    return sorted(totals, key=lambda name: (-totals[name], name))[:limit]


def draw(data: ReportData, path: Path, title: str) -> None:
    """Write the PNG: rates, topic roots, then one panel per field."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    panels = 2 + len(data.series)
    figure, axes = plt.subplots(panels, 1, figsize=(10, 3.2 * panels), squeeze=False,
                                layout="constrained")
    figure.suptitle(title)
    rate_axes, root_axes = axes[0][0], axes[1][0]
    if data.rates:
        times, values = zip(*data.rates, strict=True)
        rate_axes.bar(times, values, width=data.bucket_seconds / 86400, align="edge")
    rate_axes.set_title(f"messages per second ({data.bucket_seconds} s buckets, broker time, "
                        "UTC)")
    rate_axes.set_ylabel("msg/s")
    if data.roots:
        names, counts = zip(*data.roots, strict=True)
        bars = root_axes.barh([name or "(empty)" for name in names], counts)
        root_axes.bar_label(bars, padding=3)
        root_axes.invert_yaxis()
    root_axes.set_title("messages per topic root")
    for row, (name, devices) in enumerate(sorted(data.series.items()), start=2):
        field_axes = axes[row][0]
        for device, points in sorted(devices.items()):
            times, means = zip(*points, strict=True)
            field_axes.plot(times, means, marker=".", label=device)
        field_axes.set_title(f"{name}: mean per window, by device (event time, UTC)")
        field_axes.legend(loc="upper left", fontsize="small", ncols=4)
    for row in (0, *range(2, panels)):
        locator = mdates.AutoDateLocator()
        axes[row][0].xaxis.set_major_locator(locator)
        axes[row][0].xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def render_html(data: ReportData, png_name: str, title: str) -> str:
    esc = html.escape
    rows = "".join(
        f"<tr><td>{esc(d['device'])}</td><td>{esc(d['field'])}</td><td>{d['count']}</td>"
        f"<td>{d['windows']}</td><td>{d['min']:.4g}</td><td>{d['mean']:.4g}</td>"
        f"<td>{d['max']:.4g}</td></tr>" for d in data.devices)
    roots = "".join(f"<tr><td>{esc(name) or '(empty)'}</td><td>{count}</td></tr>"
                    for name, count in data.roots)
    bad = ", ".join(f"{esc(reason)}: {n}" for reason, n in sorted(data.quarantine.items()))
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}</style></head>
<body><h1>{esc(title)}</h1>
<p>Generated {generated}. {data.records} records in the log;
{len({d['device'] for d in data.devices})} devices with telemetry;
quarantined: {bad or "none"}.</p>
<img src="{esc(png_name)}" alt="message rates, topic roots and per-device metrics">
<h2>Messages per topic root</h2>
<table><tr><th>root</th><th>messages</th></tr>{roots}</table>
<h2>Per-device metrics (all windows)</h2>
<table><tr><th>device</th><th>field</th><th>readings</th><th>windows</th><th>min</th>
<th>mean</th><th>max</th></tr>{rows}</table>
</body></html>
"""


def run(spark: SparkSession, options: ReportOptions) -> ReportResult:
    """Collect, draw and write ``report.png`` and ``report.html`` under the output directory."""
    if options.data_dir is None and options.telemetry is None:
        raise JobError("report: give --data-dir, --telemetry or both")
    if options.telemetry is not None:
        aggregates = Path(qualify(options.telemetry)) / "aggregates"
        if is_local(str(aggregates)) and not aggregates.is_dir():
            raise JobError(f"{aggregates}: no telemetry aggregates (run `meshmq pipeline "
                           "telemetry` first)")
    data = ReportData()
    if options.data_dir is not None:
        collect_log(spark, options.data_dir, data)
    if options.telemetry is not None:
        collect_telemetry(spark, options.telemetry, data)
    output = Path(options.output).expanduser().resolve()
    png, page = output / "report.png", output / "report.html"
    draw(data, png, options.title)
    page.write_text(render_html(data, png.name, options.title), encoding="utf-8")
    return ReportResult(png, page, data)
