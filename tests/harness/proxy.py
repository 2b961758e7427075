"""A user-space TCP proxy the harness puts on a link (client -> node today, node -> node once
there is a cluster), with faults switched at run time. ``tc netem`` is not available here.

Theory of operation
-------------------
The proxy runs its own asyncio loop in a daemon thread; the test thread drives it through
blocking methods (each one applied on the loop and waited for). It listens on an ephemeral
port of ``listen_host``; each accepted connection is a *link*: the proxy dials ``target()``
(asked per link, so a restarted node on a new port is found) and runs two pumps, one per
direction. A pump reads a chunk, stamps it with the time it may be written (now + delay +
jitter, never earlier than the previous chunk's: the byte stream keeps its order), queues it
(bounded: a slow reader stops the pump reading, and TCP pushes back on the sender) and writes it
when due.

Faults (``Faults``, one value for all links, current and new):

* ``delay(fixed, jitter)``: every chunk waits ``fixed`` + uniform(0, ``jitter``) seconds.
* ``drop()``: every link is aborted now (both sockets reset); until ``heal``, new connections
  are accepted and closed at once (a node that refuses).
* ``blackhole()``: accepted connections are held and nothing is forwarded either way (a new
  link does not even dial the target); nothing is lost: the pumps stop reading, the kernel's
  buffers fill and the senders block, as in a network partition that TCP rides out. Clients
  find out only by their own timeouts (keep alive).
* ``half_open(direction)``: only ``TO_NODE`` or ``TO_CLIENT`` flows; the other is held.
* ``heal()``: no delay, both directions flow, new links accepted; held bytes go on.

A pump that reads end of stream forwards what it holds and half-closes the other side, so a
DISCONNECT followed by a close reaches the far end before the close does; a link is closed
once both directions ended, or at once when either side fails.
"""

from __future__ import annotations

import asyncio
import enum
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

QUEUED_CHUNKS = 16  # per direction; beyond it the pump stops reading (backpressure)
CHUNK = 64 * 1024
CONTROL_TIMEOUT = 10.0


class Direction(enum.Enum):
    TO_NODE = "to-node"  # from the side that connected to the side that was dialed
    TO_CLIENT = "to-client"


@dataclass(frozen=True)
class Faults:
    """What the proxy does to traffic now; ``Faults()`` is a healthy link."""

    delay: float = 0.0
    jitter: float = 0.0
    refuse: bool = False  # close new connections at once (after ``drop``)
    held: frozenset[Direction] = frozenset()  # directions that forward nothing

    def describe(self) -> str:
        parts = []
        if self.delay or self.jitter:
            parts.append(f"delay {self.delay * 1000:.0f}+{self.jitter * 1000:.0f}ms")
        if self.refuse:
            parts.append("refusing")
        if self.held == frozenset(Direction):
            parts.append("blackhole")
        elif self.held:
            parts.append("only " + next(d for d in Direction if d not in self.held).value)
        return ", ".join(parts) or "healthy"


@dataclass
class ProxyStats:
    """A snapshot of the proxy's counters (``Proxy.statistics``)."""

    accepted: int = 0
    refused: int = 0  # closed at once while refusing, or because the target did not answer
    active: int = 0
    dropped: int = 0  # links aborted by ``drop``
    bytes: dict[Direction, int] = field(
        default_factory=lambda: {direction: 0 for direction in Direction})


@dataclass(eq=False)  # links are told apart by identity (a set of them)
class _Link:
    client: asyncio.StreamWriter
    node: asyncio.StreamWriter | None = None
    task: asyncio.Task[None] | None = None

    def abort(self) -> None:
        for writer in (self.client, self.node):
            if writer is not None:
                writer.transport.abort()


