"""The report's HTML page: a summary, the PNG, the alerts, per-field tables, the quarantine.

Every number on the page says what it counts (a line under each heading), every time says
which clock it is (broker time: when the broker appended a message; event time: when a
reading was taken, the payload's ``ts``), and every value carries its unit when one is known.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from datetime import UTC, datetime

from meshmq.pipeline.jobs.report_model import Alert, DeviceStats, ReportData
from meshmq.pipeline.jobs.report_plot import duration
from meshmq.pipeline.jobs.telemetry import REASONS

MAX_ALERT_ROWS = 200
DASH = "&ndash;"
FIELDS_PER_TABLE = 5
STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1150px;padding:0 1em;
 color:#222;line-height:1.45}
h1{margin-bottom:.2em}h2{margin-top:1.8em;border-bottom:1px solid #ddd}
p.note{color:#555;font-size:.92em;margin:.3em 0 .8em}
table{border-collapse:collapse;margin:.4em 0 1em}
th,td{border:1px solid #ccc;padding:3px 10px;vertical-align:top}
th{background:#f3f3f3;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
tr:nth-child(even) td{background:#fafafa}
table.summary th{width:13em}
td.alert{color:#b0002a;font-weight:600}
img{max-width:100%;border:1px solid #ddd}
"""


def esc(text: object) -> str:
    return html.escape(str(text))


def number(value: float) -> str:
    """Integers as integers, others to 4 significant digits (no exponent below 10^6)."""
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    if 1e-3 <= abs(value) < 1e6:
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.1f}"
    return f"{value:.4g}"


def when(moment: datetime, with_date: bool = True) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S" if with_date else "%H:%M:%S")


def time_range(first: datetime, last: datetime) -> str:
    same_day = first.date() == last.date()
    span = duration((last - first).total_seconds())
    return f"{when(first)} {DASH} {when(last, not same_day)} UTC ({span})"


def _table(headers: list[str], rows: list[list[str]], numeric: set[int] | None = None,
           css: str = "") -> str:
    numeric = numeric or set()
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(cell if cell.startswith("<td") else
                         f"<td{' class=n' if i in numeric else ''}>{cell}</td>"
                         for i, cell in enumerate(row)) + "</tr>" for row in rows)
    attribute = f' class="{css}"' if css else ""
    return f"<table{attribute}><tr>{head}</tr>{body}</table>"


# ---------------------------------------------------------------- sections


def summary(data: ReportData) -> str:
    rows: list[list[str]] = []
    if data.broker_first and data.broker_last:
        roots = ", ".join(f"{esc(root or '(empty)')}/… {n:,}" for root, n in data.roots[:6])
        rows.append(["Messages read from the log", f"{data.records:,} ({roots})"])
        rows.append(["Broker time", time_range(data.broker_first, data.broker_last)])
    elif data.log_read:
        rows.append(["Messages read from the log", "0"])
    if data.event_first and data.event_last:
        rows.append(["Event time", f"{time_range(data.event_first, data.event_last)}, in "
                     f"{esc(duration(data.window_seconds or 0))} windows"])
        rows.append(["Devices", f"{len(data.devices)}: {esc(', '.join(data.devices[:12]))}"
                     + (" …" if len(data.devices) > 12 else "")])
        readings = sum(s.count for s in data.stats)
        rows.append(["Readings aggregated", f"{readings:,} values of "
                     f"{esc(', '.join(data.with_unit(name) for name in data.fields))}"])
    if data.quarantine or data.stats:
        bad = ", ".join(f"{esc(r)} {n}" for r, n in sorted(data.quarantine.items()))
        rows.append(["Quarantined messages",
                     f"{sum(data.quarantine.values())}" + (f" ({bad})" if bad else "")])
    rows.append(["Alerts fired", _alerts_line(data)])
    body = "".join(f"<tr><th>{name}</th><td>{value}</td></tr>" for name, value in rows)
    return f'<h2>Summary</h2><table class="summary">{body}</table>'


