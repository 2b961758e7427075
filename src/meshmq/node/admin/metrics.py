"""The node's Prometheus metrics: every worker's samples added up into one view.

Theory of operation
-------------------
On a scrape the admin listener gathers every worker's samples (collect.py; over the mesh for
the others) and ``NodeMetrics.update`` merges them by each metric's kind (``CATALOG``):

* ``counter``: summed over the workers, *monotonic across restarts*. The latest samples of
  each worker are kept with its pid. When a worker comes back with another pid (it restarted
  and counts from zero), its previous process's last figures move into ``carried``, which is
  added to every later total. A worker that misses a scrape (restarting, or too slow) keeps
  counting with its last figures, so a total never drops. ``carried`` and the last figures
  are saved in ``data_dir/admin/counters.json`` after each change (written aside and renamed),
  so a restart of worker 0, which serves the listener, does not reset the node's counters
  either: the new worker 0 carries its predecessor's last figures the same way. Counts of the
  last second of a crashed worker (since its last scrape) are the only ones lost.
* ``gauge``: summed over the workers that answered (a worker that is down holds no clients).
* ``max``: the largest over the workers (the slowest session's lag on a partition).

Names and labels follow Prometheus conventions: ``meshmq_`` prefix, ``_total`` counters, base
units (seconds, bytes). docs/operations.md lists them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger("meshmq.admin")

Samples = dict[str, dict[str, float]]


@dataclass(frozen=True, slots=True)
class Spec:
    kind: str  # counter, gauge, max, histogram (its _bucket and _sum parts are counters)
    help: str
    labels: tuple[str, ...] = ()


CATALOG: dict[str, Spec] = {
    "meshmq_connections": Spec("gauge", "Connected MQTT clients."),
    "meshmq_connections_total": Spec("counter", "Accepted CONNECTs (CONNACK 0)."),
    "meshmq_connections_refused_total": Spec(
        "counter", "Connections refused, by reason: connack (refused CONNACK: authentication,"
        " client id, ...), rate_limit, address_denied (CIDR rules), connection_limit.",
        ("reason",)),
    "meshmq_sessions": Spec("gauge", "Sessions, by state (online, offline).", ("state",)),
    "meshmq_subscriptions": Spec("gauge", "Subscriptions of all sessions."),
    "meshmq_shared_groups": Spec("gauge", "Shared subscription groups (per worker, summed)."),
    "meshmq_retained_messages": Spec("gauge", "Retained messages of clients ($SYS not counted)."),
    "meshmq_messages_received_total": Spec(
        "counter", "PUBLISHes received from clients and routed, by QoS.", ("qos",)),
    "meshmq_received_bytes_total": Spec(
        "counter", "MQTT bytes read from clients (every packet)."),
    "meshmq_messages_delivered_total": Spec(
        "counter", "Deliveries to subscribers, by the QoS the message was published with.",
        ("qos",)),
    "meshmq_sent_bytes_total": Spec("counter", "MQTT bytes written to clients (every packet)."),
    "meshmq_messages_dropped_total": Spec(
        "counter", "Messages dropped, by reason: queue_full (a session's queue), acl_denied"
        " (publishes and subscriptions the ACL refused), log_refused (the commit log could"
        " not take a publish).", ("reason",)),
    "meshmq_inflight_messages": Spec("gauge", "QoS 1/2 messages sent and not yet acknowledged."),
    "meshmq_queued_messages": Spec("gauge", "Messages waiting in session queues."),
    "meshmq_queued_bytes": Spec("gauge", "Bytes of the messages waiting in session queues."),
    "meshmq_catchup_sessions": Spec("gauge", "Sessions reading persisted messages from the log."),
    "meshmq_catchup_lag_messages": Spec(
        "max", "Records between the slowest session's log cursor and the high watermark,"
        " per partition.", ("partition",)),
    "meshmq_throttled_total": Spec("counter", "Times a client's input was paused by its rate"
                                   " limit."),
    "meshmq_rate_disconnects_total": Spec(
        "counter", "Clients disconnected for staying over their rate limit."),
    "meshmq_protocol_errors_total": Spec("counter", "Connections closed for a protocol error."),
    "meshmq_log_appends_total": Spec("counter", "Records appended to the commit log."),
    "meshmq_log_appended_bytes_total": Spec(
        "counter", "Payload bytes of the records appended to the commit log."),
    "meshmq_log_writer_queued": Spec("gauge", "Appends waiting for the log writer thread."),
    "meshmq_log_fsync_seconds": Spec("histogram", "Time one fsync of the commit log took."),
    "meshmq_log_fsyncs_total": Spec(
        "counter", "Fsyncs of the commit log, on the event loop (loop) or the writer thread"
        " (thread).", ("path",)),
    "meshmq_log_filesystem_syncs_total": Spec(
        "counter", "Of those fsyncs, the ones that synced several partitions with one syncfs of"
        " the log's file system (log.syncfs_min_partitions)."),
    "meshmq_log_high_watermark": Spec(
        "gauge", "Offset after the last record routed, per partition.", ("partition",)),
    "meshmq_log_earliest_offset": Spec(
        "gauge", "First offset retention kept, per partition.", ("partition",)),
    "meshmq_log_size_bytes": Spec("gauge", "Bytes of the partition's segments.", ("partition",)),
    "meshmq_log_segments": Spec("gauge", "Segments of the partition.", ("partition",)),
    "meshmq_mesh_frames_total": Spec(
        "counter", "Frames on the worker's mesh links, by direction.", ("worker", "direction")),
    "meshmq_mesh_bytes_total": Spec(
        "counter", "Bytes on the worker's mesh links, by direction.", ("worker", "direction")),
    "meshmq_mesh_forwarded_total": Spec(
        "counter", "Publishes forwarded to other workers' subscribers.", ("worker",)),
    "meshmq_mesh_congested_total": Spec(
        "counter", "Times a mesh link backed up (its publishers paused).", ("worker",)),
    "meshmq_mesh_link_queued_bytes": Spec(
        "gauge", "Bytes queued on the link from worker to peer.", ("worker", "peer")),
    "meshmq_mesh_links": Spec("gauge", "Linked peers of the worker.", ("worker",)),
    "meshmq_service_requests_total": Spec(
        "counter", "Requests stored for a service (repeats included).", ("service",)),
    "meshmq_service_duplicates_total": Spec(
        "counter", "Repeated requests answered without a second execution.", ("service",)),
    "meshmq_service_dispatched_total": Spec(
        "counter", "Attempts given to a service worker.", ("service",)),
    "meshmq_service_retries_total": Spec(
        "counter", "Attempts after the first (meshmq-retry above 0).", ("service",)),
    "meshmq_service_timeouts_total": Spec(
        "counter", "Attempts whose service worker did not reply in time.", ("service",)),
    "meshmq_service_lost_total": Spec(
        "counter", "Attempts whose service worker went (disconnected, withdrew).",
        ("service",)),
    "meshmq_service_replies_total": Spec(
        "counter", "Service workers' replies that completed a request.", ("service",)),
    "meshmq_service_late_replies_total": Spec(
        "counter", "Replies dropped: their request was complete or given up.", ("service",)),
    "meshmq_service_errors_total": Spec(
        "counter", "Error replies sent to callers, by kind (timeout, no-responders, ...).",
        ("service", "kind")),
    "meshmq_service_requests_refused_total": Spec(
        "counter", "Requests refused before they were stored (malformed, not authorized)."),
    "meshmq_service_latency_seconds": Spec(
        "histogram", "Round trip of a request through the broker: stored to reply recorded.",
        ("service",)),
    "meshmq_service_in_flight": Spec(
        "gauge", "Requests of the service not answered yet (queued or with a worker).",
        ("service",)),
    "meshmq_service_workers": Spec(
        "gauge", "Service workers offering the service.", ("service",)),
    "meshmq_process_cpu_seconds_total": Spec(
        "counter", "CPU time (user + system) of the worker process.", ("worker",)),
    "meshmq_process_resident_memory_bytes": Spec(
        "gauge", "Resident memory of the worker process.", ("worker",)),
    "meshmq_worker_up": Spec("gauge", "1 for each worker that answered this scrape.",
                             ("worker",)),
}
HISTOGRAM_PARTS = {"_bucket": ("le",), "_sum": ()}


def kind_of(name: str) -> str:
    """The kind a sample name adds up as (a histogram's parts are counters)."""
    spec = CATALOG.get(name)
    if spec is not None:
        return spec.kind
    for suffix in HISTOGRAM_PARTS:
        base = name.removesuffix(suffix)
        if base != name and CATALOG.get(base, Spec("", "")).kind == "histogram":
            return "counter"
    return "gauge"


class NodeMetrics:
    """The node's totals from the workers' samples (see the module docstring)."""

    def __init__(self, state_file: Path | None) -> None:
        self.state_file = state_file
        self.carried: Samples = {}
        self.last: dict[int, dict[str, Any]] = {}  # index -> {"pid", "counters"}
        self.totals: Samples = {}
        self._load()

    def _load(self) -> None:
        if self.state_file is None or not self.state_file.exists():
            return
        try:
            state = json.loads(self.state_file.read_text())
            self.carried = state["carried"]
            self.last = {int(index): worker for index, worker in state["last"].items()}
        except (OSError, ValueError, KeyError, TypeError) as exc:  # start afresh, say so
            log.warning("admin counters not restored from %s: %s", self.state_file, exc)

    def _save(self) -> None:
        if self.state_file is None:
            return
        try:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"carried": self.carried, "last": self.last}))
            os.replace(tmp, self.state_file)
        except OSError as exc:
            log.warning("admin counters not saved to %s: %s", self.state_file, exc)

    def update(self, answers: list[dict[str, Any]]) -> Samples:
        """Merge one scrape's worker answers (collect.worker_samples); the node's samples."""
        gauges: Samples = {}
        for answer in answers:
            counters: Samples = {}
            for name, values in answer["samples"].items():
                kind = kind_of(name)
                if kind == "counter":
                    counters[name] = values
                    continue
                into = gauges.setdefault(name, {})
                for key, value in values.items():
                    into[key] = (max(into.get(key, value), value) if kind == "max"
                                 else into.get(key, 0) + value)
            self._remember(answer["index"], answer["pid"], counters)
        self._save()
        totals = _add({}, self.carried)
        for worker in self.last.values():
            _add(totals, worker["counters"])
        totals.update(gauges)
        self.totals = totals
        return totals

    def _remember(self, index: int, pid: int, counters: Samples) -> None:
        previous = self.last.get(index)
        if previous is not None and previous["pid"] != pid:  # restarted: counts from zero
            _add(self.carried, previous["counters"])
        self.last[index] = {"pid": pid, "counters": counters}


