"""One worker's metric samples: the counters its broker, log writer and mesh keep, read now.

Called on a scrape (through the mesh for the other workers: cluster/admin.py), never on the
message path: every figure is a counter or a size the worker keeps anyway. The samples are
``{metric name: {label values joined by "|": value}}``; metrics.py knows each metric's type,
labels and how the workers' samples add up into the node's.
"""

from __future__ import annotations

import os
import resource
import time
from typing import TYPE_CHECKING, Any

from meshmq.broker import queries
from meshmq.broker.persistence import Persistence
from meshmq.log.writer import FSYNC_BUCKETS
from meshmq.services.stats import LATENCY_BUCKETS

if TYPE_CHECKING:
    from meshmq.broker.broker import Broker
    from meshmq.broker.transport.listeners import Listeners
    from meshmq.cluster.workers import WorkerCluster
    from meshmq.services.layer import ServicesLayer

Samples = dict[str, dict[str, float]]
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def own_log(broker: Broker, cluster: WorkerCluster | None) -> Persistence | None:
    """The partitions this process leads, with their writer (None: the log is off)."""
    if cluster is not None:
        return cluster.log.local if cluster.log is not None else None
    log = broker.persistence
    return log if isinstance(log, Persistence) else None


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):  # not Linux: the peak is what there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Sampler:
    """Builds one worker's samples."""

    def __init__(self, worker: int) -> None:
        self.worker = str(worker)
        self.samples: Samples = {}

    def put(self, name: str, value: float, *labels: object) -> None:
        self.samples.setdefault(name, {})["|".join(str(v) for v in labels)] = value


def worker_samples(broker: Broker, cluster: WorkerCluster | None,
                   listeners: Listeners | None,
                   services: ServicesLayer | None = None) -> dict[str, Any]:
    """This worker's samples, with its index and pid (metrics.py notices a restart by the pid)."""
    index = broker.index or 0
    out = Sampler(index)
    figures = queries.counters(broker)
    _clients(out, broker, figures, listeners)
    _messages(out, figures)
    _log(out, broker, cluster)
    _mesh(out, cluster)
    _services(out, services)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.put("meshmq_process_cpu_seconds_total", usage.ru_utime + usage.ru_stime, index)
    out.put("meshmq_process_resident_memory_bytes", _rss_bytes(), index)
    out.put("meshmq_worker_up", 1, index)
    return {"index": index, "pid": os.getpid(), "time": time.time(), "samples": out.samples}


def _clients(out: Sampler, broker: Broker, figures: dict[str, Any],
             listeners: Listeners | None) -> None:
    counters = figures["counters"]
    out.put("meshmq_connections", figures["connections"])
    out.put("meshmq_connections_total", counters["connects"])
    out.put("meshmq_connections_refused_total", counters["rejected"], "connack")
    out.put("meshmq_connections_refused_total", figures["connect_refused_rate"], "rate_limit")
    denied = over_limit = 0
    if listeners is not None:
        for stats in listeners.statistics().values():
            denied += stats["denied"]
            over_limit += stats["over_limit"]
    out.put("meshmq_connections_refused_total", denied, "address_denied")
    out.put("meshmq_connections_refused_total", over_limit, "connection_limit")
    out.put("meshmq_sessions", figures["sessions_online"], "online")
    out.put("meshmq_sessions", figures["sessions_offline"], "offline")
    out.put("meshmq_subscriptions", figures["subscriptions"])
    out.put("meshmq_shared_groups", figures["shared_groups"])
    out.put("meshmq_retained_messages", client_retained(broker))
    out.put("meshmq_throttled_total", counters["throttled"])
    out.put("meshmq_rate_disconnects_total", counters["rate_disconnects"])
    out.put("meshmq_protocol_errors_total", counters["protocol_errors"])


def client_retained(broker: Broker) -> int:
    """The retained messages of clients in this worker's store: what the Retained tab and
    ``GET /api/v1/retained`` list (queries.retained); the broker's own ``$SYS/`` topics are
    left out (``LocalRetained.count``, the figure ``$SYS`` publishes too)."""
    return broker.local_retained.count()


def _messages(out: Sampler, figures: dict[str, Any]) -> None:
    for qos in range(3):
        out.put("meshmq_messages_received_total", figures["routed"][qos], qos)
        out.put("meshmq_messages_delivered_total", figures["delivered"][qos], qos)
    counters = figures["counters"]
    out.put("meshmq_received_bytes_total", counters["bytes_in"])
    out.put("meshmq_sent_bytes_total", counters["bytes_out"])
    out.put("meshmq_messages_dropped_total", figures["dropped_queue_full"], "queue_full")
    out.put("meshmq_messages_dropped_total", counters["acl_denied"], "acl_denied")
    out.put("meshmq_messages_dropped_total", counters["refused_publishes"], "log_refused")
    out.put("meshmq_inflight_messages", figures["inflight"])
    out.put("meshmq_queued_messages", figures["queued"])
    out.put("meshmq_queued_bytes", figures["queued_bytes"])
    out.put("meshmq_catchup_sessions", figures["catching_up"])


