"""Serving a service through the broker: ``ServiceWorker(client, "billing", handler).run()``.

The worker offers the service (SUBSCRIBE ``$service/NAME`` with its ``credit``: the most
requests it runs at once), runs ``handler(request)`` for each request it gets, concurrently up
to its credit, and publishes what the handler returns as the reply: on the request's Response
Topic, with its Correlation Data, its ``meshmq-request-id`` and ``meshmq-retry`` (so that a
reply sent again after a reconnect is recognised wherever it lands). The client behind it
subscribes again on every connection and resends an unacknowledged reply (the broker
acknowledges a reply once the request is complete). A request delivered again while this
worker still runs it is not run a second time; one that comes back later (``dup``) is: the
service's idempotence is its own.
A handler that raises replies with the user property ``error`` (its message), which a meshmq
caller raises as ``ServiceError("worker-error")``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshmq.client.calls import REQUEST_ID, WORKER_ERROR
from meshmq.mqtt.packets import Publish
from meshmq.mqtt.properties import Properties, PropertyId, get_property

if TYPE_CHECKING:
    from meshmq.client.client import Client

log = logging.getLogger("meshmq.client")


@dataclass(frozen=True, slots=True)
class Request:
    """A request as its service worker gets it, envelope included."""

    service: str
    payload: bytes
    properties: Properties
    request_id: str
    sender: str
    retry: int
    dup: bool
    reply_topic: str
    correlation: bytes | None


Handler = Callable[[Request], Awaitable[bytes]]


def request_of(service: str, packet: Publish) -> Request | None:
    """The request a delivery is (None: not one, e.g. no Response Topic)."""
    properties = packet.properties
    reply_topic = get_property(properties, PropertyId.RESPONSE_TOPIC)
    if not reply_topic:
        return None
    users = dict(get_property(properties, PropertyId.USER_PROPERTY) or [])
    retry = users.get("meshmq-retry", "0")
    return Request(service, packet.payload, properties, users.get(REQUEST_ID, ""),
                   users.get("meshmq-sender", ""), int(retry) if retry.isdigit() else 0,
                   users.get("meshmq-dup") == "true", reply_topic,
                   get_property(properties, PropertyId.CORRELATION_DATA))


class ServiceWorker:
    """One service served by one client (see the module docstring)."""

    def __init__(self, client: Client, service: str, handler: Handler, credit: int = 1) -> None:
        if credit < 1:
            raise ValueError("credit must be at least 1")
        self.client = client
        self.service = service
        self.handler = handler
        self.credit = credit
        self.topic = f"$service/{service}"
        self.running: set[str] = set()  # request ids being handled
        self.served = 0  # requests handled (their replies sent or being sent)

    async def run(self) -> None:
        """Offer the service and serve it until cancelled."""
        requests: asyncio.Queue[Publish] = asyncio.Queue()
        remove = self.client.add_listener(
            lambda packet: requests.put_nowait(packet) if packet.topic == self.topic else None)
        try:
            code = await self.client.subscribe(self.topic, 1, {
                PropertyId.USER_PROPERTY: [("credit", str(self.credit))]})
            if code >= 0x80:
                raise PermissionError(f"the broker refused the offer of {self.service} "
                                      f"(0x{code:02X})")
            slots = asyncio.Semaphore(self.credit)
            async with asyncio.TaskGroup() as tasks:
                while True:
                    packet = await requests.get()
                    request = request_of(self.service, packet)
                    if request is None or request.request_id in self.running:
                        continue
                    await slots.acquire()
                    self.running.add(request.request_id)
                    tasks.create_task(self._serve(request, slots))
        finally:
            remove()

    async def _serve(self, request: Request, slots: asyncio.Semaphore) -> None:
        users = [(REQUEST_ID, request.request_id), ("meshmq-retry", str(request.retry))]
        try:
            try:
                payload = await self.handler(request)
            except Exception as error:  # the caller hears of it; the worker goes on
                log.warning("service handler failed service=%s request_id=%s: %r",
                            self.service, request.request_id, error)
                payload = b""
                users.append((WORKER_ERROR, str(error) or type(error).__name__))
            properties: Properties = {PropertyId.USER_PROPERTY: users}
            if request.correlation is not None:
                properties[PropertyId.CORRELATION_DATA] = request.correlation
            self.served += 1
            await self.client.publish(request.reply_topic, payload, 1, properties)
        finally:
            self.running.discard(request.request_id)
            slots.release()
