"""Listeners: MQTT over TCP, TLS, WebSocket and WebSocket over TLS, each behind admission rules.

Theory of operation
-------------------
Every listener is a plain TCP server. At accept, before reading anything, the listener's
``Admission`` (CIDR rules, connection limits; see ``admission.py``) decides, and then the stack
for the connection is built, bottom to top:

    socket -> [TLSLayer] -> [WebSocketLayer] -> ClientProtocol | Refuser

The sockets of the TLS and WebSocket listeners start with a ``Gate`` protocol that asks the
admission, builds the stack, sees the first chunk read, then steps aside
(``transport.set_protocol``) and costs nothing afterwards. The plain ``tcp`` listener, where
connect storms land, has no gate: its ``TcpClientProtocol`` asks the admission itself and hands
only a connection that is refused to a gate. On a plain port (``tcp``, ``ws``) a first byte of
0x16 is a TLS ClientHello: logged and closed. On a TLS port (``tls``, ``wss``) the
``TLSLayer`` does the handshake with the ``ServerCertificates`` context current at accept (a
SIGHUP reload only affects later handshakes), logs every failure with the peer and the reason,
and creates what runs above it only once the handshake is done: with ``tls.cert_username`` the
MQTT side carries the certificate's CN (see ``certauth.py``). Every layer with a handshake
(TLS, WebSocket, MQTT CONNECT) has its own deadline of ``mqtt.connect_timeout``.

The plain ``tcp`` listener (on Linux) does not use uvloop's server: it accepts on its own and
each connection is a ``TcpStream`` on one epoll set per loop (``stream.py``), about 1 KB less
per idle connection than uvloop's transport; a busy connection moves to uvloop's transport.

Accepting a storm. libuv (under uvloop) accepts one connection per listening handle per loop
turn (libuv PR 3696): with one handle, a storm's connections waiting in the accept queue cost
a loop turn each (the tcp listener's ``TcpAcceptor`` takes up to 16 a turn itself). While
connections queue, each other listening socket is therefore polled by ``ACCEPTS_PER_TURN``
handles: the socket's own and ``dup`` descriptors of it, each its own
asyncio server with the same protocol factory, sharing the one accept queue, bind and port (a
port in use fails as before; the socket closes with its last handle). A turn then accepts up
to 16 connections. The extra handles cost a connection that arrives alone a wasted
``accept4`` each, so they are opened and closed by what the accept queue shows at accept
time (``acceptq.py``).

A connection over a limit gets a ``Refuser`` in place of a ``ClientProtocol``: it reads the
CONNECT, answers CONNACK 0x97 (3.1.1: 3) and closes, without touching the broker. Each layer
holds the connection's admission ``Ticket`` and releases it when the connection is lost
(release is idempotent, so whichever layer hears of it first frees the slot). The plain tcp
listener's ``TcpClientProtocol`` is the only layer of its connection: it keeps just the
ticket's key (``Admission.admitted``) and gives it back once itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from meshmq.broker.transport.acceptq import AcceptQueueWatch, Change, can_watch, queued_connections
from meshmq.broker.transport.admission import Admission, Decision, NetworkRules, Ticket, Verdict
from meshmq.broker.transport.certauth import CertificateAuthenticator
from meshmq.broker.transport.certificates import ServerCertificates
from meshmq.broker.transport.layer import stream_transport
from meshmq.broker.transport.linger import close_gracefully
from meshmq.broker.transport.protocol import WRITE_HARD_LIMIT, ClientProtocol
from meshmq.broker.transport.stream import TcpAcceptor
from meshmq.broker.transport.stream import available as streams_available
from meshmq.broker.transport.tls import TLSLayer
from meshmq.broker.transport.websocket import WebSocketLayer
from meshmq.config import listen_address
from meshmq.mqtt.connection import ServerConnection
from meshmq.mqtt.errors import NotConnect, RemoteProtocolError
from meshmq.mqtt.packets import PacketType
from meshmq.mqtt.reason_codes import ReasonCode

if TYPE_CHECKING:
    from meshmq.broker.broker import Broker
    from meshmq.config import BrokerConfig, ServerConfig, TLSConfig, WebSocketConfig

log = logging.getLogger("meshmq.listener")

TLS_RECORD_HANDSHAKE = 0x16  # first byte of a TLS ClientHello
# Handles polling a listening socket while connections queue (acceptq.py): a loop turn then
# accepts up to this many, where libuv accepts one per handle per turn (libuv PR 3696).
ACCEPTS_PER_TURN = 16


class ListenerError(Exception):
    """A listener could not start; the message is one line naming it."""


@dataclass(frozen=True, slots=True)
class ListenerSpec:
    name: str  # tcp | tls | ws | wss: the config section is server | tls | ws | wss
    bind: str
    port: int
    tls: bool
    path: str | None  # WebSocket endpoint; None = MQTT straight on the socket
    rules: NetworkRules
    max_connections: int
    max_connections_per_ip: int


def listener_specs(config: BrokerConfig) -> list[ListenerSpec]:
    """The enabled listeners, TCP first (it is always on)."""
    bind = listen_address(config)  # where a section without its own bind listens
    specs = [_listener_spec("tcp", config.server, bind, False, None)]
    if config.tls.enabled:
        specs.append(_listener_spec("tls", config.tls, bind, True, None))
    for name, ws, tls in (("ws", config.ws, False), ("wss", config.wss, True)):
        if ws.enabled:
            specs.append(_listener_spec(name, ws, bind, tls, ws.path))
    return specs


def _listener_spec(name: str, section: ServerConfig | TLSConfig | WebSocketConfig,
                   default_bind: str, tls: bool, path: str | None) -> ListenerSpec:
    return ListenerSpec(
        name, section.bind or default_bind, section.port, tls, path,
        NetworkRules.parse(section.allow, section.deny),
        section.max_connections, section.max_connections_per_ip,
    )


def _peer(transport: asyncio.BaseTransport) -> tuple[str, str]:
    """(host, "host:port") of the peer."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple):
        return str(peer[0]), f"{peer[0]}:{peer[1]}"
    return str(peer), str(peer)


