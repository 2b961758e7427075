"""Accepting a storm: a loop turn takes many queued connections, not one (broker/listeners.py).

libuv, under uvloop, accepts one connection per listening handle per loop turn; each listener
polls its socket through ``ACCEPTS_PER_TURN`` handles. These tests run a real broker in this
process on uvloop and real client sockets: the clients' connects complete in the kernel and
wait in the accept queue, and the test counts the loop turns the broker needs to take them.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import uvloop

from meshmq.broker.listeners import ACCEPTS_PER_TURN
from meshmq.config import load_config
from meshmq.mqtt.codec import encode_packet
from meshmq.mqtt.packets import Connect
from meshmq.node.server import BrokerServer

QUEUED = 3 * ACCEPTS_PER_TURN


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
    clients = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        clients.append(sock)
    return clients


def test_a_loop_turn_accepts_many_queued_connections(tmp_path: Path) -> None:
    async def test(server: BrokerServer) -> None:
        broker = server.broker
        assert broker is not None
        clients = queued_clients(server.port, QUEUED)
        try:
            turns = await turns_until(lambda: len(broker.clients) == QUEUED)
            # One handle would need a turn per connection (48); the handles take 16 a turn,
            # and connection_made runs a turn after the accept.
            assert turns <= QUEUED // ACCEPTS_PER_TURN + 2, turns
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


def test_stopping_closes_every_handle_of_the_listening_socket(tmp_path: Path) -> None:
    ports: list[int] = []

    async def test(server: BrokerServer) -> None:
        ports.append(server.port)
        for sock in queued_clients(server.port, 2):
            sock.close()

    in_process_broker(tmp_path, test)
    with pytest.raises(ConnectionRefusedError):  # no handle kept the socket listening
        socket.create_connection(("127.0.0.1", ports[0]), timeout=5).close()
