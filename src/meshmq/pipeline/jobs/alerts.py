"""The ``alerts`` job: threshold rules over the telemetry aggregates, published over MQTT.

Theory of operation
-------------------
Input is the ``aggregates`` table of the telemetry job, read whole (batch) or as a Parquet
file stream (streaming, checkpointed). ``evaluate`` turns it into at most one candidate per
(rule, device, window): the rule's statistic of its field, on the topics it names, compared
with its threshold; when several topics of one device cross it, the worst value wins.

``AlertDelivery.deliver`` then publishes each candidate on ``alerts/{device}/{rule}`` (QoS 1,
MQTT 5, JSON payload, ``alert_id`` also as a user property) and records it in the ledger
(``ledger.py``): ``pending`` before the PUBLISH, ``sent`` after its PUBACK. In streaming
mode it runs inside ``foreachBatch``, which Spark may call again with the same batch id after
a restart; a batch id the ledger has settled for this checkpoint is skipped outright, and
any key already ``sent`` is never published again, so every (window, rule, device) gets at
most one alert whatever is replayed: the same batch, the whole table in batch mode, or a new
checkpoint. The only alerts that can be lost are those ``pending`` when a run died (sent, no
PUBACK seen): they are reported and, unless ``resend_unconfirmed``, not resent.

The ledger is a file on the driver, by default next to the default checkpoint. Publishing
happens on the driver too (``foreachBatch`` runs there), from the collected candidates, which
are few.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshmq.pipeline.jobs.common import (
    JobError,
    StreamSettings,
    apply_trigger,
    await_queries,
    is_local,
    matches_any,
    qualify,
)
from meshmq.pipeline.jobs.ledger import PENDING, SENT, AlertLedger, alert_id, alert_key
from meshmq.pipeline.jobs.publisher import AlertPublisher, DeliveryError, MqttTarget, Outgoing
from meshmq.pipeline.jobs.rules import Rule
from meshmq.pipeline.jobs.telemetry import AGGREGATES_SCHEMA

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger("meshmq.pipeline.alerts")


@dataclass(frozen=True)
class AlertsOptions:
    telemetry: str  # the telemetry job's output directory (reads its ``aggregates``)
    rules: tuple[Rule, ...]
    target: MqttTarget = field(default_factory=MqttTarget)
    ledger: str = ""  # default: see ledger_path()
    topic_prefix: str = "alerts"
    resend_unconfirmed: bool = False

    @property
    def aggregates_path(self) -> str:
        return qualify(self.telemetry) + "/aggregates"

    def ledger_path(self) -> Path:
        """``--ledger``, else ``TELEMETRY/_checkpoints/alerts.ledger.json``: one ledger for
        batch and streaming runs and whatever checkpoint they use."""
        if self.ledger:
            return Path(self.ledger)
        default = f"{qualify(self.telemetry)}/_checkpoints/alerts.ledger.json"
        if not is_local(default):
            raise JobError("--ledger is required when --telemetry is not a local path")
        return Path(default.removeprefix("file://"))


@dataclass
class AlertsResult:
    published: int = 0
    already_sent: int = 0
    unconfirmed: int = 0
    batches_skipped: int = 0
    topics: list[str] = field(default_factory=list)

    def summary(self) -> str:
        text = f"alerts: {self.published} published, {self.already_sent} already sent before"
        if self.unconfirmed:
            text += f", {self.unconfirmed} unconfirmed from an earlier crash (not resent)"
        if self.batches_skipped:
            text += f", {self.batches_skipped} replayed batches skipped"
        return text


def evaluate(aggregates: DataFrame, rules: tuple[Rule, ...] | list[Rule]) -> DataFrame:
    """One row per (rule, device, window) whose statistic crosses the rule's threshold.

    Columns: rule, device, window_start_us, window_end_us (UTC microseconds), field, stat, op,
    threshold, value, topic (of the worst value).
    """
    from functools import reduce

    from pyspark.sql import functions as F

    frames = []
    for rule in rules:
        value = F.col(rule.stat)
        crossing = {">": value > rule.threshold, ">=": value >= rule.threshold,
                    "<": value < rule.threshold, "<=": value <= rule.threshold}[rule.op]
        matching = aggregates.where((F.col("field") == rule.field) & crossing)
        if rule.topics:
            matching = matching.where(matches_any(F.col("topic"), rule.topics))
        worst, worst_by = (F.max, F.max_by) if rule.rising else (F.min, F.min_by)
        frames.append(
            matching.groupBy("device", "window_start", "window_end")
            .agg(worst(value).alias("value"), worst_by("topic", value).alias("topic"))
            .select(F.lit(rule.name).alias("rule"), "device",
                    F.unix_micros("window_start").alias("window_start_us"),
                    F.unix_micros("window_end").alias("window_end_us"),
                    F.lit(rule.field).alias("field"), F.lit(rule.stat).alias("stat"),
                    F.lit(rule.op).alias("op"), F.lit(rule.threshold).alias("threshold"),
                    "value", "topic"))
    return reduce(lambda a, b: a.unionByName(b), frames)


def _iso(micros: int) -> str:
    return datetime.fromtimestamp(micros / 1_000_000, UTC).isoformat().replace("+00:00", "Z")


def alert_message(row: dict[str, Any], prefix: str) -> tuple[str, Outgoing]:
    """(ledger key, the MQTT message) for one ``evaluate`` row."""
    key = alert_key(row["rule"], row["device"], row["window_start_us"], row["window_end_us"])
    body = {
        "alert_id": alert_id(key), "rule": row["rule"], "device": row["device"],
        "field": row["field"], "stat": row["stat"], "op": row["op"],
        "threshold": row["threshold"], "value": row["value"], "topic": row["topic"],
        "window_start": _iso(row["window_start_us"]), "window_end": _iso(row["window_end_us"]),
    }
    payload = json.dumps(body, sort_keys=True).encode("utf-8")
    topic = f"{prefix}/{row['device']}/{row['rule']}"
    return key, Outgoing(topic, payload, (("alert_id", body["alert_id"]),))


class AlertDelivery:
    """Publishes candidates not yet in the ledger; one per job run (holds the ledger lock)."""

    def __init__(self, options: AlertsOptions, ledger_path: Path,
                 checkpoint: str | None = None) -> None:
        self.options = options
        self.ledger = AlertLedger.open(ledger_path)
        self.checkpoint = checkpoint
        self.result = AlertsResult()
        self.error: DeliveryError | None = None  # why a foreachBatch call failed, if one did
        self._query_id: str | None = None

    def close(self) -> None:
        self.ledger.close()

    def deliver(self, rows: list[dict[str, Any]], batch_id: int | None = None) -> None:
        """Publish what the ledger has not seen; raise ``DeliveryError`` if any was not taken.

        Rows are ``evaluate`` rows as dicts, published in window, rule, device order.
        """
        fresh: list[tuple[str, Outgoing]] = []
        for row in sorted(rows, key=lambda r: (r["window_start_us"], r["rule"], r["device"])):
            key, message = alert_message(row, self.options.topic_prefix)
            state = self.ledger.state(key)
            if state == SENT:
                self.result.already_sent += 1
            elif state == PENDING and not self.options.resend_unconfirmed:
                self.result.unconfirmed += 1
                log.warning("alert %s was sent before a crash and never confirmed: not resent",
                            key)
            else:
                fresh.append((key, message))
        if fresh:
            self._publish(fresh, batch_id)

    def _publish(self, fresh: list[tuple[str, Outgoing]], batch_id: int | None) -> None:
        keys = [key for key, _ in fresh]
        with AlertPublisher(self.options.target) as publisher:  # connected: commit intent
            self.ledger.mark(keys, PENDING, batch_id)
            self.ledger.save()
            outcome = publisher.publish_all([message for _, message in fresh])
        self.ledger.mark([keys[i] for i in outcome.acknowledged], SENT, batch_id)
        self.ledger.forget([keys[i] for i in outcome.refused])
        self.ledger.save()
        self.result.published += len(outcome.acknowledged)
        self.result.topics += [fresh[i][1].topic for i in outcome.acknowledged]
        if outcome.refused:
            index, reason = next(iter(outcome.refused.items()))
            raise DeliveryError(f"the broker did not take {len(outcome.refused)} alert(s), "
                                f"e.g. {fresh[index][1].topic}: {reason}")
        if outcome.unknown:
            raise DeliveryError(f"no PUBACK for {len(outcome.unknown)} alert(s) within "
                                f"{self.options.target.timeout:g} s; they stay unconfirmed")

    def on_batch(self, batch: DataFrame, batch_id: int) -> None:
        """``foreachBatch`` callback: evaluate the new aggregates and deliver."""
        query_id = self._checkpoint_query_id()
        if self.ledger.batch_settled(query_id, batch_id):
            self.result.batches_skipped += 1
            return
        rows = [row.asDict() for row in evaluate(batch, self.options.rules).collect()]
        try:
            self.deliver(rows, batch_id)
        except DeliveryError as exc:  # Spark wraps it in a long trace: keep the one line
            self.error = exc
            raise
        self.ledger.settle_batch(query_id, batch_id)
        self.ledger.save()

    def _checkpoint_query_id(self) -> str | None:
        """The query id Spark keeps in ``CHECKPOINT/metadata`` (stable across restarts)."""
        if self._query_id is None and self.checkpoint and is_local(self.checkpoint):
            metadata = Path(self.checkpoint.removeprefix("file://")) / "metadata"
            try:
                self._query_id = json.loads(metadata.read_text())["id"]
            except (OSError, ValueError, KeyError):
                return None
        return self._query_id


def _check_input(options: AlertsOptions) -> None:
    path = options.aggregates_path
    if is_local(path) and not Path(path.removeprefix("file://")).is_dir():
        raise JobError(f"{path}: no telemetry aggregates (run `meshmq pipeline telemetry` "
                       "with this --output first)")


def run_batch(spark: SparkSession, options: AlertsOptions) -> AlertsResult:
    """Evaluate the rules over the whole aggregates table and publish what is new."""
    _check_input(options)
    delivery = AlertDelivery(options, options.ledger_path())
    try:
        aggregates = spark.read.schema(AGGREGATES_SCHEMA).parquet(options.aggregates_path)
        rows = [row.asDict() for row in evaluate(aggregates, options.rules).collect()]
        delivery.deliver(rows)
        return delivery.result
    finally:
        delivery.close()


def start_stream(spark: SparkSession, options: AlertsOptions,
                 stream: StreamSettings) -> tuple[Any, AlertDelivery]:
    """Start the alerting query over new aggregate files; close the delivery once it stops."""
    _check_input(options)
    checkpoint = qualify(stream.checkpoint)
    delivery = AlertDelivery(options, options.ledger_path(), checkpoint)
    try:
        aggregates = spark.readStream.schema(AGGREGATES_SCHEMA).parquet(options.aggregates_path)
        writer = (aggregates.writeStream.foreachBatch(delivery.on_batch)
                  .option("checkpointLocation", checkpoint).queryName("alerts"))
        return apply_trigger(writer, stream.trigger).start(), delivery
    except Exception:
        delivery.close()
        raise


def run_stream(spark: SparkSession, options: AlertsOptions,
               stream: StreamSettings) -> AlertsResult:
    query, delivery = start_stream(spark, options, stream)
    try:
        await_queries([query])
    except Exception:
        if delivery.error is not None:
            raise delivery.error from None
        raise
    finally:
        delivery.close()
    return delivery.result
