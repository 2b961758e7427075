"""The fault proxy in front of a node does what each fault says.

A client talks to the node through the proxy; an observer subscribes on the node directly.
What did *not* reach the node is shown with a barrier: a later message published directly on
the node reaches the observer first (and alone). Held bytes are never lost: after the heal
they go on, on the same connection.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nodes import Node, start_nodes
from proxy import Direction, Proxy

from meshmq.mqtt.packets import Puback, Publish
from rawclient import RawClient

HELD = 0.3  # seconds a client waits to see that a held answer does not come


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with start_nodes(tmp_path, 1) as nodes:
        yield nodes[0]


def observer_on(node: Node) -> RawClient:
    observer = RawClient(node.port)
    observer.connect("observer")
    observer.subscribe("p/#", qos=1)
    return observer


def received(observer: RawClient) -> bytes:
    publish = observer.recv_type(Publish)
    if publish.packet_id is not None:  # QoS 1
        observer.send(Puback(publish.packet_id))
    return publish.payload


def barrier(node: Node, observer: RawClient) -> None:
    """Publish on the node directly; the observer gets it, and nothing before it."""
    with RawClient(node.port) as direct:
        direct.connect("barrier")
        direct.publish("p/barrier", b"barrier", qos=1)
    assert received(observer) == b"barrier"


def publish(client: RawClient, payload: bytes, packet_id: int) -> None:
    client.send(Publish("p/t", payload, 1, packet_id=packet_id))


def test_blackhole_and_half_open_hold_traffic_until_the_heal(node: Node) -> None:
    observer = observer_on(node)
    with Proxy(node.address) as proxy, RawClient(proxy.port) as client:
        client.connect("client")

        proxy.blackhole()
        publish(client, b"held", 1)
        barrier(node, observer)  # "held" did not reach the node
        client.recv_nothing(HELD)
        proxy.heal()
        assert received(observer) == b"held"
        assert client.recv_type(Puback).packet_id == 1  # same connection, nothing lost

        proxy.half_open(Direction.TO_NODE)  # the node gets it, the PUBACK is held
        publish(client, b"one-way", 2)
        assert received(observer) == b"one-way"
        client.recv_nothing(HELD)
        proxy.heal()
        assert client.recv_type(Puback).packet_id == 2

        client.subscribe("q/down", qos=0)
        proxy.half_open(Direction.TO_CLIENT)  # the node's packets pass, the client's do not
        with RawClient(node.port) as direct:
            direct.connect("direct")
            direct.publish("q/down", b"down", qos=0)
        assert client.recv_type(Publish).payload == b"down"
        publish(client, b"stuck", 3)
        barrier(node, observer)  # "stuck" did not reach the node
        proxy.heal()
        assert received(observer) == b"stuck"
        assert client.recv_type(Puback).packet_id == 3
        assert proxy.statistics().dropped == 0
    observer.close()


def test_delay_and_drop(node: Node) -> None:
    with Proxy(node.address) as proxy:
        with RawClient(proxy.port) as client:
            client.connect("client")
            proxy.delay(0.2, jitter=0.05)
            began = time.monotonic()
            ack = client.publish("p/t", b"slow", qos=1)
            assert isinstance(ack, Puback) and ack.reason_code < 0x80
            assert time.monotonic() - began >= 0.4  # 0.2 s each way, at least

            proxy.heal()
            proxy.drop()
            assert client.closed()  # aborted by the proxy
        with RawClient(proxy.port) as refused:
            assert refused.closed()  # refused while dropping
        proxy.heal()
        with RawClient(proxy.port) as client:
            assert client.connect("client").reason_code == 0
        stats = proxy.statistics()
        assert stats.dropped == 1 and stats.refused == 1 and stats.accepted == 3
