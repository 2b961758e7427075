"""Plain TCP connections on one epoll set per event loop, instead of a uvloop transport each.

Why: an idle MQTT connection is mostly its transport. uvloop's ``TCPTransport`` with its libuv
handle, the loop's fd -> transport weak entry and its bound ``data_received`` cost about
1,200 bytes per connection; a ``TcpStream`` here is a slotted object holding the socket's
descriptor and an entry in one dict, about 200 (docs/benchmarks.md, "Per connection"). The
TLS and WebSocket listeners keep uvloop's transports (their layers cost more than that anyway).

How: the ``tcp`` listener accepts on its own (``TcpAcceptor``, up to ``ACCEPTS_PER_TURN`` a loop
turn, where libuv takes one per handle) and registers each socket in its loop's
``StreamPoller``: a level-triggered ``select.epoll`` whose own descriptor the event loop
watches (``add_reader``). When it is readable, one callback polls it without waiting and serves
every ready socket: one read each (``os.read``), handed to the protocol as uvloop would. A
write goes straight to the socket (``os.write``); what the kernel does not take waits in the
stream's buffer and goes out when the socket is writable, with ``pause_writing`` and
``resume_writing`` at the buffer limits, as in asyncio.

Pausing reading is lazy: ``pause_reading`` only sets a flag, and the socket leaves the epoll
set when an event comes while it is paused. A pause ended in the same loop turn (the protocol
pauses while it parses a large read over several turns) then costs no system call. A socket
with nothing to wait for leaves the set altogether: epoll reports a hang-up even to a socket
that asked for no event, and a paused one must not be woken again and again.

A busy connection moves to a transport of the event loop (``_promote``): per read and write
this Python costs about 0.5 to 1 us more than uvloop's C (an echo of one message at a time,
100 connections), which a busy connection would pay on every packet, while the memory it
saves matters for the many idle ones. A stream read or written in ``BUSY_AFTER`` poller
callbacks in a row (each at most ``BUSY_GAP`` after the one before) hands its socket over
through a duplicate descriptor and ``loop.connect_accepted_socket``; its protocol only gets a
new ``transport`` (``replace_transport``). An idle client, a CONNECT and a PINGREQ a minute,
stays here.

Each stream is the asyncio ``Transport`` of its protocol (``write``, ``close``, ``abort``,
``write_eof``, ``pause_reading``, ``set_protocol``...), so the protocols above (``ClientProtocol``,
the gate that refuses, ``Linger``) do not know the difference. Errors and the end of the
connection come as with asyncio: ``eof_received``, then ``connection_lost`` on the next turn.
When the loop's run ends (``asyncio.run`` cancels the tasks left), the streams still open are
closed, as uvloop closes its transports with the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import select
import socket
import struct
import termios
from collections.abc import Callable
from functools import partial
from typing import Any

from meshmq.broker.transport.layer import stream_transport

log = logging.getLogger("meshmq.listener")

READ_SIZE = 65536  # most bytes taken from one socket per event (then the next socket's turn)
POLL_EVENTS = 1024  # sockets served per callback at most; the rest stay ready for the next
ACCEPTS_PER_TURN = 16  # connections accepted per loop turn at most (a storm shares the turns)
ACCEPT_BACKOFF = 0.1  # seconds without accepting after running out of descriptors
# A stream read or written in this many callbacks of the poller, each at most BUSY_GAP
# callbacks after the one before, is busy: it moves to a transport of the event loop's own
# (``_promote``). An idle client (a CONNECT, then a PINGREQ a minute) never gets there.
BUSY_AFTER = 16
BUSY_GAP = 2
_NEVER = -(1 << 62)  # ``_busy`` of a stream that stays (its protocol cannot move)
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_READABLE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
_NONBLOCK = struct.pack("i", 1)  # FIONBIO's argument: an int, 1 = non-blocking
_NO_OUTPUT = bytearray()  # shared while nothing waits to be written; never written to
_LIMITS: dict[tuple[int, int], tuple[int, int]] = {}  # shared (high, low) write limits
_DEFAULT_LIMITS = (65536, 16384)  # asyncio's defaults
# Errors of accept() that concern the one connection only (it went before we took it).
_ACCEPT_SKIP = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM}


def available() -> bool:
    """Whether this platform has epoll (Linux); elsewhere the listener uses uvloop's server."""
    return hasattr(select, "epoll")