class ListenerClientProtocol(ClientProtocol):
    """A broker connection that gives its admission ticket back when it is gone."""

    __slots__ = ("ticket",)

    def __init__(self, broker: Broker, ticket: Ticket, identity: str | None,
                 peer: str) -> None:
        super().__init__(broker)
        self.ticket = ticket
        self.identity = identity
        self.peer = peer

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            super().connection_lost(exc)
        finally:
            self.ticket.release()


class WebSocketClientProtocol(ListenerClientProtocol):
    """A broker connection under a ``WebSocketLayer``: its output goes down as the list of its
    packets (``writelines``), so that the layer puts each in a frame of its own without
    parsing them out of one joined write again (see ``websocket.py`` for why)."""

    __slots__ = ()

    def _write_out(self) -> None:
        packets = self.conn.packets_to_send()
        transport = self.transport
        if packets and transport is not None and not self.closing \
                and not transport.is_closing():
            transport.writelines(packets)  # still one write below, for all of them
            self.broker.counters.bytes_out += sum(map(len, packets))
            buffered = transport.get_write_buffer_size()
            if buffered > WRITE_HARD_LIMIT and "backlog" not in self._read_pauses:
                self._backlogged(buffered)


class Refuser(asyncio.Protocol):
    """A connection over a limit: read its CONNECT, answer 0x97 (3.1.1: 3), close."""

    def __init__(self, listener: Listener, ticket: Ticket) -> None:
        self.listener = listener
        self.ticket = ticket
        self.conn = ServerConnection(max_packet_size=listener.broker.config.mqtt.max_packet_size)
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = stream_transport(transport)
        deadline = self.listener.broker.config.mqtt.connect_timeout
        self._timer = asyncio.get_running_loop().call_later(deadline, transport.close)

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        conn.receive_data(data)
        events = conn.events_received()
        if events and events[0].type is PacketType.CONNECT:
            conn.send_connack(ReasonCode.QUOTA_EXCEEDED)
        elif conn.error is not None:
            log.info("protocol error on a refused connection listener=%s error=%r",
                     self.listener.spec.name, str(conn.error))
        out = conn.data_to_send()
        if self.transport is not None:
            if out:
                self.transport.write(out)
            if conn.closed:
                close_gracefully(self.transport)  # the peer may still be sending: no reset

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.ticket.release()


