"""``$SYS/broker/...``: each run publishes its own values, from its start; none survive it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import BrokerProcess, Client, start_broker, wait_for
from meshmq.broker.message import Message
from meshmq.broker.snapshot import message_to_json
from meshmq.state.store import StateStore

LOG_OFF = "[log]\nenabled = false\n"


def sys_config(interval: float) -> str:
    return f"{LOG_OFF}[mqtt]\nsys_interval = {interval}\n"


def latest_values(watcher: Client, values: dict[str, str]) -> dict[str, str]:
    """Drain ``watcher``'s messages into ``values`` (topic under $SYS/broker/ -> payload)."""
    while not watcher.messages.empty():
        message = watcher.messages.get()
        values[message.topic.removeprefix("$SYS/broker/")] = message.payload.decode()
    return values


def seconds(uptime: str) -> int:
    number, unit = uptime.split()
    assert unit == "seconds"
    return int(number)


@pytest.mark.parametrize("workers", [1, 2])
def test_after_a_restart_sys_values_are_those_of_the_new_run(
    tmp_path: Path, client_factory: Callable[..., Client], workers: int,
) -> None:
    first = start_broker(tmp_path, sys_config(0.2), "node", workers=workers)
    try:
        watcher = client_factory()
        watcher.connect(first.port)
        watcher.subscribe("$SYS/broker/#")
        clients = [client_factory() for _ in range(3)]
        for client in clients:
            client.connect(first.port)
        for n in range(5):
            clients[0].publish("sys-test/x", str(n), qos=1)
        before: dict[str, str] = {}
        wait_for(lambda: (latest_values(watcher, before).get("messages/received") == "5"
                          and before.get("clients/total") == "4"
                          and seconds(before.get("uptime", "0 seconds")) >= 3),
                 what="the first run's $SYS values")
    finally:
        assert first.stop() == 0  # a clean stop: the state is written in full

    # A long interval: what a subscriber gets now is what the node published at start.
    second = start_broker(tmp_path, sys_config(3600), "node", workers=workers)
    try:
        subscriber = client_factory()
        subscriber.connect(second.port)
        subscriber.subscribe("$SYS/broker/#")
        after: dict[str, str] = {}
        wanted = ("uptime", "clients/total", "messages/received", "messages/sent", "workers")
        wait_for(lambda: all(key in latest_values(subscriber, after) for key in wanted),
                 what="$SYS values right after the restart")
        assert seconds(after["uptime"]) < seconds(before["uptime"]), (before, after)
        assert after["messages/received"] == "0" and after["messages/sent"] == "0", after
        # Published at start (no session yet); with workers, the first set may be published
        # again until every worker's figures are in, the subscriber's own session counted.
        assert after["clients/total"] in ("0", "1") if workers > 1 else (
            after["clients/total"] == "0"), after
        assert after["workers"] == str(workers)
    finally:
        second.stop()


@pytest.mark.parametrize("workers", [1, 2])
def test_sys_interval_0_means_no_sys_topics_not_even_a_past_run_s(
    tmp_path: Path, client_factory: Callable[..., Client], workers: int,
) -> None:
    first = start_broker(tmp_path, sys_config(0.2), "node", workers=workers)
    try:
        watcher = client_factory()
        watcher.connect(first.port)
        watcher.subscribe("$SYS/broker/#")
        wait_for(lambda: "uptime" in latest_values(watcher, {}), what="a first $SYS value")
    finally:
        assert first.stop() == 0

    second: BrokerProcess = start_broker(tmp_path, sys_config(0), "node", workers=workers)
    try:
        subscriber = client_factory()
        subscriber.connect(second.port)
        subscriber.subscribe("$SYS/#")  # a retained $SYS value would come before the barrier
        subscriber.subscribe("barrier")
        subscriber.publish("barrier", b"after", qos=1)
        message = subscriber.expect()
        assert (message.topic, message.payload) == ("barrier", b"after")
        subscriber.expect_none()
    finally:
        second.stop()


def test_sys_values_stored_by_an_older_version_are_dropped_at_restore(
    tmp_path: Path, client_factory: Callable[..., Client],
) -> None:
    """Versions before this fix wrote the $SYS retained values into the state; a node that
    finds them serves none of them (here with no $SYS of its own: sys_interval = 0)."""
    loop = asyncio.new_event_loop()
    try:
        store = StateStore(tmp_path / "node" / "data", loop)  # where start_broker puts it
        store.load()
        for topic, payload in (("$SYS/broker/uptime", b"9999 seconds"), ("kept/one", b"k")):
            message = Message(topic, payload, 0, True, None, None, 0.0)
            store.write({"op": "retain", "topic": topic, "message": message_to_json(message, 0.0)})
        store.close()
    finally:
        loop.close()
    broker = start_broker(tmp_path, sys_config(0), "node")
    try:
        subscriber = client_factory()
        subscriber.connect(broker.port)
        subscriber.subscribe("$SYS/#")
        subscriber.subscribe("kept/#")  # its retained message is the barrier
        message = subscriber.expect()
        assert (message.topic, message.payload) == ("kept/one", b"k")
        subscriber.expect_none()
    finally:
        broker.stop()
