"""First contact: a real broker process, real paho clients, both protocol versions."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize("qos", [0, 1, 2])
def test_publish_reaches_subscriber(broker, client_factory, version: int, qos: int) -> None:
    sub = client_factory("sub", version)
    sub.connect(broker.port)
    sub.subscribe("sensors/+/temp", qos=2)
    pub = client_factory("pub", version)
    pub.connect(broker.port)
    pub.publish("sensors/d1/temp", b"21.5", qos=qos)
    msg = sub.expect()
    assert (msg.topic, msg.payload, msg.qos) == ("sensors/d1/temp", b"21.5", qos)


def test_sigterm_stops_cleanly(broker) -> None:
    assert broker.stop() == 0
    assert "stopped" in broker.log()


def test_clean_shutdown_sends_server_shutting_down_and_no_wills(broker, client_factory) -> None:
    """SIGTERM: 5.0 clients get DISCONNECT 0x8B; wills of connected clients are not sent."""
    watcher = client_factory("watcher", 5)
    watcher.connect(broker.port)
    watcher.subscribe("wills/#", qos=1)
    for name in ("w1", "w2", "w3"):
        client = client_factory(name, 5)
        client.paho.will_set(f"wills/{name}", b"gone", qos=1)
        client.connect(broker.port)
    assert broker.stop() == 0
    assert watcher.disconnects.get(timeout=10).value == 0x8B
    assert watcher.messages.empty(), "a will was published on a clean shutdown"
