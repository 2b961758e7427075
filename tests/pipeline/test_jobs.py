"""The batch jobs over a log written by a real broker: a small fleet publishes telemetry with
paho (QoS 1, so every message is in the commit log once PUBACKed), then telemetry, archive,
alerts and report run through the real ``meshmq`` source. Every expected value is computed
here from what the test published, never from a job's output."""

from __future__ import annotations

import html
import json
import shutil
import socket
import threading
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path

import paho.mqtt.client as mqtt
import pyarrow.parquet as pq
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from PIL import Image

from conftest import WAIT, BrokerProcess, start_broker, wait_for
from meshmq.pipeline.jobs import alerts, archive, report, telemetry
from meshmq.pipeline.jobs.common import JobError, StreamSettings
from meshmq.pipeline.jobs.ledger import alert_id, alert_key
from meshmq.pipeline.jobs.publisher import DeliveryError, MqttTarget
from meshmq.pipeline.jobs.rules import parse_rules

# Spark start-up and first reads are slow on a busy 2-core machine: more than the default 120 s.
pytestmark = [pytest.mark.xdist_group("spark"), pytest.mark.timeout(300)]



T0 = 1_714_521_600  # 2024-05-01T00:00:00Z, a window boundary
WINDOW = 60
DEVICES = ("d0", "d1", "d2", "d3")
RULES = parse_rules("""
[[rule]]
name = "too-hot"
field = "temp"
op = ">"
threshold = 30

[[rule]]
name = "dry"
field = "hum"
op = "<"
threshold = 35
topics = "devices/+/telemetry"
""")
BAD = [  # (topic, payload, reason)
    ("devices/d1/telemetry", b"temp=21", "not_json"),
    ("devices/d1/telemetry", b"[21, 40]", "not_object"),
    ("devices/d2/telemetry", b'{"status": "ok", "on": true}', "no_numeric_field"),
    ("devices/d2/telemetry", b"", "empty"),
    ("devices/d3/telemetry", b"\xff\xfe\x00", "not_utf8"),
    ("devices/d3/telemetry", b'{"temp": 20, "ts": "soon"}', "bad_ts"),
    ("devices", b'{"temp": 20}', "no_device"),
]
OWN_ALERT = ("alerts/d0/too-hot", b'{"value": 99, "threshold": 30}')  # excluded by default


def temperature(device: int, step: int) -> float:
    """d0 runs hot in steps 12-17 (windows 4 and 5); the others stay below 30."""
    hot = 12 <= step < 18 and device == 0
    return round((31.5 if hot else 20.0) + device + (step % 3) * 0.25, 2)


def humidity(device: int, step: int) -> int:
    return 30 if device == 2 and step in (3, 4) else 40 + (device * 7 + step) % 20


def make_readings(steps: int = 30, start: int = T0) -> list[tuple[str, float, dict]]:
    """(device, event time, fields): 3 readings per device per minute, ``steps`` in all."""
    readings = []
    for step in range(steps):
        for index, device in enumerate(DEVICES):
            ts = start + step * 20 + index
            readings.append((device, float(ts), {"temp": temperature(index, step),
                                                 "hum": humidity(index, step)}))
    return readings


def telemetry_messages(readings: list[tuple[str, float, dict]]) -> list[tuple[str, bytes]]:
    return [(f"devices/{device}/telemetry", json.dumps({**fields, "ts": ts}).encode())
            for device, ts, fields in readings]


