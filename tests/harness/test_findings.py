"""What the fault harness found wrong in the node, each reproduced by a short test (it failed
before the fix). The long suite showed each first (docs/testing.md, "Reading the report").
"""

from __future__ import annotations

from pathlib import Path

from nodes import start_nodes

from meshmq.mqtt.packets import Publish
from meshmq.mqtt.properties import PropertyId
from rawclient import RawClient

DELIVERY = 2.0  # seconds a subscriber waits for a message published to it


def connect(port: int, clean: bool) -> tuple[RawClient, bool, int]:
    """Client ``S`` with a persistent session: (client, session present, serving worker)."""
    client = RawClient(port)
    connack = client.connect("S", clean_start=clean,
                             properties={PropertyId.SESSION_EXPIRY_INTERVAL: 600})
    pairs = connack.properties.get(PropertyId.USER_PROPERTY) or []
    assert isinstance(pairs, list)
    worker = dict(pair for pair in pairs if isinstance(pair, tuple)).get("meshmq-worker", "0")
    return client, connack.session_present, int(worker)


def test_a_session_moved_between_workers_keeps_its_subscriptions_through_kill_9(
        tmp_path: Path) -> None:
    with start_nodes(tmp_path, 1, workers=2) as nodes:
        node = nodes[0]
        client, _, first = connect(node.port, clean=True)
        client.subscribe("t/#", qos=1)
        client.close()
        for _ in range(64):  # reconnect until the kernel gives another worker: the session moves
            client, present, worker = connect(node.port, clean=False)
            client.close()
            if worker != first:
                break
        assert present and worker != first

        node.kill()
        node.restart()
        client, present, _ = connect(node.port, clean=False)
        assert present
        with RawClient(node.port) as publisher:
            publisher.connect("P")
            publisher.publish("t/x", b"after", qos=1)
        try:
            assert client.recv_type(Publish, timeout=DELIVERY).payload == b"after"
        finally:
            client.close()
