"""Accepting a storm: while connections queue, a loop turn takes many (broker/transport/acceptq.py).

libuv, under uvloop, accepts one connection per listening handle per loop turn; while the
accept queue holds ``WIDEN_AT`` or more, a listener on uvloop's server (TLS, WebSocket) polls
its socket through ``ACCEPTS_PER_TURN`` handles. The plain tcp listener accepts on its own, up
to ``stream.ACCEPTS_PER_TURN`` a turn (broker/transport/stream.py). The decision is tested
alone with given times and queue lengths; the rest runs a real broker in this process on uvloop
with real client sockets, whose connects complete in the kernel and wait in the accept queue
while the test counts the loop turns the broker needs to take them.
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
from meshmq.broker.transport.stream import TcpStream
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
        "ws.enabled": True, "ws.port": 0,  # a listener on uvloop's server, with the handles
    })

    async def main() -> None:
        server = BrokerServer(config)
        await server.start()
        try:
            await test(server)
        finally:
            await server.stop()

    uvloop.run(main())


def listener_named(server: BrokerServer, name: str) -> Listener:
    assert server.listeners is not None
    return next(each for each in server.listeners.listeners if each.spec.name == name)


def tcp_listener(server: BrokerServer) -> Listener:
    return listener_named(server, "tcp")


def ws_listener(server: BrokerServer) -> Listener:
    return listener_named(server, "ws")


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


async def storm(listener: Listener) -> tuple[int, list[socket.socket]]:
    """``QUEUED`` clients at once; the loop turns until ``listener`` has admitted them all
    (at accept), and them."""
    before = listener.admission.active
    clients = queued_clients(listener.port, QUEUED)
    turns = await turns_until(lambda: listener.admission.active == before + QUEUED)
    return turns, clients


async def lone_client(listener: Listener) -> socket.socket:
    """One client, waited for until ``listener`` has it: no other connection queues."""
    before = listener.admission.active
    client = queued_clients(listener.port, 1)[0]
    await turns_until(lambda: listener.admission.active == before + 1)
    return client


def test_queued_connections_are_taken_many_per_loop_turn(tmp_path: Path) -> None:
    async def test(server: BrokerServer) -> None:
        broker = server.broker
        assert broker is not None
        # One handle needs a turn per connection (49 turns for 48); the first accept sees
        # the queue and opens the extra handles, which then take 16 a turn.
        turns, websockets = await storm(ws_listener(server))
        assert turns <= 12, turns
        assert len(ws_listener(server).twins) == ACCEPTS_PER_TURN - 1
        for sock in websockets:
            sock.close()
        # The tcp listener accepts on its own, 16 a turn, with no extra handles.
        turns, clients = await storm(tcp_listener(server))
        try:
            assert turns <= 12, turns
            assert tcp_listener(server).twins == [] and tcp_listener(server).watch is None
            assert all(isinstance(client.transport, TcpStream) for client in broker.clients)
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
        listener = ws_listener(server)
        assert listener.watch is not None
        listener.watch.interval = 0  # look at every accept
        clients = [await lone_client(listener) for _ in range(20)]
        assert listener.twins == [] and not listener.watch.widened
        clients += (await storm(listener))[1]
        assert len(listener.twins) == ACCEPTS_PER_TURN - 1
        listener.watch.calm = 0  # the first empty look starts the calm, the next ends it
        clients += [await lone_client(listener) for _ in range(2)]
        assert listener.twins == [] and not listener.watch.widened
        # Closing the other handles left the socket listening: a client still gets in.
        clients.append(await lone_client(listener))
        for sock in clients:
            sock.close()

    in_process_broker(tmp_path, test)


def test_stopping_closes_every_handle_of_the_listening_socket(tmp_path: Path) -> None:
    ports: list[int] = []

    async def test(server: BrokerServer) -> None:
        ports.extend((server.port, ws_listener(server).port))
        _, clients = await storm(ws_listener(server))  # the extra handles are open
        assert ws_listener(server).twins
        clients += (await storm(tcp_listener(server)))[1]
        for sock in clients:
            sock.close()

    in_process_broker(tmp_path, test)
    for port in ports:
        with pytest.raises(ConnectionRefusedError):  # no handle kept the socket listening
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
