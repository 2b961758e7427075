"""One link to a peer router: an asyncio protocol that frames bytes for the mesh.

Outgoing frames are queued and written once per loop turn (one ``write`` for every FORWARD of
a burst); incoming bytes go through ``FrameReader`` and each frame to ``Mesh.on_frame``. When
more than ``WRITE_HIGH_WATER`` bytes wait for a peer (it is stopped, or slower than this
worker's clients), the worker stops reading its clients until the backlog drains below
``WRITE_LOW_WATER``: nothing is dropped and memory stays bounded. A
``LinkError`` (bytes that are not the link protocol) closes the link; the mesh then treats the
peer as gone until it links again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from meshmq.cluster.codec import FrameReader, LinkError

if TYPE_CHECKING:
    from meshmq.cluster.mesh import Mesh

log = logging.getLogger("meshmq.link")

WRITE_HIGH_WATER = 16 * 1024 * 1024  # bytes queued to a peer before its link counts as slow
WRITE_LOW_WATER = 4 * 1024 * 1024  # ... and after which it no longer does


class Link(asyncio.Protocol):
    """A connection to peer ``peer`` (known at once when we dialed, after HELLO otherwise)."""

    def __init__(self, mesh: Mesh, peer: int | None) -> None:
        self.mesh = mesh
        self.peer = peer
        self.ready = False  # HELLO received
        self.transport: asyncio.Transport | None = None
        self._reader = FrameReader()
        self._out: list[bytes] = []
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.set_write_buffer_limits(  # type: ignore[union-attr]
            high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)
        self.mesh.link_made(self)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
            for frame_type, body in frames:
                if self.closed:
                    return
                self.mesh.on_frame(self, frame_type, body)
        except LinkError as error:
            log.error("link protocol error peer=%s error=%r: closing the link", self.peer,
                      str(error))
            self.close()

    def send(self, frame: bytes) -> None:
        if self.closed:
            return
        out = self._out
        if not out:
            self.mesh.loop.call_soon(self.flush)
        out.append(frame)

    def flush(self) -> None:
        out = self._out
        if not out or self.transport is None or self.closed:
            return
        self._out = []
        self.transport.write(b"".join(out) if len(out) > 1 else out[0])

    def pause_writing(self) -> None:
        """The peer is not reading fast enough: stop taking client input until it catches up
        (lossless backpressure, as for one slow connection)."""
        self.mesh.link_congested(self, True)

    def resume_writing(self) -> None:
        self.mesh.link_congested(self, False)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.flush()
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.mesh.link_congested(self, False)
        self.mesh.link_lost(self)
