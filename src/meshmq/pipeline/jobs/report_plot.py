"""The report's PNG: the message rate in broker time, then one panel per field in event time.

Every panel says what is plotted, in which time and unit; legends sit to the right of the
plots, never over the data. Each device keeps one colour and marker in every panel, and
devices with identical series share one line whose label names them all. A field's rules
are dashed lines at their thresholds, and each alert that fired is a star at its window
and value (the rule's statistic, e.g. the window's maximum, which can lie above the mean
plotted for the device).

Times are ``datetime``s, which matplotlib's units registry converts; its type stubs know only
numbers and arrays there, hence the ``type: ignore[arg-type]`` on the calls that take them.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshmq.pipeline.jobs.report_model import Alert, ReportData, Threshold, group_identical

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h")
THRESHOLD_COLOURS = ("crimson", "black", "darkmagenta", "darkgoldenrod")  # not tab10 ones
OFF_SCALE = 0.5  # a threshold further than this times the data's range from it is not drawn
DPI = 90
WIDTH = 12.5  # inches
PANEL_HEIGHT = 3.1


def duration(seconds: float) -> str:
    """``45 s``, ``1 min``, ``2 min 30 s``, ``3 h``: the window and bucket lengths in words."""
    seconds = round(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            whole, rest = divmod(seconds, size)
            return f"{whole} {unit}" + (f" {duration(rest)}" if rest else "")
    return f"{seconds} s"


def draw(data: ReportData, path: Path, title: str) -> None:
    """Write the PNG (matplotlib's Agg backend: no display needed)."""
    import matplotlib.pyplot as plt

    figure = build_figure(data, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI)
    plt.close(figure)


def build_figure(data: ReportData, title: str) -> Figure:
    """The figure ``draw`` saves; the caller closes it (``plt.close``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = max((1 if data.rates else 0) + len(data.series), 1)
    figure, axes = plt.subplots(panels, 1, figsize=(WIDTH, 0.6 + PANEL_HEIGHT * panels),
                                squeeze=False, layout="constrained")
    figure.suptitle(title, fontsize="x-large")
    column = [row[0] for row in axes]
    if not data.rates and not data.series:
        column[0].text(0.5, 0.5, "no records and no telemetry to show", ha="center")
        column[0].set_axis_off()
        return figure
    if data.rates:
        draw_rates(column.pop(0), data)
    styles = device_styles(sorted({d for devices in data.series.values() for d in devices}))
    for (name, devices), axes_ in zip(data.series.items(), column, strict=True):
        draw_field(axes_, data, name, devices, styles)
    for axes_ in column[:-1]:  # the field panels share one event-time axis
        axes_.sharex(column[-1])
    return figure


def device_styles(devices: list[str]) -> dict[str, dict[str, Any]]:
    """One colour and marker per device, the same in every panel."""
    import matplotlib

    colours = matplotlib.color_sequences["tab10"]
    return {device: {"color": colours[i % len(colours)], "marker": MARKERS[i % len(MARKERS)]}
            for i, device in enumerate(devices)}


def _time_axis(axes: Axes, label: str) -> None:
    import matplotlib.dates as mdates

    locator = mdates.AutoDateLocator(minticks=5, maxticks=12)
    axes.xaxis.set_major_locator(locator)
    # Ticks within a minute read "12:28:30", not "30" beside an offset label.
    formats = ["%Y", "%b", "%d", "%H:%M", "%H:%M", "%H:%M:%S"]
    axes.xaxis.set_major_formatter(mdates.ConciseDateFormatter(
        locator, formats=formats, zero_formats=["", "%Y", "%b", "%b-%d", "%H:%M", "%H:%M"],
        offset_formats=["", "%Y", "%Y-%m", "%Y-%m-%d", "%Y-%m-%d", "%Y-%m-%d"]))
    axes.set_xlabel(label)
    axes.grid(True, alpha=0.3)


def _legend(axes: Axes, title: str | None = None) -> None:
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                fontsize="small", title=title, title_fontsize="small", alignment="left",
                frameon=False)


def draw_rates(axes: Axes, data: ReportData) -> None:
    """Stacked bars, one per bucket, from the first record to the last: msg/s by topic root."""
    rates = data.rates
    assert rates is not None and data.broker_first and data.broker_last
    bucket = rates.bucket_seconds
    width = timedelta(seconds=bucket)
    bottom = [0.0] * len(rates.starts)
    for name, counts in rates.counts.items():
        values = [count / bucket for count in counts]
        # matplotlib stubs: no datetime x (see the module docstring)
        axes.bar(rates.starts, values, width=width, bottom=bottom,  # type: ignore[arg-type]
                 align="edge", label=f"{name or '(empty)'}/…", edgecolor="white",
                 linewidth=0.3)
        bottom = [low + value for low, value in zip(bottom, values, strict=True)]
    span = (data.broker_last - data.broker_first).total_seconds()
    axes.set_title(f"Messages appended to the log: {data.records} in {duration(span)}; "
                   f"each bar is one {duration(bucket)} bucket", loc="left")
    axes.set_ylabel("messages per second")
    # matplotlib stubs: no datetime x (see the module docstring)
    axes.set_xlim(rates.starts[0], rates.starts[-1] + width)  # type: ignore[arg-type]
    axes.set_ylim(0, max(bottom) * 1.12 or 1)  # headroom: the tallest bar below the frame
    _time_axis(axes, "broker time (UTC): when the broker appended the message")
    _legend(axes, "topic")


def draw_field(axes: Axes, data: ReportData, name: str, devices: dict[str, Any],
               styles: dict[str, dict[str, Any]]) -> None:
    """Mean per window and device, the field's thresholds and the alerts that fired."""
    for group, points in group_identical(devices):
        times, means = zip(*points, strict=True)
        label = ", ".join(group) + (" (identical)" if len(group) > 1 else "")
        axes.plot(times, means, label=label, linewidth=1.4, markersize=4,
                  **styles[group[0]])
    alerts = [a for a in data.alerts if a.field == name and a.device in devices]
    values = [v for points in devices.values() for _, v in points] + [a.value for a in alerts]
    lines = [t for t in data.thresholds if t.field == name]
    for index, line in enumerate(lines):
        _threshold(axes, line, THRESHOLD_COLOURS[index % len(THRESHOLD_COLOURS)], values)
    _alerts(axes, alerts, styles)
    total = len({row.device for row in data.stats if row.field == name})
    window = duration(data.window_seconds or 0)
    shown = f" ({len(devices)} busiest of {total} devices)" if total > len(devices) else ""
    axes.set_title(f"{name}: mean per {window} window, by device{shown}", loc="left")
    axes.set_ylabel(data.with_unit(name))
    if data.event_first and data.event_last:
        # matplotlib stubs: no datetime x (see the module docstring)
        axes.set_xlim(data.event_first, data.event_last)  # type: ignore[arg-type]
    _time_axis(axes, "event time (UTC): when the readings were taken")
    _legend(axes)


def _threshold(axes: Axes, line: Threshold, colour: str, values: list[float]) -> None:
    """A dashed line at the threshold; only a legend entry if it lies far off the data (it
    would squash the data into a strip)."""
    low, high = (min(values), max(values)) if values else (line.value, line.value)
    margin = OFF_SCALE * max(high - low, abs(high) * 0.01, 1e-9)
    style: dict[str, Any] = {"color": colour, "linestyle": "--", "linewidth": 1.2}
    if low - margin <= line.value <= high + margin:
        axes.axhline(line.value, label=f"rule {line.label}", **style)
    else:
        axes.plot([], [], label=f"rule {line.label} (off the scale)", **style)


def _alerts(axes: Axes, alerts: list[Alert], styles: dict[str, dict[str, Any]]) -> None:
    star: dict[str, Any] = {
        "marker": "*", "s": 170, "zorder": 5, "edgecolors": "black", "linewidths": 0.8}
    for alert in alerts:
        middle: datetime = alert.window_start + (alert.window_end - alert.window_start) / 2
        # matplotlib stubs: no datetime x (see the module docstring)
        axes.scatter([middle], [alert.value],  # type: ignore[arg-type]
                     color=styles[alert.device]["color"], **star)
    for rule in sorted({(alert.rule, alert.stat) for alert in alerts}):
        # one legend entry per rule, in no device's colour (the stars take their device's)
        axes.scatter([], [], color="white", label=f"alert {rule[0]}: the window's {rule[1]}",
                     **star)
