"""Accepting a storm: while connections queue, a loop turn takes many (broker/transport/acceptq.py).

libuv, under uvloop, accepts one connection per listening handle per loop turn; while the
accept queue holds ``WIDEN_AT`` or more, a listener polls its socket through
``ACCEPTS_PER_TURN`` handles. The decision is tested alone with given times and queue lengths;
the rest runs a real broker in this process on uvloop with real client sockets, whose connects
complete in the kernel and wait in the accept queue while the test counts the loop turns the
broker needs to take them.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import uvloop

from meshmq.broker.transport.acceptq import WIDEN_AT, AcceptQueueWatch, Change
from meshmq.broker.transport.listeners import ACCEPTS_PER_TURN, Listener
from meshmq.config import load_config
from meshmq.mqtt.codec import encode_packet
from meshmq.mqtt.packets import Connect
from meshmq.node.server import BrokerServer

QUEUED = 3 * ACCEPTS_PER_TURN

# ---------------------------------------------------------------------- the decision alone


def test_a_queue_opens_the_extra_handles_once() -> None:
    watch = AcceptQueueWatch(interval=0.01, calm=1.0)
    assert watch.looked(0.0, WIDEN_AT - 1) is None  # a few waiting: not a storm
    assert not watch.widened and watch.next_look == pytest.approx(0.01)
    assert watch.looked(0.01, WIDEN_AT) is Change.WIDEN
    assert watch.looked(0.02, 50) is None  # already open
    assert watch.widened


def test_the_extra_handles_close_after_a_calm_of_empty_looks_only() -> None:
    watch = AcceptQueueWatch(interval=0.01, calm=1.0)
    watch.looked(0.0, 40)
    assert watch.looked(0.1, 0) is None  # the calm starts
    assert watch.looked(0.6, 2) is None  # something waited: the calm starts again
    assert watch.looked(0.7, 0) is None
    assert watch.looked(1.69, 0) is None  # 0.99 s of calm
    assert watch.looked(1.7, 0) is Change.NARROW
    assert not watch.widened
    assert watch.looked(5.0, 0) is None  # narrow stays narrow
    assert watch.looked(5.01, WIDEN_AT) is Change.WIDEN  # and the next storm widens again


# ---------------------------------------------------------------------- a real broker


def in_process_broker(tmp_path: Path, test: Callable[[BrokerServer], Awaitable[None]]) -> None:
    """Run ``test`` with a broker started in this process, on uvloop, and stop it after."""
    config = load_config(overrides={
        "server.bind": "127.0.0.1", "server.port": 0, "server.data_dir": str(tmp_path / "data"),
        "server.log_level": "warning", "log.enabled": False,
    })

    async def main() -> None:
        server = BrokerServer(config)
        await server.start()
        try:
            await test(server)
        finally:
            await server.stop()

    uvloop.run(main())


def tcp_listener(server: BrokerServer) -> Listener:
    assert server.listeners is not None
    return server.listeners.listeners[0]


async def turns_until(condition: Callable[[], bool], limit: int = 1000) -> int:
    """Loop turns (``sleep(0)``: one poll each) until ``condition()`` holds."""
    for turn in range(limit):
        if condition():
            return turn
        await asyncio.sleep(0)
    raise AssertionError(f"not true after {limit} loop turns")


def queued_clients(port: int, count: int) -> list[socket.socket]:
    """``count`` connected sockets: the kernel completes the handshakes and queues them for
    accept while the loop is busy here."""
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(count)]


async def storm(server: BrokerServer) -> tuple[int, list[socket.socket]]:
    """``QUEUED`` clients at once; the loop turns until the broker has them all, and them."""
    broker = server.broker
    assert broker is not None
    before = len(broker.clients)
    clients = queued_clients(server.port, QUEUED)
    turns = await turns_until(lambda: len(broker.clients) == before + QUEUED)
    return turns, clients


async def lone_client(server: BrokerServer) -> socket.socket:
    """One client, waited for until the broker has it: no other connection queues."""
    broker = server.broker
    assert broker is not None
    before = len(broker.clients)
    client = queued_clients(server.port, 1)[0]
    await turns_until(lambda: len(broker.clients) == before + 1)
    return client


def test_queued_connections_are_taken_many_per_loop_turn(tmp_path: Path) -> None:
    async def test(server: BrokerServer) -> None:
        broker = server.broker
        assert broker is not None
        turns, clients = await storm(server)
        try:
            # One handle needs a turn per connection (49 turns for 48); the first accept sees
            # the queue and opens the extra handles, which then take 16 a turn.
            assert turns <= 12, turns
            assert len(tcp_listener(server).twins) == ACCEPTS_PER_TURN - 1
            for index, sock in enumerate(clients):  # and each is a working MQTT connection
                connect = Connect(client_id=f"queued-{index}", protocol_level=4)
                sock.sendall(encode_packet(connect, 4))
            await turns_until(lambda: broker.counters["connects"] == QUEUED)
            for sock in clients:
                assert sock.recv(4) == b"\x20\x02\x00\x00"  # CONNACK, accepted
        finally:
            for sock in clients:
                sock.close()

    in_process_broker(tmp_path, test)


def test_connections_one_at_a_time_keep_one_handle_and_a_calm_closes_the_others(
    tmp_path: Path,
) -> None:
    async def test(server: BrokerServer) -> None:
        listener = tcp_listener(server)
        assert listener.watch is not None
        listener.watch.interval = 0  # look at every accept
        clients = [await lone_client(server) for _ in range(20)]
        assert listener.twins == [] and not listener.watch.widened
        clients += (await storm(server))[1]
        assert len(listener.twins) == ACCEPTS_PER_TURN - 1
        listener.watch.calm = 0  # the first empty look starts the calm, the next ends it
        clients += [await lone_client(server) for _ in range(2)]
        assert listener.twins == [] and not listener.watch.widened
        # Closing the other handles left the socket listening: a client still gets in.
        client = await lone_client(server)
        clients.append(client)
        client.sendall(encode_packet(Connect(client_id="after-the-calm", protocol_level=4), 4))
        broker = server.broker
        assert broker is not None
        await turns_until(lambda: "after-the-calm" in broker.sessions)
        assert client.recv(4) == b"\x20\x02\x00\x00"
        for sock in clients:
            sock.close()

    in_process_broker(tmp_path, test)


def test_stopping_closes_every_handle_of_the_listening_socket(tmp_path: Path) -> None:
    ports: list[int] = []

    async def test(server: BrokerServer) -> None:
        ports.append(server.port)
        _, clients = await storm(server)  # the extra handles are open
        assert tcp_listener(server).twins
        for sock in clients:
            sock.close()

    in_process_broker(tmp_path, test)
    with pytest.raises(ConnectionRefusedError):  # no handle kept the socket listening
        socket.create_connection(("127.0.0.1", ports[0]), timeout=5).close()