def _log(out: Sampler, broker: Broker, cluster: WorkerCluster | None) -> None:
    log = own_log(broker, cluster)
    if log is None:
        return
    writer = log.writer.statistics()
    out.put("meshmq_log_appends_total", writer.appended)
    out.put("meshmq_log_appended_bytes_total", writer.appended_bytes)
    out.put("meshmq_log_fsync_seconds_sum", writer.fsync_seconds)
    out.put("meshmq_log_fsyncs_total", writer.inline_fsyncs, "loop")
    out.put("meshmq_log_fsyncs_total", writer.fsyncs - writer.inline_fsyncs, "thread")
    out.put("meshmq_log_filesystem_syncs_total", writer.filesystem_syncs)
    out.put("meshmq_log_writer_queued", writer.queued)
    bounds = [*(str(b) for b in FSYNC_BUCKETS), "+Inf"]
    for bound, count in zip(bounds, writer.fsync_buckets, strict=True):
        out.put("meshmq_log_fsync_seconds_bucket", count, bound)
    high = log.high_watermark
    for partition, stats in zip(log.owned, log.commit_log.statistics().partitions,
                                strict=True):
        out.put("meshmq_log_high_watermark", high[partition], partition)
        out.put("meshmq_log_earliest_offset", stats.earliest_offset, partition)
        out.put("meshmq_log_size_bytes", stats.size_bytes, partition)
        out.put("meshmq_log_segments", stats.segments, partition)
    lag: dict[int, int] = {}
    for session in broker.sessions.values():
        for row in queries.cursor(broker, session) or ():
            lag[row["partition"]] = max(lag.get(row["partition"], 0), row["lag"])
    for partition in range(len(high)):
        out.put("meshmq_catchup_lag_messages", lag.get(partition, 0), partition)


def _mesh(out: Sampler, cluster: WorkerCluster | None) -> None:
    if cluster is None:
        return
    mesh = cluster.mesh
    counters = mesh.counters
    index = mesh.worker.index
    out.put("meshmq_mesh_frames_total", counters["frames_in"], index, "in")
    out.put("meshmq_mesh_frames_total", counters["frames_out"], index, "out")
    out.put("meshmq_mesh_bytes_total", counters["bytes_in"], index, "in")
    out.put("meshmq_mesh_bytes_total", counters["bytes_out"], index, "out")
    out.put("meshmq_mesh_forwarded_total", counters["forwarded"], index)
    out.put("meshmq_mesh_congested_total", counters["congested"], index)
    for peer, link in mesh.peers.items():
        out.put("meshmq_mesh_link_queued_bytes", link.data_bytes, index, peer)
    out.put("meshmq_mesh_links", len(mesh.peers), index)


# figure of a service's statistics (services/stats.py) -> its counter
SERVICE_COUNTERS = {
    "requests": "meshmq_service_requests_total",
    "duplicates": "meshmq_service_duplicates_total",
    "dispatched": "meshmq_service_dispatched_total",
    "retries": "meshmq_service_retries_total",
    "timeouts": "meshmq_service_timeouts_total",
    "lost": "meshmq_service_lost_total",
    "replies": "meshmq_service_replies_total",
    "late_replies": "meshmq_service_late_replies_total",
}
SERVICE_GAUGES = {"in_flight": "meshmq_service_in_flight",
                  "workers": "meshmq_service_workers"}


def _services(out: Sampler, services: ServicesLayer | None) -> None:
    """Per service: the dispatcher's figures where it runs (the leader of the service's
    partition) and the late replies each worker dropped itself; they add up over workers."""
    if services is None:
        return
    figures = services.statistics()
    out.put("meshmq_service_requests_refused_total", figures["requests_refused"])
    bounds = [*(str(b) for b in LATENCY_BUCKETS), "+Inf"]
    for service, stats in figures["services"].items():
        for figure, name in SERVICE_COUNTERS.items():
            if figure in stats:
                out.put(name, stats[figure], service)
        for figure, name in SERVICE_GAUGES.items():
            if figure in stats:
                out.put(name, stats[figure], service)
        for kind, count in stats.get("errors", {}).items():
            out.put("meshmq_service_errors_total", count, service, kind)
        if "latency_buckets" in stats:
            for bound, count in zip(bounds, stats["latency_buckets"], strict=True):
                out.put("meshmq_service_latency_seconds_bucket", count, service, bound)
            out.put("meshmq_service_latency_seconds_sum", stats["latency_sum"], service)
