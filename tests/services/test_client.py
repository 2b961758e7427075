"""meshmq.client against a real broker: calls, service workers, errors, the broker list.

Each test runs its asyncio part with ``asyncio.run`` against a broker process (conftest's
``broker_factory``); the clients are the library's own (client/client.py over the broker's
codec), the service workers its ``ServiceWorker``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

import pytest

from conftest import BrokerProcess
from meshmq.client import CallTimeout, Client, Request, ServiceError, ServiceWorker

FAST = """
[log]
fsync = "interval"
[services]
timeout = 1.0
retries = 1
max_wait = 0.5
"""


def address(broker: BrokerProcess) -> str:
    return f"127.0.0.1:{broker.port}"


def free_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def echo(request: Request) -> bytes:
    return b"echo:" + request.payload


@pytest.mark.parametrize("workers", [1, 2])
def test_call_and_serve(workers: int, broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(FAST, workers=workers)

    async def main() -> None:
        async with Client(address(broker), "echo-1") as serving, \
                Client(address(broker)) as calling:
            worker = ServiceWorker(serving, "echo", echo, credit=4)
            task = asyncio.create_task(worker.run())
            try:
                replies = await asyncio.gather(*(
                    calling.call("echo", f"{n}".encode(), timeout=10) for n in range(20)))
            finally:
                task.cancel()
        assert sorted(r.payload for r in replies) == sorted(f"echo:{n}".encode()
                                                            for n in range(20))
        assert len({r.request_id for r in replies}) == 20
        assert worker.served == 20

    asyncio.run(main())


def test_errors_raise_service_error_with_the_kind(
        broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(FAST)

    async def failing(request: Request) -> bytes:
        raise ValueError("out of paper")

    async def main() -> None:
        async with Client(address(broker)) as calling, Client(address(broker)) as serving:
            with pytest.raises(ServiceError) as nobody:
                await calling.call("absent", b"?", timeout=10)
            assert nobody.value.kind == "no-responders"
            task = asyncio.create_task(ServiceWorker(serving, "printer", failing).run())
            try:
                with pytest.raises(ServiceError) as failed:
                    await calling.call("printer", b"page", timeout=10)
                assert (failed.value.kind, failed.value.detail) == ("worker-error",
                                                                    "out of paper")
            finally:
                task.cancel()

    asyncio.run(main())


def test_a_call_with_no_reply_in_time_raises_call_timeout(
        broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(FAST.replace("max_wait = 0.5", "max_wait = 30.0"))

    async def main() -> None:
        async with Client(address(broker)) as calling:
            with pytest.raises(CallTimeout):
                await calling.call("silent", b"?", timeout=0.5)

    asyncio.run(main())


def test_the_client_tries_the_brokers_of_its_list_in_turn(
        broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(FAST)

    async def main() -> None:
        down = f"127.0.0.1:{free_port()}"
        async with Client([down, address(broker)]) as client:
            assert client.broker == ("127.0.0.1", broker.port)
            assert await client.publish("plain/topic", b"x", qos=1) in (0, 0x10)

    asyncio.run(main())


def test_a_reply_lost_with_the_connection_comes_again_for_the_repeat(
        broker_factory: Callable[..., BrokerProcess]) -> None:
    """The caller (a clean session) loses its connection while its request runs; the reply
    is routed while it is away and lost. On its new connection the call repeats the request
    (same correlation data): the broker answers from its deduplication window, and the
    handler ran once."""
    broker = broker_factory(FAST)
    runs: list[bytes] = []
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(request: Request) -> bytes:
        runs.append(request.payload)
        started.set()
        await release.wait()
        return b"done once"

    async def main() -> None:
        async with Client(address(broker), "slow") as serving, \
                Client(address(broker), clean_start=True,
                       reconnect_delay=(1.0, 1.0)) as calling:
            task = asyncio.create_task(ServiceWorker(serving, "slow", slow).run())
            try:
                call = asyncio.create_task(calling.call("slow", b"job", timeout=20))
                await asyncio.wait_for(started.wait(), 10)
                writer = calling._writer  # the test cuts the connection
                assert writer is not None
                writer.transport.abort()
                with contextlib.suppress(ConnectionError):  # its connection is gone
                    await asyncio.wait_for(writer.wait_closed(), 10)
                release.set()  # the reply is routed while the caller is away
                reply = await call
            finally:
                task.cancel()
        assert reply.payload == b"done once"
        assert runs == [b"job"] and calling.connections == 2

    asyncio.run(main())
