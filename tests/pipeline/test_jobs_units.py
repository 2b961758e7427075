"""The jobs' parsers and helpers: durations, topic filters, rules files, the alerts ledger,
the telemetry payload classifier (a Hypothesis property against a reference written here with
the standard library), and the command line's refusals before Spark starts."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshmq.mqtt.topics import topic_matches
from meshmq.pipeline.cli import main as pipeline_main
from meshmq.pipeline.cli import one_line
from meshmq.pipeline.jobs.common import (
    JobError,
    filter_regex,
    parse_duration,
    parse_filters,
    parse_trigger,
    write_json_atomically,
)
from meshmq.pipeline.jobs.ledger import PENDING, SENT, AlertLedger, alert_id, alert_key
from meshmq.pipeline.jobs.rules import RulesError, parse_rules
from meshmq.pipeline.jobs.telemetry import classify
from meshmq.pipeline.schema import SCHEMA

# Spark start-up and first reads are slow on a busy 2-core machine: more than the default 120 s.
pytestmark = [pytest.mark.xdist_group("spark"), pytest.mark.timeout(300)]

# ---------------------------------------------------------------- durations and filters


@pytest.mark.parametrize(("text", "spark"), [
    ("30s", "30 seconds"), ("5 m", "5 minutes"), ("1h", "1 hours"), ("2 days", "2 days"),
    ("1 minute", "1 minutes"), ("250ms", "250 milliseconds"), (" 10 SECONDS ", "10 seconds"),
])
def test_durations_become_spark_intervals(text: str, spark: str) -> None:
    assert parse_duration(text) == spark


@pytest.mark.parametrize("text", ["", "0s", "1", "-5m", "1.5m", "5 fortnights", "m5"])
def test_bad_durations_are_refused_by_name(text: str) -> None:
    with pytest.raises(JobError, match=r"^--window: expected a positive duration"):
        parse_duration(text, "--window")


@given(st.text(max_size=20))
def test_any_duration_text_gives_an_interval_or_one_job_error(text: str) -> None:
    try:
        interval = parse_duration(text)
    except JobError as exc:
        assert "\n" not in str(exc)
        return
    amount, unit = interval.split(" ")
    assert int(amount) > 0 and unit in ("milliseconds", "seconds", "minutes", "hours", "days")


def test_trigger_is_available_now_or_an_interval() -> None:
    assert parse_trigger("available-now") == "available-now"
    assert parse_trigger("10s") == "10 seconds"
    with pytest.raises(JobError, match="--trigger"):
        parse_trigger("sometimes")


@pytest.mark.parametrize(("text", "message"), [
    ("a/#/b", "invalid topic filter 'a/#/b'"),
    ("a/b+", "invalid topic filter 'a/b\\+'"),
    ("$share/g/a", "shared subscriptions"),
])
def test_bad_filters_are_refused(text: str, message: str) -> None:
    with pytest.raises(JobError, match=f"^--topics: .*{message}"):
        parse_filters(text)


LEVEL = st.sampled_from(["a", "b", "", "$x", "dev-1", "é", "a.b", "(", "*", "\\"])


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.one_of(LEVEL, st.just("+")), min_size=1, max_size=4))
    if draw(st.booleans()):
        levels.append("#")
    return "/".join(levels)


@given(filters(), st.lists(LEVEL, min_size=1, max_size=5).map("/".join))
def test_filter_regex_matches_exactly_what_mqtt_matches(topic_filter: str, topic: str) -> None:
    expected = topic_matches(topic_filter, topic)
    assert bool(re.match(filter_regex(topic_filter), topic)) is expected


# ---------------------------------------------------------------- rules files

GOOD_RULES = """
[[rule]]
name = "too-hot"
field = "temp"
op = ">"
threshold = 30

