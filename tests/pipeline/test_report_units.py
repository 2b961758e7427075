"""The report's shaping, drawing and page without Spark: rate buckets over the whole run,
identical series, legends beside (not over) the data, thresholds and alerts on the plots, and
a page that names what every number means."""

from __future__ import annotations

import html
from datetime import UTC, datetime

import matplotlib.pyplot as plt
from hypothesis import given
from hypothesis import strategies as st

from meshmq.pipeline.jobs.report import MAX_POINTS, pick_bucket
from meshmq.pipeline.jobs.report_html import render_html
from meshmq.pipeline.jobs.report_model import (
    OTHER_ROOTS,
    ROOT_SERIES,
    Alert,
    DeviceStats,
    ReportData,
    rate_series,
    thresholds_of,
)
from meshmq.pipeline.jobs.report_plot import build_figure
from meshmq.pipeline.jobs.rules import parse_rules

T0 = 1_714_521_600  # 2024-05-01T00:00:00Z
US = 1_000_000


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(T0 + seconds, UTC)


def test_rate_series_has_a_bucket_for_every_step_of_the_run_empty_ones_zero() -> None:
    # records at +3 s and +4 s, nothing for 20 s, then at +27 s: 5 s buckets from +0 to +25
    counts = {(T0 // 5, "devices"): 4, ((T0 + 25) // 5, "devices"): 1,
              ((T0 + 25) // 5, "alerts"): 2}
    series = rate_series(counts, 5, (T0 + 3) * US, (T0 + 27) * US, ["devices", "alerts"])
    assert series.bucket_seconds == 5
    assert series.starts == [at(s) for s in range(0, 30, 5)]
    assert series.counts == {"devices": [4, 0, 0, 0, 0, 1], "alerts": [0, 0, 0, 0, 0, 2]}
    assert series.totals() == [4, 0, 0, 0, 0, 3]


def test_rate_series_sums_the_quietest_roots_beyond_the_drawn_ones() -> None:
    roots = [f"r{i}" for i in range(ROOT_SERIES + 2)]  # busiest first
    counts = {(T0, root): 10 - i for i, root in enumerate(roots)}
    series = rate_series(counts, 1, T0 * US, T0 * US, roots)
    drawn = roots[:ROOT_SERIES - 1]
    assert list(series.counts) == [*drawn, OTHER_ROOTS]
    assert series.counts[OTHER_ROOTS] == [sum(10 - i for i in range(ROOT_SERIES - 1,
                                                                     len(roots)))]


@given(first=st.integers(0, 10**12), span=st.integers(0, 10**12))
def test_buckets_never_exceed_the_plot_budget(first: int, span: int) -> None:
    bucket = pick_bucket(span / US)
    series = rate_series({}, bucket, first, first + span, [])
    if bucket < 86400:  # the largest bucket is used whatever the span
        assert len(series.starts) <= MAX_POINTS
    assert series.starts[0].timestamp() <= first / US < series.starts[0].timestamp() + bucket


RULES = parse_rules("""
[[rule]]
name = "too-hot"
field = "temp"
op = ">"
threshold = 30

[[rule]]
name = "freezing"
field = "temp"
op = "<"
threshold = -5
""")


def sample() -> ReportData:
    """Three devices, two with the same temperatures; one alert; a device name to escape."""
    window = 60
    same = [(at(30 + i * window), 21.0 + i) for i in range(5)]
    hot = [(at(30 + i * window), 25.0 + 2 * i) for i in range(5)]
    alert = Alert("too-hot", "d<0>", "temp", "max", ">", 30.0, 33.5, "devices/d<0>/telemetry",
                  at(240), at(300), at(400))
    data = ReportData(
        records=18, broker_first=at(395), broker_last=at(400), roots=[("devices", 17),
                                                                       ("alerts", 1)],
        rates=rate_series({((T0 + 395), "devices"): 17, ((T0 + 400), "alerts"): 1}, 1,
                          (T0 + 395) * US, (T0 + 400) * US, ["devices", "alerts"]),
        alerts=[alert], alert_counts={("too-hot", "d<0>"): 1},
        thresholds=thresholds_of(RULES, [alert]), window_seconds=window,
        event_first=at(0), event_last=at(300),
        stats=[DeviceStats("d<0>", "temp", 15, 5, 24.5, 29.0, 33.5),
               DeviceStats("d1", "temp", 15, 5, 20.5, 23.0, 25.5),
               DeviceStats("d2", "temp", 15, 5, 20.5, 23.0, 25.5)],
        series={"temp": {"d<0>": hot, "d1": same, "d2": list(same)}},
        quarantine={"not_json": 2}, units={"temp": "°C"})
    return data


def test_identical_series_share_one_line_and_legends_sit_beside_the_plots() -> None:
    figure = build_figure(sample(), "t")
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        rates, temp = figure.axes
        for axes in (rates, temp):
            legend = axes.get_legend()
            assert legend is not None
            assert not legend.get_window_extent(renderer).overlaps(
                axes.get_window_extent(renderer)), axes.get_title()
        labels = [text.get_text() for text in temp.get_legend().get_texts()]
        assert "d1, d2 (identical)" in labels and "d<0>" in labels
        assert len([line for line in temp.get_lines() if line.get_label() == "d1"]) == 0
        assert "rule too-hot: max(temp) > 30" in labels
        # -5 lies far below readings of 20 to 33.5: named, not drawn (it would squash them)
        assert "rule freezing: min(temp) < -5 (off the scale)" in labels
        assert temp.get_ylim()[0] > 15
        assert "alert too-hot: the window's max" in labels
        assert temp.get_ylabel() == "temp (°C)" and "event time" in temp.get_xlabel()
        assert "broker time" in rates.get_xlabel() and rates.get_ylabel() == "messages per second"
        # one bar per bucket and root over the whole range, the empty ones included
        assert len(rates.patches) == 2 * 6
    finally:
        plt.close(figure)


def test_page_shows_alerts_with_thresholds_units_and_what_numbers_mean() -> None:
    page = render_html(sample(), "report.png", "fleet <1>", "what was simulated")
    assert "<h1>fleet &lt;1&gt;</h1>" in page and "<p>what was simulated</p>" in page
    assert "d<0>" not in page and "d&lt;0&gt;" in page
    # the alert: window, device, rule, condition, value with unit, when it was published
    assert ("<td>2024-05-01 00:04:00 &ndash; 00:05:00</td><td>d&lt;0&gt;</td><td>too-hot</td>"
            "<td><code>max(temp) &gt; 30</code></td><td class='n alert'>33.5 °C</td>"
            "<td>2024-05-01 00:06:40</td>") in page
    # every rule, fired or not, with its threshold and count
    assert ("<td>freezing</td><td><code>min(temp) &lt; -5</code> °C</td><td class=n>0</td>"
            in page)
    assert "<td>too-hot</td><td><code>max(temp) &gt; 30</code> °C</td><td class=n>1</td>" in page
    assert "<tr><th>Alerts fired</th><td>1 (too-hot 1)</td></tr>" in page
    assert ("<tr><th>Broker time</th><td>2024-05-01 00:06:35 &ndash; 00:06:40 UTC (5 s)</td>"
            in page)
    assert "<tr><th>Event time</th><td>2024-05-01 00:00:00 &ndash; 00:05:00 UTC (5 min), in " \
           "1 min windows</td>" in page
    assert "<th colspan=3>temp (°C)</th>" in page
    # the hot device's max crossed too-hot: shown in red
    assert "<td class='n alert'>33.5</td>" in page
    assert "<b>mean</b>: the sum of the readings divided by their number" in page
    assert html.escape(REASON_NOT_JSON) in page


REASON_NOT_JSON = "the payload is not valid JSON (duplicate keys included)"


def test_thresholds_come_from_the_rules_and_from_alerts_of_rules_not_given() -> None:
    old = Alert("too-cold", "d1", "temp", "min", "<", 0.0, -1.0, "t", at(0), at(60), at(61))
    lines = thresholds_of(RULES[:1], [old])
    assert [(t.rule, t.op, t.value) for t in lines] == [("too-cold", "<", 0.0),
                                                        ("too-hot", ">", 30.0)]


def test_empty_report_still_draws_and_renders() -> None:
    figure = build_figure(ReportData(), "nothing")
    plt.close(figure)
    page = render_html(ReportData(log_read=True), "report.png", "nothing")
    assert "<tr><th>Messages read from the log</th><td>0</td></tr>" in page
    assert "<tr><th>Alerts fired</th><td>none</td></tr>" in page
    unread = render_html(ReportData(), "report.png", "telemetry only")
    assert "Messages read from the log" not in unread
    assert "<tr><th>Alerts fired</th><td>unknown (no log read)</td></tr>" in unread


def test_the_quarantine_section_names_the_real_directory() -> None:
    """Where the bad payloads are, as a path one can open (was the docs' placeholder
    TELEMETRY/quarantine, which names no directory of the run)."""
    data = sample()
    data.quarantine_path = "/srv/run <1>/telemetry/quarantine"
    page = render_html(data, "report.png", "fleet")
    assert "TELEMETRY" not in page
    assert ("kept as received in <code>/srv/run &lt;1&gt;/telemetry/quarantine</code>."
            in page)