def publish_all(port: int, messages: list[tuple[str, bytes]], client_id: str = "") -> None:
    """Publish at QoS 1 and return once every PUBACK is in (so the log holds them)."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        infos = [client.publish(topic, payload, qos=1) for topic, payload in messages]
        for info in infos:
            info.wait_for_publish(WAIT)
            assert info.is_published()
    finally:
        client.disconnect()
        client.loop_stop()


def expected_aggregates(readings: list[tuple[str, float, dict]]) -> dict[tuple, tuple]:
    """(window start, device, field) -> (count, min, max, sum), computed here."""
    values: dict[tuple, list[float]] = defaultdict(list)
    for device, ts, fields in readings:
        start = int(ts) // WINDOW * WINDOW
        for name, value in fields.items():
            values[(start, device, name)].append(float(value))
    return {key: (len(v), min(v), max(v), sum(v)) for key, v in values.items()}


def expected_alerts(readings: list[tuple[str, float, dict]]) -> set[tuple[str, str, int]]:
    """(rule, device, window start) for every window where a rule's threshold is crossed."""
    fired = set()
    for (start, device, name), (_count, low, high, _sum) in expected_aggregates(
            readings).items():
        if name == "temp" and high > 30:
            fired.add(("too-hot", device, start))
        if name == "hum" and low < 35:
            fired.add(("dry", device, start))
    return fired


def aggregate_rows(spark, path: str) -> dict[tuple, tuple]:
    rows = spark.read.parquet(path).collect()
    table = {}
    for row in rows:
        key = (int(row["window_start"].timestamp()), row["device"], row["field"])
        assert key not in table, f"duplicate window {key}"
        assert row["window_end"].timestamp() - row["window_start"].timestamp() == WINDOW
        assert row["topic"] == f"devices/{row['device']}/telemetry"
        table[key] = (row["count"], row["min"], row["max"], row["sum"], row["mean"])
    return table


def assert_same_aggregates(got: dict[tuple, tuple], expected: dict[tuple, tuple]) -> None:
    assert set(got) == set(expected)
    for key, (count, low, high, total) in expected.items():
        g_count, g_low, g_high, g_sum, g_mean = got[key]
        assert (g_count, g_low, g_high) == (count, low, high), key
        assert g_sum == pytest.approx(total) and g_mean == pytest.approx(total / count), key


class Subscriber:
    """A paho client on alerts/#, keeping every message, with a barrier to wait on."""

    def __init__(self, port: int) -> None:
        self.messages: list[mqtt.MQTTMessage] = []
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.on_message = lambda _c, _u, msg: self.messages.append(msg)
        subscribed: list[bool] = []
        self.client.on_subscribe = lambda *_a: subscribed.append(True)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.client.subscribe("alerts/#", qos=1)
        wait_for(lambda: subscribed, what="SUBACK")
        self.port = port
        self._barriers = 0

    def settle(self) -> list[mqtt.MQTTMessage]:
        """Every alert routed so far (a barrier published after them has come back)."""
        self._barriers += 1
        token = f"barrier-{self._barriers}".encode()
        publish_all(self.port, [("alerts/_barrier", token)])
        wait_for(lambda: any(m.payload == token for m in self.messages), what="barrier")
        return [m for m in self.messages if m.topic != "alerts/_barrier"]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> BrokerProcess:
    """A broker whose log holds the fleet's telemetry, the bad payloads and one alert."""
    broker = start_broker(tmp_path_factory.mktemp("fleet"))
    try:
        publish_all(broker.port, telemetry_messages(make_readings()), "fleet")
        publish_all(broker.port, [(t, p) for t, p, _ in BAD] + [OWN_ALERT], "misfits")
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def telemetry_out(spark, fleet, tmp_path_factory) -> tuple[Path, telemetry.TelemetryResult]:
    out = tmp_path_factory.mktemp("telemetry")
    result = telemetry.run_batch(spark, telemetry.TelemetryOptions(str(fleet.data_dir),
                                                                   str(out)))
    return out, result


# ---------------------------------------------------------------- telemetry


def test_batch_aggregates_match_what_was_published(spark, telemetry_out) -> None:
    out, result = telemetry_out
    got = aggregate_rows(spark, str(out / "aggregates"))
    assert_same_aggregates(got, expected_aggregates(make_readings()))
    assert result.aggregates_path == str(out / "aggregates")


