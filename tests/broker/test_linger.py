"""broker/transport/linger.py on real sockets in one event loop: half-close, drain, and the
two bounds; under the event loop's transports and under the tcp listener's ``TcpStream``."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from meshmq.broker.transport import linger
from meshmq.broker.transport.linger import LINGER_BYTES, Linger, close_gracefully
from meshmq.broker.transport.stream import TcpAcceptor

Runner = Callable[[Coroutine[Any, Any, None]], None]
Runs = tuple[Runner, bool]  # the loop's run, and whether the server is a ``StreamServer``
# The broker runs on uvloop; the standard loop too, as the layer must not depend on one. Each
# with the loop's own transports, and with the streams of the tcp listener (stream.py).
RUNNERS = [
    pytest.param((uvloop.run, False), id="uvloop"),
    pytest.param((asyncio.run, False), id="asyncio"),
    pytest.param((uvloop.run, True), id="uvloop-streams"),
    pytest.param((asyncio.run, True), id="asyncio-streams"),
]
STREAMS = False  # set by ``run``: serve_one's server


class StreamServer:
    """What these tests use of ``asyncio.Server``, with a ``TcpAcceptor`` underneath."""

    def __init__(self, factory: Callable[[], asyncio.Protocol]) -> None:
        sock = socket.create_server(("127.0.0.1", 0))
        self.sockets = [sock]
        self.acceptor = TcpAcceptor(sock, factory, asyncio.get_running_loop())

    def close(self) -> None:
        self.acceptor.close()


class LastWords(asyncio.Protocol):
    """Says ``bye`` to the first bytes it reads, then closes gracefully."""

    def __init__(self) -> None:
        self.lost = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(b"bye")
        close_gracefully(self.transport)
        close_gracefully(self.transport)  # idempotent

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(asyncio.get_running_loop().time())


async def serve_one() -> tuple[asyncio.Server, list[LastWords]]:
    made: list[LastWords] = []

    def factory() -> LastWords:
        made.append(LastWords())
        return made[-1]

    if STREAMS:
        return StreamServer(factory), made  # type: ignore[return-value]  # (its two methods)
    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    return server, made


async def last_words(server: asyncio.Server) -> tuple[asyncio.StreamReader,
                                                      asyncio.StreamWriter]:
    """Connect, send one byte, and read the server's ``bye`` and its end of stream."""
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"x")
    assert await asyncio.wait_for(reader.read(), 5) == b"bye"  # read() ends at our FIN
    return reader, writer


@pytest.mark.parametrize("runner", RUNNERS)
def test_peer_reads_our_last_bytes_then_eof_and_its_eof_closes(runner: Runs) -> None:
    async def scenario() -> None:
        server, made = await serve_one()
        _, writer = await last_words(server)
        assert not made[0].lost.done()  # half-closed: still there, reading
        writer.close()  # the peer's FIN ends it at once
        await asyncio.wait_for(made[0].lost, 1)
        server.close()

    run(runner, scenario())


@pytest.mark.parametrize("runner", RUNNERS)
def test_peer_sending_more_than_the_byte_bound_is_cut_off(runner: Runs) -> None:
    async def scenario() -> None:
        server, made = await serve_one()
        _, writer = await last_words(server)
        linger_protocol = made[0].transport.get_protocol()  # type: ignore[union-attr]
        assert isinstance(linger_protocol, Linger)
        chunk = b"\x00" * 65536
        with pytest.raises(ConnectionError):
            for _ in range(10 * LINGER_BYTES // len(chunk)):
                writer.write(chunk)
                await writer.drain()
        await asyncio.wait_for(made[0].lost, 5)
        assert LINGER_BYTES < linger_protocol.dropped <= LINGER_BYTES + 2 * 262_144
        server.close()

    run(runner, scenario())


@pytest.mark.parametrize("runner", RUNNERS)
def test_silent_peer_is_cut_off_after_the_time_bound(monkeypatch, runner: Runs) -> None:
    monkeypatch.setattr(linger, "LINGER_SECONDS", 0.2)

    async def scenario() -> None:
        server, made = await serve_one()
        loop = asyncio.get_running_loop()
        started = loop.time()
        _, writer = await last_words(server)  # and then neither sends nor closes
        lost_at = await asyncio.wait_for(made[0].lost, 5)
        assert 0.15 <= lost_at - started < 2.0  # (uvloop keeps time in milliseconds)
        writer.close()
        server.close()

    run(runner, scenario())


@pytest.mark.parametrize("runner", RUNNERS)
def test_many_lingering_sockets_share_one_timer_and_each_is_cut_off(monkeypatch,
                                                                     runner: Runs) -> None:
    """Fifty silent peers linger at once: one queue entry each and one loop timer, and every
    socket is closed at its time bound; one peer that closes early is let go at once and its
    entry, when it comes due, does nothing."""
    monkeypatch.setattr(linger, "LINGER_SECONDS", 1.5)  # (set-up of fifty well inside it)

    async def scenario() -> None:
        server, made = await serve_one()
        loop = asyncio.get_running_loop()
        started = loop.time()
        writers = [(await last_words(server))[1] for _ in range(50)]
        deadlines = linger._deadlines_of(loop)
        assert len(deadlines.waiting) == 50
        assert deadlines._timer is not None  # one timer for all fifty
        early = made[0].transport.get_protocol()  # type: ignore[union-attr]
        assert isinstance(early, Linger)
        writers[0].close()  # this peer closes: its socket ends now, not at the bound
        first_lost = await asyncio.wait_for(made[0].lost, 1)
        assert first_lost - started < 1.5  # before its bound
        assert early.previous is None and early.transport is None  # nothing held after
        lost_at = await asyncio.wait_for(asyncio.gather(*(p.lost for p in made[1:])), 10)
        assert all(1.45 <= at - started < 6.0 for at in lost_at)  # (milliseconds in uvloop)
        assert not deadlines.waiting and deadlines._timer is None
        for writer in writers[1:]:
            writer.close()
        server.close()

    run(runner, scenario())


def run(runner: Runs, scenario: Coroutine[Any, Any, None]) -> None:
    global STREAMS
    loop_run, STREAMS = runner
    try:
        loop_run(scenario)
    finally:
        STREAMS = False
