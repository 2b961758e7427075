"""The report of a run and the demo's runs, through a real broker and the shared SparkSession.

Every expected figure is computed here from what was published (the test's readings, or the
payloads the demo's devices sent), never from a job's output: the alerts that fired with
their thresholds and values, the per-device statistics, the message rate over the whole run,
and that a second demo run in the same directory shows that run and nothing of the first.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from test_jobs import (
    RULES,
    WINDOW,
    make_readings,
    publish_all,
    telemetry_messages,
)

from conftest import start_broker
from meshmq.pipeline.jobs import alerts, demo, report, telemetry
from meshmq.pipeline.jobs.publisher import MqttTarget
from meshmq.pipeline.jobs.report_model import ReportData
from meshmq.pipeline.jobs.rules import Rule, load_rules, parse_rules

pytestmark = [pytest.mark.xdist_group("spark"), pytest.mark.timeout(300)]

FREEZING = parse_rules('[[rule]]\nname = "freezing"\nfield = "temp"\nop = "<"\n'
                       "threshold = -10\n")[0]  # never fires
OPS = {">": float.__gt__, ">=": float.__ge__, "<": float.__lt__, "<=": float.__le__}


def window_of(ts: float) -> int:
    return int(ts // WINDOW * WINDOW)


def expected_alert_values(values: dict[tuple[int, str, str], list[float]],
                          rules: tuple[Rule, ...]) -> dict[tuple[str, str, int], float]:
    """(rule, device, window start) -> the statistic that crossed, from the raw readings
    keyed by (window start, device, field)."""
    fired = {}
    for (start, device, name), readings in values.items():
        for rule in rules:
            if rule.field != name:
                continue
            stat = {"max": max(readings), "min": min(readings),
                    "mean": sum(readings) / len(readings)}[rule.stat]
            if OPS[rule.op](float(stat), rule.threshold):
                fired[(rule.name, device, start)] = stat
    return fired


def assert_rates_cover_the_run(data: ReportData, by_root: Counter[str]) -> None:
    """One bucket per step from the first record to the last, counting every record."""
    rates = data.rates
    assert rates is not None and data.broker_first and data.broker_last
    step = timedelta(seconds=rates.bucket_seconds)
    assert all(b - a == step for a, b in zip(rates.starts, rates.starts[1:], strict=False))
    assert rates.starts[0] <= data.broker_first < rates.starts[0] + step
    assert rates.starts[-1] <= data.broker_last < rates.starts[-1] + step
    assert {root: sum(counts) for root, counts in rates.counts.items()} == dict(by_root)
    assert sum(rates.totals()) == data.records == sum(by_root.values())


# ---------------------------------------------------------------- the report job


def test_report_shows_the_alerts_that_fired_with_their_thresholds(spark, tmp_path: Path
                                                                  ) -> None:
    broker = start_broker(tmp_path)
    readings = make_readings()
    out = tmp_path / "telemetry"
    try:
        publish_all(broker.port, telemetry_messages(readings), "fleet")
        telemetry.run_batch(spark, telemetry.TelemetryOptions(str(broker.data_dir), str(out)))
        before = datetime.now(UTC) - timedelta(milliseconds=1)  # the log keeps milliseconds
        fired = alerts.run_batch(spark, alerts.AlertsOptions(
            str(out), tuple(RULES), MqttTarget(port=broker.port),
            ledger=str(tmp_path / "ledger.json")))
        after = datetime.now(UTC)
        result = report.run(spark, report.ReportOptions(
            output=str(tmp_path / "report"), data_dir=str(broker.data_dir),
            telemetry=str(out), rules=(*RULES, FREEZING), units={"temp": "°C", "hum": "%"}))
    finally:
        broker.stop()
    values: dict[tuple[int, str, str], list[float]] = defaultdict(list)
    for device, ts, fields in readings:
        for name, value in fields.items():
            values[(window_of(ts), device, name)].append(float(value))
    expected = expected_alert_values(values, tuple(RULES))
    assert {rule for rule, _, _ in expected} == {"too-hot", "dry"}
    assert fired.published == len(expected)

    data = result.data
    got = {(a.rule, a.device, int(a.window_start.timestamp())): a for a in data.alerts}
    assert set(got) == set(expected)
    by_name = {rule.name: rule for rule in RULES}
    for key, alert in got.items():
        rule = by_name[key[0]]
        assert (alert.field, alert.stat, alert.op, alert.threshold) == (
            rule.field, rule.stat, rule.op, rule.threshold)
        assert alert.value == pytest.approx(expected[key])
        assert alert.window_end - alert.window_start == timedelta(seconds=WINDOW)
        assert before <= alert.published <= after  # when it fired: during the alerts run
    assert data.alert_counts == Counter((rule, device) for rule, device, _ in expected)
    assert {(t.rule, t.field, t.op, t.value) for t in data.thresholds} == {
        (r.name, r.field, r.op, r.threshold) for r in (*RULES, FREEZING)}
    assert_rates_cover_the_run(data, Counter(devices=len(readings), alerts=len(expected)))

    page = result.html.read_text()
    for (rule, device, start), value in expected.items():
        window = datetime.fromtimestamp(start, UTC)
        end = window + timedelta(seconds=WINDOW)
        unit = "°C" if rule == "too-hot" else "%"
        assert (f"<td>{window:%Y-%m-%d %H:%M:%S} &ndash; {end:%H:%M:%S}</td><td>{device}</td>"
                f"<td>{rule}</td>") in page
        assert f"<td class='n alert'>{value:g} {unit}</td>" in page
    assert "<td>too-hot</td><td><code>max(temp) &gt; 30</code> °C</td>" in page
    assert "<td>dry</td><td><code>min(hum) &lt; 35</code> %</td>" in page
    assert "<td>freezing</td><td><code>min(temp) &lt; -10</code> °C</td><td class=n>0</td>" \
        in page


def test_report_reads_only_the_range_the_source_options_name(spark, fleet_log) -> None:
    """``source_options`` bound the log read: the report of one stretch has only its records."""
    broker_dir, first, second = fleet_log
    result = report.collect(spark, report.ReportOptions(
        output="unused", data_dir=str(broker_dir),
        source_options={"startingOffsets": json.dumps(first)}))
    assert result.records == second
    assert dict(result.roots) == {"later": second}


@pytest.fixture
def fleet_log(tmp_path: Path) -> tuple[Path, dict[str, int], int]:
    """A log with 5 records on ``early/…``, then 7 on ``later/…``; returns the data dir, the
    log's end after the first five (partition -> offset) and the number of later records."""
    from meshmq.pipeline.logdir import LogDirectory

    broker = start_broker(tmp_path)
    try:
        publish_all(broker.port, [(f"early/{i}", b"x") for i in range(5)])
        log = LogDirectory.open(broker.data_dir)
        ends = {str(p): log.next_offset(p) for p in range(log.partitions)}
        assert sum(ends.values()) == 5
        publish_all(broker.port, [(f"later/{i}", b"y") for i in range(7)])
    finally:
        broker.stop()
    return broker.data_dir, ends, 7