def _alerts_line(data: ReportData) -> str:
    if not data.alerts_total:
        return "none" if data.log_read else "unknown (no log read)"
    by_rule: dict[str, int] = {}
    for (rule, _device), count in data.alert_counts.items():
        by_rule[rule] = by_rule.get(rule, 0) + count
    parts = ", ".join(f"{esc(rule)} {n}" for rule, n in sorted(by_rule.items()))
    return f"{data.alerts_total} ({parts})"


def charts(data: ReportData, png_name: str) -> str:
    notes = []
    if data.rates:
        notes.append(
            "<li><b>Messages per second</b> (broker time): each bar is the number of messages "
            f"the broker appended in one {esc(duration(data.rates.bucket_seconds))} bucket, "
            "divided by the bucket's length, stacked by topic root; the buckets cover the whole "
            "time range, so a stretch without bars is a time when nothing arrived.</li>")
    if data.series:
        window = esc(duration(data.window_seconds or 0))
        notes.append(
            f"<li><b>One panel per field</b> (event time): each point is a device's mean over "
            f"one {window} window, drawn at the middle of the window. Devices whose series are "
            "identical share a line named after all of them. Dashed lines are the alert rules' "
            "thresholds; a star is an alert that fired, at its window and at the value that "
            "crossed the threshold (the rule's statistic of the window, e.g. its maximum, "
            "which can lie above the mean).</li>")
    return (f'<h2>Charts</h2><img src="{esc(png_name)}" alt="message rate in broker time and '
            f'per-device means of each field in event time"><ul class="note">{"".join(notes)}'
            "</ul>")


def alerts_section(data: ReportData) -> str:
    if not data.thresholds and not data.alerts_total:
        return ""
    rules = []
    unit = data.units.get
    for line in data.thresholds:
        fired = {d: n for (r, d), n in data.alert_counts.items() if r == line.rule}
        devices = ", ".join(f"{esc(d)} ({n})" for d, n in sorted(fired.items()))
        condition = f"{line.stat}({line.field}) {line.op} {number(line.value)}"
        suffix = esc(unit(line.field, ""))
        rules.append([esc(line.rule), f"<code>{esc(condition)}</code> {suffix}",
                      str(sum(fired.values())), devices or DASH])
    topic = f"{data.alerts_prefix}/{{device}}/{{rule}}"
    out = ["<h2>Alerts</h2>",
           "<p class=note>A rule fires once per device and window in which the statistic of "
           "its field (over the readings of that window) crosses the threshold; the "
           f"<code>alerts</code> job publishes each alert on <code>{esc(topic)}</code>. The "
           "alerts below are those messages, read back from the log; <b>value</b> is the "
           "statistic that crossed.</p>",
           _table(["rule", "condition", "alerts", "devices (alerts)"], rules, {2})]
    if data.alerts:
        rows = [_alert_row(alert, data.units.get(alert.field, ""))
                for alert in data.alerts[:MAX_ALERT_ROWS]]
        out.append(_table(["window (event time, UTC)", "device", "rule", "condition",
                           "value", "published (broker time, UTC)"], rows, {4}))
        if data.alerts_total > len(rows):
            out.append(f"<p class=note>The first {len(rows)} of {data.alerts_total} alerts, "
                       "by window.</p>")
    return "".join(out)


def _alert_row(alert: Alert, unit: str) -> list[str]:
    window = f"{when(alert.window_start)} {DASH} {when(alert.window_end, False)}"
    value = f"{number(alert.value)} {unit}".strip()
    return [window, esc(alert.device), esc(alert.rule), f"<code>{esc(alert.condition)}"
            "</code>", f"<td class='n alert'>{esc(value)}</td>", esc(when(alert.published))]