def test_bad_payloads_are_quarantined_raw_and_counted(spark, telemetry_out) -> None:
    out, result = telemetry_out
    assert result.quarantined == dict(Counter(reason for _, _, reason in BAD))
    assert result.records == len(make_readings()) + len(BAD)  # the alert topic is excluded
    rows = spark.read.parquet(str(out / "quarantine")).collect()
    assert sorted((r["topic"], bytes(r["payload"]), r["reason"]) for r in rows) == sorted(BAD)
    assert {r["client_id"] for r in rows} == {"misfits"}
    assert all(len(r["message_id"]) == 32 and r["qos"] == 1 for r in rows)


def test_batch_run_refuses_a_streaming_output(spark, fleet, tmp_path: Path) -> None:
    (tmp_path / "aggregates" / "_spark_metadata").mkdir(parents=True)
    with pytest.raises(JobError, match="written by a streaming job"):
        telemetry.run_batch(spark, telemetry.TelemetryOptions(str(fleet.data_dir),
                                                              str(tmp_path)))


# ---------------------------------------------------------------- archive


def test_archive_is_partitioned_by_date_and_topic_root(spark, fleet, tmp_path: Path) -> None:
    published = ([("fleet", t, p) for t, p in telemetry_messages(make_readings())]
                 + [("misfits", t, p) for t, p, _ in BAD] + [("misfits", *OWN_ALERT)])
    out = tmp_path / "archive"
    summary = archive.run_batch(spark, archive.ArchiveOptions(str(fleet.data_dir), str(out)))
    assert summary == f"archive: {len(published)} records in {out}"
    dates = sorted(p.name for p in out.iterdir() if p.name.startswith("date="))
    assert len(dates) in (1, 2)  # the broker's clock, UTC: 2 only if we straddled midnight
    archived = []
    for date_dir in dates:
        roots = sorted(p.name for p in (out / date_dir).iterdir())
        assert set(roots) <= {"topic_root=alerts", "topic_root=devices"}
        for root_dir in roots:
            table = pq.read_table(out / date_dir / root_dir)  # pyarrow, not Spark
            for row in table.to_pylist():
                assert row["topic"].split("/")[0] == root_dir.removeprefix("topic_root=")
                day = row["timestamp"].astimezone(UTC).strftime("%Y-%m-%d")
                assert date_dir == f"date={day}"
                archived.append((row["client_id"], row["topic"], row["payload"]))
    assert Counter(archived) == Counter(published)


# ---------------------------------------------------------------- alerts


def alert_set(messages: list[mqtt.MQTTMessage]) -> list[tuple[str, str, int]]:
    found = []
    for message in messages:
        body = json.loads(message.payload)
        start = int(datetime.fromisoformat(body["window_start"]).timestamp())
        assert message.topic == f"alerts/{body['device']}/{body['rule']}"
        key = alert_key(body["rule"], body["device"], start * 1_000_000,
                        (start + WINDOW) * 1_000_000)
        assert body["alert_id"] == alert_id(key)
        assert dict(message.properties.UserProperty)["alert_id"] == body["alert_id"]
        assert message.qos == 1
        found.append((body["rule"], body["device"], start))
    return found


