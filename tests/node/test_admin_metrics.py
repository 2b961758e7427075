"""/metrics stays one monotonic view of the node when workers restart (worker 1, and worker 0,
which serves the admin listener), and the NodeMetrics arithmetic behind it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from admin_http import ADMIN, RESTARTED, get, http, metrics, offline_session, total, worker_of

from conftest import wait_for
from meshmq.node.admin.metrics import NodeMetrics

RECEIVED = "meshmq_messages_received_total"


def publish_from(broker, client_factory, worker: int, prefix: str, count: int, subscriber):
    """``count`` QoS 0 publishes from a client held by ``worker``, all received (barrier)."""
    for number in range(64):
        client = client_factory(f"{prefix}-{number}")
        client.connect(broker.port)
        if worker_of(broker, f"{prefix}-{number}") == worker:
            break
        client.disconnect()
    for _ in range(count):
        client.publish("t/x", b"p")
    for _ in range(count):
        subscriber.expect()
    return client


def pid_of(broker, worker: int) -> int:
    return next(w["pid"] for w in get(broker, "/api/v1/node")["workers"]["list"]
                if w["index"] == worker)


def restart(broker, worker: int) -> None:
    """SIGKILL ``worker``; return once the supervisor says it is back."""
    before = len(RESTARTED.findall(broker.log()))
    os.kill(pid_of(broker, worker), signal.SIGKILL)
    wait_for(lambda: len(RESTARTED.findall(broker.log())) > before, what="worker restarted")
    port = broker.port_of("admin")  # the supervisor held the port: the same number
    wait_for(lambda: http(port, "GET", "/api/v1/node").status == 200
             and get(broker, "/api/v1/node")["workers"]["up"] == 2, what="both workers up")


def test_counters_never_drop_when_workers_restart(broker_factory, client_factory) -> None:
    broker = broker_factory(ADMIN, workers=2)
    subscriber = client_factory("sub")
    subscriber.connect(broker.port)
    subscriber.subscribe("t/#")
    sub_worker = worker_of(broker, "sub")
    publish_from(broker, client_factory, 1, "a", 5, subscriber)
    publish_from(broker, client_factory, 0, "b", 4, subscriber)
    first = metrics(broker)
    assert total(first, RECEIVED) == 9
    cpu_1 = total(first, "meshmq_process_cpu_seconds_total", worker="1")

    restart(broker, 1)  # its counters start from zero in the new process
    second = metrics(broker)
    assert total(second, RECEIVED) == 9
    assert total(second, "meshmq_process_cpu_seconds_total", worker="1") >= cpu_1
    if sub_worker == 1:  # the subscriber went with worker 1
        subscriber = client_factory("sub2")
        subscriber.connect(broker.port)
        subscriber.subscribe("t/#")
    publish_from(broker, client_factory, 1, "c", 3, subscriber)
    assert total(metrics(broker), RECEIVED) == 12

    restart(broker, 0)  # the worker that serves /metrics: restored from data_dir/admin
    third = metrics(broker)
    assert total(third, RECEIVED) == 12
    assert total(third, "meshmq_connections_total") >= total(second, "meshmq_connections_total")


def test_worker_that_misses_a_scrape_keeps_its_counts() -> None:
    node = NodeMetrics(None)
    sample = {"meshmq_messages_received_total": {"0": 5}, "meshmq_connections": {"": 2}}
    node.update([{"index": 0, "pid": 10, "samples": sample},
                 {"index": 1, "pid": 11, "samples": sample}])
    totals = node.update([{"index": 0, "pid": 10, "samples": sample}])  # 1 missed it
    assert totals["meshmq_messages_received_total"] == {"0": 10}
    assert totals["meshmq_connections"] == {"": 2}  # gauges: only those that answered
    restarted = {"meshmq_messages_received_total": {"0": 1}, "meshmq_connections": {"": 0}}
    totals = node.update([{"index": 0, "pid": 10, "samples": sample},
                          {"index": 1, "pid": 12, "samples": restarted}])
    assert totals["meshmq_messages_received_total"] == {"0": 11}


def test_counters_survive_in_the_state_file(tmp_path: Path) -> None:
    state = tmp_path / "admin" / "counters.json"
    sample = {"meshmq_messages_received_total": {"1": 7}}
    NodeMetrics(state).update([{"index": 0, "pid": 10, "samples": sample}])
    again = NodeMetrics(state)  # worker 0 restarted: pid 20 counts from zero
    totals = again.update([{"index": 0, "pid": 20,
                            "samples": {"meshmq_messages_received_total": {"1": 2}}}])
    assert totals["meshmq_messages_received_total"] == {"1": 9}
    state.write_text("{broken")
    assert NodeMetrics(state).update([]) == {}  # a damaged file: afresh (and a warning)


def test_max_kind_takes_the_slowest() -> None:
    node = NodeMetrics(None)
    totals = node.update([
        {"index": 0, "pid": 1, "samples": {"meshmq_catchup_lag_messages": {"3": 4}}},
        {"index": 1, "pid": 2, "samples": {"meshmq_catchup_lag_messages": {"3": 9}}}])
    assert totals["meshmq_catchup_lag_messages"] == {"3": 9}


def test_every_metric_is_documented() -> None:
    from meshmq.node.admin.metrics import CATALOG

    docs = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    missing = [name for name in CATALOG if f"`{name}`" not in docs]
    assert not missing, f"docs/operations.md does not list {missing}"


def test_drops_stay_counted_after_the_session_ends(broker_factory, client_factory) -> None:
    config = ADMIN + "[log]\nenabled = false\n[session]\nmax_queued_messages = 5\n"
    broker = broker_factory(config, workers=2)
    offline_session(broker, client_factory, "sleeper", "q/#")
    publisher = client_factory("filler")
    publisher.connect(broker.port)
    for number in range(12):
        publisher.publish("q/x", f"{number}", qos=1)
    wait_for(lambda: get(broker, "/api/v1/sessions/sleeper")["dropped"] == 7,
             what="7 dropped from a queue of 5")
    dropped = "meshmq_messages_dropped_total"
    assert total(metrics(broker), dropped, reason="queue_full") == 7
    assert http(broker.port_of("admin"), "DELETE", "/api/v1/sessions/sleeper").status == 200
    assert total(metrics(broker), dropped, reason="queue_full") == 7  # the session is gone
