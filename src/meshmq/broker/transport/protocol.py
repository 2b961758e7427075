"""asyncio glue: one ``asyncio.Protocol`` per TCP connection feeding a ``ServerConnection``.

Bytes in go to the sans-I/O connection, its events go to the broker, and its output is written
once per batch: immediately after the packets of one read were handled, and for deliveries
caused by other connections once per loop turn (``Broker.schedule_flush``), or earlier if that
turn's output reaches ``WRITE_HIGH_WATER`` (so a busy turn does not push deliveries through the
session queue).

Flow control, both ways, without dropping anything that was acknowledged:

* Out: ``congested`` is true while the transport's buffer is past its high watermark or this
  turn's pending output already is; sessions then queue (bounded, drops counted) instead of
  writing, and ``resume_writing`` (or the flush that emptied the output) pumps them again. If
  the buffer still grows past ``WRITE_HARD_LIMIT`` (the client sends requests but does not
  read our answers), reading pauses until it drains.
* In: with per-client rate limits (``limits.client_*``), a ``ClientThrottle`` decides which
  packets of a read the broker gets now; the rest wait here while reading is paused (TCP
  backpressure), and a client that stays throttled for ``limits.throttle_timeout`` seconds is
  disconnected (5.0: DISCONNECT 0x96 Message rate too high).

Closing: ``close()`` writes what is pending and closes gracefully (``linger.py``), so that a
client still sending reads our last CONNACK or DISCONNECT instead of a reset; the broker is told
at once (next loop turn) that the connection is over, not when the socket finally closes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Final

from meshmq.broker.ratelimit import ClientThrottle
from meshmq.broker.transport.certauth import certify
from meshmq.broker.transport.layer import stream_transport
from meshmq.broker.transport.linger import close_gracefully
from meshmq.mqtt.connection import ServerConnection
from meshmq.mqtt.errors import RemoteProtocolError
from meshmq.mqtt.packets import Packet, PacketType
from meshmq.mqtt.reason_codes import ReasonCode
from meshmq.mypycattr import mypyc_attr

if TYPE_CHECKING:
    from meshmq.broker.broker import Broker
    from meshmq.broker.session import Session

log: Final = logging.getLogger("meshmq.connection")

WRITE_HIGH_WATER: Final = 512 * 1024
WRITE_LOW_WATER: Final = 128 * 1024
# beyond it, stop reading a client that does not read
WRITE_HARD_LIMIT: Final = 4 * WRITE_HIGH_WATER
# packets parsed per connection per loop turn, so no client hogs the loop
TURN_PACKETS: Final = 1000
# Shared by every connection whose reading was never paused (most): never modified, as
# ``_pause_reading`` gives a connection a set of its own first (216 bytes saved per client).
_NOT_PAUSED: Final[set[str]] = set()
# Likewise for packets held back by the throttle: ``_waiting`` is only ever replaced, never
# appended to, so connections that were never throttled share this one.
_NOTHING_WAITING: Final[list[Packet]] = []
# 1.5 x each Keep Alive seen, shared: a fleet uses a handful of values (24 bytes per client).
_KEEP_ALIVE_LIMITS: Final[dict[int, float]] = {}


@mypyc_attr(allow_interpreted_subclasses=True)  # listeners.py: the TCP and listener ones
class ClientProtocol(asyncio.Protocol):
    """The I/O side of one client connection."""

    __slots__ = (  # one per connection: no __dict__ (docs/benchmarks.md, connection storms)
        "_dirty",
        "_read_pauses",
        "_resume_handle",
        "_waiting",
        "_write_paused",
        "broker",
        "client_id",
        "close_reason",
        "closing",
        "conn",
        "connected_at",
        "gone",
        "held",
        "identity",
        "keep_alive_limit",
        "last_read",
        "log_positions",
        "peer",
        "rejected",
        "session",
        "throttle",
        "transport",
    )

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        mqtt = broker.config.mqtt
        self.conn = ServerConnection(
            max_packet_size=mqtt.max_packet_size,
            receive_maximum=mqtt.receive_maximum,
            topic_alias_maximum=mqtt.topic_alias_maximum,
            max_topic_levels=mqtt.max_topic_levels,
            max_topic_bytes=broker.config.limits.max_topic_bytes,
            max_qos=mqtt.max_qos,
            retain_available=mqtt.retain_available,
            max_events=TURN_PACKETS,
        )
        self.transport: asyncio.Transport | None = None
        self.session: Session | None = None  # set by CONNECT
        self.client_id = ""
        self.peer = "?"
        self.rejected = False
        self.closing = False  # close() was called: nothing more is written or read
        self.gone = False  # the connection is over; late callbacks must leave this client alone
        self.held: list[Packet] | None = None  # packets waiting for CONNECT authentication
        self.throttle: ClientThrottle | None = None  # inbound rate limits, from CONNACK on
        self._write_paused = False
        self._read_pauses = _NOT_PAUSED  # why reading is paused by flow control
        self._waiting = _NOTHING_WAITING  # packets held back by the throttle
        self._resume_handle: asyncio.TimerHandle | None = None
        self.identity: str | None = None  # user name the transport proved (mTLS certificate CN)
        self.close_reason = ""  # why the connection ends, for the "client disconnected" line
        self.log_positions = False  # CONNECT asked for log positions on delivery (replay.md)
        self._dirty = False
        # Deadlines live in the broker's timer wheel (deadlines.py), which reads these two.
        self.keep_alive_limit = 0.0  # 1.5 x the Keep Alive once connected; 0 = none (yet)
        self.last_read = 0.0
        self.connected_at = 0.0  # wall clock of the TCP accept (the admin API shows it)

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = stream = stream_transport(transport)
        stream.set_write_buffer_limits(WRITE_HIGH_WATER, WRITE_LOW_WATER)
        if self.peer == "?":  # (the listener's gate tells it when it knows it already)
            peer = transport.get_extra_info("peername")
            self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.connected_at = time.time()
        self.broker.clients[self] = None
        for reason in self.broker.input_pauses:
            self._pause_reading(reason)
        self.broker.await_connect(self)  # mqtt.connect_timeout from now

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        conn = self.conn
        broker = self.broker
        self.last_read = now = broker.loop.time()
        broker.counters.bytes_in += len(data)  # per read, not per packet
        conn.receive_data(data)
        events = conn.events_received()
        if self.throttle is not None:
            self.throttle.charge_bytes(len(data), now)
            if not events:
                self._dispatch(events, now)  # a byte flood of partial packets pauses too
        if events:
            if self.identity is not None and events[0].type is PacketType.CONNECT:
                events[0] = certify(events[0], self.identity)
            self._dispatch(events, now)
        self._schedule_next_turn()
        if conn.error is not None and not self.rejected:
            self._log_protocol_error(conn.error)
        self.flush()
        if conn.closed:
            self.close()

    def eof_received(self) -> bool:
        self.close_reason = self.close_reason or "socket closed by the client"
        self._drain_input()
        self.conn.receive_eof()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.close_reason and exc is not None:
            self.close_reason = f"connection error: {exc}"
        self._end()

    def _end(self) -> None:
        """The connection is over (the socket closed, or ``close()`` began): stop the timers
        and tell the broker, once."""
        if self.gone:
            return
        self.gone = True
        self._waiting = _NOTHING_WAITING
        if self._resume_handle is not None:
            self._resume_handle.cancel()
            self._resume_handle = None
        self.broker.forget_deadline(self)
        self.conn.receive_eof()
        if not self.close_reason:
            self.close_reason = "socket closed"
        self.broker.connection_lost(self)

    def replace_transport(self, transport: asyncio.Transport) -> None:
        """The socket moved to ``transport`` (a busy connection of the tcp listener leaves its
        ``TcpStream`` for a transport of the event loop's, stream.py); nothing else changes."""
        self.transport = transport

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._resume_reading("backlog")
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
            if self.transport is not None:  # (it is: set by connection_made)
                self.transport.resume_reading()
            self.broker.handle_events(self, held)
        self.flush()
        if self.conn.closed:
            self.close()

    # ------------------------------------------------------------------ used by sessions

    def wake(self) -> None:
        """Output is pending on ``conn``: write it at the end of this loop turn, or at once
        when this turn's output reaches the high watermark (a fan-in of many publishers to
        one subscriber), so that later deliveries this turn need not wait in the queue."""
        if not self._dirty:
            self._dirty = True
            self.broker.schedule_flush(self)
        if self.conn.pending_output >= WRITE_HIGH_WATER and not self._write_paused:
            self._write_out()

    @property
    def congested(self) -> bool:
        """Deliveries must wait: the socket buffer, or this turn's output, is full enough."""
        return self._write_paused or self.conn.pending_output >= WRITE_HIGH_WATER

    def flush(self) -> None:
        self._dirty = False
        was_full = self.conn.pending_output >= WRITE_HIGH_WATER
        self._write_out()
        if self.conn.local_close is not None:
            self.close()  # e.g. a SUBACK refusal a 3.1 client cannot be told
            return
        if was_full and not self._write_paused and self.session is not None \
                and self.session.client is self:
            self.session.pump(self.broker.loop.time())  # congested by this turn's output only

    def _write_out(self) -> None:
        """Hand the connection's pending output to the transport, joined in one write (no
        pumping: callers may be in the middle of a delivery). Under WebSocket the packets go
        as a list instead, one frame each (``listeners.WebSocketClientProtocol``)."""
        data = self.conn.data_to_send()
        transport = self.transport
        if data and transport is not None and not self.closing and not transport.is_closing():
            transport.write(data)
            self.broker.counters.bytes_out += len(data)  # per write, not per packet
            buffered = transport.get_write_buffer_size()
            if buffered > WRITE_HARD_LIMIT and "backlog" not in self._read_pauses:
                self._backlogged(buffered)

    def _backlogged(self, buffered: int) -> None:
        """Answers pile up unread: take no more requests until the client reads."""
        log.info("client does not read, reading paused client_id=%s peer=%s buffered=%d",
                 self.client_id or "-", self.peer, buffered)
        self._pause_reading("backlog")

    def close(self) -> None:
        """Write what is pending, then close gracefully: the client can read it even while
        it is still sending (``linger.py``); the broker hears of the end on the next turn."""
        if self.closing:
            return
        self._write_out()
        self.closing = True
        why = self.conn.local_close
        if why is not None:
            log.info("closing the connection client_id=%s peer=%s why=%r",
                     self.client_id or "-", self.peer, why)
        if self.transport is not None:
            close_gracefully(self.transport)
        self.broker.loop.call_soon(self._end)

    # ------------------------------------------------------------------ timers

    def connected(self, keep_alive: int) -> None:
        """CONNACK sent: replace the CONNECT deadline by the keep-alive check."""
        broker = self.broker
        now = broker.loop.time()
        self.throttle = ClientThrottle.from_config(broker.config.limits, now)
        self.last_read = now  # silence counts from the CONNACK (authentication may be slow)
        limit = _KEEP_ALIVE_LIMITS.get(keep_alive)
        if limit is None:  # (at most 65,536 distinct values)
            limit = _KEEP_ALIVE_LIMITS[keep_alive] = keep_alive * 1.5  # MQTT-3.1.2-24
        self.keep_alive_limit = limit
        broker.watch_keep_alive(self)  # (or forget the CONNECT deadline, with keep alive 0)

    def deadline_passed(self) -> None:
        """The timer wheel says: no CONNECT in time, or silent for 1.5 x the Keep Alive."""
        if self.closing:
            return
        if not self.keep_alive_limit:
            log.info("no CONNECT in time peer=%s", self.peer)
            self.close()
            return
        log.info("keep alive timeout client_id=%s peer=%s", self.client_id, self.peer)
        self.close_reason = "keep-alive timeout"
        self.conn.send_disconnect(ReasonCode.KEEP_ALIVE_TIMEOUT)
        self.close()

    # ------------------------------------------------------------------ inbound flow control

    def _dispatch(self, events: list[Packet], now: float, fresh: bool = True) -> bool:
        """Hand ``events`` to the broker as far as the throttle allows; True if reading must
        stay paused (the rest wait in ``_waiting``). ``fresh``: they come from a new read."""
        throttle = self.throttle
        if throttle is None:
            self.broker.handle_events(self, events)
            return False
        ready = throttle.admit(events, now)
        if ready:
            self.broker.handle_events(self, events if ready == len(events) else events[:ready])
        if self.conn.closed or self.rejected or self.gone:
            return False
        waiting = events[ready:]
        if not throttle.must_wait(len(waiting), now):
            if fresh:
                throttle.read_without_pause()
            return False
        if throttle.flooding(now):
            self._flooded(throttle)
            return False
        throttle.start_pause(now)
        counters = self.broker.counters
        counters.throttled += 1
        self._waiting = waiting
        self._pause_reading("rate")
        delay = throttle.wait_time(len(waiting), now)
        self._resume_handle = self.broker.loop.call_later(delay, self._resume)
        return True

    def _resume(self) -> None:
        """The throttle's pause is over: hand on what waited, then read again if allowed."""
        self._resume_handle = None
        if self.gone:
            return
        now = self.broker.loop.time()
        self.last_read = now  # we held the client back; it was not idle
        waiting, self._waiting = self._waiting, _NOTHING_WAITING
        if not self._dispatch(waiting, now, fresh=False):
            self._schedule_next_turn()  # read data not parsed yet goes first
            self._resume_reading("rate")
        self.flush()
        if self.conn.closed:
            self.close()

    def _schedule_next_turn(self) -> None:
        """Parsing stopped at ``TURN_PACKETS``: let other clients run, continue next turn."""
        if self.conn.input_pending and self._resume_handle is None and not self.gone \
                and "turn" not in self._read_pauses:
            self._pause_reading("turn")
            self.broker.loop.call_soon(self._next_turn)

    def _next_turn(self) -> None:
        if self.gone:
            return
        conn = self.conn
        conn.receive_data(b"")  # the next slice of what was already read
        events = conn.events_received()
        if events:
            self._dispatch(events, self.broker.loop.time(), fresh=False)
        if conn.input_pending and self._resume_handle is None:
            self.broker.loop.call_soon(self._next_turn)  # reading stays paused
        else:  # all parsed, or throttled (its pause holds reading; ``_resume`` continues)
            self._resume_reading("turn")
        if conn.error is not None and not self.rejected:
            self._log_protocol_error(conn.error)
        self.flush()
        if conn.closed:
            self.close()

    def _drain_input(self) -> None:
        """At EOF: handle everything already read (held back or not yet parsed) at once; it
        is at most one read, and dropping it would lose what the client sent before leaving."""
        if self.gone or not (self._waiting or self.conn.input_pending):
            return
        if self._resume_handle is not None:
            self._resume_handle.cancel()
            self._resume_handle = None
        conn = self.conn
        waiting, self._waiting = self._waiting, _NOTHING_WAITING
        conn.max_events = 0
        conn.receive_data(b"")
        events = waiting + conn.events_received()
        if events and not self.rejected:
            self.broker.handle_events(self, events)
        self.flush()

    def _flooded(self, throttle: ClientThrottle) -> None:
        """Still over its rate after ``throttle_timeout`` seconds of throttling: disconnect.

        What waited is dropped unacknowledged, so a QoS 1/2 sender resends it after
        reconnecting; nothing it was told is stored is lost.
        """
        counters = self.broker.counters
        counters.rate_disconnects += 1
        log.warning(
            "client over its rate limit for %gs, disconnecting client_id=%s peer=%s pauses=%d",
            throttle.max_throttle, self.client_id, self.peer, throttle.throttles,
        )
        self._waiting = _NOTHING_WAITING
        self.rejected = True
        self.close_reason = "message rate too high"
        self.conn.send_disconnect(ReasonCode.MESSAGE_RATE_TOO_HIGH)
        self.close()

    def pause_input(self, reason: str, paused: bool) -> None:
        """Node-wide flow control (``Broker.pause_input``)."""
        if paused:
            self._pause_reading(reason)
        else:
            self._resume_reading(reason)

    def _pause_reading(self, reason: str) -> None:
        transport = self.transport
        if self.closing:
            return  # the socket lingers (linger.py): it must keep reading to drop the input
        if not self._read_pauses and transport is not None and not transport.is_closing():
            transport.pause_reading()
        if self._read_pauses is _NOT_PAUSED:
            self._read_pauses = set()
        self._read_pauses.add(reason)

    def _resume_reading(self, reason: str) -> None:
        if reason not in self._read_pauses:
            return
        self._read_pauses.discard(reason)
        transport = self.transport
        if self._read_pauses or self.held is not None or self.gone or self.closing \
                or transport is None:
            return
        if not transport.is_closing():
            transport.resume_reading()

    def _log_protocol_error(self, error: RemoteProtocolError) -> None:
        self.close_reason = f"protocol error 0x{error.reason_code:02X}: {error}"
        self.broker.counters.protocol_errors += 1
        log.info(
            "protocol error client_id=%s peer=%s reason=0x%02X error=%r",
            self.client_id or "-", self.peer, error.reason_code, str(error),
        )
