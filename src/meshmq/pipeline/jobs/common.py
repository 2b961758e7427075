"""What every job shares: the Spark session, option checks, topic filters, stream triggers.

Nothing here imports pyspark at module level except through the functions that need it, so
the command line can parse and check its arguments before paying for a JVM.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshmq.mqtt.errors import RemoteProtocolError
from meshmq.mqtt.topics import validate_topic_filter

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.streaming import DataStreamWriter

DEFAULT_MASTER = "local[*]"
AVAILABLE_NOW = "available-now"

# Spark's own log configuration is replaced by this one unless --verbose: a job's failure is
# reported by the command line in one line, so Spark's ERROR traces (an aborted write, a
# cancelled stage) would only repeat it at length.
_QUIET_LOG4J2 = """\
rootLogger.level = fatal
# PySpark's gateway counts as a REPL: Spark resets the root level to the level of the class
# that starts logging (default WARN, announced on stderr) unless they are equal.
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = fatal
logger.repl.name = org.apache.spark.repl.Main
logger.repl.level = fatal
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""

_DURATION = re.compile(
    r"^\s*(\d{1,9})\s*(ms|s|m|h|d|milliseconds?|seconds?|minutes?|hours?|days?)\s*$",
    re.IGNORECASE | re.ASCII)
_UNIT_NAMES = {"ms": "milliseconds", "s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


class JobError(Exception):
    """A one-line reason a job cannot run (bad option, missing input); exit status 2."""


@dataclass(frozen=True)
class StreamSettings:
    """How a streaming job runs: its checkpoint directory and trigger.

    ``trigger`` is ``"available-now"`` (process what is there, then stop) or an interval such
    as ``"10 seconds"`` (a processing-time trigger: run until stopped).
    """

    checkpoint: str
    trigger: str = AVAILABLE_NOW


def parse_duration(text: str, what: str = "duration") -> str:
    """``"30s"``, ``"5 minutes"``, ``"1h"`` -> Spark's interval text (``"5 minutes"``).

    Raises ``JobError`` naming ``what`` for anything else (zero included).
    """
    match = _DURATION.match(text)
    if not match or int(match.group(1)) == 0:
        raise JobError(f"{what}: expected a positive duration such as '30 seconds', '5m' "
                       f"or '1h', got {text!r}")
    amount, unit = int(match.group(1)), match.group(2).lower()
    unit = _UNIT_NAMES.get(unit, unit)
    if not unit.endswith("s"):
        unit += "s"
    return f"{amount} {unit}"


def parse_trigger(text: str) -> str:
    """``available-now`` or a processing-time interval (checked like ``parse_duration``)."""
    if text.strip().lower() in (AVAILABLE_NOW, "availablenow", "once"):
        return AVAILABLE_NOW
    return parse_duration(text, "--trigger")


def parse_filters(text: str, what: str = "--topics") -> tuple[str, ...]:
    """A comma-separated list of MQTT topic filters, each checked; empty text -> ()."""
    filters = tuple(part.strip() for part in text.split(",") if part.strip())
    for topic_filter in filters:
        if topic_filter.startswith("$share/"):
            raise JobError(f"{what}: shared subscriptions mean nothing here: {topic_filter!r}")
        try:
            validate_topic_filter(topic_filter)
        except RemoteProtocolError as exc:
            raise JobError(f"{what}: invalid topic filter {topic_filter!r}: {exc}") from None
    return filters


def filter_regex(topic_filter: str) -> str:
    """A regular expression (Java and Python syntax) matching exactly what the filter matches.

    Same rules as ``meshmq.mqtt.topics.topic_matches``: ``+`` is one level, ``#`` the parent
    and any children, and a leading wildcard never matches a ``$`` topic.
    """
    levels = topic_filter.split("/")
    parts: list[str] = []
    for index, level in enumerate(levels):
        sep = "/" if index else ""
        if level == "#":
            parts.append("(?:/.*)?" if index else ".*")
            break
        parts.append(sep + ("[^/]*" if level == "+" else re.escape(level)))
    guard = "(?!\\$)" if levels[0] in ("+", "#") else ""
    return "^" + guard + "".join(parts) + "$"


def matches_any(topic: Column, filters: tuple[str, ...]) -> Column:
    """A boolean column: does ``topic`` match one of ``filters``?"""
    from pyspark.sql import functions as F

    if not filters:
        return F.lit(False)
    pattern = "|".join(f"(?:{filter_regex(f)})" for f in filters)
    return topic.rlike(pattern)


def qualify(path: str | os.PathLike[str]) -> str:
    """An absolute path (executors do not share our working directory); URIs pass unchanged."""
    text = os.fspath(path)
    if "://" in text:
        return text
    return str(Path(text).expanduser().resolve())


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def check_log_dir(data_dir: str) -> str:
    """The broker data directory (or its ``log``), qualified; ``JobError`` if no log is there."""
    path = qualify(data_dir)
    if is_local(path):
        local = Path(path.removeprefix("file://"))
        if not ((local / "log" / "meta.json").is_file() or (local / "meta.json").is_file()):
            raise JobError(f"{data_dir}: not a meshmq data directory (no log/meta.json)")
    return path


def check_not_streaming_output(path: str) -> None:
    """Refuse to overwrite a directory a streaming query writes (it has ``_spark_metadata``)."""
    if is_local(path) and (Path(path.removeprefix("file://")) / "_spark_metadata").exists():
        raise JobError(f"{path}: written by a streaming job (has _spark_metadata); a batch run "
                       "would corrupt it: choose another --output")


def read_log(spark: SparkSession, data_dir: str, topics: tuple[str, ...] = (),
             streaming: bool = False, options: dict[str, str] | None = None) -> DataFrame:
    """The broker's commit log as a DataFrame (batch) or a streaming DataFrame.

    ``topics`` is pushed down to the ``meshmq`` source, which skips other records. A stream
    starts at the earliest offsets (a job's first run processes the history; its checkpoint
    then takes over) unless ``options`` name another start.
    """
    from meshmq.pipeline import register

    register(spark)
    settings = dict(options or {})
    if streaming and not any(key.lower().startswith("starting") for key in settings):
        settings["startingOffsets"] = "earliest"
    if topics:
        settings["topics"] = ",".join(topics)
    reader: Any = spark.readStream if streaming else spark.read
    return reader.format("meshmq").options(**settings).load(data_dir)


def apply_trigger(writer: DataStreamWriter, trigger: str) -> DataStreamWriter:
    if trigger == AVAILABLE_NOW:
        return writer.trigger(availableNow=True)
    return writer.trigger(processingTime=trigger)


def await_queries(queries: list[Any]) -> None:
    """Wait until every query has stopped (available-now) or one fails, or until Ctrl-C.

    A failed query's exception is raised; every query still running is stopped first.
    """
    pending = list(queries)
    try:
        while pending:
            for query in list(pending):
                if query.awaitTermination(0.5):  # raises if the query failed
                    pending.remove(query)
    finally:
        for query in queries:
            if query.isActive:
                query.stop()


def create_session(app_name: str, master: str | None = DEFAULT_MASTER, verbose: bool = False,
                   conf: dict[str, str] | None = None) -> SparkSession:
    """A SparkSession for a job run from the command line.

    ``master=None`` leaves the master to ``spark-submit``. Local masters get 127.0.0.1, this
    interpreter on the executors, no web UI and a log4j2 configuration that is quiet from the
    JVM's first line; every session computes in UTC and shows Spark's console progress bar.
    Unless ``verbose``, Spark logs nothing below FATAL once its context has started.
    """
    from pyspark.sql import SparkSession

    local = master is not None and master.startswith("local")
    if local:  # (under spark-submit, master is None: the environment is spark-submit's)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    settings = {"spark.sql.session.timeZone": "UTC", "spark.ui.showConsoleProgress": "true"}
    if local:
        settings.update({"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "8",
                         "spark.driver.bindAddress": "127.0.0.1"})
    if not verbose:
        settings["spark.log.level"] = "FATAL"  # from SparkContext start-up on
        if local:  # we launch the JVM: silence it from the first line (a cluster's
            # spark-defaults.conf may set driver options of its own: leave those alone)
            settings["spark.driver.extraJavaOptions"] = (
                f"-Dlog4j2.configurationFile=file:{_quiet_log_config()}")
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    if not verbose:
        session.sparkContext.setLogLevel("FATAL")
    from meshmq.pipeline.jobs.interrupts import adopt_session

    adopt_session(session)
    return session


def _quiet_log_config() -> str:
    path = Path(tempfile.gettempdir()) / f"meshmq-log4j2-quiet-{os.getuid()}.properties"
    if not path.exists() or path.read_text() != _QUIET_LOG4J2:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(_QUIET_LOG4J2)
        tmp.replace(path)
    return str(path)


def parse_conf(pairs: list[str]) -> dict[str, str]:
    """``["k=v", ...]`` from repeated ``--conf`` flags."""
    conf: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise JobError(f"--conf: expected KEY=VALUE, got {pair!r}")
        conf[key.strip()] = value
    return conf


def write_json_atomically(path: Path, document: object) -> None:
    """Replace ``path`` by ``document`` so a crash leaves the old or the new file, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=1, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
