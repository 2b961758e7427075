"""An asyncio MQTT 5 client that stays connected: a list of brokers, reconnects, resends.

Theory of operation
-------------------
``Client`` keeps one connection at a time to one of ``brokers`` (tried in turn, from the last
that worked, with a backoff between rounds). Its session is persistent by default
(``clean_start=False`` with a session expiry), so that what the broker holds for it survives a
dropped connection. On every new connection it:

1. subscribes again to everything it subscribed to (a services offer lasts only as long as its
   connection, and a new session has no subscriptions), then
2. resends every QoS 1 publish not yet acknowledged, with DUP set, in order, as the broker's
   Receive Maximum allows (MQTT-4.4.0-1), before anything new,

and only then counts as connected. ``publish`` therefore returns once the broker acknowledged
the message, whichever connection that took; ``subscribe`` once the broker granted it (and it
is renewed on each connection). Incoming messages go to the listeners (``add_listener``) and
are acknowledged after they ran. A connection that breaks the protocol, a missing PINGRESP
(keep alive) or a DISCONNECT from the broker ends the connection, never the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl as ssl_module
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshmq.client.calls import Calls, Reply
from meshmq.client.protocol import Framer, encode
from meshmq.mqtt.errors import RemoteProtocolError
from meshmq.mqtt.packets import (
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
)
from meshmq.mqtt.properties import Properties, PropertyId, get_property

log = logging.getLogger("meshmq.client")

Listener = Callable[[Publish], None]


class ConnectFailed(ConnectionError):
    """No broker of the list took the connection in time (the message says why)."""


@dataclass(slots=True)
class _Outgoing:
    packet: Publish
    done: asyncio.Future[int]
    sent: bool = False  # on the current connection


def parse_brokers(brokers: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"h1:1883,h2:1884"`` or a list of ``host:port`` (the port defaults to 1883)."""
    items = brokers.split(",") if isinstance(brokers, str) else list(brokers)
    found = []
    for item in (entry.strip() for entry in items):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit():
            host, port = item, "1883"
        found.append((host.strip("[]"), int(port)))
    if not found:
        raise ValueError("no broker to connect to")
    return found


