"""The mesh's I/O: abstract unix sockets between a node's workers, driving ``Mesh`` (mesh.py).

Theory of operation
-------------------
Every worker listens on ``\\0meshmq-{token}-{index}`` (nothing on disk, no path length limit)
and dials every worker with a higher index, so each pair has one link. A dial that fails, or a
dialed link that closes, is dialed again after a backoff (``Redial``: 10 ms doubling to 1 s),
as long as the peer is not linked. Bytes go to ``Mesh.data_received``; what the mesh queues is
written once per loop turn (``wake`` → ``flush``), one ``write`` per link. The transport's
write buffer limits tell the mesh when its data must wait (``pause_writing`` /
``resume_writing`` → ``Mesh.link_paused``). The mesh's deadlines come back as one loop timer
(``schedule`` sets it).

Who is at the other end. An abstract socket's name is visible to every local user
(``/proc/net/unix``), so the name proves nothing: every link, accepted or dialed, is checked
with the kernel's peer credentials (``SO_PEERCRED``) before the mesh hears of it. The peer must
run as this process's user and be a child of this worker's supervisor (its parent process is
ours), or be this very process (tests run several meshes in one). Anything else is logged and
closed before a byte of it is read; a squatter on a peer's name is refused the same way.

Start. A worker waits up to ``LINK_WAIT`` for every peer, then serves with those it reached
and links the others when they come (a stopped peer, which accepts but never says HELLO, is
dropped by the mesh's handshake timeout and dialed again): the partitions it leads are offline
meanwhile, as when it is down.

This module has no protocol in it: every decision is the mesh's; this one only moves bytes and
time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from typing import TYPE_CHECKING

from meshmq.broker.transport.layer import stream_transport
from meshmq.cluster.mesh import SOCKET_HIGH_WATER, SOCKET_LOW_WATER

if TYPE_CHECKING:
    from meshmq.cluster.mesh import Mesh
    from meshmq.cluster.spec import WorkerSpec

log = logging.getLogger("meshmq.mesh")

LINK_WAIT = 10.0  # seconds a starting worker waits for every peer before it serves anyway
REDIAL_FIRST = 0.01
REDIAL_MAX = 1.0


class MeshError(Exception):
    """The worker cannot listen for links; the message says why."""


_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def parent_of(pid: int) -> int | None:
    """``pid``'s parent process id (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last
    return int(text[text.rindex(b")") + 2:].split()[1])


def refuse_peer(sock: socket.socket | None) -> str | None:
    """Why the process at the other end of ``sock`` may not join this worker's mesh (None:
    it may): it must run as our user and be our supervisor's child, or be this process."""
    if sock is None:
        return "is unknown (no socket to ask)"
    pid, uid, _ = _CREDENTIALS.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
    if uid != os.getuid():
        return f"pid={pid} uid={uid} runs as another user"
    if pid != os.getpid() and parent_of(pid) != os.getppid():
        return f"pid={pid} uid={uid} is not a worker of this node"
    return None


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
        if self._timer is not None:
            self._timer.cancel()
        self._timer_when = when
        self._timer = self.loop.call_at(when, self._fire)

    def close_link(self, link: int, last: bytes = b"") -> None:
        transport = self._transports.get(link)
        if transport is not None:
            if last:
                transport.write(last)  # (close() flushes it first)
            transport.close()

    # ------------------------------------------------------------------ start and stop

    async def start(self, mesh: Mesh) -> None:
        """Listen, dial the higher indexes, and wait until every peer is linked or
        ``LINK_WAIT`` has passed (the others are linked when they come)."""
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
            await asyncio.wait_for(self._linked.wait(), LINK_WAIT)
        except TimeoutError:
            missing = sorted(set(range(self.worker.count)) - set(mesh.peers)
                             - {self.worker.index})
            log.warning("worker %d serves without workers %s, not linked within %.0f s: "
                        "their partitions are offline until they link", self.worker.index,
                        missing, LINK_WAIT)

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

    def new_ident(self) -> int:
        """A link id for a link of another kind this layer writes for (cluster/tcplinks.py)."""
        ident = self._next_ident
        self._next_ident += 1
        return ident

    def attach(self, ident: int, transport: asyncio.Transport) -> None:
        self._transports[ident] = transport

    def detach(self, ident: int) -> None:
        self._transports.pop(ident, None)

    def _opened(self, link: _Link, transport: asyncio.Transport) -> None:
        ident = link.ident = self._next_ident
        self._next_ident += 1
        if link.peer is not None:
            self._dialed[ident] = link.peer
        why = refuse_peer(transport.get_extra_info("socket"))
        if why is not None:
            log.error("link refused: the process at the other end %s (worker=%d)", why,
                      self.worker.index)
            link.refused = True
            transport.close()  # connection_lost: a dialed peer is dialed again later
            return
        self._transports[ident] = transport
        transport.set_write_buffer_limits(high=SOCKET_HIGH_WATER, low=SOCKET_LOW_WATER)
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
        when = self._timer_when
        self._timer = None
        self._timer_when = float("inf")
        if self.mesh is not None:  # (a loop may run a timer up to its clock's resolution early)
            self.mesh.expire(max(self.loop.time(), when))


class _Link(asyncio.Protocol):
    """One socket of the mesh."""

    def __init__(self, sockets: MeshSockets, peer: int | None) -> None:
        self.sockets = sockets
        self.peer = peer
        self.ident = 0
        self.refused = False  # the peer's credentials were refused: nothing is read

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.sockets._opened(self, stream_transport(transport))

    def data_received(self, data: bytes) -> None:
        mesh = self.sockets.mesh
        if mesh is not None and not self.refused:
            mesh.data_received(self.ident, data)

    def pause_writing(self) -> None:
        """More than SOCKET_HIGH_WATER waits in the socket: the mesh holds its data."""
        if self.sockets.mesh is not None:
            self.sockets.mesh.link_paused(self.ident, True)

    def resume_writing(self) -> None:
        if self.sockets.mesh is not None:
            self.sockets.mesh.link_paused(self.ident, False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.sockets._closed(self.ident)
