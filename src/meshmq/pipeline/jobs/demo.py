"""``meshmq pipeline demo``: devices publish, the pipeline aggregates, the report shows it.

1. Clear what the previous run left in ``WORKDIR`` (its broker data, telemetry tables, alerts
   ledger, report and broker log): every run is self-contained. ``rules.toml`` stays (it is
   written on the first run, for the user to edit). A directory the demo did not make (no
   ``.meshmq-demo`` marker) is refused rather than cleared.
2. Use the broker given by ``--port``/``--data-dir``, or start one (``meshmq serve`` on
   127.0.0.1, a free port, data under ``WORKDIR/data``). Note where its log ends: this run
   reads from there on, so a shared broker's earlier messages stay out of the report.
3. Simulated devices (``demo_fleet``) publish JSON telemetry at QoS 1, while Spark starts.
4. ``telemetry`` (batch) aggregates this run's records into ``WORKDIR/telemetry``; ``alerts``
   (batch) applies ``WORKDIR/rules.toml`` and publishes to the broker, while a subscriber
   counts what arrives on ``alerts/#``; ``report`` writes ``WORKDIR/report/report.html``
   from this run's records (alerts included) and telemetry.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshmq.log.reader import log_is_locked
from meshmq.pipeline.jobs.common import JobError, check_log_dir
from meshmq.pipeline.jobs.demo_fleet import (
    BAD_PAYLOADS,
    DRAINING_DEVICE,
    HOT_DEVICE,
    TIMEOUT,
    AlertCounter,
    FleetPublisher,
    device_name,
    fleet_payloads,
)
from meshmq.pipeline.jobs.interrupts import interrupt_requested

if TYPE_CHECKING:
    from meshmq.pipeline.jobs.alerts import AlertsResult
    from meshmq.pipeline.jobs.report import ReportResult
    from meshmq.pipeline.jobs.telemetry import TelemetryResult

DEMO_RULES = """\
# Alert rules for the demo (see docs/pipeline.md, "alerts").
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
UNITS = {"temp": "°C", "humidity": "%", "battery": "%"}
MARKER = ".meshmq-demo"
RULES_FILE = "rules.toml"
# What one run writes in the workdir, removed before the next run starts.
RUN_OUTPUTS = ("data", "telemetry", "report", "broker.log", "broker.port")


@dataclass(frozen=True)
class DemoOptions:
    workdir: str = "meshmq-demo"
    host: str = "127.0.0.1"
    port: int | None = None
    data_dir: str | None = None
    devices: int = 6
    readings: int = 60
    interval: int = 15
    publish_over: float = 10.0  # seconds of wall-clock time the devices take to publish


@dataclass
class DemoResult:
    published: dict[str, list[bytes]]  # topic -> payloads, as the devices sent them
    telemetry: TelemetryResult
    alerts: AlertsResult
    arrived: int  # alerts the subscriber received
    report: ReportResult


