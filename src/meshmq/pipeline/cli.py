"""``meshmq pipeline telemetry|archive|alerts|report|demo``: the Spark jobs on the command line.

``meshmq pipeline ARGS`` calls ``main(ARGS)`` (``meshmq.cli`` imports this module only then).
The same parser serves ``spark-submit`` (``meshmq/pipeline/jobs/submit.py``), where
``--master`` defaults to whatever spark-submit was given. Options are checked before Spark
starts. Exit status: 0 done; 1 the job failed (Spark error, broker unreachable, alert not
taken: one line on stderr, the trace with ``--verbose``); 2 bad usage or bad input (one line);
130 interrupted. pyspark is imported only once a job runs, so ``meshmq serve`` never needs it.
"""

from __future__ import annotations

import argparse
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

from meshmq.pipeline.jobs.common import (
    AVAILABLE_NOW,
    DEFAULT_MASTER,
    JobError,
    StreamSettings,
    check_log_dir,
    parse_conf,
    parse_duration,
    parse_filters,
    parse_trigger,
    qualify,
)

PROG = "meshmq pipeline"
_PYTHON_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit)): (.+)$")
# Source errors that mean the input is wrong, not that the job broke: exit status 2.
BAD_INPUT_ERRORS = ("SourceOptionError: ", "LogNotFound: ")