[[rule]]
name = "flat.battery"
field = "battery"
op = "<="
threshold = 15.5
stat = "mean"
topics = ["devices/+/telemetry", "lab/#"]
"""


def test_rules_are_read_with_defaults() -> None:
    hot, battery = parse_rules(GOOD_RULES)
    assert (hot.name, hot.field, hot.op, hot.threshold, hot.stat, hot.topics) == (
        "too-hot", "temp", ">", 30.0, "max", ())
    assert (battery.stat, battery.topics) == ("mean", ("devices/+/telemetry", "lab/#"))
    assert parse_rules('[[rule]]\nname="x"\nfield="f"\nop="<"\nthreshold=1\n')[0].stat == "min"


@pytest.mark.parametrize(("text", "message"), [
    ("", "r.toml: no rules"),
    ("rule = 1", "r.toml: no rules"),
    ("[[rules]]\nname='x'", "r.toml: unknown table or key 'rules'"),
    ("[[rule]]\nname = 'x'\nfield = 'f'\nop = '=>'\nthreshold = 1",
     "r.toml: rule 1 ('x'): op must be one of >, >=, <, <=, got '=>'"),
    ("[[rule]]\nname = 'x'\nfield = 'f'\nop = '>'", "r.toml: rule 1 ('x'): missing key "
     "'threshold'"),
    ("[[rule]]\nname = 'a/b'\nfield = 'f'\nop = '>'\nthreshold = 1",
     "r.toml: rule 1 ('a/b'): name must be"),
    ("[[rule]]\nname = 'x'\nfield = 'f'\nop = '>'\nthreshold = true",
     "r.toml: rule 1 ('x'): threshold must be a finite number, got True"),
    ("[[rule]]\nname = 'x'\nfield = 'f'\nop = '>'\nthreshold = inf",
     "r.toml: rule 1 ('x'): threshold must be a finite number"),
    ("[[rule]]\nname = 'x'\nfield = 'f'\nop = '>'\nthreshold = 1\nstat = 'p99'",
     "r.toml: rule 1 ('x'): stat must be one of min, max, mean, got 'p99'"),
    ("[[rule]]\nname = 'x'\nfield = 'f'\nop = '>'\nthreshold = 1\ntopics = 'a/#/b'",
     "r.toml: rule 1 ('x'): topics: invalid topic filter 'a/#/b'"),
    ("[[rule]]\nname = 'x'\nfield = 'f'\nop = '>'\nthreshold = 1\ncolour = 'red'",
     "r.toml: rule 1 ('x'): unknown key 'colour'"),
    ("[[rule]]\nname = 'x'\nfield = 'f'\nop = '>'\nthreshold = 1\n"
     "[[rule]]\nname = 'x'\nfield = 'g'\nop = '>'\nthreshold = 2",
     "r.toml: rule 2: duplicate name 'x'"),
    ("[[rule]\n", "r.toml: invalid TOML"),
])
def test_bad_rules_get_one_line_naming_rule_and_key(text: str, message: str) -> None:
    with pytest.raises(RulesError) as caught:
        parse_rules(text, "r.toml")
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


@given(st.text(max_size=200))
def test_any_rules_text_gives_rules_or_one_rules_error(text: str) -> None:
    try:
        parse_rules(text)
    except RulesError as exc:
        assert "\n" not in str(exc)


@given(st.lists(st.tuples(st.sampled_from(["name", "field", "op", "threshold", "stat",
                                           "topics", "x"]),
                          st.one_of(st.text(max_size=8), st.integers(), st.floats(),
                                    st.booleans(), st.lists(st.text(max_size=5)))),
                max_size=7))
def test_any_rule_table_gives_a_rule_or_one_rules_error(pairs: list) -> None:
    lines = ["[[rule]]"] + [f"{key} = {json.dumps(value)}" for key, value in dict(pairs).items()
                            if not (isinstance(value, float) and not math.isfinite(value))]
    try:
        rules = parse_rules("\n".join(lines))
    except RulesError:
        return
    assert rules[0].op in (">", ">=", "<", "<=") and math.isfinite(rules[0].threshold)


# ---------------------------------------------------------------- ledger


def test_ledger_round_trips_and_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "ck.ledger.json"
    key = alert_key("hot", "d1", 60_000_000, 120_000_000)
    ledger = AlertLedger.open(path)
    ledger.mark([key], PENDING, 3)
    ledger.save()
    ledger.mark([key], SENT, 3)
    ledger.settle_batch("query-1", 3)
    ledger.save()
    ledger.close()
    assert not list(tmp_path.glob(".*.tmp"))
    again = AlertLedger.open(path)
    assert again.state(key) == SENT
    assert again.alerts[key]["id"] == alert_id(key) == alert_id(
        alert_key("hot", "d1", 60_000_000, 120_000_000))
    assert again.batch_settled("query-1", 3) and not again.batch_settled("query-1", 4)
    assert not again.batch_settled("another-query", 0)
    again.close()


def test_one_job_at_a_time_per_ledger(tmp_path: Path) -> None:
    first = AlertLedger.open(tmp_path / "l.json")
    with pytest.raises(JobError, match="in use by another alerts job"):
        AlertLedger.open(tmp_path / "l.json")
    first.close()
    AlertLedger.open(tmp_path / "l.json").close()


def test_a_damaged_ledger_is_refused_not_reset(tmp_path: Path) -> None:
    path = tmp_path / "l.json"
    path.write_text('{"format": "meshmq-alerts-ledger", "version": 1, "alerts": {')
    with pytest.raises(JobError, match="unreadable alerts ledger"):
        AlertLedger.open(path)
    write_json_atomically(path, {"format": "something else"})
    with pytest.raises(JobError, match="not a version 1 alerts ledger"):
        AlertLedger.open(path)
    assert json.loads(path.read_text()) == {"format": "something else"}


# ---------------------------------------------------------------- the payload classifier

T = datetime(2024, 5, 1, tzinfo=UTC)
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-10**30, 10**30),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=8)
PAYLOADS = st.one_of(
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(["temp", "hum", "x", "é", ""]), JSON_VALUES,
                    max_size=4).map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=12),
    st.sampled_from([b'{"a": 1, "a": 2}', b'{"a": {"b": 1, "b": 1}, "c": 2}', b"NaN",
                     b'{"a": NaN}', b'{"t": 1e400}', b" {\"a\": 1} ", b"\xef\xbb\xbf{}"]))


def reference(payload: bytes) -> tuple[str | None, dict[str, float]]:
    """What the classifier should say, by the standard library: (reason, numeric values)."""
    if not payload:
        return "empty", {}
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        return "not_utf8", {}

    def no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
        if len({key for key, _ in pairs}) != len(pairs):
            raise ValueError("duplicate key")
        return dict(pairs)

    def refuse(constant: str) -> object:
        raise ValueError(constant)

    try:
        value = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=refuse)
    except ValueError:
        return "not_json", {}
    if not isinstance(value, dict):
        return "not_object", {}
    numbers = {key: float(v) for key, v in value.items()
               if isinstance(v, int | float) and not isinstance(v, bool) and key != "ts"}
    numbers = {key: v for key, v in numbers.items() if math.isfinite(v)}
    return ("no_numeric_field" if not numbers else None), numbers


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(PAYLOADS, min_size=60, max_size=200))
def test_classifier_agrees_with_the_standard_library(spark, payloads: list[bytes]) -> None:
    rows = [(0, i, T, "devices/d1/telemetry", 1, False, p, "c", "0" * 32, {})
            for i, p in enumerate(payloads)]
    got = {row["offset"]: (row["reason"], dict(row["values"] or {}))
           for row in classify(spark.createDataFrame(rows, SCHEMA)).collect()}
    for index, payload in enumerate(payloads):
        reason, values = got[index]
        expected_reason, expected_values = reference(payload)
        assert reason == expected_reason, payload
        if reason is None:
            assert values == expected_values, payload


def test_a_raw_nul_makes_a_payload_not_json(spark) -> None:
    """Spark's JSON parser stops at a NUL; the standard library (and RFC 8259) refuse it."""
    payloads = [b"0\r\x00", b'{"v": 1}\x00', b'{"v": 1, "s": "a\x00b"}', b'{"v": 1}']
    rows = [(0, i, T, "devices/d1/telemetry", 1, False, p, "c", "0" * 32, {})
            for i, p in enumerate(payloads)]
    got = {row["offset"]: row["reason"]
           for row in classify(spark.createDataFrame(rows, SCHEMA)).collect()}
    assert [got[i] for i in range(len(payloads))] == [reference(p)[0] for p in payloads]
    assert [reference(p)[0] for p in payloads] == ["not_json", "not_json", "not_json", None]