def fields_section(data: ReportData) -> str:
    if not data.stats:
        return ""
    out = ["<h2>Per device</h2>",
           "<p class=note><b>readings</b>: how many values of each field the device sent "
           "(a range when the fields differ); <b>windows</b>: windows with at least one of "
           "them; <b>min</b> and <b>max</b>: the lowest and highest reading over the whole "
           "run; <b>mean</b>: the sum of the readings divided by their number; "
           "<b>alerts</b>: alerts fired for the device by any rule. A value in red crossed a "
           "rule's threshold (for rules on a window's minimum or maximum).</p>"]
    fields = data.fields
    for first in range(0, len(fields), FIELDS_PER_TABLE):
        out.append(_device_table(data, fields[first:first + FIELDS_PER_TABLE]))
    return "".join(out)


def _device_table(data: ReportData, fields: list[str]) -> str:
    stats = {(row.device, row.field): row for row in data.stats}
    top = ("<tr><th rowspan=2>device</th><th rowspan=2>readings</th><th rowspan=2>windows"
           "</th>" + "".join(f"<th colspan=3>{esc(data.with_unit(name))}</th>" for name in fields)
           + "<th rowspan=2>alerts</th></tr>")
    sub = "<tr>" + "<th>min</th><th>mean</th><th>max</th>" * len(fields) + "</tr>"
    rows = []
    for device in data.devices:
        mine = [stats[(device, name)] for name in fields if (device, name) in stats]
        if not mine:
            continue
        cells = [f"<td>{esc(device)}</td>", _numeric(_span(r.count for r in mine)),
                 _numeric(_span(r.windows for r in mine))]
        for name in fields:
            row = stats.get((device, name))
            cells += ([_stat_cell(data, row, "min"), _numeric(number(row.mean)),
                       _stat_cell(data, row, "max")] if row else ["<td></td>"] * 3)
        alerts = sum(n for (_rule, d), n in data.alert_counts.items() if d == device)
        cells.append(f"<td class='n alert'>{alerts}</td>" if alerts else _numeric("0"))
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table>{top}{sub}{''.join(rows)}</table>"


def _span(values: Iterable[int]) -> str:
    low, high = min(values := list(values)), max(values)
    return f"{low:,}" if low == high else f"{low:,}{DASH}{high:,}"


def _numeric(text: str, css: str = "n") -> str:
    return f"<td class='{css}'>{text}</td>"


def _stat_cell(data: ReportData, row: DeviceStats, stat: str) -> str:
    """The device's min or max over the run, in red if a rule on that statistic crossed."""
    value = row.min if stat == "min" else row.max
    crossed = any(t.field == row.field and t.stat == stat and _crosses(value, t.op, t.value)
                  for t in data.thresholds)
    return _numeric(esc(number(value)), "n alert" if crossed else "n")


def _crosses(value: float, op: str, threshold: float) -> bool:
    return {">": value > threshold, ">=": value >= threshold, "<": value < threshold,
            "<=": value <= threshold}[op]


def quarantine_section(data: ReportData) -> str:
    if not data.quarantine:
        return ""
    rows = [[esc(reason), str(count), esc(REASONS.get(reason, ""))]
            for reason, count in sorted(data.quarantine.items())]
    where = f" in <code>{esc(data.quarantine_path)}</code>" if data.quarantine_path else ""
    return ("<h2>Quarantine</h2><p class=note>Messages the telemetry job could not use, kept "
            f"as received{where}.</p>"
            + _table(["reason", "messages", "meaning"], rows, {1}))


def roots_section(data: ReportData) -> str:
    if not data.roots:
        return ""
    rows = [[esc(root or "(empty)"), f"{count:,}"] for root, count in data.roots]
    return ("<h2>Messages per topic root</h2><p class=note>Messages read from the log, by "
            "the first level of their topic.</p>" + _table(["root", "messages"], rows, {1}))


def render_html(data: ReportData, png_name: str, title: str, description: str = "") -> str:
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lede = f"<p>{esc(description)}</p>" if description else ""
    body = "".join((summary(data), charts(data, png_name), alerts_section(data),
                    fields_section(data), quarantine_section(data), roots_section(data)))
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{esc(title)}</title><style>{STYLE}</style></head>\n<body>"
            f"<h1>{esc(title)}</h1><p class=note>Generated {generated}.</p>{lede}\n{body}\n"
            "</body></html>\n")