# ---------------------------------------------------------------- the demo


def payload_values(published: dict[str, list[bytes]]
                   ) -> tuple[dict[tuple[int, str, str], list[float]], int, int]:
    """Readings keyed by (window start, device, field) from the demo's payloads, the number
    of telemetry messages and of payloads no telemetry job can use."""
    values: dict[tuple[int, str, str], list[float]] = defaultdict(list)
    good = bad = 0
    for topic, payloads in published.items():
        device = topic.split("/")[1]
        for payload in payloads:
            try:
                document = json.loads(payload)
            except ValueError:
                document = None
            numbers = {k: v for k, v in document.items() if k != "ts" and isinstance(
                v, int | float) and math.isfinite(v)} if isinstance(document, dict) else {}
            if not numbers:
                bad += 1
                continue
            good += 1
            for name, value in numbers.items():
                values[(window_of(document["ts"]), device, name)].append(float(value))
    return values, good, bad


def check_demo_run(result: demo.DemoResult, workdir: Path) -> None:
    """The run's report shows that run's devices, readings, alerts and records, computed here
    from the payloads its devices sent."""
    values, good, bad = payload_values(result.published)
    rules = tuple(load_rules(workdir / "rules.toml"))
    expected = expected_alert_values(values, rules)
    assert result.alerts.published == len(expected) and result.alerts.already_sent == 0
    assert result.arrived == len(expected)
    data = result.report.data
    assert {(a.rule, a.device, int(a.window_start.timestamp())): a.value
            for a in data.alerts} == pytest.approx(expected)
    assert data.quarantine and sum(data.quarantine.values()) == bad
    per_device: dict[tuple[str, str], list[float]] = defaultdict(list)
    for (_start, device, name), readings in values.items():
        per_device[(device, name)] += readings
    got = {(s.device, s.field): (s.count, s.min, s.max, s.mean) for s in data.stats}
    assert set(got) == set(per_device)
    for key, readings in per_device.items():
        assert got[key][:3] == (len(readings), min(readings), max(readings))
        assert got[key][3] == pytest.approx(sum(readings) / len(readings))
    assert_rates_cover_the_run(data, Counter(devices=good + bad, alerts=len(expected)))
    page = (workdir / "report" / "report.html").read_text()
    devices = sorted(topic.split("/")[1] for topic in result.published)
    assert f"<tr><th>Devices</th><td>{len(devices)}: {', '.join(devices)}</td></tr>" in page


