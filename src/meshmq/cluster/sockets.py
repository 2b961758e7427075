"""The mesh's I/O: abstract unix sockets between a node's workers, driving ``Mesh`` (mesh.py).

Theory of operation
-------------------
Every worker listens on ``\\0meshmq-{token}-{index}`` (nothing on disk, no path length limit)
and dials every worker with a higher index, so each pair has one link. A dial that fails, or a
dialed link that closes, is dialed again after a backoff (``Redial``: 10 ms doubling to 1 s),
as long as the peer is not linked. Bytes go to ``Mesh.data_received``; what the mesh queues is
written once per loop turn (``wake`` → ``flush``), one ``write`` per link. The transport's
write buffer limits are the mesh's congestion marks: ``pause_writing`` / ``resume_writing``
tell it. The mesh's deadlines come back as one loop timer (``schedule``).

This module has no protocol in it: every decision is the mesh's; this one only moves bytes and
time.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING

from meshmq.broker.transport.layer import stream_transport
from meshmq.cluster.mesh import WRITE_HIGH_WATER, WRITE_LOW_WATER

if TYPE_CHECKING:
    from meshmq.cluster.mesh import Mesh
    from meshmq.cluster.spec import WorkerSpec

log = logging.getLogger("meshmq.mesh")

LINK_TIMEOUT = 60.0  # seconds to link to every peer at start-up
REDIAL_FIRST = 0.01
REDIAL_MAX = 1.0


class MeshError(Exception):
    """The workers could not link; the message says which are missing."""


class Redial:
    """Backoff between dials of one peer: ``REDIAL_FIRST`` doubling up to ``REDIAL_MAX``,
    back to the start once linked."""

    def __init__(self) -> None:
        self._delays: dict[int, float] = {}

    def failed(self, peer: int) -> float:
        """A dial of ``peer`` failed (or its link closed): seconds before the next one."""
        delay = min(REDIAL_MAX, self._delays.get(peer, REDIAL_FIRST / 2) * 2)
        self._delays[peer] = delay
        return delay

    def linked(self, peer: int) -> None:
        self._delays.pop(peer, None)


class MeshSockets:
    """The ``MeshIO`` of one worker (cluster/mesh.py)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, worker: WorkerSpec) -> None:
        self.loop = loop
        self.worker = worker
        self.mesh: Mesh | None = None
        self.redial = Redial()
        self._transports: dict[int, asyncio.Transport] = {}
        self._dialed: dict[int, int] = {}  # link id -> the peer we dialed
        self._next_ident = 1
        self._server: asyncio.AbstractServer | None = None
        self._flush_pending = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = float("inf")
        self._linked = asyncio.Event()
        self.closing = False

    # ------------------------------------------------------------------ MeshIO

    def now(self) -> float:
        return self.loop.time()

    def wake(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self.flush)

    def schedule(self, when: float) -> None:
        if when >= self._timer_when and self._timer is not None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_when = when
        self._timer = self.loop.call_at(when, self._fire)

    def close_link(self, link: int) -> None:
        transport = self._transports.get(link)
        if transport is not None:
            transport.close()

    # ------------------------------------------------------------------ start and stop

    async def start(self, mesh: Mesh) -> None:
        """Listen, dial the higher indexes, and wait until every peer is linked."""
        self.mesh = mesh
        mesh.on_link_up.append(lambda peer, hello: self._on_linked(peer))
        mesh.on_link_down.append(self._on_unlinked)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.worker.link_address(self.worker.index))
        except OSError as error:
            sock.close()
            raise MeshError(f"cannot listen for links worker={self.worker.index}: "
                            f"{error.strerror or error}") from None
        sock.listen(64)
        sock.setblocking(False)
        self._server = await self.loop.create_unix_server(lambda: _Link(self, None), sock=sock)
        for peer in range(self.worker.index + 1, self.worker.count):
            self._dial(peer)
        if mesh.all_linked():
            self._linked.set()
        try:
            await asyncio.wait_for(self._linked.wait(), LINK_TIMEOUT)
        except TimeoutError:
            missing = sorted(set(range(self.worker.count)) - set(mesh.peers)
                             - {self.worker.index})
            raise MeshError(f"worker {self.worker.index} could not link to workers {missing} "
                            f"within {LINK_TIMEOUT:.0f} s") from None

    def close(self) -> None:
        self.closing = True
        if self.mesh is not None:
            self.mesh.close()
        self.flush()
        if self._server is not None:
            self._server.close()
        for transport in list(self._transports.values()):
            transport.close()
        if self._timer is not None:
            self._timer.cancel()

    # ------------------------------------------------------------------ links

    def _dial(self, peer: int) -> None:
        if self.closing or (self.mesh is not None and peer in self.mesh.peers):
            return
        self.loop.create_task(self._connect(peer))

    async def _connect(self, peer: int) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await self.loop.sock_connect(sock, self.worker.link_address(peer))
            await self.loop.create_unix_connection(lambda: _Link(self, peer), sock=sock)
        except OSError as error:
            log.debug("dial failed peer=%d error=%r", peer, str(error))
            sock.close()
            if not self.closing:
                self.loop.call_later(self.redial.failed(peer), self._dial, peer)

    def _opened(self, link: _Link, transport: asyncio.Transport) -> None:
        ident = link.ident = self._next_ident
        self._next_ident += 1
        self._transports[ident] = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)
        if link.peer is not None:
            self._dialed[ident] = link.peer
        assert self.mesh is not None
        self.mesh.link_opened(ident, link.peer)

    def _closed(self, ident: int) -> None:
        self._transports.pop(ident, None)
        peer = self._dialed.pop(ident, None)
        if self.mesh is not None:
            self.mesh.link_closed(ident)
            # Ours to dial again, also when a dial reached a dying peer and was dropped
            # before HELLO (its old listening socket can still accept while it exits).
            if peer is not None and not self.closing and peer not in self.mesh.peers:
                self.loop.call_later(self.redial.failed(peer), self._dial, peer)

    def _on_linked(self, peer: int) -> None:
        self.redial.linked(peer)
        if self.mesh is not None and self.mesh.all_linked():
            self._linked.set()

    def _on_unlinked(self, peer: int) -> None:
        if peer > self.worker.index and not self.closing:
            self._dial(peer)

    # ------------------------------------------------------------------ bytes and time

    def flush(self) -> None:
        """Write what the mesh queued, one ``write`` per link."""
        self._flush_pending = False
        if self.mesh is None:
            return
        for ident, data in self.mesh.data_to_send().items():
            transport = self._transports.get(ident)
            if transport is not None and not transport.is_closing():
                transport.write(data)

    def _fire(self) -> None:
        self._timer = None
        self._timer_when = float("inf")
        if self.mesh is not None:
            self.mesh.expire(self.loop.time())


class _Link(asyncio.Protocol):
    """One socket of the mesh."""

    def __init__(self, sockets: MeshSockets, peer: int | None) -> None:
        self.sockets = sockets
        self.peer = peer
        self.ident = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.sockets._opened(self, stream_transport(transport))

    def data_received(self, data: bytes) -> None:
        mesh = self.sockets.mesh
        if mesh is not None:
            mesh.data_received(self.ident, data)

    def pause_writing(self) -> None:
        """More than WRITE_HIGH_WATER waits for the peer: the mesh's link is congested."""
        if self.sockets.mesh is not None:
            self.sockets.mesh.link_written(self.ident, WRITE_HIGH_WATER)

    def resume_writing(self) -> None:
        if self.sockets.mesh is not None:
            self.sockets.mesh.link_written(self.ident, WRITE_LOW_WATER)

    def connection_lost(self, exc: Exception | None) -> None:
        self.sockets._closed(self.ident)
