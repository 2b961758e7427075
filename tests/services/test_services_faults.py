"""Services through ``kill -9``: the dispatching worker process, then the whole node.

A node of two workers serves one service; four service workers (meshmq.client's
``ServiceWorker``) and two callers (meshmq.client's ``call``) are spread over both workers, and
calls stream in. Mid-stream the test kills, with SIGKILL, the worker process that dispatches
the service (the supervisor restarts it), or the whole node (restarted by the test on the same
port and data directory). Every call must end with a reply, and every request with one answer:

* every call returns a reply, none an error or a timeout;
* all the replies a caller received for one request (its correlation data) carry the same
  request id and the same payload: one execution's answer, however many times the caller
  repeated the request (meshmq.client repeats after a reconnect; the broker's deduplication
  answers a repeat with the remembered reply or joins it to the pending request);
* a request a service worker got more than once got it again marked ``meshmq-dup``.

The log's fsync policy is ``interval``: a process crash loses nothing the OS has been given
(docs/replay.md), and the tests stay quick.
"""

from __future__ import annotations

import asyncio
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from servicekit import service_on

from meshmq.client import Client, Request, ServiceWorker
from meshmq.mqtt.packets import Publish
from meshmq.mqtt.properties import PropertyId, get_property

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
from nodes import Node  # tests/harness: nodes killed and restarted on their port

CONFIG = """
[log]
fsync = "interval"
[services]
timeout = 2.0
retries = 10
max_wait = 30.0
"""
CALLS = 120  # per caller
IN_FLIGHT = 8  # per caller


@dataclass
class Ledger:
    """What the service workers executed and what the callers received."""

    executed: dict[bytes, list[tuple[str, int, bool]]] = field(
        default_factory=lambda: defaultdict(list))  # payload -> (request id, retry, dup)
    received: dict[bytes, list[tuple[str | None, bytes]]] = field(
        default_factory=lambda: defaultdict(list))  # correlation -> (request id, payload)
    answered: int = 0


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    node = Node("services", tmp_path / "node", CONFIG, workers=2).start()
    try:
        yield node
    finally:
        node.stop()


async def client_on(node: Node, worker: int, client_id: str) -> Client:
    """A meshmq.client Client connected to ``worker`` (new connections until one lands)."""
    for _ in range(64):
        client = Client(f"127.0.0.1:{node.port}", client_id, keep_alive=5)
        await client.start()
        pairs = dict(get_property(client.connack.properties, PropertyId.USER_PROPERTY) or [])
        if pairs.get("meshmq-worker") == str(worker):
            return client
        await client.close()
    raise AssertionError(f"no connection landed on worker {worker}")


async def scenario(node: Node, kill: str) -> Ledger:
    ledger = Ledger()
    service = service_on(1, 2, "ledger")
    victim = 1  # the dispatcher's worker process

    async def handle(request: Request) -> bytes:
        ledger.executed[request.payload].append((request.request_id, request.retry,
                                                 request.dup))
        if halfway.is_set() and not killed.is_set():  # in hand when the kill comes: held
            await killed.wait()  # until the node (or its dispatcher) is back
        return b"done:" + request.payload

    workers = [await client_on(node, w % 2, f"sw-{w}") for w in range(4)]
    callers = [await client_on(node, w, f"caller-{w}") for w in (0, 1)]
    for caller in callers:
        def record(packet: Publish, caller: Client = caller) -> None:
            if packet.topic == f"replies/{caller.client_id}":
                pairs = dict(get_property(packet.properties, PropertyId.USER_PROPERTY) or [])
                correlation = get_property(packet.properties, PropertyId.CORRELATION_DATA)
                ledger.received[correlation or b""].append(
                    (pairs.get("meshmq-request-id"), packet.payload))
        caller.add_listener(record)
    serving = [asyncio.create_task(ServiceWorker(w, service, handle, credit=4).run())
               for w in workers]
    killed = asyncio.Event()

    halfway = asyncio.Event()  # half the calls answered: the kill comes then

    async def stream(caller: Client, index: int) -> list[bytes]:
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def one(n: int) -> bytes:
            async with gate:
                reply = await caller.call(service, f"{index}:{n}".encode(), timeout=90)
                ledger.answered += 1
                if ledger.answered == CALLS // 2:
                    halfway.set()
                return reply.payload

        return list(await asyncio.gather(*(one(n) for n in range(CALLS))))

    async def nemesis() -> None:
        await asyncio.wait_for(halfway.wait(), 120)
        if kill == "dispatcher":
            pid = node.kill_worker(victim)
            await asyncio.to_thread(node.wait_worker_restarted, victim, pid)
        else:
            await asyncio.to_thread(node.kill)
            await asyncio.to_thread(node.restart)
        killed.set()

    try:
        chaos = asyncio.create_task(nemesis())
        results = await asyncio.gather(*(stream(caller, i) for i, caller in
                                         enumerate(callers)))
        await chaos
    finally:
        for task in serving:
            task.cancel()
        for client in workers + callers:
            await client.close()
    assert killed.is_set()
    for index, replies in enumerate(results):
        assert replies == [f"done:{index}:{n}".encode() for n in range(CALLS)]
    return ledger


def check(ledger: Ledger) -> None:
    assert len(ledger.received) == 2 * CALLS  # one correlation per call, each answered
    for correlation, replies in ledger.received.items():
        assert len(set(replies)) == 1, (correlation, replies)  # one answer, maybe repeated
        assert replies[0][0] is not None
    for payload, runs in ledger.executed.items():
        assert len({request_id for request_id, _, _ in runs}) >= 1
        assert all(dup for _, _, dup in runs[1:]), (payload, runs)  # again: marked dup
    assert set(ledger.executed) == {f"{i}:{n}".encode() for i in (0, 1) for n in range(CALLS)}


def test_the_dispatching_worker_killed_mid_stream(node: Node) -> None:
    ledger = asyncio.run(scenario(node, "dispatcher"))
    check(ledger)
    assert "Traceback" not in node.log()


def test_the_whole_node_killed_and_restarted_mid_stream(node: Node) -> None:
    ledger = asyncio.run(scenario(node, "node"))
    check(ledger)
    assert "Traceback" not in node.log()
    assert "services recovered" in node.log()
