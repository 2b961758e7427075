"""HTTP webhooks (node/webhooks.py) against a real local HTTP server and a real broker process.

The receiver is an aiohttp web server on an ephemeral port, in a thread of its own; it records
every POST (headers and JSON body) and can answer 503 to the first requests.
"""

from __future__ import annotations

import asyncio
import base64
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aiohttp import web

from conftest import start_broker, wait_for
from meshmq.mqtt.packets import Publish
from meshmq.mqtt.properties import PropertyId


class Receiver:
    """An HTTP server recording each POST to /hook; the first ``fail_first`` get 503."""

    def __init__(self, fail_first: int = 0) -> None:
        self.fail_first = fail_first
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner: web.AppRunner | None = None
        self.port: int = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return self.runner.addresses[0][1]

    async def _handle(self, request: web.Request) -> web.Response:
        self.requests.append((dict(request.headers), await request.json()))
        if len(self.requests) <= self.fail_first:
            return web.Response(status=503)
        return web.Response(status=204)

    def accepted(self) -> list[dict[str, Any]]:
        """The batches answered 2xx, in arrival order."""
        return [body for _, body in self.requests[self.fail_first:]]

    def events(self) -> list[dict[str, Any]]:
        return [event for batch in self.accepted() for event in batch["events"]]

    def close(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def receiver_factory() -> Iterator[Callable[..., Receiver]]:
    made: list[Receiver] = []

    def factory(fail_first: int = 0) -> Receiver:
        receiver = Receiver(fail_first)
        made.append(receiver)
        return receiver

    yield factory
    for receiver in made:
        receiver.close()


def hooks_config(url: str, **keys: object) -> str:
    lines = ["[hooks]", f'url = "{url}"']
    for name, value in keys.items():
        text = ("true" if value else "false") if isinstance(value, bool) else (
            f'"{value}"' if isinstance(value, str) else str(value))
        lines.append(f"{name} = {text}")
    return "\n".join(lines) + "\n"


def of_kind(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [event for event in events if event["event"] == kind]


def test_connect_publish_and_disconnect_events_arrive_with_their_fields(
        tmp_path, raw_factory, receiver_factory) -> None:
    receiver = receiver_factory()
    broker = start_broker(tmp_path, hooks_config(
        receiver.url, events="client_connected,client_disconnected,publish",
        publish_filters="sensors/#, alarms/+", include_payload=True,
        authorization="Bearer s3cret", batch_delay_ms=20))
    try:
        device = raw_factory(broker.port)
        assert device.connect("dev-1", username="alice", keep_alive=30).reason_code == 0
        device.publish("sensors/t", b"\x00\x01hi", qos=1)
        device.publish("other/x", b"not sent")  # matches no publish filter
        device.publish("alarms/fire", b"", qos=0, retain=True)
        device.disconnect()
        wait_for(lambda: of_kind(receiver.events(), "client_disconnected"),
                 what="the disconnect event")
        events = receiver.events()  # one worker: its events in order, the disconnect last
        assert [event["event"] for event in events] == [
            "client_connected", "publish", "publish", "client_disconnected"]
        connected, reading, alarm, gone = events
        assert all(abs(event["ts"] - time.time()) < 60 for event in events)
        assert connected["client_id"] == "dev-1" and connected["username"] == "alice"
        assert connected["peer"].startswith("127.0.0.1:")
        assert (connected["protocol"], connected["clean_start"], connected["session_present"],
                connected["keep_alive"]) == ("5.0", True, False, 30)
        assert (reading["client_id"], reading["username"], reading["topic"], reading["qos"],
                reading["retain"], reading["payload_size"]) == (
                    "dev-1", "alice", "sensors/t", 1, False, 4)
        assert base64.b64decode(reading["payload"]) == b"\x00\x01hi"
        assert (alarm["topic"], alarm["retain"], alarm["payload"]) == ("alarms/fire", True, "")
        assert (gone["client_id"], gone["peer"], gone["reason"]) == (
            "dev-1", connected["peer"], "DISCONNECT 0x00 normal disconnection")
        headers, body = receiver.requests[0]
        assert headers["Authorization"] == "Bearer s3cret"
        assert headers["Content-Type"] == "application/json"
        assert body["worker"] is None  # a single-process node
    finally:
        broker.stop()


def test_publish_events_leave_out_the_payload_unless_asked(
        tmp_path, raw_factory, receiver_factory) -> None:
    receiver = receiver_factory()
    broker = start_broker(tmp_path, hooks_config(receiver.url, events="publish",
                                                 batch_delay_ms=0))
    try:
        device = raw_factory(broker.port)
        device.connect("dev-2")
        device.publish("any/topic", b"12345", qos=1)
        wait_for(receiver.events, what="the publish event")
        (event,) = receiver.events()  # no connect event: not in hooks.events
        assert event["topic"] == "any/topic" and event["payload_size"] == 5
        assert "payload" not in event
        assert "Authorization" not in receiver.requests[0][0]
    finally:
        broker.stop()


def test_a_failing_receiver_gets_the_batch_after_a_retry(
        tmp_path, raw_factory, receiver_factory) -> None:
    receiver = receiver_factory(fail_first=2)
    broker = start_broker(tmp_path, hooks_config(receiver.url, retry_backoff_ms=50,
                                                 retries=5, batch_delay_ms=0))
    try:
        raw_factory(broker.port).connect("patient")
        wait_for(receiver.accepted, what="the batch to be accepted")
        bodies = [body for _, body in receiver.requests]
        assert len(bodies) == 3 and bodies[0] == bodies[1] == bodies[2]  # the same batch again
        assert [event["client_id"] for event in receiver.events()] == ["patient"]
        log = broker.log()
        assert "webhook POST failed" in log and "error=\"HTTP 503\"" in log
    finally:
        broker.stop()


def test_a_dead_receiver_never_holds_back_delivery_and_drops_are_counted(
        tmp_path, raw_factory) -> None:
    with socket.socket() as hole:  # bound, never listening: every POST is refused
        hole.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{hole.getsockname()[1]}/hook"
        broker = start_broker(tmp_path, "[mqtt]\nsys_interval = 0.2\n" + hooks_config(
            url, events="client_connected,publish", queue_size=5, batch_size=1,
            batch_delay_ms=0, retries=1000, retry_backoff_ms=1000))
        try:
            reader = raw_factory(broker.port)
            reader.connect("reader")
            reader.subscribe("load/#", qos=0)
            writer = raw_factory(broker.port)
            writer.connect("writer")
            for index in range(100):
                writer.publish(f"load/{index}", b"x" * 100)
            writer.publish("load/barrier", b"last")
            topics = [reader.recv_type(Publish).topic for _ in range(101)]
            assert topics == [f"load/{index}" for index in range(100)] + ["load/barrier"]
            events = 2 + 101  # two connects, 101 publishes
            watcher = raw_factory(broker.port)
            watcher.connect("watcher")
            watcher.subscribe("$SYS/broker/webhooks/#")
            figures: dict[str, int] = {}

            def counted() -> bool:
                packet = watcher.recv_type(Publish)
                figures[packet.topic.rsplit("/", 1)[1]] = int(packet.payload)
                # at most queue_size events wait, and one batch of batch_size is being retried
                return figures.get("dropped", 0) >= events - 5 - 1 and \
                    figures.get("failed", 0) >= 1
            wait_for(counted, what="the drops and failures in $SYS")
            assert figures.get("sent", 0) == 0
            assert "webhook queue full: events dropped" in broker.log()
        finally:
            broker.stop()


def test_each_worker_posts_its_own_events(tmp_path, raw_factory, receiver_factory) -> None:
    receiver = receiver_factory()
    broker = start_broker(tmp_path, hooks_config(receiver.url, batch_delay_ms=0), workers=2)
    try:
        served: dict[str, int] = {}
        for attempt in range(40):
            connack = raw_factory(broker.port).connect(f"c-{attempt}")
            pairs = dict(connack.properties[PropertyId.USER_PROPERTY])
            served[f"c-{attempt}"] = int(pairs["meshmq-worker"])
            if set(served.values()) == {0, 1}:
                break

        def posted_by() -> dict[str, int]:
            return {event["client_id"]: batch["worker"] for batch in receiver.accepted()
                    for event in batch["events"] if event["event"] == "client_connected"}
        wait_for(lambda: set(posted_by()) == set(served), what="every connect event")
        assert posted_by() == served
    finally:
        broker.stop()


def test_events_still_queued_at_shutdown_are_sent_before_exit(
        tmp_path, raw_factory, receiver_factory) -> None:
    receiver = receiver_factory()
    broker = start_broker(tmp_path, hooks_config(receiver.url, batch_delay_ms=600_000))
    try:
        raw_factory(broker.port).connect("stayer")
        wait_for(lambda: "client connected client_id=stayer" in broker.log(), what="the connect")
        assert receiver.requests == []  # the batch waits to fill (ten minutes)
    finally:
        assert broker.stop() == 0
    events = receiver.events()
    assert [(event["event"], event["client_id"]) for event in events] == [
        ("client_connected", "stayer"), ("client_disconnected", "stayer")]
    assert events[1]["reason"] == "server shutting down"
