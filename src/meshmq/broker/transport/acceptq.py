"""When a listening socket needs more accept handles: the accept queue, watched at accept.

Theory of operation
-------------------
libuv, under uvloop, accepts one connection per listening handle per loop turn (libuv PR
3696). In a storm that is a loop turn per connection (an ``epoll_wait``, an ``io_uring_enter``
and the loop's own work), while the rest wait in the kernel's accept queue. More handles on the
same socket (``dup`` descriptors, each its own asyncio server: see ``listeners.py``) take up to
one connection each per turn, but when connections arrive one at a time every handle is woken
for each and all but one get EAGAIN from ``accept4``: measured, that made a lone connection
cost 1.7 times the CPU. So the extra handles are opened only while connections queue.

``AcceptQueueWatch`` decides, sans I/O, from what the listener tells it at accept time: at most
once per ``interval`` the listener reads the accept queue's length (``queued_connections``:
Linux ``TCP_INFO``, whose ``tcpi_unacked`` is the backlog of a listening socket) and reports
it. ``WIDEN_AT`` connections waiting open the extra handles; they close again once every look
for ``calm`` seconds found the queue empty. A look happens only when a connection is accepted,
so with no connections at all nothing is looked at and nothing changes (idle handles cost
nothing). Where ``TCP_INFO`` is missing the listener keeps one handle, as before.
"""

from __future__ import annotations

import socket
import struct
from enum import Enum

WIDEN_AT = 4  # connections waiting in the accept queue that open the extra handles
CHECK_INTERVAL = 0.01  # seconds between looks at the accept queue (only ever at an accept)
CALM = 1.0  # seconds of an empty queue at every look before the extra handles close

# struct tcp_info (linux/tcp.h): 8 single bytes, then 32-bit fields (rto, ato, snd_mss,
# rcv_mss, unacked, ...); tcpi_unacked of a listening socket is its accept queue's length.
_TCP_INFO = struct.Struct("8x5I")
_TCP_INFO_LEVEL = getattr(socket, "TCP_INFO", None)


class Change(Enum):
    WIDEN = "widen"  # open the extra handles
    NARROW = "narrow"  # close them


class AcceptQueueWatch:
    """Whether a listening socket should be polled by extra handles (module docstring)."""

    __slots__ = ("_calm_since", "calm", "interval", "next_look", "widened")

    def __init__(self, interval: float = CHECK_INTERVAL, calm: float = CALM) -> None:
        self.interval = interval
        self.calm = calm
        self.next_look = 0.0  # loop time of the next look (the accept path compares)
        self.widened = False
        self._calm_since: float | None = None  # first look of the current empty run

    def looked(self, now: float, queued: int) -> Change | None:
        """The accept queue held ``queued`` connections at ``now``: what to change, if
        anything."""
        self.next_look = now + self.interval
        if queued >= WIDEN_AT:
            self._calm_since = None
            if not self.widened:
                self.widened = True
                return Change.WIDEN
            return None
        if queued:
            self._calm_since = None  # still busy: not calm yet
            return None
        if not self.widened:
            return None
        if self._calm_since is None:
            self._calm_since = now
        elif now - self._calm_since >= self.calm:
            self.widened = False
            self._calm_since = None
            return Change.NARROW
        return None


def can_watch() -> bool:
    """Whether this platform tells the accept queue's length (Linux ``TCP_INFO``)."""
    return _TCP_INFO_LEVEL is not None


def queued_connections(sock: socket.socket) -> int:
    """Connections waiting in the accept queue of the listening TCP socket ``sock``."""
    assert _TCP_INFO_LEVEL is not None
    info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO_LEVEL, _TCP_INFO.size)
    return int(_TCP_INFO.unpack_from(info)[4])
