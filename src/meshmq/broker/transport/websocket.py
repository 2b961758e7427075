"""MQTT over WebSocket: the ``websockets`` sans-I/O server protocol between a socket and MQTT.

Theory of operation
-------------------
``WebSocketLayer`` is two things at once: the ``asyncio.Protocol`` of the socket below (plain
TCP for ``ws``, the TLS transport for ``wss``) and the ``asyncio.Transport`` of the MQTT
protocol above (the same ``ClientProtocol`` as on TCP, or the limit ``Refuser``). It feeds the
bytes it reads to ``websockets.server.ServerProtocol`` and acts on its events:

* the HTTP upgrade request: the path must be ``ws.path`` (else 404), the client must offer the
  ``mqtt`` subprotocol (spec 6.0; ``mqttv3.1`` too, for old clients), else 400. On success the
  MQTT protocol above is created and ``connection_made(self)``;
* binary frames (and their continuations) carry an MQTT *byte stream*: frame boundaries mean
  nothing (MQTT-6.0.0-2), so each frame's payload goes straight to ``data_received``;
* a text frame closes the connection with 1003 (MQTT-6.0.0-1); pings are answered by the
  library; a close frame is echoed and the socket closed.

When the MQTT side closes (e.g. after a DISCONNECT with a reason code), a close frame 1000
follows its last bytes and the connection below closes gracefully (``linger.py``): the server
closes TCP first, as RFC 6455 section 7.1.1 advises, but only after a FIN, while it still reads
(and drops) the client's close frame and whatever it was sending, within the linger bounds.

What the MQTT side writes goes out as one binary frame per MQTT packet, though MQTT-6.0.0-2
would allow several in a frame: client libraries expect one (Eclipse Paho C reads one packet
from a frame and leaves the rest until more bytes arrive, so two packets in a frame stall its
acknowledgements; Mosquitto sends one per frame). ``writelines()`` takes one packet per item
(``WebSocketClientProtocol`` hands over its output queue so, once per batch); ``write()`` takes
whole packets joined (the ``Refuser``'s CONNACK) and finds them by their fixed headers. Either
way the frames of one call go below in one write: framing adds bytes, not writes. The frames
are built here, not by the library's ``send_binary`` (a frame is a header and the packet: no
extension is ever negotiated, and a server does not mask): about 0.1 us per packet where the
library takes 1.6 us per frame. What the library owes (a pong) goes first.

Flow control is the socket's: pause/resume reading and the write-buffer watermarks pass
straight through, so a slow WebSocket subscriber is paused like a TCP one.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Iterable
from typing import Any

from websockets.frames import CloseCode, Frame, Opcode
from websockets.http11 import Request
from websockets.protocol import OPEN
from websockets.server import ServerProtocol
from websockets.typing import Subprotocol

from meshmq.broker.transport.admission import Ticket
from meshmq.broker.transport.layer import StackedLayer, stream_transport
from meshmq.broker.transport.linger import close_gracefully
from meshmq.mqtt.codec import parse_fixed_header
from meshmq.mqtt.errors import InsufficientData, MalformedPacket

log = logging.getLogger("meshmq.websocket")
# The library logs "connection open/closed" at info and every frame at debug: keep it quiet.
_library_log = logging.getLogger("meshmq.websocket.library")
_library_log.setLevel(logging.WARNING)

SUBPROTOCOLS = [Subprotocol("mqtt"), Subprotocol("mqttv3.1")]

# A binary frame's header (RFC 6455 5.2): FIN and opcode 2, then the payload length in 7 bits,
# or 126 and 16 bits, or 127 and 64 bits; no mask from a server. Most packets are short.
_BINARY = 0x82
_SHORT_HEADERS = [bytes((_BINARY, size)) for size in range(126)]
_HEADER_16 = struct.Struct("!BBH")
_HEADER_64 = struct.Struct("!BBQ")


def frame_header(size: int) -> bytes:
    """The header of a binary frame of ``size`` bytes."""
    if size < 126:
        return _SHORT_HEADERS[size]
    if size < 0x10000:
        return _HEADER_16.pack(_BINARY, 126, size)
    return _HEADER_64.pack(_BINARY, 127, size)


def split_packets(data: bytes) -> list[bytes]:
    """The MQTT packets joined in ``data``, found by their fixed headers. Bytes that are not
    whole packets (never written by the MQTT side) stay together as the last item: they still
    make a valid byte stream (MQTT-6.0.0-2)."""
    end = len(data)
    packets = []
    pos = 0
    while pos < end:
        try:
            _, _, stop = parse_fixed_header(data, pos, end)
        except (InsufficientData, MalformedPacket):
            stop = end
        packets.append(data[pos:stop])
        pos = stop
    return packets


class WebSocketLayer(StackedLayer, asyncio.Protocol, asyncio.Transport):
    """Protocol for the socket, Transport for the MQTT protocol made by ``make_inner()``."""

    def __init__(
        self, listener: str, path: str, make_inner: Callable[[], asyncio.BaseProtocol],
        max_frame: int, deadline: float, ticket: Ticket | None = None,
    ) -> None:
        asyncio.Transport.__init__(self)
        self.listener = listener
        self.path = path
        self.make_inner = make_inner
        self.ticket = ticket
        self.deadline = deadline
        self.ws = ServerProtocol(
            subprotocols=SUBPROTOCOLS, max_size=(None, max_frame), logger=_library_log
        )
        self.inner: Any = None
        self.below: asyncio.Transport | None = None
        self.peer = "?"
        self._closing = False
        self._timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ the socket below

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.below = stream_transport(transport)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        # the upgrade must be done in time (then ClientProtocol's CONNECT deadline takes over)
        self._timer = asyncio.get_running_loop().call_later(self.deadline, self._too_slow)

    def _too_slow(self) -> None:
        self._timer = None
        log.info("no websocket handshake in time listener=%s peer=%s", self.listener, self.peer)
        self._closing = True
        if self.below is not None:
            self.below.close()

    def data_received(self, data: bytes) -> None:
        ws = self.ws
        ws.receive_data(data)
        for event in ws.events_received():
            if self._closing:
                break
            if isinstance(event, Frame):
                self._frame(event)
            elif isinstance(event, Request):
                self._handshake(event)  # (a server is never sent a Response)
        if ws.parser_exc is not None and not self._closing:
            log.info("websocket error listener=%s peer=%s error=%r",
                     self.listener, self.peer, str(ws.parser_exc))
            self._closing = True
        self._send()

    def eof_received(self) -> bool:
        self.ws.receive_eof()
        if self.inner is not None:
            self.inner.eof_received()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.ticket is not None:
            self.ticket.release()
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def _handshake(self, request: Request) -> None:
        ws = self.ws
        if request.path.split("?", 1)[0] != self.path:
            response = ws.reject(404, f"No MQTT endpoint here: use {self.path}\n")
            why = f"path {request.path!r} is not {self.path!r}"
        else:
            response = ws.accept(request)
            why = str(ws.handshake_exc) if ws.handshake_exc is not None else ""
        ws.send_response(response)
        if response.status_code != 101:
            log.info("websocket handshake refused listener=%s peer=%s status=%d why=%r",
                     self.listener, self.peer, response.status_code, why)
            return
        self._send()  # the 101 goes out before any MQTT byte
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.inner = self.make_inner()
        self.inner.connection_made(self)

    def _frame(self, frame: Frame) -> None:
        if frame.opcode is Opcode.BINARY or frame.opcode is Opcode.CONT:
            if frame.data and self.inner is not None:
                self.inner.data_received(bytes(frame.data))
        elif frame.opcode is Opcode.TEXT:  # MQTT-6.0.0-1
            log.info("websocket text frame refused listener=%s peer=%s", self.listener,
                     self.peer)
            self.ws.fail(CloseCode.UNSUPPORTED_DATA, "MQTT needs binary frames")
            self._closing = True

    def _send(self) -> None:
        below = self.below
        if below is None:
            return
        eof = False
        for chunk in self.ws.data_to_send():
            if chunk:
                below.write(chunk)
            else:
                eof = True  # the library is done with this connection
        if eof or (self._closing and not below.is_closing()):
            close_gracefully(below)

    # ------------------------------------------------------------------ the MQTT side above

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """``data`` is whole MQTT packets: each goes in a binary frame of its own."""
        self.writelines(split_packets(bytes(data)))

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        """One binary frame per item, each a whole MQTT packet; one write below for all."""
        below = self.below
        ws = self.ws
        if self._closing or ws.state is not OPEN or below is None:
            return
        parts: list[bytes | bytearray | memoryview] = []
        owed = ws.data_to_send()
        if owed:  # what the library owes (a pong) was due first
            parts.extend(owed)
        append = parts.append
        short = _SHORT_HEADERS
        for packet in list_of_data:
            size = len(packet)
            append(short[size] if size < 126 else frame_header(size))
            append(packet)  # (not copied into a frame of its own: it may be shared)
        if parts:
            below.write(b"".join(parts))

    def close(self) -> None:
        """Close frame 1000 after what was written, then close the connection below
        gracefully (``linger.py``): the peer reads both, its close frame and anything else it
        still sends are dropped, and the TCP (or TLS) connection ends at the peer's EOF or the
        linger bound, whichever comes first."""
        if self._closing:
            return
        self._closing = True
        if self.ws.state is OPEN:
            self.ws.send_close(CloseCode.NORMAL_CLOSURE)
        self._send()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "subprotocol":
            return self.ws.subprotocol
        return self.below.get_extra_info(name, default) if self.below is not None else default

    def pause_reading(self) -> None:
        if self.below is not None:
            self.below.pause_reading()

    def resume_reading(self) -> None:
        if self.below is not None:
            self.below.resume_reading()

    def is_reading(self) -> bool:
        return self.below is not None and self.below.is_reading()

