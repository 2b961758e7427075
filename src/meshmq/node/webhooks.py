"""HTTP webhooks: client and publish events, batched and POSTed as JSON by a background task.

Theory of operation
-------------------
The broker calls ``Webhooks`` (its ``BrokerEvents``) on the message path. Each call builds one
small dict and appends it to a queue bounded by ``hooks.queue_size``; when the queue is full the
event is dropped and counted: the message path never waits for HTTP.

One task (``run``) empties the queue: it takes up to ``batch_size`` events (once the first is
there it waits at most ``batch_delay_ms`` for the batch to fill), POSTs them as one JSON
document and, when the POST fails (connection error, timeout, a status other than 2xx), sends
the same batch again after a backoff that doubles from ``retry_backoff_ms`` up to
``retry_backoff_max_ms``. After ``retries`` retries the batch is dropped and its events counted.
Batches go one at a time, in order, so the receiver sees a worker's events in the order they
happened. Each worker of a node posts its own events; the batch's ``worker`` field says which.

``statistics()`` is a plain snapshot of the counters (for ``$SYS``-like reports and the admin
plane); failures and drops are also logged, at most one line per ``LOG_EVERY`` seconds each.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from meshmq.logsetup import kv
from meshmq.mqtt.topics import topic_matches

if TYPE_CHECKING:
    import aiohttp

    from meshmq.broker.message import Message
    from meshmq.config import HooksConfig

log = logging.getLogger("meshmq.webhooks")

LOG_EVERY = 10.0  # seconds between two warnings of one kind (failed POSTs, drops)
CLOSE_GRACE = 2.0  # seconds given at shutdown to send what is still queued


@dataclass(slots=True)
class WebhookStatistics:
    """The webhook counters of one worker (``Webhooks.statistics()`` returns them as a dict)."""

    queued: int = 0  # events waiting now
    sent_events: int = 0
    sent_batches: int = 0
    failed_posts: int = 0  # POSTs that failed (each retry counts)
    dropped_queue_full: int = 0  # events dropped because the queue was full
    dropped_after_retries: int = 0  # events of batches dropped after their last retry


class Webhooks:
    """Queues broker events and posts them in batches (see the module docstring)."""

    def __init__(self, cfg: HooksConfig, worker: int | None = None) -> None:
        self.cfg = cfg
        self.worker = worker
        names = cfg.event_names
        self.wants_connected = "client_connected" in names
        self.wants_disconnected = "client_disconnected" in names
        self.filters = cfg.filters if "publish" in names else ()
        self.queue: deque[dict[str, Any]] = deque()
        self.stats = WebhookStatistics()
        self.closing = False
        self._arrived = asyncio.Event()  # the queue is not empty (or we are closing)
        self._filled = asyncio.Event()  # a whole batch is waiting (or we are closing)
        self._closed = asyncio.Event()  # ends a backoff early
        self._last_warning: dict[str, float] = {}

    # ------------------------------------------------------------------ BrokerEvents

    def client_connected(self, client_id: str, username: str | None, peer: str, protocol: str,
                         clean_start: bool, session_present: bool, keep_alive: int) -> None:
        if self.wants_connected:
            self._put({"event": "client_connected", "ts": time.time(), "client_id": client_id,
                       "username": username, "peer": peer, "protocol": protocol,
                       "clean_start": clean_start, "session_present": session_present,
                       "keep_alive": keep_alive})

    def client_disconnected(self, client_id: str, username: str | None, peer: str,
                            protocol: str, reason: str) -> None:
        if self.wants_disconnected:
            self._put({"event": "client_disconnected", "ts": time.time(),
                       "client_id": client_id, "username": username, "peer": peer,
                       "protocol": protocol, "reason": reason})

    def published(self, message: Message, username: str | None) -> None:
        topic = message.topic
        if not any(topic_matches(topic_filter, topic) for topic_filter in self.filters):
            return
        event = {"event": "publish", "ts": time.time(), "client_id": message.sender,
                 "username": username, "topic": topic, "qos": message.qos,
                 "retain": message.retain, "payload_size": len(message.payload)}
        if self.cfg.include_payload:
            event["payload"] = base64.b64encode(message.payload).decode("ascii")
        self._put(event)

    def _put(self, event: dict[str, Any]) -> None:
        queue = self.queue
        if len(queue) >= self.cfg.queue_size:
            self.stats.dropped_queue_full += 1
            self._warn("webhook queue full: events dropped",
                       dropped=self.stats.dropped_queue_full)
            return
        queue.append(event)
        self._arrived.set()
        if len(queue) >= self.cfg.batch_size:
            self._filled.set()

    # ------------------------------------------------------------------ sending

    def statistics(self) -> dict[str, int]:
        """A snapshot of the counters (plain ints)."""
        self.stats.queued = len(self.queue)
        return asdict(self.stats)

    async def run(self) -> None:
        """Send batches until ``close()``; then what is left, within its grace period."""
        import aiohttp  # here: 0.3 s of start-up (its TLS contexts) a node without hooks skips

        cfg = self.cfg
        headers = {"Content-Type": "application/json"}
        if cfg.authorization:
            headers["Authorization"] = cfg.authorization
        timeout = aiohttp.ClientTimeout(total=cfg.timeout)
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as http:
            while True:
                batch = await self._next_batch()
                if not batch:
                    return  # closing, and nothing left
                try:
                    sent = await self._deliver(http, batch)
                except Exception:  # a bug: lose this batch, not the sender
                    log.exception("webhook batch lost", extra=kv(events=len(batch)))
                    self.stats.dropped_after_retries += len(batch)
                    sent = False
                if not sent and self.closing:  # the receiver is down: no point in the rest
                    self.stats.dropped_after_retries += len(self.queue)
                    self.queue.clear()
                    return

    def close(self) -> None:
        """No more waiting: ``run`` sends what is queued (one attempt per batch) and returns.
        The caller awaits the task for at most ``CLOSE_GRACE`` seconds."""
        self.closing = True
        self._arrived.set()
        self._filled.set()
        self._closed.set()

    async def _next_batch(self) -> list[dict[str, Any]]:
        queue = self.queue
        if not queue and not self.closing:
            self._arrived.clear()
            await self._arrived.wait()
        delay = self.cfg.batch_delay_ms / 1000
        if len(queue) < self.cfg.batch_size and delay > 0 and not self.closing:
            self._filled.clear()
            try:
                await asyncio.wait_for(self._filled.wait(), delay)
            except TimeoutError:
                pass  # send what is there
        count = min(len(queue), self.cfg.batch_size)
        return [queue.popleft() for _ in range(count)]

    async def _deliver(self, http: aiohttp.ClientSession, events: list[dict[str, Any]]) -> bool:
        """POST one batch, retrying with capped exponential backoff; count the outcome.
        True when the receiver took it."""
        cfg = self.cfg
        body = json.dumps({"worker": self.worker, "events": events}).encode("utf-8")
        backoff = cfg.retry_backoff_ms / 1000
        for attempt in range(cfg.retries + 1):
            problem = await self._post(http, body)
            if not problem:
                self.stats.sent_batches += 1
                self.stats.sent_events += len(events)
                return True
            self.stats.failed_posts += 1
            self._warn("webhook POST failed", url=cfg.url, attempt=attempt + 1, error=problem)
            if attempt == cfg.retries or self.closing:
                break
            try:  # a backoff ends early at shutdown, for a last attempt
                await asyncio.wait_for(self._closed.wait(), backoff)
            except TimeoutError:
                pass
            backoff = min(backoff * 2, cfg.retry_backoff_max_ms / 1000)
        self.stats.dropped_after_retries += len(events)
        self._warn("webhook batch dropped after its last attempt", attempts=attempt + 1,
                   dropped=self.stats.dropped_after_retries)
        return False

    async def _post(self, http: aiohttp.ClientSession, body: bytes) -> str:
        """One POST; "" when the receiver took it (2xx), else what went wrong."""
        import aiohttp  # (imported by run() already)

        try:
            async with http.post(self.cfg.url, data=body) as response:
                await response.read()
                if 200 <= response.status < 300:
                    return ""
                return f"HTTP {response.status}"
        except TimeoutError:
            return f"no answer within {self.cfg.timeout:g} s"
        except aiohttp.ClientError as exc:
            return " ".join(str(exc).split()) or type(exc).__name__

    def _warn(self, message: str, **fields: object) -> None:
        """Log ``message`` unless it was logged less than ``LOG_EVERY`` seconds ago."""
        now = time.monotonic()
        if now - self._last_warning.get(message, -LOG_EVERY) >= LOG_EVERY:
            self._last_warning[message] = now
            log.warning(message, extra=kv(**fields))