def test_alerts_published_once_per_window_and_rule_across_replays(
        spark, telemetry_out, tmp_path: Path) -> None:
    broker = start_broker(tmp_path, name="alerts")  # alerts go here, not into the fleet's log
    own = tmp_path / "telemetry"
    shutil.copytree(telemetry_out[0], own)
    options = alerts.AlertsOptions(str(own), tuple(RULES), MqttTarget(port=broker.port))
    expected = expected_alerts(make_readings())
    assert {rule for rule, _, _ in expected} == {"too-hot", "dry"}
    subscriber = Subscriber(broker.port)
    try:
        stream = StreamSettings(str(tmp_path / "ck"))
        first = alerts.run_stream(spark, options, stream)
        assert first.published == len(expected)
        received = alert_set(subscriber.settle())
        assert sorted(received) == sorted(expected)  # each exactly once

        # The driver dies after publishing, before Spark commits the batch: on restart Spark
        # runs the same batch id again; the ledger has settled it.
        commits = tmp_path / "ck" / "commits"
        last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
        (commits / str(last)).unlink()
        (commits / f".{last}.crc").unlink(missing_ok=True)
        replay = alerts.run_stream(spark, options, stream)
        assert (replay.published, replay.batches_skipped) == (0, 1)

        # A brand-new checkpoint (every window replayed) and a batch run: same ledger.
        assert (own / "_checkpoints" / "alerts.ledger.json").is_file()
        again = alerts.run_stream(spark, options, StreamSettings(str(tmp_path / "ck2")))
        assert (again.published, again.already_sent) == (0, len(expected))
        assert alerts.run_batch(spark, options).published == 0
        assert len(subscriber.settle()) == len(expected)

        # New data in a new window (the telemetry table is rewritten): only its alert goes
        # out, from the original checkpoint.
        later = [("d3", float(T0 + 3600 + 5), {"temp": 45.0, "hum": 50})]
        publish_all(broker.port, telemetry_messages(later), "late")
        telemetry.run_batch(spark, telemetry.TelemetryOptions(str(broker.data_dir), str(own)))
        new = alerts.run_stream(spark, options, stream)
        assert new.published == 1
        assert alert_set(subscriber.settle()[len(expected):]) == [("too-hot", "d3", T0 + 3600)]
    finally:
        subscriber.close()
        broker.stop()


def test_alerts_refused_by_the_broker_are_not_marked_sent(spark, telemetry_out,
                                                          tmp_path: Path) -> None:
    acl = tmp_path / "acl"
    acl.write_text("client:meshmq-alerts deny alerts/#\n* readwrite alerts/#\n")
    broker = start_broker(tmp_path, f'[auth]\nacl_file = "{acl}"\n', name="strict")
    try:
        options = alerts.AlertsOptions(str(telemetry_out[0]), tuple(RULES[:1]),
                                       MqttTarget(port=broker.port),
                                       ledger=str(tmp_path / "ledger.json"))
        with pytest.raises(DeliveryError, match=r"the broker did not take \d+ alert\(s\), "
                                                r"e\.g\. alerts/d0/too-hot: Not authorized"):
            alerts.run_batch(spark, options)
        ledger = json.loads((tmp_path / "ledger.json").read_text())
        assert ledger["alerts"] == {}  # refused means not delivered: a later run may retry
        allowed = alerts.AlertsOptions(options.telemetry, options.rules,
                                       MqttTarget(port=broker.port, client_id="other"),
                                       ledger=options.ledger)
        subscriber = Subscriber(broker.port)
        try:
            assert alerts.run_batch(spark, allowed).published == 2
            assert len(subscriber.settle()) == 2
        finally:
            subscriber.close()
    finally:
        broker.stop()