class StreamPoller:
    """One loop's epoll set of TCP streams, and the callback that serves the ready ones."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.epoll = select.epoll()
        self.streams: dict[int, TcpStream] = {}
        self.turn = 0  # callbacks so far: when each stream was last busy (``TcpStream._seen``)
        loop.add_reader(self.epoll.fileno(), self._ready)
        # Cancelled when the loop's run ends (asyncio.run cancels what is left): close then.
        self._closer = loop.create_task(self._close_at_the_end())

    def _ready(self) -> None:
        streams, read = self.streams, os.read
        self.turn = turn = self.turn + 1
        for fd, events in self.epoll.poll(0, POLL_EVENTS):
            stream = streams.get(fd)
            if stream is None:
                continue  # closed earlier in this batch
            try:
                if events == _IN and stream._reading:  # the common case, inline: data in
                    try:
                        data = read(fd, READ_SIZE)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as exc:
                        stream._lose(exc)
                        continue
                    if data:
                        stream._used(turn)
                        stream.protocol.data_received(data)  # type: ignore[union-attr]
                    else:
                        stream._eof()
                    continue
                if events & _OUT:
                    stream._write_ready()
                if events & _READABLE and stream.fd >= 0:
                    stream._read_ready()
            except Exception as exc:  # a protocol's callback failed: as uvloop, log and abort
                stream._fatal(exc)

    async def _close_at_the_end(self) -> None:
        try:
            await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            self.close()

    def close(self) -> None:
        """Close every stream (abort: their protocols hear of it, if the loop still runs)."""
        for stream in list(self.streams.values()):
            stream._finish(None)
        if not self.loop.is_closed():
            self.loop.remove_reader(self.epoll.fileno())
        self.epoll.close()


_poller: StreamPoller | None = None  # the running loop's (a new loop makes its own)


def poller_of(loop: asyncio.AbstractEventLoop) -> StreamPoller:
    global _poller
    poller = _poller
    if poller is None or poller.loop is not loop or poller.epoll.closed:
        poller = _poller = StreamPoller(loop)
    return poller


class TcpStream(asyncio.Transport):
    """The transport of one accepted TCP socket (see the module docstring)."""

    __slots__ = (  # one per connection, and few: this is what an idle connection costs
        "_busy",
        "_closing",
        "_limits",
        "_mask",
        "_out",
        "_reading",
        "_seen",
        "_shut",
        "_write_paused",
        "fd",
        "peername",
        "poller",
        "protocol",
    )

    def __init__(self, fd: int, poller: StreamPoller, peername: Any) -> None:
        self.fd = fd  # -1 once closed
        self.poller = poller
        self.peername = peername  # from accept(); None after connection_made
        self.protocol: asyncio.BaseProtocol | None = None
        self._out = _NO_OUTPUT  # what the kernel did not take yet
        self._mask = 0  # the events the epoll set has for this socket; 0 = not in it
        self._reading = True
        self._closing = False  # close() or abort() was called: nothing more is read
        self._shut = False  # write_eof(): shut our side once the output is out
        self._write_paused = False  # the protocol was told pause_writing
        self._limits = _DEFAULT_LIMITS
        self._busy = 0  # reads and writes in a row, each soon after the one before
        self._seen = 0  # the poller's turn of the last of them

    def start(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol
        self.poller.streams[self.fd] = self
        self._watch(_IN)
        try:
            protocol.connection_made(self)
        except Exception as exc:
            self._fatal(exc)
        self.peername = None

    # ------------------------------------------------------------------ events

    def _read_ready(self) -> None:
        if not self._reading:  # paused (lazily): stop hearing of it until resumed
            self._watch(self._mask & ~_IN)
            return
        try:
            data = os.read(self.fd, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lose(exc)
            return
        if data:
            self.protocol.data_received(data)  # type: ignore[union-attr]
        else:
            self._eof()

    def _eof(self) -> None:
        self._reading = False  # end of stream
        self._watch(self._mask & ~_IN)
        if not self.protocol.eof_received():  # type: ignore[union-attr]
            self.close()

    def _write_ready(self) -> None:
        out = self._out
        try:
            sent = os.write(self.fd, out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lose(exc)
            return
        del out[:sent]  # (a bytearray drops its head without moving the rest)
        if out:
            return
        self._out = _NO_OUTPUT
        self._watch(self._mask & ~_OUT)
        if self._write_paused:
            self._write_paused = False
            self.protocol.resume_writing()  # type: ignore[union-attr]
        if self._closing:
            self._finish(None)
        elif self._shut:
            self._shutdown()

    # ------------------------------------------------------------------ asyncio.Transport

    def _used(self, turn: int) -> None:
        """A read or a write in poller turn ``turn``: one more in a row if soon after the one
        before; ``BUSY_AFTER`` in a row moves the stream to a uvloop transport."""
        if turn - self._seen <= BUSY_GAP:
            self._busy += 1
            if self._busy == BUSY_AFTER:
                self._promote()
        elif self._busy > 0:
            self._busy = 0
        self._seen = turn

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.fd < 0 or self._shut or not data:
            return
        self._used(self.poller.turn)
        out = self._out
        if out:  # behind what waits already
            out += data
        else:
            try:
                sent = os.write(self.fd, data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._lose(exc)
                return
            if sent == len(data):
                return
            self._out = out = bytearray(memoryview(data)[sent:])
            self._watch(self._mask | _OUT)
        if not self._write_paused and len(out) > self._limits[0]:
            self._write_paused = True
            self.protocol.pause_writing()  # type: ignore[union-attr]

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def get_write_buffer_size(self) -> int:
        return len(self._out)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        high, low = self._limits
        return low, high

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = 4 * low if low is not None else _DEFAULT_LIMITS[0]
        if low is None:
            low = high // 4
        limits = (high, low)
        self._limits = _LIMITS.setdefault(limits, limits)  # one tuple per distinct pair

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        if self._shut or self.fd < 0:
            return
        self._shut = True
        if not self._out:
            self._shutdown()

    def _shutdown(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 0, self.fd)  # not a dup
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # (the peer is gone: reading tells)
        finally:
            sock.detach()

    def pause_reading(self) -> None:
        self._reading = False  # the socket leaves the epoll set at its next event

    def resume_reading(self) -> None:
        if self._closing or self.fd < 0 or self._reading:
            return
        self._reading = True
        if not self._mask & _IN:
            self._watch(self._mask | _IN)

    def is_reading(self) -> bool:
        return self._reading and not self._closing

    def is_closing(self) -> bool:
        return self._closing or self.fd < 0

    def close(self) -> None:
        """Close once the output is written (no more reading)."""
        if self._closing or self.fd < 0:
            return
        self._closing = True
        self._reading = False
        if not self._out:
            self._finish(None)

    def abort(self) -> None:
        self._closing = True
        self._finish(None)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.protocol  # type: ignore[return-value]  # (set by start)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername" and self.peername is not None:
            return self.peername
        if name not in ("peername", "sockname") or self.fd < 0:
            return default
        sock = socket.socket(fileno=self.fd)  # (its family, for the address)
        try:
            return sock.getpeername() if name == "peername" else sock.getsockname()
        except OSError:
            return default
        finally:
            sock.detach()

    # ------------------------------------------------------------------ a busy stream moves

    def _promote(self) -> None:
        """Busy: hand the socket to a transport of the event loop (uvloop's is C, cheaper per
        read and write than this Python; dearer per connection, which a busy one can afford).

        The loop's transport gets a duplicate descriptor and starts once its ``Handover``
        protocol hears ``connection_made`` (next turn); until then this stream goes on as
        before. The hand-over happens only if the connection is still plainly open and
        reading then; otherwise the duplicate is closed and this stream stays."""
        if getattr(self.protocol, "replace_transport", None) is None:
            self._busy = _NEVER  # (a gate, a lingering close: short-lived anyway)
            return
        self._busy = _NEVER
        loop = self.poller.loop
        try:
            sock = socket.socket(fileno=os.dup(self.fd))
        except OSError:
            return
        loop.create_task(loop.connect_accepted_socket(partial(Handover, self), sock))

    def _handed_over(self, transport: asyncio.Transport) -> bool:
        """``Handover``: move to ``transport`` now if still plainly open; False if not."""
        protocol = self.protocol
        # (Not while reading is paused: uvloop starts reading after ``connection_made`` even
        # if ``pause_reading`` was called in it.)
        if self.fd < 0 or self._closing or self._shut or not self._reading or protocol is None:
            self._busy = 0  # it may try again
            return False
        fd = self.fd
        self.fd = -1
        if self._mask:
            self.poller.epoll.unregister(fd)  # (a duplicate is open: closing would not)
        self.poller.streams.pop(fd, None)
        os.close(fd)
        high, low = self._limits
        transport.set_write_buffer_limits(high, low)
        transport.set_protocol(protocol)
        if self._out:
            transport.write(bytes(self._out))  # (past ``high``, it pauses the protocol itself)
            self._out = _NO_OUTPUT
        self.protocol = None
        protocol.replace_transport(transport)  # type: ignore[attr-defined]
        if self._write_paused and transport.get_write_buffer_size() <= high:
            protocol.resume_writing()  # the new transport will not: it never paused it
        return True

    # ------------------------------------------------------------------ the end

    def _watch(self, mask: int) -> None:
        """Set the events the epoll set reports for this socket; none: out of the set."""
        if mask == self._mask or self.fd < 0:
            return
        epoll = self.poller.epoll
        if not self._mask:
            epoll.register(self.fd, mask)
        elif mask:
            epoll.modify(self.fd, mask)
        else:
            epoll.unregister(self.fd)
        self._mask = mask

    def _lose(self, exc: OSError) -> None:
        """Reading or writing failed (reset, broken pipe): the connection is over."""
        self._closing = True
        self._finish(exc)

    def _fatal(self, exc: Exception) -> None:
        """A protocol's callback raised: report it as uvloop does, and abort."""
        self.poller.loop.call_exception_handler({
            "message": "Fatal error: protocol callback failed on a TCP stream",
            "exception": exc, "transport": self, "protocol": self.protocol,
        })
        self.abort()

    def _finish(self, exc: Exception | None) -> None:
        """Close the socket now; the protocol hears of it on the next loop turn."""
        fd = self.fd
        if fd < 0:
            return
        self.fd = -1
        self._closing = True
        self._reading = False
        self._out = _NO_OUTPUT
        self.poller.streams.pop(fd, None)
        if self._busy == _NEVER and self._mask:  # a hand-over may hold a duplicate
            with contextlib.suppress(OSError):
                self.poller.epoll.unregister(fd)
        os.close(fd)  # (which takes it out of the epoll set if it has no other descriptor)
        self._mask = 0
        loop = self.poller.loop
        if not loop.is_closed():
            loop.call_soon(self._lost, exc)

    def _lost(self, exc: Exception | None) -> None:
        protocol, self.protocol = self.protocol, None
        if protocol is not None:
            protocol.connection_lost(exc)


