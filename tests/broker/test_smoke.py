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
