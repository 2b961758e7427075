"""asyncio glue: one ``asyncio.Protocol`` per TCP connection feeding a ``ServerConnection``.

Bytes in go to the sans-I/O connection, its events go to the broker, and its output is written
once per batch: immediately after the packets of one read were handled, and for deliveries
caused by other connections once per loop turn (``Broker.schedule_flush``). The transport's
write-buffer watermarks drive ``congested``, which sessions read to stop sending to a client
that does not keep up; ``resume_writing`` pumps its queue again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from meshmq.mqtt.connection import ServerConnection
from meshmq.mqtt.packets import Packet
from meshmq.mqtt.reason_codes import ReasonCode

if TYPE_CHECKING:
    from meshmq.broker.broker import Broker
    from meshmq.broker.session import Session

log = logging.getLogger("meshmq.connection")

WRITE_HIGH_WATER = 512 * 1024
WRITE_LOW_WATER = 128 * 1024


class ClientProtocol(asyncio.Protocol):
    """The I/O side of one client connection."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        mqtt = broker.config.mqtt
        self.conn = ServerConnection(
            max_packet_size=mqtt.max_packet_size,
            receive_maximum=mqtt.receive_maximum,
            topic_alias_maximum=mqtt.topic_alias_maximum,
            max_topic_levels=mqtt.max_topic_levels,
            max_qos=mqtt.max_qos,
            retain_available=mqtt.retain_available,
        )
        self.transport: asyncio.Transport | None = None
        self.session: Session = None  # type: ignore[assignment]  # set by CONNECT
        self.client_id = ""
        self.peer = "?"
        self.rejected = False
        self.gone = False  # the socket is closed; late callbacks must leave this client alone
        self.held: list[Packet] | None = None  # packets waiting for CONNECT authentication
        self.congested = False
        self._dirty = False
        self._keep_alive = 0.0
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(WRITE_HIGH_WATER, WRITE_LOW_WATER)  # type: ignore[attr-defined]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.broker.clients.add(self)
        loop = self.broker.loop
        deadline = self.broker.config.mqtt.connect_timeout
        self._timer = loop.call_later(deadline, self._connect_timeout)

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        self._last_read = self.broker.loop.time()
        conn.receive_data(data)
        events = conn.events_received()
        if events:
            self.broker.handle_events(self, events)
        if conn.error is not None and not self.rejected:
            self._log_protocol_error()
        self.flush()
        if conn.closed:
            self.close()

    def eof_received(self) -> bool:
        self.conn.receive_eof()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.conn.receive_eof()
        self.broker.connection_lost(self)

    def pause_writing(self) -> None:
        self.congested = True

    def resume_writing(self) -> None:
        self.congested = False
        if self.session is not None and self.session.client is self:
            self.session.pump(self.broker.loop.time())

    # ------------------------------------------------------------------ authentication

    def hold(self) -> None:
        """Stop reading and keep later packets until ``release()`` (CONNECT is being checked)."""
        self.held = []
        if self.transport is not None:
            self.transport.pause_reading()

    def release(self) -> None:
        """Handle the packets held behind CONNECT and read again."""
        held = self.held or []
        self.held = None
        if self.gone:
            return
        if not self.rejected:
            self.transport.resume_reading()  # type: ignore[union-attr]
            self.broker.handle_events(self, held)
        self.flush()
        if self.conn.closed:
            self.close()

    # ------------------------------------------------------------------ used by sessions

    def wake(self) -> None:
        """Output is pending on ``conn``: write it at the end of this loop turn."""
        if not self._dirty:
            self._dirty = True
            self.broker.schedule_flush(self)

    def flush(self) -> None:
        self._dirty = False
        data = self.conn.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        """Write what is pending, then close the socket."""
        self.flush()
        if self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------------ timers

    def connected(self, keep_alive: int) -> None:
        """CONNACK sent: replace the CONNECT deadline by the keep-alive check."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if keep_alive:
            self._keep_alive = keep_alive * 1.5  # MQTT-3.1.2-24
            self._timer = self.broker.loop.call_later(self._keep_alive, self._check_keep_alive)

    def _connect_timeout(self) -> None:
        self._timer = None
        log.info("no CONNECT in time peer=%s", self.peer)
        self.close()

    def _check_keep_alive(self) -> None:
        loop = self.broker.loop
        idle = loop.time() - self._last_read
        if idle >= self._keep_alive:
            self._timer = None
            log.info("keep alive timeout client_id=%s peer=%s", self.client_id, self.peer)
            self.conn.send_disconnect(ReasonCode.KEEP_ALIVE_TIMEOUT)
            self.close()
            return
        self._timer = loop.call_later(self._keep_alive - idle, self._check_keep_alive)

    def _log_protocol_error(self) -> None:
        error = self.conn.error
        self.broker.counters["protocol_errors"] += 1
        log.info(
            "protocol error client_id=%s peer=%s reason=0x%02X error=%r",
            self.client_id or "-", self.peer, error.reason_code, str(error),  # type: ignore[union-attr]
        )
