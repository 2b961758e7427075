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
costs ``LINGER_SECONDS`` of a socket and ``LINGER_BYTES`` of reading. ``Linger`` takes over a
TCP transport's protocol for that time and hands ``connection_lost`` on to the protocol it
replaced (the layers above learn of the socket's end as before). The layers with a closing
handshake do theirs first: TLS sends close_notify, WebSocket a close frame (tlslayer.py,
websocket.py), then their socket lingers the same way.
"""

from __future__ import annotations

import asyncio
from typing import Any

from meshmq.broker.layer import StackedLayer

LINGER_SECONDS = 2.0  # longest a closing connection keeps reading what the peer still sends
LINGER_BYTES = 1_048_576  # most it reads (and drops) from that peer before closing anyway


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


class Linger(asyncio.Protocol):
    """The protocol of a socket being closed: half-closed, draining the peer, bounded."""

    def __init__(self, transport: asyncio.Transport, previous: asyncio.BaseProtocol) -> None:
        self.transport = transport
        self.previous = previous  # told of connection_lost, as if it had stayed
        self.dropped = 0
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        transport = self.transport
        transport.set_protocol(self)
        self._timer = asyncio.get_running_loop().call_later(LINGER_SECONDS, self._give_up)
        if transport.can_write_eof():
            transport.write_eof()  # FIN once the write buffer is flushed
        if not transport.is_reading():
            transport.resume_reading()  # flow control paused it: now we only drop input

    def data_received(self, data: bytes) -> None:
        self.dropped += len(data)
        if self.dropped > LINGER_BYTES:
            self._give_up()

    def eof_received(self) -> bool:
        return False  # the peer is done too: the transport closes (after our FIN)

    def _give_up(self) -> None:
        """A bound is reached: close now, even if output is still unread (abort: a peer that
        reads nothing must not keep the socket through ``close()``'s wait for the buffer)."""
        self._timer = None
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.previous.connection_lost(exc)

    def pause_writing(self) -> None:
        pass  # nothing is written any more

    def resume_writing(self) -> None:
        pass