def build_parser(prog: str = PROG, master: str | None = DEFAULT_MASTER
                 ) -> argparse.ArgumentParser:
    """The parser of ``meshmq pipeline`` (or of ``submit.py`` with ``master=None``)."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Spark jobs over the broker's commit log (needs the 'spark' "
        "extra: pip install 'meshmq[spark]').")
    add_job_commands(parser, master)
    return parser


def main(argv: list[str] | None = None, prog: str = PROG,
         master: str | None = DEFAULT_MASTER) -> int:
    parser = build_parser(prog, master)
    args = parser.parse_args(argv)
    if args.job is None:
        parser.print_help(sys.stderr)
        return 2
    return run_job(args)


def add_job_commands(parser: argparse.ArgumentParser, master: str | None) -> None:
    jobs = parser.add_subparsers(dest="job", metavar="JOB")
    telemetry = _job(jobs, "telemetry", _telemetry, master,
                     "JSON telemetry -> per-device window aggregates and a quarantine table")
    _log_input(telemetry)
    telemetry.add_argument("--output", required=True, metavar="DIR",
                           help="writes DIR/aggregates and DIR/quarantine (Parquet)")
    telemetry.add_argument("--window", default="1 minute", help="window length (1 minute)")
    telemetry.add_argument("--watermark", default="2 minutes",
                           help="how late an event may arrive, streaming (2 minutes)")
    telemetry.add_argument("--device-level", type=int, default=1, metavar="N",
                           help="0-based topic level holding the device id (1: devices/ID/...)")
    telemetry.add_argument("--exclude", default="alerts/#", metavar="FILTERS",
                           help="topic filters to skip (alerts/#: our own alerts)")
    _stream_options(telemetry)

    archive = _job(jobs, "archive", _archive, master,
                   "raw records -> Parquet partitioned by date and topic root")
    _log_input(archive)
    archive.add_argument("--output", required=True, metavar="DIR", help="the archive table")
    _stream_options(archive)

    alerts = _job(jobs, "alerts", _alerts, master,
                  "threshold rules over the telemetry aggregates -> MQTT alerts/{device}/{rule}")
    alerts.add_argument("--telemetry", required=True, metavar="DIR",
                        help="the telemetry job's --output")
    alerts.add_argument("--rules", required=True, metavar="FILE", help="rules file (TOML)")
    _broker_options(alerts)
    alerts.add_argument("--client-id", default="meshmq-alerts")
    alerts.add_argument("--topic-prefix", default="alerts", help="first topic level (alerts)")
    alerts.add_argument("--ledger", metavar="FILE",
                        help="alerts ledger (default: TELEMETRY/_checkpoints/alerts.ledger.json)")
    alerts.add_argument("--resend-unconfirmed", action="store_true",
                        help="resend alerts left unconfirmed by a crash (at least once)")
    alerts.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                        help="wait this long for CONNACK and PUBACKs (10)")
    _stream_options(alerts)

    report = _job(jobs, "report", _report, master,
                  "a PNG and an HTML page: message rates, topic roots, per-device metrics")
    report.add_argument("--data-dir", metavar="DIR", help="broker data directory (the log)")
    report.add_argument("--telemetry", metavar="DIR", help="the telemetry job's --output")
    report.add_argument("--output", required=True, metavar="DIR",
                        help="writes DIR/report.png and DIR/report.html")
    report.add_argument("--title", default="meshmq report")
    report.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="meshmq source option for the log read, e.g. "
                        "startingTimestamp=2024-05-01T00:00:00Z (repeatable)")
    report.add_argument("--rules", metavar="FILE",
                        help="the alerts job's rules: thresholds drawn even if nothing fired")
    report.add_argument("--unit", action="append", default=[], metavar="FIELD=UNIT",
                        help="unit of a telemetry field for axes and tables, e.g. temp=°C "
                        "(repeatable)")
    report.add_argument("--alerts-prefix", default="alerts", metavar="LEVEL",
                        help="the alerts job's --topic-prefix: alerts are read from LEVEL/# "
                        "(alerts)")

    demo = _job(jobs, "demo", _demo, master,
                "simulated devices publish; telemetry, alerts and report run; prints the report")
    demo.add_argument("--workdir", default="meshmq-demo", metavar="DIR",
                      help="where everything goes (./meshmq-demo)")
    demo.add_argument("--host", default="127.0.0.1", help="a running broker (with --port)")
    demo.add_argument("-p", "--port", type=int, help="use the broker running on this port "
                      "(default: start one on a free port)")
    demo.add_argument("--data-dir", metavar="DIR", help="that broker's data directory")
    demo.add_argument("--devices", type=_positive, default=6, metavar="N")
    demo.add_argument("--readings", type=_positive, default=60, metavar="N",
                      help="readings per device (60)")
    demo.add_argument("--interval", type=_positive, default=15, metavar="SECONDS",
                      help="event time between readings (15)")
    demo.add_argument("--publish-over", type=_non_negative, default=10.0, metavar="SECONDS",
                      help="wall-clock time the devices take to publish (10; 0: at once)")


def _job(jobs: Any, name: str, run: Callable[..., int], master: str | None,
         summary: str) -> argparse.ArgumentParser:
    parser = jobs.add_parser(name, help=summary, description=summary[:1].upper() + summary[1:])
    parser.add_argument("--master", default=master,
                        help=f"Spark master URL (default: {master or 'from spark-submit'})")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                        help="Spark configuration (repeatable)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show Spark's logs and full error traces")
    parser.set_defaults(job_run=run)
    return parser


def _log_input(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", required=True, metavar="DIR",
                        help="broker data directory (the log is DIR/log)")
    parser.add_argument("--topics", default="", metavar="FILTERS",
                        help="comma-separated MQTT filters, pushed down to the source")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="meshmq source option, e.g. startingOffsets=latest (repeatable)")


def _stream_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=("batch", "stream"), default="batch")
    parser.add_argument("--trigger", default=AVAILABLE_NOW,
                        help="stream: available-now (default) or an interval such as 10s")
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="stream: checkpoint directory (default: OUTPUT/_checkpoints/JOB)")


def _broker_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="broker host (127.0.0.1)")
    parser.add_argument("-p", "--port", type=int, default=1883, help="broker port (1883)")
    parser.add_argument("-u", "--username")
    parser.add_argument("-P", "--password")


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds from 0 to 3600, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


# ---------------------------------------------------------------- running


def run_job(args: argparse.Namespace) -> int:
    """Run the chosen job; turn failures into one line and an exit status."""
    from meshmq.pipeline.jobs.interrupts import Interrupts

    try:
        with Interrupts().installed():
            return args.job_run(args)
    except JobError as exc:
        return _fail(args, f"error: {exc}", 2)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # Spark, Py4J, broker: one line unless --verbose
        line = one_line(exc)
        if line.startswith(BAD_INPUT_ERRORS):  # the source refused an option or a path
            return _fail(args, f"error: {line}", 2)
        return _fail(args, f"failed: {line}", 1)


def _fail(args: argparse.Namespace, message: str, status: int) -> int:
    if args.verbose:
        traceback.print_exc()
    print(f"{PROG}: {message}", file=sys.stderr)
    return status


def one_line(exc: BaseException) -> str:
    """The line of an error worth showing. Spark wraps a Python error raised in a data source
    or a worker as "[ERROR_CLASS] ...: Traceback ..." plus a Java trace: show the Python
    exception's own line (``SourceOptionError: unknown option 'bogus' ...``) instead."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if any("Traceback (most recent call last)" in line for line in lines):
        for line in reversed(lines):
            match = _PYTHON_ERROR.match(line)
            if match:
                return f"{match.group(1).rsplit('.', 1)[-1]}: {match.group(2)}"
    return lines[0]


def _session(args: argparse.Namespace, job: str) -> Any:
    from meshmq.pipeline.jobs.common import create_session

    return create_session(f"meshmq-{job}", args.master, args.verbose, parse_conf(args.conf))


def _stream(args: argparse.Namespace, output: str, job: str) -> StreamSettings | None:
    if args.mode != "stream":
        return None
    checkpoint = args.checkpoint or f"{qualify(output)}/_checkpoints/{job}"
    return StreamSettings(qualify(checkpoint), parse_trigger(args.trigger))


