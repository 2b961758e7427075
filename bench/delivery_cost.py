"""Broker CPU per QoS 0 delivery on the send path, by what the receiving client asked for.

Usage::

    PYTHONPATH=src python bench/delivery_cost.py [--deliveries N]

Calls ``Session.deliver`` for a QoS 0 message with a real ``ServerConnection`` behind it (its
output drained every 1,000 deliveries) and prints the best of 5 runs, in nanoseconds per
delivery, for:

* ``plain``: a 5.0 client without topic aliases: the one shared frame per message;
* ``plain, persisted``: the same with messages that have a log position (not asked for);
* ``positions``: a client that asked for log positions (``meshmq-positions``), persisted
  messages: its own frame, with the property block built once per message;
* ``aliases``: a client with Topic Alias Maximum 16 receiving 8 topics (all hold an alias);
* ``aliases, contended``: Topic Alias Maximum 2 and 8 topics of equal rate (most deliveries
  count a candidate and go without alias).

Runs in a few seconds; the in-process numbers leave out the socket and the event loop.
"""

from __future__ import annotations

import argparse
import time

from meshmq.broker.message import Message
from meshmq.broker.session import Session
from meshmq.config import SessionConfig
from meshmq.mqtt.codec import encode_packet
from meshmq.mqtt.connection import ServerConnection
from meshmq.mqtt.packets import Connect
from meshmq.mqtt.properties import PropertyId

TOPICS = [f"sensors/plant-{i}/temperature" for i in range(8)]


class Link:
    """The ``ClientLink`` a session writes to: never congested, no I/O."""

    congested = False

    def __init__(self, conn: ServerConnection, log_positions: bool) -> None:
        self.conn = conn
        self.log_positions = log_positions

    def wake(self) -> None:
        pass


def attached(alias_maximum: int, log_positions: bool) -> tuple[Session, ServerConnection]:
    conn = ServerConnection()
    props = {PropertyId.TOPIC_ALIAS_MAXIMUM: alias_maximum} if alias_maximum else {}
    conn.receive_data(encode_packet(Connect("bench", 5, properties=props), 5))
    conn.events_received()
    conn.outgoing_alias_maximum = 65535  # mqtt.broker_topic_aliases default
    conn.send_connack(0)
    conn.data_to_send()
    session = Session("bench", SessionConfig())
    session.attach(Link(conn, log_positions), 0.0)
    return session, conn


def cost(deliveries: int, alias_maximum: int = 0, persisted: bool = False,
         log_positions: bool = False) -> float:
    """Best of 5: nanoseconds per ``Session.deliver`` call."""
    session, conn = attached(alias_maximum, log_positions)
    messages = [Message(topic, b"x" * 64, 0, False, {}, "publisher") for topic in TOPICS]
    if persisted:
        for offset, message in enumerate(messages):
            message.set_position(0, offset)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for index in range(deliveries):
            session.deliver(messages[index % len(messages)], 0, False, None, 0.0)
            if index % 1000 == 999:
                conn.data_to_send()
        best = min(best, (time.perf_counter() - started) / deliveries)
        conn.data_to_send()
    return best * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deliveries", type=int, default=200_000)
    n = parser.parse_args().deliveries
    rows = [
        ("plain", cost(n)),
        ("plain, persisted", cost(n, persisted=True)),
        ("positions", cost(n, persisted=True, log_positions=True)),
        ("aliases", cost(n, alias_maximum=16)),
        ("aliases, contended", cost(n, alias_maximum=2)),
    ]
    for name, nanoseconds in rows:
        print(f"{name:<20} {nanoseconds:7.0f} ns/delivery")


if __name__ == "__main__":
    main()
