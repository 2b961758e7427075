"""The workers' side of the metadata service: a ``MetadataStore`` over the local socket.

Theory of operation
-------------------
``MetaClient`` keeps one connection to its node's metadata service (cluster/metaproc.py) and
dials it again whenever it is lost (``REDIAL_FIRST`` doubling to ``REDIAL_MAX``), for as long
as the client is open. Requests are coroutines on the caller's loop: each waits for its
answer until its deadline (``request_timeout``, a little longer than the service's own, so
the service's ``NoQuorum`` with its reason arrives first).

Lost connections. The client sends nothing on a connection before the service's greeting
(a refused connection is closed before one). A request whose answer has not come is sent
again on the next connection: a write with the same request id, so it applies at most once
(cluster/metastate.py), and a read as it is. A request never sent before its deadline
raises ``NoQuorum`` (it did not apply: the service could not be reached); one sent and not
answered raises ``Timeout`` (its outcome is unknown).

Watches. With at least one watch, the client asks the service for changes on each
connection and keeps a mirror of the state (``view_nowait``). Watch callbacks see each
version at most once and never an older one: after a reconnection the service starts again
with its whole state, which can be older than what was already seen (a restarted service
replays its log); the client then follows it silently until it has caught up, and hands on
the whole state as one reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from meshmq.broker.transport.layer import stream_transport
from meshmq.cluster.metadata import (
    CasResult,
    Change,
    Entry,
    Json,
    Member,
    MetadataError,
    NoQuorum,
    Timeout,
    View,
    WatchCallback,
    drop_member,
    members_of,
    put_member,
)
from meshmq.cluster.metaproto import (
    FrameDecoder,
    ProtocolError,
    change_from_json,
    encode,
    error_from_json,
    result_from_json,
    view_from_json,
)
from meshmq.cluster.raftstore import RaftSettings

log = logging.getLogger("meshmq.metadata")

REDIAL_FIRST = 0.01
REDIAL_MAX = 1.0
REQUEST_TIMEOUT = RaftSettings().request_timeout + 2.0


@dataclass
class _Pending:
    message: dict[str, Any]
    future: asyncio.Future[dict[str, Any]]
    sent: bool = False


class ClientWatch:
    def __init__(self, client: MetaClient, callback: WatchCallback) -> None:
        self.client = client
        self.callback = callback

    def cancel(self) -> None:
        self.client._watches.discard(self)


@dataclass
class _Mirror:
    """The state as the watches last saw it, and one being caught up after a reconnect."""

    version: int = -1
    entries: dict[str, Entry] = field(default_factory=dict)
    catching_up: tuple[int, dict[str, Entry]] | None = None


class MetaClient:
    """A ``MetadataStore`` through this node's metadata service; see the module docstring.
    ``connect()`` before use, ``close()`` at the end."""

    def __init__(self, socket_name: str, request_timeout: float = REQUEST_TIMEOUT) -> None:
        self.socket_name = socket_name if socket_name.startswith("\0") else "\0" + socket_name
        self.request_timeout = request_timeout
        self._ids = itertools.count(1)
        self._requests = f"{uuid.uuid4().hex[:12]}-"
        self._pending: dict[int, _Pending] = {}
        self._watches: set[ClientWatch] = set()
        self._mirror = _Mirror()
        self._decoder = FrameDecoder()
        self._transport: asyncio.Transport | None = None
        self._connected = asyncio.Event()
        self._lost: asyncio.Event = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self._closing = False

    # -- connection -------------------------------------------------------------------------------

    async def connect(self, timeout: float | None = None) -> None:
        """Start dialing and wait until connected (``NoQuorum`` if not within ``timeout``,
        by default the request timeout; the client keeps dialing)."""
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run())
        try:
            async with asyncio.timeout(self.request_timeout if timeout is None else timeout):
                await self._connected.wait()
        except TimeoutError:
            raise NoQuorum(f"the node's metadata service does not answer on socket "
                           f"{self.socket_name[1:]!r}") from None

    async def close(self) -> None:
        self._closing = True
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
            self._runner = None
        if self._transport is not None:
            self._transport.close()
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(MetadataError("the metadata client is closed"))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        delay = REDIAL_FIRST
        while not self._closing:
            self._lost.clear()
            # The socket made here: uvloop's create_unix_connection refuses an abstract name
            # given as a path (EINVAL), as the mesh's sockets do (cluster/sockets.py).
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, self.socket_name)
                await loop.create_unix_connection(lambda: _Connection(self), sock=sock)
            except OSError as error:
                sock.close()
                log.debug("metadata service not reached socket=%r error=%s",
                          self.socket_name[1:], error)
            else:
                linked_at = loop.time()
                await self._lost.wait()
                if loop.time() - linked_at > REDIAL_MAX:
                    delay = REDIAL_FIRST  # it served a while: dial again at once
                    continue
            # not reached, refused at once, or flapping: back off
            await asyncio.sleep(delay)
            delay = min(delay * 2, REDIAL_MAX)

    def _opened(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._decoder = FrameDecoder()

    def _greeted(self) -> None:
        self._connected.set()
        if self._watches:
            self._send_now({"id": 0, "op": "watch"})
        for ident in sorted(self._pending):
            self._send_pending(self._pending[ident])

    def _closed(self) -> None:
        was_connected = self._connected.is_set()
        self._transport = None
        self._connected.clear()
        self._lost.set()
        if self._closing:
            return
        if was_connected:
            log.warning("metadata service connection lost socket=%r", self.socket_name[1:])
        else:
            log.debug("metadata service closed the connection before its greeting (this "
                      "process refused?) socket=%r", self.socket_name[1:])

    def _received(self, data: bytes) -> None:
        try:
            messages = self._decoder.feed(data)
            for message in messages:
                self._handle(message)
        except ProtocolError as error:
            log.error("metadata service sent something else than its protocol: %s", error)
            if self._transport is not None:
                self._transport.abort()

    def _handle(self, message: dict[str, Any]) -> None:
        if "hello" in message:
            self._greeted()
            return
        if "change" in message:
            self._changed(change_from_json(message["change"]))
            return
        pending = self._pending.pop(message.get("id", -1), None)
        if pending is not None and not pending.future.done():
            pending.future.set_result(message)

    # -- requests ---------------------------------------------------------------------------------

    def _send_now(self, message: dict[str, Any]) -> bool:
        transport = self._transport
        if transport is None or transport.is_closing() or not self._connected.is_set():
            return False
        transport.write(encode(message))
        return True

    def _send_pending(self, pending: _Pending) -> None:
        if self._send_now(pending.message):
            pending.sent = True

    async def _request(self, op: str, **fields: Any) -> dict[str, Any]:
        ident = next(self._ids)
        loop = asyncio.get_running_loop()
        pending = _Pending({"id": ident, "op": op, **fields}, loop.create_future())
        self._pending[ident] = pending
        self._send_pending(pending)
        try:
            async with asyncio.timeout(self.request_timeout):
                answer = await pending.future
        except TimeoutError:
            if not pending.sent:
                raise NoQuorum(f"the node's metadata service was not reached within "
                               f"{self.request_timeout:.1f} s (socket "
                               f"{self.socket_name[1:]!r})") from None
            raise Timeout(f"no answer from the node's metadata service within "
                          f"{self.request_timeout:.1f} s: the outcome is unknown") from None
        finally:
            self._pending.pop(ident, None)
        if "error" in answer:
            raise error_from_json(answer["error"])
        return answer

    def _request_id(self) -> str:
        return f"{self._requests}{next(self._ids)}"

    # -- MetadataStore ----------------------------------------------------------------------------

    async def read(self) -> View:
        return view_from_json((await self._request("read"))["view"])

    async def cas(self, key: str, expected: int, value: Json,
                  guards: Mapping[str, int] | None = None) -> CasResult:
        answer = await self._request("cas", key=key, expected=expected, value=value,
                                     guards=dict(guards or {}), request=self._request_id())
        return result_from_json(answer["result"])

    async def delete(self, key: str, expected: int,
                     guards: Mapping[str, int] | None = None) -> CasResult:
        answer = await self._request("delete", key=key, expected=expected,
                                     guards=dict(guards or {}), request=self._request_id())
        return result_from_json(answer["result"])

    def watch(self, callback: WatchCallback) -> ClientWatch:
        watch = ClientWatch(self, callback)
        first = not self._watches
        self._watches.add(watch)
        if first:
            self._send_now({"id": 0, "op": "watch"})
        elif self._mirror.version >= 0:  # the others' mirror is there: start from it
            mirror = self._mirror
            asyncio.get_running_loop().call_soon(self._deliver_to, watch, Change(
                mirror.version, MappingProxyType(dict(mirror.entries)), reset=True))
        return watch

    async def add_member(self, member: Member) -> int:
        return await put_member(self, member)

    async def remove_member(self, node_id: str) -> int:
        return await drop_member(self, node_id)

    async def members(self) -> dict[str, Member]:
        return members_of(await self.read())

    async def status(self) -> dict[str, Any]:
        status = (await self._request("status"))["status"]
        assert isinstance(status, dict)
        return status

    async def leave(self) -> str:
        """Take this node's voter out of the Raft voter set (raftvoters.py)."""
        return str((await self._request("leave"))["done"])

    async def remove_voter(self, address: str) -> str:
        """Take the voter at ``address`` (a node forgotten for good) out of the voter set."""
        return str((await self._request("remove_voter", address=address))["done"])

    def view_nowait(self) -> View | None:
        """The state as the watches last saw it (None before the first change arrived, or
        without a watch)."""
        mirror = self._mirror
        if mirror.version < 0:
            return None
        return View(mirror.version, MappingProxyType(dict(mirror.entries)))

    # -- watches ----------------------------------------------------------------------------------

    def _changed(self, change: Change) -> None:
        mirror = self._mirror
        if change.reset:
            entries = {key: entry for key, entry in change.changed.items() if entry is not None}
            mirror.catching_up = (change.version, entries)
        elif mirror.catching_up is not None:
            if change.version <= mirror.catching_up[0]:
                return
            _apply(mirror.catching_up[1], change)
            mirror.catching_up = (change.version, mirror.catching_up[1])
        else:
            if change.version <= mirror.version:
                return  # seen already
            _apply(mirror.entries, change)
            mirror.version = change.version
            self._deliver(change)
            return
        version, entries = mirror.catching_up
        if version < mirror.version:
            return  # still behind what the watches saw
        seen = version == mirror.version  # the same version is the same state: not again
        mirror.version, mirror.entries, mirror.catching_up = version, entries, None
        if not seen:
            self._deliver(Change(version, MappingProxyType(dict(entries)), reset=True))

    def _deliver(self, change: Change) -> None:
        for watch in list(self._watches):
            self._deliver_to(watch, change)

    def _deliver_to(self, watch: ClientWatch, change: Change) -> None:
        if watch not in self._watches:
            return
        try:
            watch.callback(change)
        except Exception:  # a watcher's bug must not cut the others off
            log.exception("metadata watch callback failed")


def _apply(entries: dict[str, Entry], change: Change) -> None:
    for key, entry in change.changed.items():
        if entry is None:
            entries.pop(key, None)
        else:
            entries[key] = entry


class _Connection(asyncio.Protocol):
    def __init__(self, client: MetaClient) -> None:
        self.client = client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client._opened(stream_transport(transport))

    def data_received(self, data: bytes) -> None:
        self.client._received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._closed()
