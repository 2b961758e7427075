"""``$SYS`` topics: the node's counters, published as retained messages every interval.

Theory of operation
-------------------
At start (``start()``, once the stored state is restored, before any listener is up), then
every ``mqtt.sys_interval`` seconds, each worker takes its local counters (``local_counts``).
A single-process node publishes them at once. With workers, every worker but the leader sends
them to the leader (a ``STATS`` frame); the leader adds the latest figures of each linked peer
to its own and publishes the totals, so ``$SYS`` describes the whole node whichever worker a
subscriber is on (the topics are routed like any publish). A peer's figures are at most one
interval old; at start, until every peer's first figures are in, the leader publishes again
every ``CATCH_UP`` seconds (within the first interval only).

The messages are retained (a new subscriber gets the current values at once), QoS 0, and never
stored on disk (``keeper.py`` skips ``$SYS/``): the first set of a run is published at start,
so even a subscriber that comes right after a restart never sees the previous run's uptime or
counters. ``mqtt.sys_interval = 0``: no ``$SYS`` topics at all.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Protocol

from meshmq import __version__
from meshmq.broker.message import Message

if TYPE_CHECKING:
    from meshmq.broker.interfaces import BrokerEvents, NodeStatistics, RetainedMessages
    from meshmq.broker.router import Router
    from meshmq.broker.session import Session

PREFIX = "$SYS/broker/"
CATCH_UP = 0.02  # seconds between the leader's publishes while peers' first figures are due

# counter name -> topic under $SYS/broker/ (Mosquitto's names where it has one)
TOPICS = {
    "clients_connected": "clients/connected",
    "clients_disconnected": "clients/disconnected",
    "clients_total": "clients/total",
    "messages_received": "messages/received",
    "messages_sent": "messages/sent",
    "messages_dropped": "messages/dropped",
    "subscriptions": "subscriptions/count",
    "retained": "retained messages/count",
    "forwarded": "mesh/forwarded",
    "webhook_sent": "webhooks/sent",  # only with hooks.url
    "webhook_failed": "webhooks/failed",
    "webhook_dropped": "webhooks/dropped",
}


class SysHost(Protocol):
    """What ``$SYS`` needs from the broker it serves (broker.py)."""

    loop: asyncio.AbstractEventLoop
    sessions: dict[str, Session]
    router: Router  # publishes the topics; counts what was routed and delivered
    retained: RetainedMessages
    events: BrokerEvents | None  # webhooks, when configured: their counters too
    statistics_sink: NodeStatistics  # the node's totals (several workers: one adds up)


def local_counts(broker: SysHost) -> dict[str, int]:
    """This process's share of the node's counters (``forwarded``: its peers add theirs)."""
    connected = dropped = subscriptions = 0
    for session in broker.sessions.values():  # one pass per interval
        connected += session.client is not None
        dropped += session.dropped
        subscriptions += len(session.subscriptions)
    counts = {
        "clients_connected": connected,
        "clients_disconnected": len(broker.sessions) - connected,
        "clients_total": len(broker.sessions),
        "messages_received": broker.router.routed,
        "messages_sent": broker.router.delivered,
        "messages_dropped": dropped,
        "subscriptions": subscriptions,
        "retained": broker.retained.count(),  # those this router keeps: no double counting
        "forwarded": 0,
    }
    if broker.events is not None:
        hooks = broker.events.statistics()
        counts["webhook_sent"] = hooks["sent_events"]
        counts["webhook_failed"] = hooks["failed_posts"]
        counts["webhook_dropped"] = hooks["dropped_queue_full"] + hooks["dropped_after_retries"]
    return counts


class SysTopics:
    """The node's ``$SYS/broker/...`` topics, published by the router that adds them up."""

    def __init__(self, broker: SysHost, interval: float) -> None:
        self.broker = broker
        self.interval = interval
        self.started = time.monotonic()
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """The first set now (the stored state is restored), then one every interval."""
        if self.interval > 0:
            self.tick()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def tick(self) -> None:
        broker = self.broker
        totals = broker.statistics_sink.totals(local_counts(broker))
        if totals is not None:
            self.publish(totals)
        self._handle = broker.loop.call_later(self.next_delay(), self.tick)

    def next_delay(self) -> float:
        """The interval; shorter while the first figures of other routers are due."""
        if not self.broker.statistics_sink.complete() \
                and time.monotonic() - self.started < self.interval:
            return min(CATCH_UP, self.interval)
        return self.interval

    def publish(self, counts: dict[str, int]) -> None:
        broker = self.broker
        # a name the core does not know is a topic itself (a cluster's per-node figures)
        values = {TOPICS.get(name, name): str(value) for name, value in counts.items()}
        values["uptime"] = f"{int(time.monotonic() - self.started)} seconds"
        values["version"] = f"meshmq {__version__}"
        values["workers"] = str(broker.statistics_sink.workers)
        router = broker.router
        now = broker.loop.time()
        for topic, text in values.items():
            message = Message(PREFIX + topic, text.encode(), 0, True, None, None, now)
            router.publish_internal(message, now)
            broker.retained.keep(message, None)
