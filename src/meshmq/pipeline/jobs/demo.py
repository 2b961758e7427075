"""``meshmq pipeline demo``: devices publish, the pipeline aggregates, the report shows it.

1. Use the broker given by ``--port``/``--data-dir``, or start one (``meshmq serve`` on
   127.0.0.1, a free port, data under ``WORKDIR/data``).
2. Simulated devices publish JSON telemetry at QoS 1 (so it lands in the commit log) on
   ``devices/{id}/telemetry``: temperature, humidity and battery, with event times ``ts``
   spread over the last ``readings * interval`` seconds; one device runs hot, one battery runs
   down, and a few payloads are broken on purpose.
3. ``telemetry`` (batch) aggregates into ``WORKDIR/telemetry``; ``alerts`` (batch) applies
   ``WORKDIR/rules.toml`` (written if absent) and publishes to the broker, while a subscriber
   counts what arrives on ``alerts/#``; ``report`` writes ``WORKDIR/report/report.html``.

Run it again and it adds a new stretch of data; alerts already sent are not sent again.
"""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from meshmq.pipeline.jobs.common import JobError, check_log_dir

DEMO_RULES = """\
# Alert rules for the demo (see docs/pipeline.md, "Alert rules").
[[rule]]
name = "too-hot"
field = "temp"
op = ">"
threshold = 30

[[rule]]
name = "battery-low"
field = "battery"
op = "<"
threshold = 15
"""
BAD_PAYLOADS = (b"temp=21.5", b'{"status": "ok"}', b"[21.5, 40]")
TIMEOUT = 30.0


@dataclass(frozen=True)
class DemoOptions:
    workdir: str = "meshmq-demo"
    host: str = "127.0.0.1"
    port: int | None = None
    data_dir: str | None = None
    devices: int = 6
    readings: int = 60
    interval: int = 15


def reading(device: int, step: int, rng: random.Random) -> dict[str, float]:
    """One device's reading at ``step``: a daily-looking wave plus noise."""
    phase = step / 12 + device
    temp = 21 + device * 0.8 + 4 * math.sin(phase) + rng.uniform(-0.5, 0.5)
    if device == 0:
        temp += 8  # the hot one
    battery = 100 - step * (90 / 60 if device == 1 else 0.2)
    return {"temp": round(temp, 2), "humidity": round(50 + 10 * math.cos(phase), 1),
            "battery": round(max(battery, 0.0), 1)}


def simulate(host: str, port: int, options: DemoOptions, now: float) -> int:
    """Publish every device's readings (QoS 1, all acknowledged); return how many were sent."""
    rng = random.Random(int(now))
    start = now - options.readings * options.interval
    sent = 0
    for device in range(options.devices):
        name = f"sensor-{device:02d}"
        messages: list[bytes] = []
        for step in range(options.readings):
            values = reading(device, step, rng)
            values["ts"] = round(start + step * options.interval + rng.uniform(0, 2), 3)
            messages.append(_json(values))
        if device == options.devices - 1:
            messages += BAD_PAYLOADS
        _publish_all(host, port, f"demo-{name}", f"devices/{name}/telemetry", messages)
        sent += len(messages)
    return sent


def _json(values: dict[str, float]) -> bytes:
    return json.dumps(values).encode()


def _publish_all(host: str, port: int, client_id: str, topic: str,
                 payloads: list[bytes]) -> None:
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                         protocol=mqtt.MQTTv5)
    client.connect(host, port)
    client.loop_start()
    try:
        infos = [client.publish(topic, payload, qos=1) for payload in payloads]
        for info in infos:
            info.wait_for_publish(TIMEOUT)
            if not info.is_published():
                raise JobError(f"demo: the broker at {host}:{port} did not acknowledge")
    finally:
        client.disconnect()
        client.loop_stop()


class AlertCounter:
    """Subscribes to ``alerts/#`` and counts what arrives."""

    def __init__(self, host: str, port: int) -> None:
        self.count = 0
        self._ready = threading.Event()
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="",
                                   protocol=mqtt.MQTTv5)
        self._client.on_subscribe = lambda *_args: self._ready.set()
        self._client.on_message = self._on_message
        self._client.connect(host, port)
        self._client.subscribe("alerts/#", qos=1)
        self._client.loop_start()
        if not self._ready.wait(TIMEOUT):
            raise JobError("demo: no SUBACK for alerts/#")

    def _on_message(self, *_args: Any) -> None:
        self.count += 1

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


def start_broker(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    """``meshmq serve`` on 127.0.0.1 and a free port, data under ``workdir/data``."""
    port_file = workdir / "broker.port"
    port_file.unlink(missing_ok=True)
    with open(workdir / "broker.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshmq", "serve", "--bind", "127.0.0.1", "--port", "0",
             "--data-dir", str(workdir / "data"), "--port-file", str(port_file),
             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + TIMEOUT
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_broker(proc)
            raise JobError(f"demo: the broker did not start (see {workdir / 'broker.log'})")
        time.sleep(0.05)
    return proc, int(port_file.read_text().split()[0])  # the TCP port comes first


def stop_broker(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(options: DemoOptions, session: Callable[[], Any]) -> int:
    """The whole demo; ``session()`` makes the SparkSession once the data is published."""
    if (options.port is None) != (options.data_dir is None):
        raise JobError("demo: --port and --data-dir go together (the running broker's port "
                       "and data directory)")
    workdir = Path(options.workdir).expanduser().resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = None
    if options.port is None:
        proc, port = start_broker(workdir)
        data_dir = str(workdir / "data")
        print(f"demo: started a broker on 127.0.0.1:{port} (data in {data_dir})")
    else:
        port, data_dir = options.port, check_log_dir(str(options.data_dir))
    try:
        return _pipeline(options, workdir, options.host, port, data_dir, session)
    finally:
        if proc is not None:
            stop_broker(proc)


def _pipeline(options: DemoOptions, workdir: Path, host: str, port: int, data_dir: str,
              session: Callable[[], Any]) -> int:
    from meshmq.pipeline.jobs import alerts, report, telemetry
    from meshmq.pipeline.jobs.publisher import MqttTarget
    from meshmq.pipeline.jobs.rules import load_rules

    sent = simulate(host, port, options, time.time())
    print(f"demo: {options.devices} devices published {sent} messages")
    rules_path = workdir / "rules.toml"
    if not rules_path.exists():
        rules_path.write_text(DEMO_RULES)
    rules = tuple(load_rules(rules_path))
    spark = session()
    counter = AlertCounter(host, port)
    try:
        result = telemetry.run_batch(spark, telemetry.TelemetryOptions(
            data_dir=data_dir, output=str(workdir / "telemetry")))
        print(result.summary())
        fired = alerts.run_batch(spark, alerts.AlertsOptions(
            telemetry=str(workdir / "telemetry"), rules=rules,
            target=MqttTarget(host, port, client_id="meshmq-demo-alerts")))
        print(fired.summary())
        deadline = time.monotonic() + TIMEOUT
        while counter.count < fired.published and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"demo: {counter.count} alerts arrived on alerts/#")
        made = report.run(spark, report.ReportOptions(
            output=str(workdir / "report"), data_dir=data_dir,
            telemetry=str(workdir / "telemetry"), title="meshmq demo"))
    finally:
        counter.close()
        spark.stop()
    print(f"demo: the report is {made.html}")
    return 0
