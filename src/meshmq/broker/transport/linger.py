"""Closing a connection so that the peer can read our last words.

When the broker ends a connection (CONNACK refusal, DISCONNECT with a reason code, shutdown)
the peer may still be sending: PUBRELs in flight, a SUBSCRIBE pipelined behind its CONNECT.
Closing a TCP socket that holds unread input makes the kernel send a reset instead of a FIN,
and a reset discards whatever of ours the peer has not read yet: the CONNACK or DISCONNECT
that says why is lost. So we close in two steps:

1. shut our side for writing once what we wrote is flushed (``write_eof``: a FIN after the
   last byte), so the peer reads everything we sent, then end of stream;
2. keep reading, and drop, what the peer still sends, until it closes its side (EOF), or
   ``LINGER_BYTES`` have arrived, or ``LINGER_SECONDS`` have passed; then close the socket.

The bounds keep a peer that never stops from holding a socket: at worst a closing connection
costs ``LINGER_SECONDS`` of a socket and ``LINGER_BYTES`` of reading. The time bound needs no
timer per socket: every socket lingers the same ``LINGER_SECONDS``, so the order in which they
start lingering is the order of their deadlines. One queue per event loop keeps them in that
order with one loop timer, set for the oldest (``LingerDeadlines``): a storm of refusals or a
mass disconnect costs a deque entry per socket, not a libuv timer each. ``Linger`` takes over a
TCP transport's protocol for that time and hands ``connection_lost`` on to the protocol it
replaced (the layers above learn of the socket's end as before). The layers with a closing
handshake do theirs first: TLS sends close_notify, WebSocket a close frame (tls.py,
websocket.py), then their socket lingers the same way.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from meshmq.broker.transport.layer import StackedLayer

LINGER_SECONDS = 2.0  # longest a closing connection keeps reading what the peer still sends
LINGER_BYTES = 1_048_576  # most it reads (and drops) from that peer before closing anyway
# How late past its deadline a lingering socket may be cut off: the queue's one timer wakes
# once per this much, for every deadline that has come by then (not once per socket).
LINGER_SLACK = 0.05


def close_gracefully(transport: Any) -> None:
    """Close ``transport`` so the peer can read what was written to it: a stacked layer (TLS,
    WebSocket) runs its closing handshake and lingers on its socket; a socket lingers itself.
    Idempotent."""
    if isinstance(transport, StackedLayer):
        transport.close()  # graceful, and it ends here again for its own socket
        return
    protocol = transport.get_protocol()
    if not isinstance(protocol, Linger) and not transport.is_closing():
        Linger(transport, protocol).start()


class LingerDeadlines:
    """The sockets lingering on one event loop, oldest first, and the one timer for them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waiting: deque[tuple[float, Linger]] = deque()  # (deadline, linger), in order
        self._timer: asyncio.TimerHandle | None = None

    def add(self, linger: Linger) -> None:
        deadline = self.loop.time() + LINGER_SECONDS
        self.waiting.append((deadline, linger))
        if self._timer is None:
            self._timer = self.loop.call_at(deadline + LINGER_SLACK, self._due)

    def _due(self) -> None:
        self._timer = None
        waiting, now = self.waiting, self.loop.time()
        while waiting and waiting[0][0] <= now:
            waiting.popleft()[1].give_up()
        if waiting:  # (a timer may fire a little early: then the oldest is not due yet)
            self._timer = self.loop.call_at(waiting[0][0] + LINGER_SLACK, self._due)


_deadlines: LingerDeadlines | None = None  # the running loop's (a new loop makes its own)


def _deadlines_of(loop: asyncio.AbstractEventLoop) -> LingerDeadlines:
    """``loop``'s queue. Loops in other threads each get their own (the cached one is only
    the last one used; a local keeps another thread's swap from handing over the wrong one)."""
    global _deadlines
    deadlines = _deadlines
    if deadlines is None or deadlines.loop is not loop:
        deadlines = _deadlines = LingerDeadlines(loop)
    return deadlines


class Linger(asyncio.Protocol):
    """The protocol of a socket being closed: half-closed, draining the peer, bounded."""

    __slots__ = ("dropped", "previous", "transport")

    def __init__(self, transport: asyncio.Transport, previous: asyncio.BaseProtocol) -> None:
        # Both None once the socket is gone: the deadline queue may hold this a while longer.
        self.transport: asyncio.Transport | None = transport
        self.previous: asyncio.BaseProtocol | None = previous  # told of connection_lost
        self.dropped = 0

    def start(self) -> None:
        transport = self.transport
        assert transport is not None
        transport.set_protocol(self)
        _deadlines_of(asyncio.get_running_loop()).add(self)
        if transport.can_write_eof():
            transport.write_eof()  # FIN once the write buffer is flushed
        if not transport.is_reading():
            transport.resume_reading()  # flow control paused it: now we only drop input

    def data_received(self, data: bytes) -> None:
        self.dropped += len(data)
        if self.dropped > LINGER_BYTES:
            self.give_up()

    def eof_received(self) -> bool:
        return False  # the peer is done too: the transport closes (after our FIN)

    def give_up(self) -> None:
        """A bound is reached (``LINGER_BYTES`` here, ``LINGER_SECONDS`` in
        ``LingerDeadlines``): close now, even if output is still unread (abort: a peer that
        reads nothing must not keep the socket through ``close()``'s wait for the buffer).
        Nothing to do if the socket is gone already."""
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        previous, self.previous, self.transport = self.previous, None, None
        if previous is not None:
            previous.connection_lost(exc)

    def pause_writing(self) -> None:
        pass  # nothing is written any more

    def resume_writing(self) -> None:
        pass