def _add(into: Samples, more: Samples) -> Samples:
    for name, values in more.items():
        target = into.setdefault(name, {})
        for key, value in values.items():
            target[key] = target.get(key, 0) + value
    return into


class _Snapshot(Collector):
    def __init__(self, totals: Samples) -> None:
        self.totals = totals

    def collect(self) -> Iterator[Metric]:
        totals = self.totals
        for name, spec in CATALOG.items():
            if spec.kind == "histogram":
                if name + "_bucket" in totals:
                    yield _histogram(name, spec, totals)
                continue
            values = totals.get(name)
            if values is None:
                continue
            family: Metric
            if spec.kind == "counter":
                family = CounterMetricFamily(name.removesuffix("_total"), spec.help,
                                             labels=spec.labels)
            else:
                family = GaugeMetricFamily(name, spec.help, labels=spec.labels)
            for key, value in sorted(values.items()):
                family.add_metric(key.split("|") if spec.labels else [], value)
            yield family


def _histogram(name: str, spec: Spec, totals: Samples) -> HistogramMetricFamily:
    """A histogram family from its ``_bucket`` samples (keyed ``labels|bound``) and its
    ``_sum`` samples (keyed ``labels``)."""
    series: dict[str, list[tuple[str, float]]] = {}
    for key, count in totals[name + "_bucket"].items():
        labels, _, bound = key.rpartition("|")
        series.setdefault(labels, []).append((bound, count))
    sums = totals.get(name + "_sum", {})
    family = HistogramMetricFamily(name, spec.help, labels=spec.labels or None)
    for labels, buckets in sorted(series.items()):
        buckets.sort(key=lambda item: float(item[0]))
        cumulative, running = [], 0.0
        for bound, count in buckets:
            running += count
            cumulative.append((bound, running))
        family.add_metric(labels.split("|") if spec.labels else [], cumulative,
                          sums.get(labels, 0.0))
    return family


def render(totals: Samples) -> bytes:
    """The Prometheus text exposition of the node's samples."""
    from prometheus_client import generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(totals))
    return generate_latest(registry)