class Handover(asyncio.Protocol):
    """The first protocol of the loop's transport taking a busy stream's socket over."""

    __slots__ = ("stream",)

    def __init__(self, stream: TcpStream) -> None:
        self.stream = stream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        loops = stream_transport(transport)
        if not self.stream._handed_over(loops):
            loops.abort()  # (closes the duplicate only: the stream keeps its socket)

    def connection_lost(self, exc: Exception | None) -> None:
        pass


class TcpAcceptor:
    """Accepts on one listening socket and starts a ``TcpStream`` per connection."""

    def __init__(self, sock: socket.socket, factory: Callable[[], asyncio.BaseProtocol],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.sock = sock
        self.factory = factory
        self.loop = loop
        self.poller = poller_of(loop)
        self._backoff: asyncio.TimerHandle | None = None
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._accept_ready)

    def _accept_ready(self) -> None:
        accept, poller, factory = self.sock._accept, self.poller, self.factory  # type: ignore[attr-defined]
        for _ in range(ACCEPTS_PER_TURN):
            try:
                fd, peername = accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _ACCEPT_SKIP:
                    continue
                self._pause(exc)  # out of descriptors or memory: try again in a while
                return
            try:
                fcntl.ioctl(fd, termios.FIONBIO, _NONBLOCK)  # one system call, not fcntl's two
            except OSError:
                os.close(fd)
                continue
            TcpStream(fd, poller, peername).start(factory())

    def _pause(self, exc: OSError) -> None:
        log.warning("cannot accept connections, retrying in %gs error=%s", ACCEPT_BACKOFF,
                    os.strerror(exc.errno) if exc.errno else exc)
        self.loop.remove_reader(self.sock.fileno())
        self._backoff = self.loop.call_later(ACCEPT_BACKOFF, self._resume)

    def _resume(self) -> None:
        self._backoff = None
        if self.sock.fileno() >= 0:
            self.loop.add_reader(self.sock.fileno(), self._accept_ready)

    def close(self) -> None:
        """Stop accepting and close the listening socket (the connections stay)."""
        if self._backoff is not None:
            self._backoff.cancel()
            self._backoff = None
        if self.sock.fileno() >= 0:
            if not self.loop.is_closed():
                with contextlib.suppress(Exception):
                    self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