def test_unreachable_broker_is_one_line_and_the_ledger_untouched(spark, telemetry_out,
                                                                 tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        options = alerts.AlertsOptions(str(telemetry_out[0]), tuple(RULES),
                                       MqttTarget(port=port, timeout=2),
                                       ledger=str(tmp_path / "ledger.json"))
        with pytest.raises(DeliveryError, match=f"cannot reach the broker at 127.0.0.1:{port}"):
            alerts.run_batch(spark, options)
    assert not (tmp_path / "ledger.json").exists()


class PubackSwallower:
    """A TCP proxy in front of a broker that passes everything except PUBACKs to the client:
    the broker takes and routes each alert, the publisher never hears back (as when the
    connection or the job dies at that moment)."""

    def __init__(self, broker_port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.broker_port = broker_port
        self.swallowed = 0
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        upstream = socket.create_connection(("127.0.0.1", self.broker_port))
        self.sockets += [client, upstream]
        threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
        threading.Thread(target=self._filter, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass

    def _filter(self, source: socket.socket, sink: socket.socket) -> None:
        buffer = b""
        try:
            while data := source.recv(65536):
                buffer += data
                while (packet := self._next_packet(buffer)) is not None:
                    buffer = buffer[len(packet):]
                    if packet[0] >> 4 == 4:  # PUBACK
                        self.swallowed += 1
                    else:
                        sink.sendall(packet)
        except OSError:
            pass

    @staticmethod
    def _next_packet(buffer: bytes) -> bytes | None:
        length, multiplier = 0, 1
        for index in range(1, min(len(buffer), 5)):
            length += (buffer[index] & 0x7F) * multiplier
            multiplier *= 128
            if not buffer[index] & 0x80:
                end = index + 1 + length
                return buffer[:end] if len(buffer) >= end else None
        return None

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def test_alerts_sent_but_never_acknowledged_are_not_resent_by_default(
        spark, telemetry_out, tmp_path: Path) -> None:
    broker = start_broker(tmp_path, name="lossy")
    subscriber = Subscriber(broker.port)
    proxy = PubackSwallower(broker.port)
    rules = tuple(RULES[:1])  # too-hot: d0 in minutes 4 and 5
    try:
        lossy = alerts.AlertsOptions(str(telemetry_out[0]), rules,
                                     MqttTarget(port=proxy.port, timeout=5),
                                     ledger=str(tmp_path / "ledger.json"))
        with pytest.raises(DeliveryError, match=r"no PUBACK for 2 alert\(s\) within 5 s"):
            alerts.run_batch(spark, lossy)
        wait_for(lambda: proxy.swallowed == 2, what="the broker to acknowledge both")
        first = subscriber.settle()
        assert len(first) == 2  # the broker has them; the ledger cannot know

        direct = alerts.AlertsOptions(lossy.telemetry, rules, MqttTarget(port=broker.port),
                                      ledger=lossy.ledger)
        result = alerts.run_batch(spark, direct)
        assert (result.published, result.unconfirmed) == (0, 2)  # at most once
        assert len(subscriber.settle()) == 2

        resend = alerts.AlertsOptions(lossy.telemetry, rules, MqttTarget(port=broker.port),
                                      ledger=lossy.ledger, resend_unconfirmed=True)
        assert alerts.run_batch(spark, resend).published == 2  # at least once, same ids
        everything = subscriber.settle()
        assert sorted(alert_set(everything[2:])) == sorted(alert_set(first))
        assert alerts.run_batch(spark, resend).published == 0
    finally:
        proxy.close()
        subscriber.close()
        broker.stop()


# ---------------------------------------------------------------- report


def test_report_png_and_html(spark, fleet, telemetry_out, tmp_path: Path) -> None:
    result = report.run(spark, report.ReportOptions(
        output=str(tmp_path / "report"), data_dir=str(fleet.data_dir),
        telemetry=str(telemetry_out[0]), title="fleet <test>"))
    with Image.open(result.png) as image:
        image.load()
        assert image.format == "PNG" and image.width >= 600 and image.height >= 800
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 50
    page = result.html.read_text()
    assert '<img src="report.png"' in page and html.escape("fleet <test>") in page
    for device in DEVICES:
        assert f"<tr><td>{device}</td>" in page
    published_devices_root = len(make_readings()) + len(BAD)  # "devices" and devices/...
    assert f"<tr><td>devices</td><td class=n>{published_devices_root}</td></tr>" in page
    assert "<tr><td>alerts</td><td class=n>1</td></tr>" in page
    for reason, count in Counter(reason for _, _, reason in BAD).items():
        assert f"<tr><td>{reason}</td><td class=n>{count}</td>" in page
    assert result.data.records == published_devices_root + 1
    assert set(result.data.series) == {"temp", "hum"}
    assert result.data.alerts == []  # OWN_ALERT is not an alert the alerts job would send