class Gate(asyncio.Protocol):
    """The first protocol of every accepted socket: admission, then the listener's stack."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.inner: asyncio.Protocol | None = None
        self.ticket: Ticket | None = None
        self.peer = "?"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.listener.accepted()
        host, peer = _peer(transport)
        self.decided(transport, peer, self.listener.admission.admit(host))

    def decided(self, transport: asyncio.BaseTransport, peer: str, decision: Decision) -> None:
        """Act on the admission's ``decision`` for the connection from ``peer``."""
        self.transport = stream_transport(transport)
        listener = self.listener
        self.peer = peer
        self.ticket = decision.ticket
        name = listener.spec.name
        if decision.verdict is Verdict.DENIED or decision.verdict is Verdict.CLOSED:
            log.info("connection refused at accept listener=%s peer=%s why=%r", name,
                     self.peer, decision.why)
            transport.close()
            return
        if decision.verdict is Verdict.OVER_LIMIT:
            log.info("connection refused listener=%s peer=%s why=%r: CONNACK 0x97 (3.1.1: 3)"
                     " once CONNECT arrives", name, self.peer, decision.why)
        self.inner = listener.stack(decision, self.peer)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        transport, inner = self.transport, self.inner
        if transport is None or inner is None:
            return
        if data[0] == TLS_RECORD_HANDSHAKE and not self.listener.spec.tls:
            log.info("TLS handshake on a plain port listener=%s peer=%s: closing (the TLS"
                     " listener is elsewhere)", self.listener.spec.name, self.peer)
            transport.close()
            return
        transport.set_protocol(inner)  # from now on the gate is out of the way
        inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.ticket is not None:
            self.ticket.release()
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


class TcpClientProtocol(ClientProtocol):
    """MQTT straight on a plain TCP socket (the ``tcp`` listener), with the gate's work done in
    place: a connection costs one protocol object and no hand-over. Admission happens at
    accept; a connection that is not simply admitted is handed to a ``Gate``, which refuses
    it. A TLS ClientHello (first byte 0x16) is refused by the CONNECT check at its first byte
    (``NotConnect``) and logged as the gate logs it. The listener's factory (``for_listener``)
    makes this class itself, not a subclass of it: compiled, a connection of a subclass made
    at run time would call every method of ``ClientProtocol`` through Python."""

    __slots__ = ("admission_key", "listener")

    def __init__(self, listener: Listener) -> None:  # (admitted at accept)
        ClientProtocol.__init__(self, listener.broker)
        self.listener = listener
        self.admission_key: str | None = None  # its admission count's key (no Ticket object)

    @staticmethod
    def for_listener(listener: Listener) -> Callable[[], TcpClientProtocol]:
        return partial(TcpClientProtocol, listener)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        listener = self.listener
        listener.accepted()
        host, peer = _peer(transport)
        key = listener.admission.admitted(host)
        if key is None:  # refused: the gate does that
            gate = Gate(listener)
            transport.set_protocol(gate)
            gate.decided(transport, peer, listener.admission.admit(host))
            return
        self.admission_key = key
        self.peer = peer
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            ClientProtocol.connection_lost(self, exc)
        finally:
            key = self.admission_key
            if key is not None:
                self.admission_key = None
                self.listener.admission.release(key)

    def _log_protocol_error(self, error: RemoteProtocolError) -> None:
        if isinstance(error, NotConnect) and error.first_byte == TLS_RECORD_HANDSHAKE:
            self.close_reason = "TLS handshake on a plain port"
            log.info("TLS handshake on a plain port listener=%s peer=%s: closing (the TLS"
                     " listener is elsewhere)", self.listener.spec.name, self.peer)
            return
        super()._log_protocol_error(error)


def server_sockets(server: asyncio.AbstractServer) -> list[socket.socket]:
    """A server's sockets: a tuple under asyncio (as typeshed says), a list under uvloop,
    which this module's compiled code would refuse as not the annotated tuple."""
    return list(cast(Any, server).sockets)


