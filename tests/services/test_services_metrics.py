"""Per-service figures in /metrics and GET /api/v1/services (the dashboard's Services tab), on
a node of two workers: a service answered, one whose only worker hangs (timeouts, retries, then
the error reply), one with no worker (no-responders). Plain paho clients."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from paho.mqtt.packettypes import PacketTypes
from servicekit import Caller, PahoWorker, service_on

from conftest import BrokerProcess, Client, connect_on, props, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
from admin_http import ADMIN, get, metrics, total  # tests/node: HTTP to the admin listener

CONFIG = ADMIN + """
[log]
fsync = "interval"
[services]
timeout = 0.5
retries = 2
max_wait = 0.5
"""


def test_each_service_has_its_requests_replies_retries_timeouts_errors_and_latency(
        broker_factory: Callable[..., BrokerProcess],
        client_factory: Callable[..., Client]) -> None:
    node = broker_factory(CONFIG, workers=2)
    answered, hung = service_on(1, 2, "answered"), service_on(0, 2, "hung")
    nobody = service_on(1, 2, "nobody")
    good = PahoWorker(connect_on(client_factory, node, 0, "sw-good"), answered)
    stuck = PahoWorker(connect_on(client_factory, node, 1, "sw-stuck"), hung, hang=True)
    assert good.offer(credit=4) == [1] and stuck.offer() == [1]
    caller = Caller(connect_on(client_factory, node, 1, "caller"), "reply/caller")
    for n in range(5):
        caller.call(answered, b"x", f"a{n}".encode())
    replies = caller.collect(5)
    assert all(reply.error is None for reply in replies)
    caller.call(hung, b"x", b"h")
    caller.call(nobody, b"x", b"n")
    errors = {reply.correlation: reply.error for reply in caller.collect(2, timeout=30)}
    assert errors == {b"h": "timeout", b"n": "no-responders"}

    samples = metrics(node)

    def figure(name: str, service: str, **labels: str) -> float:
        return total(samples, name, service=service, **labels)

    assert figure("meshmq_service_requests_total", answered) == 5
    assert figure("meshmq_service_replies_total", answered) == 5
    assert figure("meshmq_service_latency_seconds_count", answered) == 5
    assert figure("meshmq_service_latency_seconds_bucket", answered, le="+Inf") == 5
    assert 0 < figure("meshmq_service_latency_seconds_sum", answered) < 5 * 30
    assert figure("meshmq_service_workers", answered) == 1
    assert figure("meshmq_service_in_flight", answered) == 0
    assert figure("meshmq_service_timeouts_total", hung) == 3  # the first attempt and 2 more
    assert figure("meshmq_service_retries_total", hung) == 2
    assert figure("meshmq_service_dispatched_total", hung) == 3
    assert figure("meshmq_service_errors_total", hung, kind="timeout") == 1
    assert figure("meshmq_service_errors_total", nobody, kind="no-responders") == 1
    assert figure("meshmq_service_replies_total", hung) == 0

    # the late reply of the hung worker's last attempt: dropped and counted
    last = stuck.served[-1]
    late = props(PacketTypes.PUBLISH, CorrelationData=last.correlation)
    stuck.client.publish("reply/caller", b"late", qos=1, properties=late)
    wait_for(lambda: total(metrics(node), "meshmq_service_late_replies_total",
                           service=hung) == 1, what="the late reply counted")

    rows = {row["service"]: row for row in get(node, "/api/v1/services")["data"]}
    assert rows[answered]["requests"] == 5 and rows[answered]["replies"] == 5
    assert rows[answered]["latency_count"] == 5
    assert 0 < rows[answered]["latency_p50"] <= rows[answered]["latency_p99"]
    assert rows[hung]["timeouts"] == 3 and rows[hung]["retries"] == 2
    assert rows[hung]["errors"] == 1 and rows[hung]["error_kinds"] == "timeout=1"
    assert rows[hung]["late_replies"] == 1
    assert rows[nobody]["error_kinds"] == "no-responders=1"
    assert get(node, "/api/v1/services?sort=-requests")["data"][0]["service"] == answered