def _telemetry(args: argparse.Namespace) -> int:
    from meshmq.pipeline.jobs import telemetry

    if args.device_level < 0:
        raise JobError(f"--device-level: expected 0 or more, got {args.device_level}")
    options = telemetry.TelemetryOptions(
        data_dir=check_log_dir(args.data_dir), output=qualify(args.output),
        window=parse_duration(args.window, "--window"),
        watermark=parse_duration(args.watermark, "--watermark"),
        device_level=args.device_level, topics=parse_filters(args.topics),
        exclude=parse_filters(args.exclude, "--exclude"),
        source_options=parse_conf_option(args.option))
    stream = _stream(args, args.output, "telemetry")
    spark = _session(args, "telemetry")
    try:
        if stream is None:
            result = telemetry.run_batch(spark, options)
        else:
            result = telemetry.run_stream(spark, options, stream)
    finally:
        spark.stop()
    print(result.summary())
    return 0


def _archive(args: argparse.Namespace) -> int:
    from meshmq.pipeline.jobs import archive

    options = archive.ArchiveOptions(
        data_dir=check_log_dir(args.data_dir), output=qualify(args.output),
        topics=parse_filters(args.topics), source_options=parse_conf_option(args.option))
    stream = _stream(args, args.output, "archive")
    spark = _session(args, "archive")
    try:
        if stream is None:
            print(archive.run_batch(spark, options))
        else:
            print(archive.run_stream(spark, options, stream))
    finally:
        spark.stop()
    return 0


def _alerts(args: argparse.Namespace) -> int:
    from meshmq.pipeline.jobs import alerts
    from meshmq.pipeline.jobs.publisher import DeliveryError, MqttTarget
    from meshmq.pipeline.jobs.rules import load_rules

    if args.timeout <= 0:
        raise JobError(f"--timeout: expected a positive number, got {args.timeout:g}")
    options = alerts.AlertsOptions(
        telemetry=qualify(args.telemetry), rules=tuple(load_rules(args.rules)),
        target=MqttTarget(args.host, args.port, args.client_id, args.username, args.password,
                          args.timeout),
        ledger=args.ledger or "", topic_prefix=args.topic_prefix,
        resend_unconfirmed=args.resend_unconfirmed)
    if not args.topic_prefix or any(c in args.topic_prefix for c in "+#\x00"):
        raise JobError(f"--topic-prefix: expected a topic without wildcards, "
                       f"got {args.topic_prefix!r}")
    stream = _stream(args, args.telemetry, "alerts")
    spark = _session(args, "alerts")
    try:
        if stream is None:
            result = alerts.run_batch(spark, options)
        else:
            result = alerts.run_stream(spark, options, stream)
    except DeliveryError as exc:
        print(f"{PROG}: alerts: {exc}", file=sys.stderr)
        return 1
    finally:
        spark.stop()
    print(result.summary())
    return 0


def _report(args: argparse.Namespace) -> int:
    from meshmq.pipeline.jobs import report
    from meshmq.pipeline.jobs.rules import load_rules

    if args.data_dir is None and args.telemetry is None:
        raise JobError("report: give --data-dir, --telemetry or both")
    prefix = args.alerts_prefix
    if not prefix or any(c in prefix for c in "/+#\x00"):
        raise JobError(f"--alerts-prefix: expected one topic level without wildcards, "
                       f"got {prefix!r}")
    options = report.ReportOptions(
        output=args.output, title=args.title,
        data_dir=check_log_dir(args.data_dir) if args.data_dir else None,
        telemetry=qualify(args.telemetry) if args.telemetry else None,
        source_options=parse_conf_option(args.option),
        rules=tuple(load_rules(args.rules)) if args.rules else (),
        units=parse_units(args.unit), alerts_prefix=prefix)
    spark = _session(args, "report")
    try:
        result = report.run(spark, options)
    finally:
        spark.stop()
    print(result.summary())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from meshmq.pipeline.jobs import demo

    options = demo.DemoOptions(workdir=args.workdir, host=args.host, port=args.port,
                               data_dir=args.data_dir, devices=args.devices,
                               readings=args.readings, interval=args.interval,
                               publish_over=args.publish_over)
    sessions: list[Any] = []

    def session() -> Any:
        sessions.append(_session(args, "demo"))
        return sessions[-1]

    try:
        demo.run(options, session)
    finally:
        for spark in sessions:
            spark.stop()
    return 0


def parse_units(pairs: list[str]) -> dict[str, str]:
    """``["temp=°C", ...]`` from repeated ``--unit`` flags."""
    try:
        return parse_conf(pairs)
    except JobError:
        bad = next(p for p in pairs if "=" not in p or not p.partition("=")[0].strip())
        raise JobError(f"--unit: expected FIELD=UNIT, got {bad!r}") from None


def parse_conf_option(pairs: list[str]) -> dict[str, str]:
    try:
        return parse_conf(pairs)
    except JobError as exc:
        raise JobError(str(exc).replace("--conf", "--option")) from None
