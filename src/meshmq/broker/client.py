"""A client connection as the core sees it: ``ClientHandle``.

The I/O layer (broker/transport/) makes one object per client connection, its asyncio
protocol (``ClientProtocol``), and hands it to the core with each batch of packets. The core
(the broker, its handlers, sessions and queries) never imports the I/O layer: it uses only what
``ClientHandle`` names, so a handler can be driven in a test by a small fake connection.

A handle's life: made at accept (``Broker.await_connect``), CONNECT handled (``session`` and
``client_id`` set, ``connected()`` once CONNACK is queued), packets handled until the
connection ends; then ``gone`` is true and the broker hears ``connection_lost`` once. Output is
queued on ``conn`` (the sans-I/O ``ServerConnection``) and written when the handle is woken.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol, TypeGuard, runtime_checkable

from meshmq.broker.session import ClientLink

if TYPE_CHECKING:
    from meshmq.broker.counters import Counters
    from meshmq.broker.session import Session
    from meshmq.mqtt.packets import Packet

log = logging.getLogger("meshmq.broker")


@runtime_checkable
class ClientHandle(ClientLink, Protocol):
    """What the core uses of a client connection: ``ClientLink`` (what a session uses) and
    what the packet handlers use."""

    session: Session | None  # set by CONNECT
    client_id: str  # set by CONNECT (assigned when the client sent none)
    peer: str  # "host:port"
    connected_at: float  # wall clock of the accept (the admin API shows it)
    rejected: bool  # refused or in violation: the rest of its packets are ignored
    closing: bool  # close() was called: nothing more is written or read
    gone: bool  # the connection is over; late callbacks must leave it alone
    held: list[Packet] | None  # packets waiting while CONNECT is authenticated (``hold``)
    close_reason: str  # why the connection ends, for the "client disconnected" line
    # Read by the broker's timer wheel (deadlines.py):
    keep_alive_limit: float  # 1.5 x the Keep Alive once connected; 0: none (yet)
    last_read: float  # loop time of the last read

    def close(self) -> None:
        """Write what is queued on ``conn``, then close gracefully; the broker hears
        ``connection_lost`` on a later loop turn."""

    def flush(self) -> None:
        """Write what is queued on ``conn`` now."""

    def hold(self) -> None:
        """Stop reading and keep later packets in ``held`` (CONNECT is being checked)."""

    def release(self) -> None:
        """Hand the held packets to the broker and read again."""

    def connected(self, keep_alive: int) -> None:
        """CONNACK queued: the CONNECT deadline gives way to the keep-alive check."""

    def deadline_passed(self) -> None:
        """The broker's timer wheel: no CONNECT in time, or silent too long."""

    def pause_input(self, reason: str, paused: bool) -> None:
        """Stop (or resume) reading this connection for ``reason``."""


_HANDLE_CLASSES: set[type] = set()  # classes whose instances passed ``is_handle``


def is_handle(client: ClientLink | None) -> TypeGuard[ClientHandle]:
    """Is ``client``, a session's, a connection (a ``ClientHandle``)? Always, when not None:
    a session's ``client`` is typed ``ClientLink`` (what the session uses), and the broker
    attaches only handles (connects.py). The structural check (every member looked up, some
    100 us) runs once per class: a handle's constructor sets every member."""
    if client is None:
        return False
    kind = type(client)
    if kind in _HANDLE_CLASSES:
        return True
    if not isinstance(client, ClientHandle):
        return False
    _HANDLE_CLASSES.add(kind)
    return True


def protocol_violation(client: ClientHandle, counters: Counters, code: int, why: str) -> None:
    """A rule checked above the codec was broken: count it, tell the client (DISCONNECT with
    ``code``; 3.1.1 gets no DISCONNECT) and close."""
    counters.protocol_errors += 1
    log.info("protocol error client_id=%s reason=0x%02X why=%r", client.client_id, code, why)
    client.close_reason = f"protocol error 0x{code:02X}: {why}"
    client.rejected = True
    client.conn.send_disconnect(code)
    client.close()