class Proxy:
    """See the module docstring. Use as a context manager, or ``start()`` / ``close()``."""

    def __init__(self, target: Callable[[], tuple[str, int]], listen_host: str = "127.0.0.1",
                 name: str = "proxy", seed: int | None = None) -> None:
        self.target = target
        self.listen_host = listen_host
        self.name = name
        self._random = random.Random(seed)
        self._faults = Faults()
        self._stats = ProxyStats()
        self._links: set[_Link] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._server: asyncio.Server | None = None
        self._flowing: dict[Direction, asyncio.Event] = {}
        self._changed: asyncio.Event | None = None
        self.port = 0

    # -- control, from the test's thread -----------------------------------------------------

    def start(self) -> Proxy:
        """Listen (on an ephemeral port, ``address()``) and return."""
        self._thread.start()
        self._call(self._listen())
        return self

    def address(self) -> tuple[str, int]:
        return self.listen_host, self.port

    @property
    def faults(self) -> Faults:
        return self._faults

    def delay(self, fixed: float, jitter: float = 0.0) -> None:
        self._set(replace(self._faults, delay=fixed, jitter=jitter))

    def drop(self) -> None:
        """Abort every link now and refuse new ones until ``heal``."""
        self._set(replace(self._faults, refuse=True))
        self._call(self._drop_links())

    def blackhole(self) -> None:
        self._set(replace(self._faults, held=frozenset(Direction)))

    def half_open(self, flowing: Direction) -> None:
        """Forward ``flowing`` only; hold the other direction."""
        self._set(replace(self._faults, held=frozenset(d for d in Direction if d != flowing)))

    def heal(self) -> None:
        self._set(Faults())

    def statistics(self) -> ProxyStats:
        stats = self._stats
        return replace(stats, active=len(self._links), bytes=dict(stats.bytes))

    def close(self) -> None:
        """Stop listening, abort every link, stop the loop's thread."""
        if not self._thread.is_alive():
            return
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=CONTROL_TIMEOUT)
        self._loop.close()

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _set(self, faults: Faults) -> None:
        self._call(self._apply(faults))

    def _call(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout=CONTROL_TIMEOUT)

    # -- on the loop ---------------------------------------------------------------------------

    async def _listen(self) -> None:
        self._flowing = {direction: asyncio.Event() for direction in Direction}
        self._changed = asyncio.Event()
        await self._apply(self._faults)
        self._server = await asyncio.start_server(self._serve, self.listen_host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _apply(self, faults: Faults) -> None:
        self._faults = faults
        for direction, event in self._flowing.items():
            if direction in faults.held:
                event.clear()
            else:
                event.set()
        assert self._changed is not None
        self._changed.set()  # delayed chunks re-read the delay
        self._changed = asyncio.Event()

    async def _drop_links(self) -> None:
        for link in list(self._links):
            link.abort()
            if link.task is not None:
                link.task.cancel()
            self._stats.dropped += 1

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [link.task for link in self._links if link.task is not None]
        await self._drop_links()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._stats.accepted += 1
        if self._faults.refuse:
            self._stats.refused += 1
            writer.transport.abort()
            return
        link = _Link(writer, task=asyncio.current_task())
        self._links.add(link)
        try:
            await self._flowing[Direction.TO_NODE].wait()  # a blackhole dials nothing
            await self._forward(link, reader)
        except asyncio.CancelledError:
            pass  # dropped: ending here keeps asyncio's stream callback from logging it
        finally:
            self._links.discard(link)
            link.abort()

    async def _forward(self, link: _Link, reader: asyncio.StreamReader) -> None:
        try:
            host, port = self.target()
            node_reader, link.node = await asyncio.open_connection(host, port)
        except OSError:
            self._stats.refused += 1
            return
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._pump(reader, link.node, Direction.TO_NODE))
                group.create_task(self._pump(node_reader, link.client, Direction.TO_CLIENT))
        except* OSError:
            pass  # either side failed: the link ends

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    direction: Direction) -> None:
        """Forward one direction until end of stream, then half-close the other side."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUED_CHUNKS)
        async with asyncio.TaskGroup() as group:
            group.create_task(self._read(reader, queue, direction))
            group.create_task(self._write(queue, writer, direction))

    async def _read(self, reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]],
                    direction: Direction) -> None:
        due = 0.0
        while True:
            await self._flowing[direction].wait()
            data = await reader.read(CHUNK)
            faults = self._faults
            wait = faults.delay + (self._random.uniform(0, faults.jitter) if faults.jitter else 0)
            due = max(due, time.monotonic() + wait)  # never before the previous chunk
            await queue.put((due, data))
            if not data:
                return

    async def _write(self, queue: asyncio.Queue[tuple[float, bytes]],
                     writer: asyncio.StreamWriter, direction: Direction) -> None:
        while True:
            due, data = await queue.get()
            await self._until(due)
            await self._flowing[direction].wait()
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            self._stats.bytes[direction] += len(data)
            await writer.drain()

    async def _until(self, due: float) -> None:
        """Wait until ``due``; a heal (any change of faults) ends a delay early."""
        assert self._changed is not None
        while (left := due - time.monotonic()) > 0 and self._faults.delay + self._faults.jitter:
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                return