def test_event_time_from_ts_and_device_from_topic(spark) -> None:
    payloads = [
        ("devices/d1/telemetry", b'{"v": 1, "ts": 1714521600}'),
        ("devices/d1/telemetry", b'{"v": 1, "ts": 1714521600250}'),
        ("devices/d1/telemetry", b'{"v": 1, "ts": 1714521600.5}'),
        ("devices/d1/telemetry", b'{"v": 1, "ts": "2024-05-01T00:00:02Z"}'),
        ("devices/d2/telemetry", b'{"v": 1}'),
        ("devices/d1/telemetry", b'{"v": 1, "ts": "yesterday"}'),
        ("devices/d1/telemetry", b'{"v": 1, "ts": true}'),
        ("devices", b'{"v": 1}'),
        ("devices//telemetry", b'{"v": 1}'),
    ]
    rows = [(0, i, T, topic, 1, False, p, "c", "0" * 32, {})
            for i, (topic, p) in enumerate(payloads)]
    got = sorted(classify(spark.createDataFrame(rows, SCHEMA)).collect(),
                 key=lambda row: row["offset"])
    base = T.timestamp()
    times = [row["event_time"] and row["event_time"].timestamp() for row in got]
    assert times[:5] == [base, base + 0.25, base + 0.5, base + 2, base]
    assert [row["device"] for row in got[:5]] == ["d1"] * 4 + ["d2"]
    assert [row["reason"] for row in got] == [None] * 5 + ["bad_ts", "bad_ts", "no_device",
                                                           "no_device"]