class Listener:
    """One listening socket and its admission rules."""

    def __init__(
        self, spec: ListenerSpec, broker: Broker, certificates: ServerCertificates | None,
        reuse_port: bool = False,
    ) -> None:
        self.spec = spec
        self.reuse_port = reuse_port  # workers: every worker listens on the same port
        self.broker = broker
        self.certificates = certificates
        self.admission = Admission(spec.rules, spec.max_connections, spec.max_connections_per_ip)
        self.port = 0
        self.server: asyncio.base_events.Server | None = None
        self.factory: Callable[[], asyncio.Protocol]  # what each accepted socket starts with
        # Plain MQTT, the common case: no gate, and (on Linux) no uvloop transport (stream.py).
        self.streams = not spec.tls and spec.path is None and streams_available()
        self.acceptors: list[TcpAcceptor] = []
        if not spec.tls and spec.path is None:
            self.factory = TcpClientProtocol.for_listener(self)
        else:
            self.factory = partial(Gate, self)
        self.twins: list[asyncio.base_events.Server] = []  # the same socket, more handles
        # When to open the twins, and a descriptor of the socket to read its accept queue and
        # make the twins with: both set at start, where the platform tells the queue's length.
        self.watch: AcceptQueueWatch | None = None
        self._probe: socket.socket | None = None
        self._widening: asyncio.Task[None] | None = None
        self.cert_username = certificates is not None and certificates.cfg.cert_username
        mqtt = broker.config.mqtt
        self.deadline = mqtt.connect_timeout
        self.max_frame = 2 * mqtt.max_packet_size + 4096  # a frame may hold a few packets

    async def start(self) -> None:
        spec = self.spec
        loop = asyncio.get_running_loop()
        try:
            if self.streams:
                await self._start_streams(loop)
                return
            self.server = server = await loop.create_server(
                self.factory, spec.bind, spec.port, reuse_address=True, backlog=4096,
                reuse_port=self.reuse_port or None,
            )
            bound = server_sockets(server)
            for sock in bound:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if can_watch() and len(bound) == 1:  # (several: one handle each)
                sock = bound[0]
                self._probe = socket.socket(sock.family, sock.type, sock.proto,
                                            os.dup(sock.fileno()))
                self.watch = AcceptQueueWatch()
        except OSError as exc:
            self.close()
            # asyncio's strerror is a sentence of its own; the errno's text is what a worker
            # node's supervisor prints for the same problem.
            reason = os.strerror(exc.errno) if exc.errno else exc.strerror or str(exc)
            raise ListenerError(
                f"cannot listen listener={spec.name} bind={spec.bind} port={spec.port}"
                f" error={reason}"
            ) from None
        self.port = bound[0].getsockname()[1]

    async def _start_streams(self, loop: asyncio.AbstractEventLoop) -> None:
        """The plain tcp listener: accept on our own, each connection a ``TcpStream``.

        The event loop still binds the sockets (the same addresses, options and errors as
        for the other listeners), without listening; we listen on a descriptor of our own."""
        spec = self.spec
        server = await loop.create_server(
            self.factory, spec.bind, spec.port, reuse_address=True, backlog=4096,
            reuse_port=self.reuse_port or None, start_serving=False,
        )
        try:
            sockets = [socket.socket(sock.family, sock.type, sock.proto, os.dup(sock.fileno()))
                       for sock in server_sockets(server)]
        finally:
            server.close()  # (its descriptors: ours keep the sockets)
        try:
            for sock in sockets:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited
                sock.listen(4096)  # (where a port in use fails)
        except OSError:
            for sock in sockets:
                sock.close()
            raise
        self.acceptors = [TcpAcceptor(sock, self.factory, loop) for sock in sockets]
        self.port = sockets[0].getsockname()[1]

    # ------------------------------------------------------------------ accepting a storm

    def accepted(self) -> None:
        """A connection was accepted. Once per ``watch.interval``: read the accept queue's
        length and open or close the extra handles as the watch says (acceptq.py)."""
        watch = self.watch
        if watch is None:
            return
        now = self.broker.loop.time()
        if now < watch.next_look or self._probe is None:
            return
        try:
            queued = queued_connections(self._probe)
        except OSError:  # (the socket is closing)
            return
        change = watch.looked(now, queued)
        if change is Change.WIDEN:
            self._widening = self.broker.loop.create_task(self._widen())
        elif change is Change.NARROW:
            self._narrow()

    async def _widen(self) -> None:
        """Open ``ACCEPTS_PER_TURN - 1`` more handles on the listening socket."""
        loop = asyncio.get_running_loop()
        try:
            while len(self.twins) < ACCEPTS_PER_TURN - 1 and self._probe is not None:
                self.twins.append(await _twin_server(loop, self.factory, self._probe))
        except OSError as exc:  # (out of descriptors: one handle still accepts)
            log.warning("cannot add accept handles listener=%s error=%s", self.spec.name, exc)
        finally:
            if self._widening is asyncio.current_task():  # (not a later widening's)
                self._widening = None

    def _narrow(self) -> None:
        if self._widening is not None:
            self._widening.cancel()
            self._widening = None
        twins, self.twins = self.twins, []
        for server in twins:
            server.close()

    def stack(self, decision: Decision, peer: str) -> asyncio.Protocol:
        """The protocols above the socket for an admitted (or over-limit) connection from
        ``peer`` ("host:port")."""
        ticket = decision.ticket
        assert ticket is not None
        spec = self.spec
        if not spec.tls and spec.path is None:  # plain MQTT, the common case: no layers
            if decision.verdict is Verdict.OVER_LIMIT:
                return Refuser(self, ticket)
            return ListenerClientProtocol(self.broker, ticket, None, peer)

        def mqtt(identity: str | None,
                 kind: type[ListenerClientProtocol] = ListenerClientProtocol) -> asyncio.Protocol:
            if decision.verdict is Verdict.OVER_LIMIT:
                return Refuser(self, ticket)
            return kind(self.broker, ticket, identity, peer)

        def above_tls(identity: str | None) -> asyncio.Protocol:
            if spec.path is None:
                return mqtt(identity)
            return WebSocketLayer(spec.name, spec.path,
                                  lambda: mqtt(identity, WebSocketClientProtocol), self.max_frame,
                                  self.deadline, ticket)

        if not spec.tls:
            return above_tls(None)
        assert self.certificates is not None
        return TLSLayer(spec.name, self.certificates.context, above_tls, self.deadline,
                        self.cert_username, ticket)

    def close(self) -> None:
        """Stop listening: the socket closes with the last of its handles."""
        self._narrow()
        if self.server is not None:
            self.server.close()
        for acceptor in self.acceptors:
            acceptor.close()
        self.acceptors = []
        if self._probe is not None:
            self._probe.close()
            self._probe = None

    async def wait_closed(self) -> None:
        if self.server is not None:
            await self.server.wait_closed()


