"""broker/transport/stream.py: the tcp listener's connections without a uvloop transport each.

Real sockets in one event loop (uvloop and the standard one): a ``TcpAcceptor`` serving a
small protocol, and a real broker in this process for what an idle connection costs.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import struct
import tracemalloc
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop

from meshmq.broker.transport.stream import TcpAcceptor, TcpStream
from meshmq.config import load_config
from meshmq.mqtt.codec import encode_packet
from meshmq.mqtt.packets import Connect
from meshmq.node.server import BrokerServer

Runner = Callable[[Coroutine[Any, Any, None]], None]
RUNNERS = [pytest.param(uvloop.run, id="uvloop"), pytest.param(asyncio.run, id="asyncio")]


class Recorder(asyncio.Protocol):
    """Keeps what it reads and what happens to it; ``reply`` is written for each read."""

    def __init__(self, reply: bytes = b"") -> None:
        loop = asyncio.get_running_loop()
        self.reply = reply
        self.data = bytearray()
        self.got_data = asyncio.Event()
        self.eof = False
        self.lost: asyncio.Future[Exception | None] = loop.create_future()
        self.pauses = 0
        self.resumed = asyncio.Event()
        self.transport: TcpStream | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, TcpStream)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.data += data
        self.got_data.set()
        if self.reply:
            assert self.transport is not None
            self.transport.write(self.reply)

    def eof_received(self) -> bool:
        self.eof = True
        return False

    def pause_writing(self) -> None:
        self.pauses += 1

    def resume_writing(self) -> None:
        self.resumed.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set_result(exc)


class Made(list[Any]):
    """The protocols an acceptor made, in order; ``count(n)`` waits until it made ``n``."""

    def __init__(self) -> None:
        super().__init__()
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []

    def add(self, protocol: Any) -> Any:
        self.append(protocol)
        for wanted, made in self._waiting:
            if len(self) >= wanted and not made.done():
                made.set_result(None)
        return protocol

    async def count(self, wanted: int) -> None:
        if len(self) < wanted:
            made = asyncio.get_running_loop().create_future()
            self._waiting.append((wanted, made))
            await asyncio.wait_for(made, 5)


async def serve(make: Callable[[], asyncio.Protocol]) -> tuple[TcpAcceptor, int, Made]:
    made = Made()
    sock = socket.create_server(("127.0.0.1", 0))
    return (TcpAcceptor(sock, lambda: made.add(make()), asyncio.get_running_loop()),
            sock.getsockname()[1], made)


@pytest.mark.parametrize("run", RUNNERS)
def test_output_the_kernel_does_not_take_waits_pauses_the_protocol_and_arrives_whole(
        run: Runner) -> None:
    async def scenario() -> None:
        acceptor, port, made = await serve(Recorder)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await made.count(1)
        stream = made[0].transport
        stream.set_write_buffer_limits(high=65536)
        blob = bytes(range(256)) * 64  # 16 KB
        for _ in range(256):  # 4 MB at once, while the peer does not read
            stream.write(blob)
        assert stream.get_write_buffer_size() > 65536  # the kernel took some, not all
        assert made[0].pauses == 1  # once, past the high watermark
        received = await reader.readexactly(256 * len(blob))
        assert received == blob * 256  # in order, nothing lost or doubled
        await asyncio.wait_for(made[0].resumed.wait(), 5)
        assert stream.get_write_buffer_size() == 0
        writer.close()
        assert await asyncio.wait_for(made[0].lost, 5) is None
        assert made[0].eof
        acceptor.close()

    run(scenario())


@pytest.mark.parametrize("run", RUNNERS)
def test_paused_reading_delivers_nothing_until_resumed(run: Runner) -> None:
    async def scenario() -> None:
        acceptor, port, made = await serve(lambda: Recorder(reply=b"ok"))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"first")
        assert await reader.readexactly(2) == b"ok"
        stream = made[0].transport
        stream.pause_reading()
        assert not stream.is_reading()
        writer.write(b"second")
        writer.write_eof()
        barrier_reader, barrier_writer = await asyncio.open_connection("127.0.0.1", port)
        barrier_writer.write(b"x")  # read by the loop after the paused socket's bytes came
        assert await barrier_reader.readexactly(2) == b"ok"
        assert bytes(made[0].data) == b"first" and not made[0].eof
        stream.resume_reading()
        await asyncio.wait_for(made[0].lost, 5)
        assert bytes(made[0].data) == b"firstsecond" and made[0].eof
        assert await reader.read() == b"ok"  # the answer to "second", then our end
        for each in (writer, barrier_writer):
            each.close()
        acceptor.close()

    run(scenario())


@pytest.mark.parametrize("run", RUNNERS)
def test_a_reset_peer_is_lost_with_the_error(run: Runner) -> None:
    async def scenario() -> None:
        acceptor, port, made = await serve(Recorder)
        client = socket.create_connection(("127.0.0.1", port))
        await made.count(1)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # a reset
        made[0].transport.write(b"x" * 100)  # (a write may be what finds out)
        lost = await asyncio.wait_for(made[0].lost, 5)
        assert isinstance(lost, ConnectionError) or made[0].eof
        assert made[0].transport.is_closing()
        acceptor.close()

    run(scenario())


@pytest.mark.parametrize("run", RUNNERS)
def test_a_failing_protocol_is_aborted_and_reported_and_the_others_go_on(run: Runner) -> None:
    class Failing(Recorder):
        def data_received(self, data: bytes) -> None:
            raise RuntimeError("a bug")

    reported: list[dict[str, Any]] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, context: reported.append(
            context))
        kinds = [Failing, lambda: Recorder(reply=b"ok")]
        acceptor, port, made = await serve(lambda: kinds.pop(0)())
        bad_reader, bad_writer = await asyncio.open_connection("127.0.0.1", port)
        await made.count(1)
        good_reader, good_writer = await asyncio.open_connection("127.0.0.1", port)
        await made.count(2)
        bad_writer.write(b"boom")
        good_writer.write(b"fine")
        assert await good_reader.readexactly(2) == b"ok"
        assert await asyncio.wait_for(bad_reader.read(), 5) == b""  # aborted
        await asyncio.wait_for(made[0].lost, 5)
        assert not made[1].lost.done()
        for writer in (bad_writer, good_writer):
            writer.close()
        acceptor.close()

    run(scenario())
    assert [str(context["exception"]) for context in reported] == ["a bug"]


@pytest.mark.parametrize("run", RUNNERS)
def test_streams_left_open_are_closed_when_the_loop_run_ends(run: Runner) -> None:
    clients: list[socket.socket] = []

    async def scenario() -> None:
        acceptor, port, made = await serve(Recorder)
        clients.append(socket.create_connection(("127.0.0.1", port)))
        await made.count(1)
        acceptor.close()  # the listening socket: the connection stays

    run(scenario())
    clients[0].settimeout(5)
    assert clients[0].recv(10) == b""  # its socket was closed with the run
    clients[0].close()


def test_an_idle_connection_costs_under_1500_bytes_of_python_heap(tmp_path: Path) -> None:
    """The goal for an idle 3.1.1 connection (docs/benchmarks.md, "Per connection"): its
    protocol, MQTT state, session, timer entry and transport, all of it. 2,230 bytes with a
    uvloop transport per connection; about 1,200 with the streams."""
    count = 400
    config = load_config(overrides={
        "server.bind": "127.0.0.1", "server.port": 0, "server.data_dir": str(tmp_path / "data"),
        "server.log_level": "warning", "log.enabled": False,
    })
    packets = [encode_packet(Connect(client_id=f"idle-client-{index}", keep_alive=600,
                                     protocol_level=4), 4) for index in range(count)]

    async def scenario() -> None:
        server = BrokerServer(config)
        await server.start()
        broker = server.broker
        assert broker is not None
        clients: list[socket.socket] = []
        mine = [tracemalloc.Filter(False, __file__), tracemalloc.Filter(False, socket.__file__)]
        try:
            gc.collect()
            tracemalloc.start(1)
            before = tracemalloc.take_snapshot().filter_traces(mine)
            for packet in packets:  # (the client sockets are allocated in socket.py: not counted)
                client = socket.create_connection(("127.0.0.1", server.port))
                client.sendall(packet)
                clients.append(client)
            def connacks() -> list[bytes]:  # (a thread: the broker runs on this loop)
                for client in clients:
                    client.settimeout(5)
                return [client.recv(4) for client in clients]

            accepted = await asyncio.to_thread(connacks)
            assert accepted == [b"\x20\x02\x00\x00"] * count  # each was accepted
            assert broker.counters["connects"] == count
            gc.collect()
            after = tracemalloc.take_snapshot().filter_traces(mine)
            tracemalloc.stop()
            grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
            assert grown / count < 1500, f"{grown / count:.0f} bytes per idle connection"
        finally:
            tracemalloc.stop()
            for client in clients:
                client.close()
            await server.stop()

    uvloop.run(scenario())


class Movable(Recorder):
    """A protocol that can move to another transport (as ``ClientProtocol``): echoes."""

    def __init__(self) -> None:
        super().__init__(reply=b"")
        self.moved_to: list[asyncio.Transport] = []
        self.moved = asyncio.Event()

    def replace_transport(self, transport: asyncio.Transport) -> None:
        self.moved_to.append(transport)
        self.moved.set()
        self.transport = transport  # type: ignore[assignment]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        assert self.transport is not None
        self.transport.write(data)


@pytest.mark.parametrize("run", RUNNERS)
def test_a_busy_stream_moves_to_a_loop_transport_and_nothing_is_lost_or_reordered(
        run: Runner) -> None:
    async def scenario() -> None:
        acceptor, port, made = await serve(Movable)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        idle_writer.write(b"once")
        assert await idle_reader.readexactly(4) == b"once"
        for number in range(200):  # ping-pong: a read and a write in every turn
            line = b"%d;" % number
            writer.write(line)
            assert await reader.readexactly(len(line)) == line
        protocol = made[0]
        assert len(protocol.moved_to) == 1 and not isinstance(protocol.transport, TcpStream)
        assert not made[1].moved_to and isinstance(made[1].transport, TcpStream)  # idle: stays
        writer.write(b"after")
        assert await reader.readexactly(5) == b"after"
        writer.close()
        assert await asyncio.wait_for(protocol.lost, 5) is None
        assert bytes(protocol.data) == b"".join(b"%d;" % n for n in range(200)) + b"after"
        idle_writer.close()
        await asyncio.wait_for(made[1].lost, 5)
        acceptor.close()

    run(scenario())


@pytest.mark.parametrize("run", RUNNERS)
def test_a_stream_closed_while_moving_stays_closed(run: Runner) -> None:
    async def scenario() -> None:
        acceptor, port, made = await serve(Movable)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        assert await reader.readexactly(5) == b"hello"
        stream = made[0].transport
        stream._promote()  # the loop's transport takes over next turn...
        stream.write(b"bye")
        stream.close()  # ...but the stream closes first
        assert await asyncio.wait_for(reader.read(), 5) == b"bye"  # and our end, once
        await asyncio.wait_for(made[0].lost, 5)
        assert not made[0].moved_to
        writer.close()
        acceptor.close()

    run(scenario())


@pytest.mark.parametrize("run", RUNNERS)
def test_a_stream_moves_with_its_pending_output_and_the_writer_is_resumed(run: Runner) -> None:
    async def scenario() -> None:
        acceptor, port, made = await serve(Movable)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"start")
        assert await reader.readexactly(5) == b"start"
        protocol = made[0]
        stream = protocol.transport
        stream.set_write_buffer_limits(high=65536)
        blob = bytes(range(256)) * 256  # 64 KB
        sent = 0
        while not protocol.pauses and sent < 4096:  # until the kernel's buffers are full
            stream.write(blob)  # (busy: these writes also start the move)
            sent += 1
        assert protocol.pauses == 1 and stream.get_write_buffer_size() > 65536
        await asyncio.wait_for(protocol.moved.wait(), 5)  # moved, pending output and all
        assert stream.fd == -1  # the old stream let go of its descriptor
        assert await reader.readexactly(sent * len(blob)) == blob * sent
        await asyncio.wait_for(protocol.resumed.wait(), 5)
        writer.write(b"end")
        assert await reader.readexactly(3) == b"end"  # and it goes on, on the new transport
        writer.close()
        await asyncio.wait_for(protocol.lost, 5)
        acceptor.close()

    run(scenario())
