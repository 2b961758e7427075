"""What a report shows, already aggregated and small, and the pure helpers that shape it.

``report.py`` fills a ``ReportData`` with Spark; ``report_plot`` and ``report_html`` only
read it. Nothing here imports Spark or matplotlib, so the shaping is tested without either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from meshmq.pipeline.jobs.rules import Rule

ROOT_SERIES = 5  # topic roots drawn separately in the rate plot; the rest are summed
OTHER_ROOTS = "(other roots)"

Points = list[tuple[datetime, float]]


@dataclass(frozen=True)
class Alert:
    """One alert the ``alerts`` job published, as read back from the log."""

    rule: str
    device: str
    field: str
    stat: str
    op: str
    threshold: float
    value: float
    topic: str
    window_start: datetime
    window_end: datetime
    published: datetime  # broker time of the alert message

    @property
    def condition(self) -> str:
        return f"{self.stat}({self.field}) {self.op} {self.threshold:g}"


@dataclass(frozen=True)
class Threshold:
    """A rule's line on its field's plot."""

    rule: str
    field: str
    stat: str
    op: str
    value: float

    @property
    def label(self) -> str:
        return f"{self.rule}: {self.stat}({self.field}) {self.op} {self.value:g}"


@dataclass(frozen=True)
class DeviceStats:
    """One device's readings of one field over every window of the run."""

    device: str
    field: str
    count: int
    windows: int
    min: float
    mean: float
    max: float


@dataclass(frozen=True)
class RateSeries:
    """Messages per broker-time bucket: one count per bucket from the first record's bucket to
    the last one's, empty buckets included, per topic root (in stacking order)."""

    bucket_seconds: int
    starts: list[datetime]
    counts: dict[str, list[int]]

    def totals(self) -> list[int]:
        return [sum(column) for column in zip(*self.counts.values(), strict=True)]


@dataclass
class ReportData:
    """Everything the PNG and the page show."""

    log_read: bool = False  # whether the report read a log (records and alerts are known)
    records: int = 0  # log records read
    broker_first: datetime | None = None
    broker_last: datetime | None = None
    roots: list[tuple[str, int]] = field(default_factory=list)  # busiest first
    rates: RateSeries | None = None
    alerts: list[Alert] = field(default_factory=list)  # by window (at most MAX_ALERTS)
    alert_counts: dict[tuple[str, str], int] = field(default_factory=dict)  # (rule, device)
    thresholds: list[Threshold] = field(default_factory=list)
    window_seconds: int | None = None
    event_first: datetime | None = None  # start of the first window
    event_last: datetime | None = None  # end of the last window
    stats: list[DeviceStats] = field(default_factory=list)
    series: dict[str, dict[str, Points]] = field(default_factory=dict)  # field -> device ->
    quarantine: dict[str, int] = field(default_factory=dict)
    quarantine_path: str = ""  # the telemetry job's quarantine table, as the report read it
    units: dict[str, str] = field(default_factory=dict)
    alerts_prefix: str = "alerts"

    @property
    def alerts_total(self) -> int:
        return sum(self.alert_counts.values())

    @property
    def devices(self) -> list[str]:
        return sorted({row.device for row in self.stats})

    @property
    def fields(self) -> list[str]:
        return sorted({row.field for row in self.stats})

    def with_unit(self, name: str) -> str:
        unit = self.units.get(name)
        return f"{name} ({unit})" if unit else name


def rate_series(counts: dict[tuple[int, str], int], bucket_seconds: int, first_us: int,
                last_us: int, roots: list[str]) -> RateSeries:
    """Counts keyed by (bucket number since the epoch, topic root) -> a ``RateSeries``.

    Buckets run from the one holding ``first_us`` to the one holding ``last_us``; a bucket
    without records counts 0. ``roots`` (busiest first) are drawn one by one up to
    ``ROOT_SERIES``; beyond that the quietest are summed as ``OTHER_ROOTS``.
    """
    size = bucket_seconds * 1_000_000
    first, last = first_us // size, last_us // size
    shown = roots if len(roots) <= ROOT_SERIES else roots[:ROOT_SERIES - 1]
    names = [*shown, OTHER_ROOTS] if len(shown) < len(roots) else list(shown)
    per_root = {name: [0] * (last - first + 1) for name in names}
    for (bucket, root), count in counts.items():
        if not first <= bucket <= last:
            raise ValueError(f"bucket {bucket} outside {first}..{last}")
        per_root[root if root in shown else OTHER_ROOTS][bucket - first] += count
    starts = [datetime.fromtimestamp((first + i) * bucket_seconds, UTC)
              for i in range(last - first + 1)]
    return RateSeries(bucket_seconds, starts, per_root)


def thresholds_of(rules: tuple[Rule, ...] | list[Rule], alerts: list[Alert]) -> list[Threshold]:
    """The rules' thresholds, plus those of alerts whose rule is not (or no longer) among them."""
    lines = [Threshold(r.name, r.field, r.stat, r.op, r.threshold) for r in rules]
    for alert in alerts:
        line = Threshold(alert.rule, alert.field, alert.stat, alert.op, alert.threshold)
        if line not in lines:
            lines.append(line)
    return sorted(lines, key=lambda t: (t.field, t.rule, t.value))


def group_identical(series: dict[str, Points]) -> list[tuple[list[str], Points]]:
    """Devices whose series are the same (to 9 significant digits) share one line and one
    label: drawn separately, the last one would hide the others."""
    groups: dict[tuple[tuple[datetime, str], ...], list[str]] = {}
    points: dict[tuple[tuple[datetime, str], ...], Points] = {}
    for device in sorted(series):
        key = tuple((when, f"{value:.9g}") for when, value in series[device])
        groups.setdefault(key, []).append(device)
        points.setdefault(key, series[device])
    return [(devices, points[key]) for key, devices in groups.items()]