class Client:
    """One MQTT 5 client identity, kept connected (see the module docstring)."""

    def __init__(self, brokers: str | Sequence[str] = "127.0.0.1:1883",
                 client_id: str | None = None, *, clean_start: bool = False,
                 session_expiry: int = 3600, keep_alive: int = 30,
                 username: str | None = None, password: str | None = None,
                 ssl: ssl_module.SSLContext | None = None, connect_timeout: float = 5.0,
                 reconnect_delay: tuple[float, float] = (0.05, 2.0)) -> None:
        self.brokers = parse_brokers(brokers)
        self.client_id = client_id or f"meshmq-{uuid.uuid4().hex[:16]}"
        self.clean_start = clean_start
        self.session_expiry = session_expiry
        self.keep_alive = keep_alive
        self.username = username
        self.password = password
        self.ssl = ssl
        self.connect_timeout = connect_timeout
        self.reconnect_delay = reconnect_delay
        self.broker: tuple[str, int] | None = None  # the one connected to
        self.connections = 0  # how many connections were made (each a reconnect after the 1st)
        self.last_error = ""
        self._listeners: list[Listener] = []
        self._reconnected: list[Callable[[], None]] = []
        self._subscriptions: dict[str, tuple[SubscriptionOptions, Properties]] = {}
        self._outgoing: OrderedDict[int, _Outgoing] = OrderedDict()
        self._subacks: dict[int, asyncio.Future[list[int]]] = {}
        self._next_id = 1
        self._window = 65535
        self._in_flight = 0
        self._writer: asyncio.StreamWriter | None = None
        self._connected: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._current = 0  # index in ``brokers`` to try first
        self._framer = Framer()  # the current connection's
        self._early: list[Packet] = []  # packets that came with the CONNACK
        self._connack = Connack()
        self.connack = Connack()  # the current connection's (its properties: the broker's)
        self._calls: Calls | None = None

    # ------------------------------------------------------------------ life

    async def start(self, timeout: float | None = None) -> None:
        """Connect (keep trying the brokers in turn); returns once connected, or raises
        ``ConnectFailed`` after ``timeout`` seconds (None: ``connect_timeout`` x brokers)."""
        if self._task is None:
            self._connected = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        wait = timeout if timeout is not None else self.connect_timeout * len(self.brokers)
        try:
            await asyncio.wait_for(self.wait_connected(), wait)
        except TimeoutError:
            why = self.last_error or "no answer"
            raise ConnectFailed(f"cannot connect to {self._where()}: {why}") from None

    async def wait_connected(self) -> None:
        assert self._connected is not None, "start() first"
        await self._connected.wait()

    @property
    def connected(self) -> bool:
        return self._connected is not None and self._connected.is_set()

    async def close(self) -> None:
        """Disconnect cleanly (the session stays, for its expiry) and stop reconnecting."""
        self._closing = True
        writer = self._writer
        if writer is not None and not writer.is_closing():
            with contextlib.suppress(OSError):
                writer.write(encode(Disconnect()))
                await asyncio.wait_for(writer.drain(), 1.0)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for outgoing in self._outgoing.values():
            if not outgoing.done.done():
                outgoing.done.set_exception(ConnectionError("client closed"))
        self._outgoing.clear()

    async def __aenter__(self) -> Client:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _where(self) -> str:
        return ",".join(f"{host}:{port}" for host, port in self.brokers)

    # ------------------------------------------------------------------ what users do

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """``listener(publish)`` for every message received; returns its remover."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def on_reconnect(self, callback: Callable[[], None]) -> None:
        """``callback()`` after each connection but the first (messages may have been lost
        with the previous one: a caller repeats what it waits for)."""
        self._reconnected.append(callback)

    async def publish(self, topic: str, payload: bytes = b"", qos: int = 1,
                      properties: Properties | None = None, retain: bool = False) -> int:
        """Publish; at QoS 1 wait for the PUBACK (across reconnects) and return its reason
        code; at QoS 0 return 0 once written."""
        if qos not in (0, 1):
            raise ValueError("qos must be 0 or 1")
        if qos == 0:
            await self.wait_connected()
            self._write(Publish(topic, payload, 0, retain, False, None, properties or {}))
            return 0
        packet_id = self._allocate()
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._outgoing[packet_id] = _Outgoing(
            Publish(topic, payload, 1, retain, False, packet_id, properties or {}), done)
        if self.connected:
            self._pump()
        return await done

    async def call(self, service: str, payload: bytes = b"", timeout: float = 10.0,
                   properties: Properties | None = None) -> Reply:
        """Call ``service`` through the broker and return its reply (client/calls.py:
        raises ``ServiceError`` for an error reply, ``CallTimeout`` after ``timeout``)."""
        if self._calls is None:
            self._calls = Calls(self)
        return await self._calls.call(service, payload, timeout, properties)

    async def flush(self) -> None:
        """Wait until every QoS 1 publish made so far is acknowledged."""
        waiting = [outgoing.done for outgoing in self._outgoing.values()]
        if waiting:
            await asyncio.gather(*waiting, return_exceptions=True)

    async def subscribe(self, topic_filter: str, qos: int = 1,
                        properties: Properties | None = None) -> int:
        """Subscribe (again on every connection); the reason code of the first SUBACK."""
        options = SubscriptionOptions(qos)
        self._subscriptions[topic_filter] = (options, properties or {})
        while True:
            await self.wait_connected()
            future = self._send_subscribe(topic_filter, options, properties or {})
            try:
                return (await future)[0]
            except ConnectionError:
                continue  # the connection dropped first: the next one subscribes again

    def _allocate(self) -> int:
        for _ in range(65535):
            packet_id = self._next_id
            self._next_id = packet_id % 65535 + 1
            if packet_id not in self._outgoing and packet_id not in self._subacks:
                return packet_id
        raise RuntimeError("no free packet identifier")

    def _send_subscribe(self, topic_filter: str, options: SubscriptionOptions,
                        properties: Properties) -> asyncio.Future[list[int]]:
        packet_id = self._allocate()
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._subacks[packet_id] = future
        self._write(Subscribe(packet_id, [(topic_filter, options)], properties))
        return future

    def _write(self, packet: Packet) -> None:
        writer = self._writer
        if writer is not None and not writer.is_closing():
            writer.write(encode(packet))

    def _pump(self) -> None:
        """Send the publishes not sent on this connection, within the broker's window."""
        for outgoing in self._outgoing.values():
            if self._in_flight >= self._window:
                return
            if not outgoing.sent:
                outgoing.sent = True
                self._in_flight += 1
                self._write(outgoing.packet)
                outgoing.packet.dup = True  # any later send is a resend

    # ------------------------------------------------------------------ the connection

    async def _run(self) -> None:
        delay = self.reconnect_delay[0]
        while not self._closing:
            for step in range(len(self.brokers)):
                index = (self._current + step) % len(self.brokers)
                try:
                    reader, writer = await self._open(*self.brokers[index])
                except (OSError, TimeoutError, RemoteProtocolError, ConnectionError) as error:
                    self.last_error = str(error) or type(error).__name__
                    continue
                self._current = index
                delay = self.reconnect_delay[0]
                try:
                    await self._serve(reader, writer)
                except (OSError, TimeoutError, RemoteProtocolError, ConnectionError) as error:
                    self.last_error = str(error) or type(error).__name__
                finally:
                    self._lost(writer)
                if self._closing:
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.reconnect_delay[1])

    async def _open(self, host: str, port: int
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=self.ssl), self.connect_timeout)
        connect = Connect(self.client_id, clean_start=self.clean_start,
                          keep_alive=self.keep_alive, username=self.username,
                          password=None if self.password is None else self.password.encode(),
                          properties={PropertyId.SESSION_EXPIRY_INTERVAL: self.session_expiry})
        writer.write(encode(connect))
        framer = Framer()
        try:
            while True:
                data = await asyncio.wait_for(reader.read(65536), self.connect_timeout)
                if not data:
                    raise ConnectionError(f"{host}:{port} closed the connection")
                packets = framer.feed(data)
                if packets:
                    break
        except BaseException:
            writer.close()
            raise
        connack = packets[0]
        if not isinstance(connack, Connack) or connack.reason_code >= 0x80:
            writer.close()
            code = getattr(connack, "reason_code", -1)
            raise ConnectionError(f"{host}:{port} refused the connection (0x{code:02X})")
        self._framer = framer
        self._early = packets[1:]
        self._connack = connack
        return reader, writer

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connack = self.connack = self._connack
        self._writer = writer
        self.broker = self.brokers[self._current]
        self.connections += 1
        self._window = get_property(connack.properties, PropertyId.RECEIVE_MAXIMUM, 65535)
        self._in_flight = 0
        for topic_filter, (options, properties) in self._subscriptions.items():
            self._send_subscribe(topic_filter, options, properties)
        for outgoing in self._outgoing.values():
            outgoing.sent = False
        self._pump()
        assert self._connected is not None
        self._connected.set()
        if self.connections > 1:
            for callback in list(self._reconnected):
                callback()
        self._handle(self._early)
        quiet = 0
        interval = max(self.keep_alive * 0.5, 0.5) if self.keep_alive else None
        while True:
            try:
                data = await asyncio.wait_for(reader.read(65536), interval)
            except TimeoutError:
                quiet += 1
                if quiet > 2:
                    raise ConnectionError(
                        "no answer to PINGREQ: the connection is dead") from None
                self._write(Pingreq())
                continue
            if not data:
                raise ConnectionError("the broker closed the connection")
            quiet = 0
            self._handle(self._framer.feed(data))
            if writer.transport.get_write_buffer_size() > 1 << 20:
                await writer.drain()

    def _lost(self, writer: asyncio.StreamWriter) -> None:
        if self._connected is not None:
            self._connected.clear()
        self._writer = None
        writer.close()
        for future in self._subacks.values():
            if not future.done():
                future.set_exception(ConnectionError("connection lost"))
        self._subacks.clear()

    def _handle(self, packets: list[Packet]) -> None:
        for packet in packets:
            if isinstance(packet, Publish):
                for listener in list(self._listeners):
                    try:
                        listener(packet)
                    except Exception:  # a listener's bug must not end the connection
                        log.exception("message listener failed")
                if packet.qos == 1 and packet.packet_id is not None:
                    self._write(Puback(packet.packet_id))
                elif packet.qos == 2 and packet.packet_id is not None:
                    self._write(Pubrec(packet.packet_id))
            elif isinstance(packet, Puback):
                outgoing = self._outgoing.pop(packet.packet_id, None)
                if outgoing is not None:
                    self._in_flight -= 1
                    if not outgoing.done.done():
                        outgoing.done.set_result(packet.reason_code)
                    self._pump()
            elif isinstance(packet, Pubrel):
                self._write(Pubcomp(packet.packet_id))
            elif isinstance(packet, Suback):
                future = self._subacks.pop(packet.packet_id, None)
                if future is not None and not future.done():
                    future.set_result(list(packet.reason_codes))
            elif isinstance(packet, Disconnect):
                raise ConnectionError(
                    f"the broker disconnected us (0x{packet.reason_code:02X})")