def test_two_demo_runs_in_one_workdir_give_two_self_contained_reports(
        spark, tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    first = demo.run(demo.DemoOptions(workdir=str(workdir), devices=3, readings=12,
                                      publish_over=0), lambda: spark)
    check_demo_run(first, workdir)
    assert any(a.rule == "battery-low" for a in first.report.data.alerts)
    # Same event times (both end now), fewer devices: mixed with the first run, the windows
    # would hold more readings, sensor-02 would appear and the alerts of windows alerted
    # before would count as "already sent".
    second = demo.run(demo.DemoOptions(workdir=str(workdir), devices=2, readings=10,
                                       publish_over=0), lambda: spark)
    check_demo_run(second, workdir)
    assert "sensor-02" not in (workdir / "report" / "report.html").read_text()
    assert sorted(p.name for p in workdir.iterdir()) == [
        ".meshmq-demo", "broker.log", "broker.port", "data", "report", "rules.toml",
        "telemetry"]


def test_a_demo_run_on_a_running_broker_reports_only_its_own_messages(
        spark, tmp_path: Path) -> None:
    broker = start_broker(tmp_path, name="shared")
    try:
        # Earlier traffic on the same topics, alert format included: none of it may show.
        earlier = {"temp": 99.0, "humidity": 5.0, "battery": 1.0,
                   "ts": datetime.now(UTC).timestamp() - 30}
        alert = {"alert_id": "0" * 32, "rule": "too-hot", "device": "sensor-00",
                 "field": "temp", "stat": "max", "op": ">", "threshold": 30.0, "value": 99.0,
                 "topic": "devices/sensor-00/telemetry", "window_start": "2024-05-01T00:00:00Z",
                 "window_end": "2024-05-01T00:01:00Z"}
        publish_all(broker.port, [("devices/sensor-00/telemetry", json.dumps(earlier).encode()),
                                  ("alerts/sensor-00/too-hot", json.dumps(alert).encode())])
        workdir = tmp_path / "demo"
        result = demo.run(demo.DemoOptions(
            workdir=str(workdir), port=broker.port, data_dir=str(broker.data_dir), devices=2,
            readings=8, publish_over=0), lambda: spark)
    finally:
        broker.stop()
    check_demo_run(result, workdir)
    assert all(a.value != 99.0 for a in result.report.data.alerts)
    assert not (workdir / "data").exists()  # the broker's data stays where it is
