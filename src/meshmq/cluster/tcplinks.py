"""The I/O of the links between nodes: TCP, the cluster port, dialing every other node.

Theory of operation
-------------------
Every worker of a node listens on the node's cluster port (``cluster.listen``; the workers
share it with SO_REUSEPORT, so the kernel gives each incoming link to one of them) and dials
every other node it knows once: the seeds (``cluster.seeds``) at start, then the nodes their
``MEMBERS`` frames name. A dial that fails, a link that drops or one the other end refused is
dialed again after a backoff (0.1 s doubling to 5 s), as long as no link to that node is up.
An address that turned out to be this node itself (a seed list that names it) is dropped.

Bytes and time go to the worker's ``Mesh`` as for its local links (cluster/sockets.py): the
handshake, the checks of the secret and everything after are the mesh's (cluster/nodes.py);
this module only moves bytes. TCP_NODELAY is set: the mesh writes once per loop turn anyway.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING

from meshmq.broker.transport.layer import stream_transport
from meshmq.cluster.mesh import SOCKET_HIGH_WATER, SOCKET_LOW_WATER
from meshmq.config import split_listen

if TYPE_CHECKING:
    from meshmq.cluster.mesh import Mesh
    from meshmq.cluster.nodes import NodeLinks
    from meshmq.cluster.sockets import MeshSockets

log = logging.getLogger("meshmq.cluster")

REDIAL_FIRST = 0.1
REDIAL_MAX = 5.0


class NodeSockets:
    """One worker's TCP links to the other nodes (see the module docstring). Link ids come
    from the worker's ``MeshSockets``, which also writes the mesh's output and runs its timer:
    one I/O layer for the mesh, whichever kind of socket a link is."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local: MeshSockets,
                 links: NodeLinks, listen: str, seeds: tuple[str, ...],
                 sock: socket.socket | None = None) -> None:
        self.loop = loop
        self.local = local
        self.links = links
        self.listen = listen
        self.sock = sock  # the node's reserved socket for the cluster port, if any
        self.addresses: dict[str, str | None] = dict.fromkeys(seeds)  # address -> node id
        self._delays: dict[str, float] = {}
        self._dialing: set[str] = set()
        self._by_ident: dict[int, str] = {}  # link id -> the address it dialed
        self._server: asyncio.AbstractServer | None = None
        self.closing = False
        links.on_members = self._learned
        links.on_node_up.append(self._node_up)
        links.on_forget.append(self._forget)

    @property
    def mesh(self) -> Mesh:
        return self.links.mesh

    async def start(self) -> None:
        """Listen on the cluster port, and dial the seeds."""
        host, port = split_listen(self.listen)
        if self.sock is not None:
            self.sock.listen(128)
            self.sock.setblocking(False)
            self._server = await self.loop.create_server(
                lambda: _NodeLink(self, None), sock=self.sock)
        else:
            self._server = await self.loop.create_server(
                lambda: _NodeLink(self, None), host, port, reuse_port=True)
        for address in list(self.addresses):
            self._dial(address)

    def bound_port(self) -> int:
        sockets = getattr(self._server, "sockets", None)  # (asyncio's and uvloop's servers)
        assert sockets
        return int(sockets[0].getsockname()[1])

    def close(self) -> None:
        self.closing = True
        if self._server is not None:
            self._server.close()

    # ------------------------------------------------------------------ dialing

    def _learned(self, members: list[tuple[str, str]]) -> None:
        for node_id, address in members:
            if address not in self.addresses:
                self.addresses[address] = node_id
            self._dial(address)

    def _linked_to(self, address: str) -> bool:
        node_id = self.addresses.get(address)
        if node_id is None:
            return False
        return self.links.dialed(node_id) is not None

    def _forget(self, node_id: str) -> None:
        """``node_id`` left: its addresses are not dialed again (a dial under way ends)."""
        for address in [a for a, known in self.addresses.items() if known == node_id]:
            del self.addresses[address]
            self._delays.pop(address, None)

    def _gone(self, address: str) -> bool:
        """The node at ``address`` left (or the address was dropped with it)."""
        return address not in self.addresses or self.addresses[address] in self.links.forgotten

    def _dial(self, address: str) -> None:
        if self.closing or address in self._dialing or self._linked_to(address) \
                or self._gone(address):
            return
        if address == self.links.identity.address:
            return  # this node itself
        self._dialing.add(address)
        self.loop.create_task(self._connect(address))

    async def _connect(self, address: str) -> None:
        host, port = split_listen(address)
        try:
            await self.loop.create_connection(lambda: _NodeLink(self, address), host, port)
        except OSError as error:
            log.debug("dial failed address=%s error=%r", address, str(error))
            self._dialing.discard(address)
            self._again(address)

    def _again(self, address: str) -> None:
        if self.closing or self._linked_to(address) or self._gone(address):
            return
        delay = min(REDIAL_MAX, self._delays.get(address, REDIAL_FIRST / 2) * 2)
        self._delays[address] = delay
        self.loop.call_later(delay, self._dial, address)

    def _node_up(self, peer: int, node_id: str) -> None:
        link = self.mesh.remote.get(peer)
        address = self._by_ident.get(link.ident) if link is not None else None
        if address is not None:
            self.addresses[address] = node_id
            self._delays.pop(address, None)

    # ------------------------------------------------------------------ links

    def opened(self, link: _NodeLink, transport: asyncio.Transport) -> None:
        ident = link.ident = self.local.new_ident()
        self.local.attach(ident, transport)
        transport.set_write_buffer_limits(high=SOCKET_HIGH_WATER, low=SOCKET_LOW_WATER)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if link.address is not None:
            self._by_ident[ident] = link.address
            self._dialing.discard(link.address)
        self.mesh.remote_opened(ident, dialed=link.address is not None)

    def closed(self, link: _NodeLink) -> None:
        self.local.detach(link.ident)
        state = self.mesh.link(link.ident)
        hello = state.remote.hello if state is not None and state.remote is not None else None
        self.mesh.link_closed(link.ident)
        address = self._by_ident.pop(link.ident, None)
        if address is not None and hello is not None and address in self.addresses:
            self.addresses[address] = hello.node_id  # (this node itself: not dialed again)
        if address is not None and not self.closing:
            if self.addresses.get(address) == self.links.identity.node_id:
                return  # it was this node itself
            self._again(address)


class _NodeLink(asyncio.Protocol):
    """One TCP link with another node (``address``: the one this worker dialed)."""

    def __init__(self, sockets: NodeSockets, address: str | None) -> None:
        self.sockets = sockets
        self.address = address
        self.ident = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.sockets.opened(self, stream_transport(transport))

    def data_received(self, data: bytes) -> None:
        self.sockets.mesh.data_received(self.ident, data)

    def pause_writing(self) -> None:
        self.sockets.mesh.link_paused(self.ident, True)

    def resume_writing(self) -> None:
        self.sockets.mesh.link_paused(self.ident, False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.sockets.closed(self)
