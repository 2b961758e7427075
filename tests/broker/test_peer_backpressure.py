"""One slow peer holds back only the clients that publish to it (cluster/mesh.py, "Congestion").

Three workers: worker 2 is stopped (SIGSTOP), so worker 0's link to it backs up past its high
water mark. The publisher on worker 0 whose messages go to worker 2 is paused until the link
drains, and loses nothing; a second publisher on worker 0, whose messages go to worker 1, keeps
going meanwhile: its QoS 1 publishes are acknowledged and delivered while worker 2 is stopped.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from test_workers import LOG_OFF, worker_pids

from conftest import BrokerProcess, Client, connect_on, wait_for


def test_a_stopped_peer_pauses_only_the_publishers_that_send_to_it(
        broker_factory: Callable[..., BrokerProcess],
        client_factory: Callable[..., Client]) -> None:
    broker = broker_factory(LOG_OFF, workers=3)
    pids = worker_pids(broker)
    slow_subscriber = connect_on(client_factory, broker, 2)
    slow_subscriber.subscribe("slow/#", qos=0)
    fast_subscriber = connect_on(client_factory, broker, 1)
    fast_subscriber.subscribe("fast/#", qos=1)
    to_slow = connect_on(client_factory, broker, 0)
    to_fast = connect_on(client_factory, broker, 0)
    to_slow.publish("slow/x", "warm-up", qos=1)  # both routes are in place on worker 0
    assert slow_subscriber.expect().payload == b"warm-up"
    to_fast.publish("fast/x", "warm-up", qos=1)
    assert fast_subscriber.expect().payload == b"warm-up"
    os.kill(pids[2], signal.SIGSTOP)  # worker 2 reads nothing: worker 0's link to it backs up
    try:
        payload = b"x" * 65536
        for n in range(1000):  # 64 MB, four times the link's high water mark
            to_slow.publish("slow/x", n.to_bytes(4, "big") + payload, qos=0)
        wait_for(lambda: "link to worker 2 backed up" in broker.log(),
                 what="worker 0 pausing the publisher to worker 2")
        for n in range(50):  # the other publisher on worker 0 is not held back: each PUBACK
            to_fast.publish("fast/x", f"fast-{n}", qos=1)  # comes while worker 2 is stopped
        got = [fast_subscriber.expect().payload for _ in range(50)]
        assert got == [f"fast-{n}".encode() for n in range(50)]
    finally:
        os.kill(pids[2], signal.SIGCONT)
    got_slow = [int.from_bytes(slow_subscriber.expect().payload[:4], "big") for _ in range(1000)]
    assert got_slow == list(range(1000))  # all of them, in order, once the link drained