async def _twin_server(loop: asyncio.AbstractEventLoop, factory: Callable[[], asyncio.Protocol],
                       sock: socket.socket) -> asyncio.base_events.Server:
    """A server polling the listening socket ``sock`` through a descriptor of its own (a
    ``dup``): the same accept queue, one more accept per loop turn."""
    twin = socket.socket(sock.family, sock.type, sock.proto, os.dup(sock.fileno()))
    try:
        return await loop.create_server(factory, sock=twin, backlog=4096)
    except BaseException:
        twin.close()
        raise


class Listeners:
    """Every listener of a node; start-up, the port file, SIGHUP reload, shutdown."""

    def __init__(self, config: BrokerConfig, broker: Broker, reuse_port: bool = False) -> None:
        specs = listener_specs(config)
        self.certificates: ServerCertificates | None = None
        if any(spec.tls for spec in specs):
            self.certificates = ServerCertificates(config.tls)  # TLSConfigError if unusable
            if config.tls.cert_username:
                broker.authenticator = CertificateAuthenticator(broker.authenticator)
        self.listeners = [
            Listener(spec, broker, self.certificates, reuse_port) for spec in specs
        ]

    async def start(self) -> None:
        """Listen on every socket; ``ListenerError`` (and nothing left open) if one fails."""
        try:
            for listener in self.listeners:
                await listener.start()
        except ListenerError:
            self.close()
            raise

    def port(self, name: str = "tcp") -> int:
        return next(listener.port for listener in self.listeners if listener.spec.name == name)

    def binds(self) -> list[str]:
        return [listener.spec.bind for listener in self.listeners]

    def describe(self) -> str:
        """``tls=127.0.0.1:8883 ws=127.0.0.1:8083/mqtt`` for the extra listeners, for the log."""
        parts = []
        for listener in self.listeners[1:]:
            spec = listener.spec
            parts.append(f"{spec.name}={spec.bind}:{listener.port}{spec.path or ''}")
        return " ".join(parts)

    def port_file_text(self) -> str:
        """The TCP port on the first line (as before), then ``name=port`` for every listener."""
        lines = [str(self.port("tcp"))]
        lines += [f"{listener.spec.name}={listener.port}" for listener in self.listeners]
        return "\n".join(lines) + "\n"

    def reload_tls(self, cfg: TLSConfig | None = None) -> bool:
        """Re-read the certificate files (SIGHUP; from ``cfg`` when given: the configuration
        changed); False if there is no TLS or it failed."""
        return self.certificates is not None and self.certificates.reload(cfg)

    def close(self) -> None:
        for listener in self.listeners:
            listener.close()

    async def wait_closed(self) -> None:
        for listener in self.listeners:
            await listener.wait_closed()

    def statistics(self) -> dict[str, Any]:
        return {listener.spec.name: listener.admission.statistics() for listener in self.listeners}
