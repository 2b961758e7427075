"""Calling a service through the broker: ``await client.call("billing", payload)``.

A call publishes a request to ``$service/NAME`` (QoS 1) with the client's reply topic
(``replies/CLIENT-ID`` by default, subscribed to once) and a fresh Correlation Data, and waits
for the reply with that Correlation Data. It repeats the same request (same Correlation Data)
if no reply came within ``repeat_every`` seconds, or right after a reconnect (the reply may have
been lost with the connection): the broker's deduplication window answers a repeat with the
remembered reply, or joins it to the pending request, so a repeat never runs the service
twice. A request the broker did not store for a passing reason (``TRANSIENT``: its
dispatcher's process is restarting, say) is sent again after a short backoff. An error reply
raises ``ServiceError`` with its kind (``timeout``, ``no-responders``, ``not-authorized``...);
no reply at all within ``timeout`` raises ``CallTimeout``.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshmq.mqtt.packets import Publish
from meshmq.mqtt.properties import Properties, PropertyId, get_property
from meshmq.mqtt.reason_codes import ReasonCode

if TYPE_CHECKING:
    from meshmq.client.client import Client

REQUEST_ID = "meshmq-request-id"
# PUBACK reason codes that mean "not stored, try again": the partition's leader is down (0x80),
# the broker is busy (0x89) or its log queue is full (0x97).
TRANSIENT = frozenset({ReasonCode.UNSPECIFIED_ERROR, ReasonCode.SERVER_BUSY,
                       ReasonCode.QUOTA_EXCEEDED})
ERROR = "meshmq-error"
WORKER_ERROR = "error"  # set by meshmq's service worker helper when its handler failed


class ServiceError(Exception):
    """The call failed: ``kind`` is the broker's error (``meshmq-error``), ``refused`` when
    the broker refused the request itself, or ``worker-error`` when the service worker's
    handler failed (meshmq's helper replies so)."""

    def __init__(self, kind: str, detail: str = "", request_id: str | None = None) -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.detail = detail
        self.request_id = request_id


class CallTimeout(ServiceError):
    """No reply came within the call's timeout."""


@dataclass(frozen=True, slots=True)
class Reply:
    payload: bytes
    properties: Properties
    request_id: str | None

    def user(self, name: str) -> str | None:
        """The last value of user property ``name`` (None: absent)."""
        pairs = get_property(self.properties, PropertyId.USER_PROPERTY) or []
        values = [value for key, value in pairs if key == name]
        return values[-1] if values else None


class Calls:
    """A client's calls in progress (see the module docstring)."""

    def __init__(self, client: Client, reply_prefix: str = "replies",
                 repeat_every: float = 5.0) -> None:
        self.client = client
        self.reply_topic = f"{reply_prefix}/{client.client_id}"
        self.repeat_every = repeat_every
        self.pending: dict[bytes, asyncio.Future[Publish]] = {}
        self._subscribed: asyncio.Future[int] | None = None
        self._reconnected = asyncio.Event()
        client.add_listener(self._on_message)
        client.on_reconnect(self._on_reconnect)

    def _on_message(self, packet: Publish) -> None:
        if packet.topic != self.reply_topic:
            return
        correlation = get_property(packet.properties, PropertyId.CORRELATION_DATA)
        future = self.pending.get(correlation or b"")
        if future is not None and not future.done():
            future.set_result(packet)

    def _on_reconnect(self) -> None:
        self._reconnected.set()
        self._reconnected = asyncio.Event()

    async def _subscribe(self) -> None:
        if self._subscribed is None:
            self._subscribed = asyncio.ensure_future(
                self.client.subscribe(self.reply_topic, 1))
        code = await asyncio.shield(self._subscribed)
        if code >= 0x80:
            self._subscribed = None
            raise ServiceError("refused", f"cannot subscribe to {self.reply_topic} "
                                          f"(0x{code:02X})")

    async def call(self, service: str, payload: bytes, timeout: float,
                   properties: Properties | None) -> Reply:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        correlation = uuid.uuid4().bytes
        future: asyncio.Future[Publish] = loop.create_future()
        self.pending[correlation] = future
        request = {**(properties or {}), PropertyId.RESPONSE_TOPIC: self.reply_topic,
                   PropertyId.CORRELATION_DATA: correlation}
        backoff = 0.05
        try:
            await asyncio.wait_for(self._subscribe(), timeout)
            while not future.done():
                left = deadline - loop.time()
                if left <= 0:
                    raise CallTimeout("timeout", f"no reply from {service} in {timeout:g} s")
                reconnected = self._reconnected
                code = await asyncio.wait_for(self.client.publish(
                    f"$service/{service}", payload, 1, request), left)
                if code in TRANSIENT:  # not stored (its dispatcher restarts, say): again
                    backoff = min(backoff * 2, 1.0)
                    await asyncio.sleep(min(backoff, max(0.0, deadline - loop.time())))
                    continue
                if code >= 0x80:
                    await self._refused(future, code, deadline)
                waiter = asyncio.ensure_future(reconnected.wait())
                watched: set[asyncio.Future[Any]] = {future, waiter}
                try:
                    await asyncio.wait(watched, timeout=min(
                        self.repeat_every, max(0.0, deadline - loop.time())),
                        return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
        except TimeoutError:
            raise CallTimeout("timeout", f"no reply from {service} in {timeout:g} s") from None
        finally:
            self.pending.pop(correlation, None)
        return _result(future.result())

    async def _refused(self, future: asyncio.Future[Publish], code: int,
                       deadline: float) -> None:
        """The broker refused the request: its error reply (not-authorized) may follow;
        otherwise the PUBACK's reason code says why."""
        if code == ReasonCode.NOT_AUTHORIZED:
            left = deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(asyncio.shield(future), min(1.0, max(0.0, left)))
                return
            except TimeoutError:
                raise ServiceError("not-authorized") from None
        raise ServiceError("refused", f"PUBACK 0x{code:02X}")


def _result(packet: Publish) -> Reply:
    reply = Reply(packet.payload, packet.properties, None)
    request_id = reply.user(REQUEST_ID)
    reply = Reply(packet.payload, packet.properties, request_id)
    error = reply.user(ERROR)
    if error is not None:
        raise ServiceError(error, request_id=request_id)
    failed = reply.user(WORKER_ERROR)
    if failed is not None:
        raise ServiceError("worker-error", failed, request_id)
    return reply