# ---------------------------------------------------------------- command line


def test_spark_wrapped_python_errors_are_cut_to_their_own_line() -> None:
    wrapped = Exception(
        "[PYTHON_DATA_SOURCE_ERROR] Failed to initialize Python data source reader: Traceback "
        "(most recent call last):\n  File \"source.py\", line 38, in reader\n"
        "    return MeshmqBatchReader(parse_options(self.options, streaming=False))\n"
        "meshmq.pipeline.errors.SourceOptionError: unknown option 'bogus' for the meshmq "
        "source (known: path)\n SQLSTATE: 38000\n\tat org.apache.spark.Foo(Foo.scala:1)")
    assert one_line(wrapped) == ("SourceOptionError: unknown option 'bogus' for the meshmq "
                                 "source (known: path)")
    assert one_line(Exception("\n  first\nsecond")) == "first"
    assert one_line(KeyError()) == "KeyError"


def test_meshmq_cli_does_not_import_pyspark() -> None:
    code = ("import sys, meshmq.cli; meshmq.cli.build_parser(); "
            "sys.exit(1 if any(m.startswith('pyspark') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.parametrize(("argv", "message"), [
    (["telemetry", "--data-dir", "{tmp}", "--output", "{tmp}/o"],
     "error: {tmp}: not a meshmq data directory (no log/meta.json)"),
    (["telemetry", "--data-dir", "{log}", "--output", "o", "--window", "5 fortnights"],
     "error: --window: expected a positive duration"),
    (["telemetry", "--data-dir", "{log}", "--output", "o", "--topics", "a/#/b"],
     "error: --topics: invalid topic filter 'a/#/b'"),
    (["archive", "--data-dir", "{log}", "--output", "o", "--mode", "stream",
      "--trigger", "often"], "error: --trigger: expected a positive duration"),
    (["alerts", "--telemetry", "{tmp}", "--rules", "{tmp}/missing.toml"],
     "error: {tmp}/missing.toml: cannot read rules"),
    (["report", "--output", "{tmp}/r"], "error: report: give --data-dir, --telemetry or both"),
    (["demo", "--port", "1883"], "error: demo: --port and --data-dir go together"),
    (["demo", "--workdir", "{tmp}"],
     "error: demo: {tmp} holds files the demo did not write (data, no .meshmq-demo)"),
    (["report", "--data-dir", "{log}", "--output", "r", "--alerts-prefix", "a/b"],
     "error: --alerts-prefix: expected one topic level without wildcards, got 'a/b'"),
    (["report", "--data-dir", "{log}", "--output", "r", "--unit", "celsius"],
     "error: --unit: expected FIELD=UNIT, got 'celsius'"),
    (["telemetry", "--data-dir", "{log}", "--output", "o", "--conf", "nonsense"],
     "error: --conf: expected KEY=VALUE, got 'nonsense'"),
])
def test_bad_input_exits_2_with_one_line_before_spark(tmp_path: Path, capsys, argv: list[str],
                                                      message: str) -> None:
    log = tmp_path / "data"
    (log / "log").mkdir(parents=True)
    (log / "log" / "meta.json").write_text("{}")
    argv = [a.format(tmp=tmp_path, log=log) for a in argv]
    assert pipeline_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshmq pipeline: " + message.format(tmp=tmp_path)), err
    assert err.count("\n") == 1
