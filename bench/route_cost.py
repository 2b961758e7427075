"""Broker CPU per ``Router.publish`` of a QoS 0 message to one plain subscriber, in-process.

Usage::

    PYTHONPATH=src python bench/route_cost.py [--publishes N]

Prints the best of 7 runs in nanoseconds per publish. It isolates what the router does per
message (match, counters, one delivery into a real ``ServerConnection``), without sockets or
the event loop: the place where a per-message counter shows (docs/benchmarks.md, "Operations
plane"). Compare two trees by running it with each one's ``src`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import time

from delivery_cost import attached

from meshmq.broker.message import Message
from meshmq.broker.router import Router
from meshmq.broker.session import Subscription
from meshmq.mqtt.packets import SubscriptionOptions


def cost(publishes: int) -> float:
    """Best of 7: nanoseconds per ``Router.publish``."""
    session, conn = attached(0, False)
    router = Router({session.client_id: session})
    router.subscribe(session, "sensors/#", Subscription(SubscriptionOptions(qos=1)))
    messages = [Message(f"sensors/plant-{i}/t", b"x" * 64, 0, False, {}, "pub")
                for i in range(8)]
    best = float("inf")
    for _ in range(7):
        started = time.perf_counter()
        for index in range(publishes):
            router.publish(messages[index & 7], 0.0)
            if index % 1000 == 999:
                conn.data_to_send()
        best = min(best, (time.perf_counter() - started) / publishes)
    return best * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--publishes", type=int, default=200_000)
    args = parser.parse_args()
    print(f"{cost(args.publishes):.0f} ns per Router.publish (QoS 0, one subscriber)")


if __name__ == "__main__":
    main()