def prepare_workdir(workdir: Path, own_broker: bool) -> None:
    """Make ``workdir`` the demo's and clear the previous run's outputs from it.

    Raises ``JobError`` for a directory the demo did not make (it holds more than a
    ``rules.toml`` and no ``.meshmq-demo``), and for one whose broker is still running.
    """
    if workdir.exists() and not workdir.is_dir():
        raise JobError(f"demo: {workdir} is not a directory")
    workdir.mkdir(parents=True, exist_ok=True)
    marker = workdir / MARKER
    if not marker.exists():
        strangers = sorted(p.name for p in workdir.iterdir() if p.name != RULES_FILE)
        if strangers:
            raise JobError(f"demo: {workdir} holds files the demo did not write ({strangers[0]}"
                           f", no {MARKER}): give an empty or new --workdir")
        marker.write_text("Written by `meshmq pipeline demo`: each run clears "
                          f"{', '.join(RUN_OUTPUTS)} here.\n")
    log_dir = workdir / "data" / "log"
    if own_broker and log_dir.is_dir() and log_is_locked(log_dir):
        raise JobError(f"demo: a broker is still running on {workdir / 'data'}: stop it first")
    for name in RUN_OUTPUTS if own_broker else RUN_OUTPUTS[1:]:
        path = workdir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def start_broker(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    """``meshmq serve`` on 127.0.0.1 and a free port, data under ``workdir/data``."""
    port_file = workdir / "broker.port"
    with open(workdir / "broker.log", "wb") as log:
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


def log_end(data_dir: str) -> dict[str, str]:
    """Source options reading from the log's current end: what this run publishes next."""
    from meshmq.pipeline.logdir import LogDirectory

    directory = LogDirectory.open(data_dir.removeprefix("file://"))
    ends = {str(p): directory.next_offset(p) for p in range(directory.partitions)}
    return {"startingOffsets": json.dumps(ends)}


def describe(options: DemoOptions) -> str:
    """The paragraph under the report's title: what was simulated."""
    last = device_name(options.devices - 1)
    text = (f"{options.devices} simulated devices ({device_name(0)} … {last}) each took "
            f"{options.readings} readings of temperature, humidity and battery level, "
            f"{options.interval} s apart (event time), and sent them at QoS 1 over about "
            f"{options.publish_over:g} s (broker time). {device_name(HOT_DEVICE)} runs hot")
    if options.devices > DRAINING_DEVICE:
        text += f"; {device_name(DRAINING_DEVICE)}'s battery runs down"
    return (text + f"; {last} also sent {len(BAD_PAYLOADS)} broken payloads. The rules in "
            f"{RULES_FILE} decide which alerts fire.")


def run(options: DemoOptions, session: Callable[[], Any]) -> DemoResult:
    """The whole demo; ``session()`` makes the SparkSession (the caller stops it)."""
    if (options.port is None) != (options.data_dir is None):
        raise JobError("demo: --port and --data-dir go together (the running broker's port "
                       "and data directory)")
    workdir = Path(options.workdir).expanduser().resolve()
    prepare_workdir(workdir, own_broker=options.port is None)
    rules_path = workdir / RULES_FILE
    if not rules_path.exists():
        rules_path.write_text(DEMO_RULES)
    proc = None
    if options.port is None:
        proc, port = start_broker(workdir)
        data_dir = str(workdir / "data")
        print(f"demo: started a broker on 127.0.0.1:{port} (data in {data_dir})")
    else:
        port, data_dir = options.port, check_log_dir(str(options.data_dir))
    try:
        return _pipeline(options, workdir, port, data_dir, session)
    finally:
        if proc is not None:
            stop_broker(proc)


def _pipeline(options: DemoOptions, workdir: Path, port: int, data_dir: str,
              session: Callable[[], Any]) -> DemoResult:
    from meshmq.pipeline.jobs import alerts, report, telemetry
    from meshmq.pipeline.jobs.publisher import MqttTarget
    from meshmq.pipeline.jobs.rules import load_rules

    rules = tuple(load_rules(workdir / RULES_FILE))
    this_run = log_end(data_dir)
    fleet = fleet_payloads(options.devices, options.readings, options.interval, time.time())
    publisher = FleetPublisher(options.host, port, fleet, options.publish_over)
    try:
        spark = session()  # Spark starts while the devices publish
    except BaseException:
        publisher.close()
        raise
    sent = publisher.wait()
    if interrupt_requested():  # Ctrl-C while the devices published: no Spark job started yet
        raise KeyboardInterrupt
    print(f"demo: {options.devices} devices published {sent} messages")
    counter = AlertCounter(options.host, port)
    try:
        made = telemetry.run_batch(spark, telemetry.TelemetryOptions(
            data_dir=data_dir, output=str(workdir / "telemetry"), source_options=this_run))
        print(made.summary())
        fired = alerts.run_batch(spark, alerts.AlertsOptions(
            telemetry=str(workdir / "telemetry"), rules=rules,
            target=MqttTarget(options.host, port, client_id="meshmq-demo-alerts")))
        print(fired.summary())
        arrived = counter.wait_for(fired.published)
        print(f"demo: {arrived} alerts arrived on alerts/#")
    finally:
        counter.close()
    shown = report.run(spark, report.ReportOptions(
        output=str(workdir / "report"), data_dir=data_dir,
        telemetry=str(workdir / "telemetry"), title="meshmq demo",
        description=describe(options), source_options=this_run, rules=rules, units=UNITS))
    print(f"demo: the report is {shown.html}")
    return DemoResult(fleet, made, fired, arrived, shown)
