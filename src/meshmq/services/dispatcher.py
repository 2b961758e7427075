"""The dispatcher of one service: which service worker gets which request, and when it is done.

Theory of operation
-------------------
``Dispatcher`` is sans I/O: it is told what happens (a request arrived, a service worker offers
or withdraws, a reply came, a record became durable, time passed: ``now`` is an argument) and
answers with *actions* in ``actions``, which its owner (services/layer.py) carries out in
order and clears:

* ``Deliver``: send this attempt of a request to that service worker (where it is connected);
* ``Note``: record the assignment in the log (not waited for: see below);
* ``Commit``: record the request's completion (its reply, or the error reply) in the log, then
  call ``committed``; nothing reaches the caller before that;
* ``Respond``: route the request's reply (or error reply) to the caller now.

A request is *queued* until a service worker with free credit takes it (round-robin, or the
least loaded), *assigned* while an attempt runs, *completing* while its completion is being
made durable, and *done* once it is: its reply is then remembered for ``dedup_window`` so that
a repeat (same caller, same Correlation Data) gets it again instead of a second execution.

Credit: a service worker holds every request it was given until it replies to it or goes, even
one it was given up on (timed out): a hung worker fills its credit and gets no more. The first
reply to a request completes it, whichever attempt it answers; any later one is *late*
(dropped, counted). An attempt that times out, or whose worker goes, is retried (``retry`` + 1,
``dup``) on another worker if one has free credit, up to ``retries``; then the caller gets an
error reply (``timeout``, ``worker-lost``). A request no worker takes within ``max_wait``
(none connected, or none with free credit) gets ``no-responders``; with the ``fail`` policy it
gets it at once while no worker offers the service at all.

Crash recovery (services/recovery.py) replays the service's records into a new dispatcher
(``recover_*``) and then calls ``recovered``: the requests that were not done are queued again
with ``dup`` set, or, if the log says a worker held one, kept assigned until that worker's
process reports what it holds (``sync``: a worker still holding it keeps it; otherwise it goes
to another with ``dup``). Assignments are recorded without waiting because of this rule: after
a crash every request not known to be done is treated as perhaps delivered. Completions are
waited for, so a request is never answered twice by two executions.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from meshmq.broker.message import Message
from meshmq.services import envelope
from meshmq.services.settings import FAIL, LEAST_LOADED, ServiceSettings
from meshmq.services.stats import ServiceStats

WorkerKey = tuple[int, str]  # (the worker process it is connected to, its client id)
Holding = list[tuple[str, int]]  # (request id, retry) a service worker holds
DEDUP_MAX = 100_000  # completed requests one service remembers at most (oldest forgotten first)
_NEVER = float("inf")


class Phase(Enum):
    QUEUED = "queued"
    ASSIGNED = "assigned"
    COMPLETING = "completing"
    DONE = "done"


class Verdict(Enum):
    """What a reply turned out to be."""

    ACCEPTED = "accepted"  # it completes the request (once ``committed``)
    ROUTED = "routed"  # a recovered completion's reply, routed now (answer it as accepted)
    LATE = "late"  # the request was completed by another reply, or given up: dropped
    UNKNOWN = "unknown"  # no such request (forgotten, or never known here)
    MISMATCH = "mismatch"  # not a reply to that request (another topic or correlation)


@dataclass(eq=False, slots=True)
class Request:
    """One request as its dispatcher follows it."""

    id: str
    offset: int  # its place in the service's partition (the recovery checkpoint's unit)
    caller: str  # the client id that published it
    reply_topic: str
    correlation: bytes | None
    message: Message  # as stored: payload and the caller's properties
    arrived: float  # when it became durable (for the round-trip latency)
    topic_envelope: bool = False  # the caller used the topic envelope (error replies differ)
    phase: Phase = Phase.QUEUED
    retry: int = -1  # the last attempt's number (-1: none yet)
    holder: WorkerKey | None = None  # who runs the current attempt
    deadline: float = _NEVER  # of the current attempt, or of the wait for a worker
    dup: bool = False  # its next delivery may not be its first (a retry, or recovered)
    confirmed: bool = True  # False: a recovered assignment its holder has not confirmed
    reply: Message | None = None  # what the caller gets: the reply, or an error reply
    completer: tuple[WorkerKey, int] | None = None  # whose reply (worker, retry) completed it
    routed: bool = True  # False: recovered done, its reply perhaps never routed
    expires: float = _NEVER  # end of its deduplication memory (once done)
    error: str = ""  # the error kind of an error reply

    @property
    def dedup_key(self) -> tuple[str, bytes] | None:
        return None if self.correlation is None else (self.caller, self.correlation)


@dataclass(slots=True)
class Offer:
    """A service worker offering the service: its credit and what it holds."""

    key: WorkerKey
    serial: int  # the offer's number where it is connected: a new offer, a new number
    capacity: int
    holding: dict[str, int] = field(default_factory=dict)  # request id -> retry

    @property
    def free(self) -> int:
        return self.capacity - len(self.holding)


class Deliver(NamedTuple):
    request: Request
    worker: WorkerKey
    serial: int
    retry: int
    dup: bool


class Note(NamedTuple):
    request: Request  # an assignment to record: ``holder`` has attempt ``retry``


class Commit(NamedTuple):
    request: Request  # a completion to record (``reply``), then ``committed``


class Respond(NamedTuple):
    request: Request  # route ``reply`` to the caller


Action = Deliver | Note | Commit | Respond


class Dispatcher:
    """One service's requests and service workers (see the module docstring)."""

    def __init__(self, service: str, settings: ServiceSettings, me: int) -> None:
        self.service = service
        self.settings = settings
        self.me = me  # the worker process this dispatcher runs in
        self.requests: dict[str, Request] = {}  # not yet forgotten (done: remembered)
        self.by_key: dict[tuple[str, bytes], Request] = {}  # (caller, correlation)
        self.queue: deque[str] = deque()  # request ids waiting for a worker (lazy removal)
        self.offers: dict[WorkerKey, Offer] = {}
        self.order: list[WorkerKey] = []  # offers in round-robin order
        self.cursor = 0
        self.actions: list[Action] = []
        self.stats = ServiceStats()
        self._timers: list[tuple[float, int, str]] = []  # (deadline, sequence, request id)
        self._sequence = 0
        self._remembered: deque[tuple[float, str]] = deque()  # (expires, request id)

    # ------------------------------------------------------------------ requests

    def arrive(self, request: Request, now: float, recovering: bool = False) -> None:
        """A request is durable in the log. A repeat of one not forgotten is not executed
        again: a done one's reply goes to the caller again; a pending one answers both."""
        if not recovering:
            self.stats.requests += 1
        key = request.dedup_key
        if key is not None:
            earlier = self.by_key.get(key)
            if earlier is not None and self.requests.get(earlier.id) is earlier:
                if not recovering:  # (counted when it came; a recovery counts nothing)
                    self.stats.duplicates += 1
                if earlier.phase is Phase.DONE and not recovering:
                    self.actions.append(Respond(earlier))
                return
            self.by_key[key] = request
        self.requests[request.id] = request
        if recovering:
            self.queue.append(request.id)
            return
        self._enqueue(request, now)

    def _enqueue(self, request: Request, now: float, front: bool = False) -> None:
        request.phase = Phase.QUEUED
        request.holder = None
        if not self.offers and self.settings.no_responders == FAIL:
            return self._fail(request, envelope.NO_RESPONDERS)
        if front:
            self.queue.appendleft(request.id)
        else:
            self.queue.append(request.id)
        self._set_deadline(request, now + self.settings.max_wait)
        self._pump(now)

    def _pump(self, now: float) -> None:
        """Give queued requests, oldest first, to workers with free credit."""
        queue, requests = self.queue, self.requests
        while queue:
            request = requests.get(queue[0])
            if request is None or request.phase is not Phase.QUEUED:
                queue.popleft()
                continue
            offer = self._choose(request.id)
            if offer is None:
                return
            queue.popleft()
            self._assign(request, offer, now)

    def _choose(self, request_id: str) -> Offer | None:
        """A worker with free credit, preferring one that never had this request: the next
        in turn (round-robin), or the least loaded (ties in turn)."""
        order, offers = self.order, self.offers
        count = len(order)
        best: Offer | None = None
        best_index = 0
        fallback: Offer | None = None
        fallback_index = 0
        least = self.settings.dispatch == LEAST_LOADED
        for step in range(count):
            index = (self.cursor + step) % count
            offer = offers[order[index]]
            if offer.free <= 0:
                continue
            if request_id in offer.holding:  # it had this request before: only if no other
                if fallback is None:
                    fallback, fallback_index = offer, index
                continue
            if best is None or (least and _load(offer) < _load(best)):
                best, best_index = offer, index
                if not least:
                    break
        if best is None:
            best, best_index = fallback, fallback_index
        if best is not None:
            self.cursor = (best_index + 1) % count
        return best

    def _assign(self, request: Request, offer: Offer, now: float) -> None:
        request.retry += 1
        if request.retry > 0:
            self.stats.retries += 1
        dup = request.dup or request.retry > 0
        request.phase = Phase.ASSIGNED
        request.holder = offer.key
        request.confirmed = True
        offer.holding[request.id] = request.retry
        self._set_deadline(request, now + self.settings.timeout)
        self.stats.dispatched += 1
        self.actions.append(Deliver(request, offer.key, offer.serial, request.retry, dup))
        self.actions.append(Note(request))

    def _retry_or_fail(self, request: Request, why: str, now: float) -> None:
        """The current attempt failed (``why``): another attempt, or the error reply."""
        request.holder = None
        if request.retry >= self.settings.retries:
            return self._fail(request, why)
        request.dup = True
        self._enqueue(request, now, front=True)

    # ------------------------------------------------------------------ service workers

    def offer(self, key: WorkerKey, serial: int, capacity: int, now: float) -> None:
        """Service worker ``key`` offers the service with ``capacity`` (0: withdraws; a new
        ``serial`` is a new offer: whatever the old one held is lost)."""
        old = self.offers.get(key)
        if capacity <= 0:
            if old is not None and old.serial == serial:
                self._withdraw(old, now)
            return
        if old is not None and old.serial != serial:
            self._withdraw(old, now)
            old = None
        if old is None:
            self.offers[key] = Offer(key, serial, capacity)
            self.order.append(key)
        else:
            old.capacity = capacity
        self._pump(now)

    def sync(self, process: int, offers: Iterable[tuple[str, int, int, Holding]],
             now: float) -> None:
        """Worker process ``process`` states every offer it has for this service, each with
        what it holds (on each new link): recovered assignments are confirmed or lost, an
        offer it no longer has is withdrawn."""
        reported: set[WorkerKey] = set()
        for client_id, serial, capacity, holding in offers:
            key = (process, client_id)
            reported.add(key)
            offer = self.offers.get(key)
            if offer is None or offer.serial != serial:
                if offer is not None:
                    self._withdraw(offer, now)
                offer = self.offers[key] = Offer(key, serial, capacity)
                self.order.append(key)
            offer.capacity = capacity
            self._reconcile(offer, dict(holding), now)
        for key in [k for k in self.offers if k[0] == process and k not in reported]:
            self._withdraw(self.offers[key], now)
        for request in list(self.requests.values()):  # recovered, and not held any more
            if (request.phase is Phase.ASSIGNED and not request.confirmed
                    and request.holder is not None and request.holder[0] == process):
                self._retry_or_fail(request, envelope.WORKER_LOST, now)
        self._pump(now)

    def _reconcile(self, offer: Offer, holding: dict[str, int], now: float) -> None:
        """What ``offer``'s worker says it holds: it keeps those, the others are lost."""
        for request_id, retry in holding.items():
            request = self.requests.get(request_id)
            if request is None or request.phase not in (Phase.QUEUED, Phase.ASSIGNED):
                continue
            if request.holder is None or request.holder == offer.key:
                request.phase = Phase.ASSIGNED  # (a queued one leaves the queue lazily)
                request.holder = offer.key
                request.confirmed = True
                request.retry = max(request.retry, retry)
                self._set_deadline(request, now + self.settings.timeout)
        lost = [request_id for request_id in offer.holding if request_id not in holding]
        offer.holding = holding
        for request_id in lost:
            request = self.requests.get(request_id)
            if request is not None and request.phase is Phase.ASSIGNED \
                    and request.holder == offer.key:
                self._retry_or_fail(request, envelope.WORKER_LOST, now)

    def process_down(self, process: int, now: float) -> None:
        """Worker process ``process`` is gone (its link dropped): so are its offers."""
        for key in [k for k in self.offers if k[0] == process]:
            self._withdraw(self.offers[key], now)
        for request in list(self.requests.values()):
            if request.phase is Phase.ASSIGNED and request.holder is not None \
                    and request.holder[0] == process:
                self._retry_or_fail(request, envelope.WORKER_LOST, now)

    def _withdraw(self, offer: Offer, now: float) -> None:
        del self.offers[offer.key]
        index = self.order.index(offer.key)
        del self.order[index]
        if index < self.cursor:
            self.cursor -= 1
        if self.order:
            self.cursor %= len(self.order)
        else:
            self.cursor = 0
        for request_id in offer.holding:
            request = self.requests.get(request_id)
            if request is not None and request.phase is Phase.ASSIGNED \
                    and request.holder == offer.key:
                self.stats.lost += 1
                self._retry_or_fail(request, envelope.WORKER_LOST, now)
        if not self.offers and self.settings.no_responders == FAIL:
            for request_id in self.queue:  # nobody left to wait for
                request = self.requests.get(request_id)
                if request is not None and request.phase is Phase.QUEUED:
                    self._fail(request, envelope.NO_RESPONDERS)
            self.queue.clear()

    # ------------------------------------------------------------------ replies

    def reply(self, request_id: str, worker: WorkerKey, retry: int, message: Message,
              now: float, expected: tuple[str, bytes | None] | None = None) -> Verdict:
        """A reply to ``request_id`` from ``worker``'s attempt ``retry`` (``expected``: the
        reply's topic and correlation, to check when it was recognised by its request id
        only). ``ACCEPTED``: ``Commit`` follows, answer the replier once ``committed``."""
        request = self.requests.get(request_id)
        if request is not None and expected is not None and expected != (
                request.reply_topic, request.correlation):
            return Verdict.MISMATCH
        offer = self.offers.get(worker)
        if offer is not None and offer.holding.pop(request_id, None) is not None:
            self._pump(now)  # its credit is free again
        if request is None:
            return Verdict.UNKNOWN
        if request.phase in (Phase.QUEUED, Phase.ASSIGNED):
            request.phase = Phase.COMPLETING
            request.reply = Message(
                request.reply_topic, message.payload, message.qos, False,
                envelope.reply_properties(message.properties, request.id,
                                          request.correlation), message.sender, now)
            request.completer = (worker, retry)
            self.stats.replies += 1
            self.actions.append(Commit(request))
            return Verdict.ACCEPTED
        if request.phase is Phase.DONE and not request.routed and _same_reply(
                request.completer, worker, retry):
            request.routed = True  # the reply that completed it, resent: now routed
            self.actions.append(Respond(request))
            return Verdict.ROUTED
        self.stats.late_replies += 1
        return Verdict.LATE

    def committed(self, request_id: str, now: float, durable: bool = True) -> None:
        """The completion of ``request_id`` is durable (or, ``durable`` False, could not be
        recorded: the request runs on as if that reply never came)."""
        request = self.requests.get(request_id)
        if request is None or request.phase is not Phase.COMPLETING:
            return
        if not durable:
            request.reply = None
            request.error = ""
            return self._retry_or_fail(request, envelope.WORKER_LOST, now)
        request.phase = Phase.DONE
        request.holder = None
        request.deadline = _NEVER
        if not request.error:
            self.stats.observe(now - request.arrived)
        self.actions.append(Respond(request))
        self._remember(request, now + self.settings.dedup_window)

    def _fail(self, request: Request, kind: str) -> None:
        """Give up: the caller gets an error reply once it is recorded."""
        request.phase = Phase.COMPLETING
        request.error = kind
        request.holder = None
        topic = request.reply_topic
        if request.topic_envelope:
            topic = f"{topic}/{envelope.ERROR_LEVEL}"
        request.reply = Message(topic, kind.encode(), 1, False, envelope.error_properties(
            request.correlation, request.id, kind))
        self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1
        self.actions.append(Commit(request))

    def _remember(self, request: Request, expires: float) -> None:
        """Keep a done request for deduplication until ``expires`` (without a correlation
        there is nothing to recognise a repeat by: forgotten at once)."""
        if request.dedup_key is None or expires <= 0:
            self._forget(request)
            return
        request.expires = expires
        self._remembered.append((expires, request.id))
        while len(self._remembered) > DEDUP_MAX:
            _, oldest = self._remembered.popleft()
            old = self.requests.get(oldest)
            if old is not None and old.phase is Phase.DONE:
                self._forget(old)

    def _forget(self, request: Request) -> None:
        if self.requests.get(request.id) is request:
            del self.requests[request.id]
        key = request.dedup_key
        if key is not None and self.by_key.get(key) is request:
            del self.by_key[key]

    # ------------------------------------------------------------------ time

    def _set_deadline(self, request: Request, deadline: float) -> None:
        request.deadline = deadline
        self._sequence += 1
        heapq.heappush(self._timers, (deadline, self._sequence, request.id))

    def next_deadline(self) -> float | None:
        timers = self._timers
        candidates = [timers[0][0]] if timers else []
        if self._remembered:
            candidates.append(self._remembered[0][0])
        return min(candidates) if candidates else None

    def expire(self, now: float) -> None:
        """Attempts past their timeout, waits past ``max_wait``, memories past the window."""
        timers = self._timers
        while timers and timers[0][0] <= now:
            deadline, _, request_id = heapq.heappop(timers)
            request = self.requests.get(request_id)
            if request is None or request.deadline != deadline:
                continue  # (a later deadline replaced it)
            if request.phase is Phase.ASSIGNED:
                if request.confirmed:
                    self.stats.timeouts += 1
                    self._retry_or_fail(request, envelope.TIMEOUT, now)
                else:  # recovered, and its holder never said it still has it
                    self._retry_or_fail(request, envelope.WORKER_LOST, now)
            elif request.phase is Phase.QUEUED:
                self._fail(request, envelope.NO_RESPONDERS)
        remembered = self._remembered
        while remembered and remembered[0][0] <= now:
            expires, request_id = remembered.popleft()
            request = self.requests.get(request_id)
            if request is not None and request.phase is Phase.DONE \
                    and request.expires == expires:
                self._forget(request)

    # ------------------------------------------------------------------ recovery

    def recover_assign(self, request_id: str, retry: int, worker: WorkerKey) -> None:
        """The log says ``worker`` was given attempt ``retry``."""
        request = self.requests.get(request_id)
        if request is None or request.phase not in (Phase.QUEUED, Phase.ASSIGNED):
            return
        request.phase = Phase.ASSIGNED
        request.retry = max(request.retry, retry)
        request.holder = worker
        request.confirmed = False

    def recover_completion(self, request_id: str, reply: Message, error: str,
                           completer: tuple[WorkerKey, int] | None, age: float,
                           now: float) -> None:
        """The log says ``request_id`` was completed ``age`` seconds ago with ``reply``; it
        may not have been routed (a crash right after): its replier's resend routes it."""
        request = self.requests.get(request_id)
        if request is None or request.phase is Phase.DONE:
            return
        request.phase = Phase.DONE
        request.reply = reply
        request.error = error
        request.completer = completer
        request.holder = None
        request.routed = False
        self._remember(request, now + self.settings.dedup_window - age)

    def recovered(self, now: float) -> None:
        """The replay is over: every request not done is perhaps delivered already. A queued
        one waits for a worker; an assigned one, for its holder's process to confirm it (an
        assignment in this process is lost: its connections died with it)."""
        for request in list(self.requests.values()):
            if request.phase not in (Phase.QUEUED, Phase.ASSIGNED):
                continue
            request.dup = True
            holder = request.holder
            if request.phase is Phase.ASSIGNED and holder is not None and holder[0] != self.me:
                self._set_deadline(request, now + self.settings.timeout)
                continue
            if request.phase is Phase.ASSIGNED:  # lost with this process's connections
                request.phase = Phase.QUEUED
                request.holder = None
                self.queue.appendleft(request.id)
            # (no fail-at-once policy here: the workers have not had time to come back)
            self._set_deadline(request, now + self.settings.max_wait)
        self._pump(now)

    # ------------------------------------------------------------------ figures

    def gauges(self) -> dict[str, int]:
        phases = {phase: 0 for phase in Phase}
        for request in self.requests.values():
            phases[request.phase] += 1
        return {"in_flight": phases[Phase.QUEUED] + phases[Phase.ASSIGNED]
                + phases[Phase.COMPLETING], "queued": phases[Phase.QUEUED],
                "remembered": phases[Phase.DONE], "workers": len(self.offers),
                "credit": sum(max(0, offer.free) for offer in self.offers.values())}


def _same_reply(completer: tuple[WorkerKey, int] | None, worker: WorkerKey, retry: int) -> bool:
    """Is this reply (from ``worker``'s attempt ``retry``, -1: not known) the one that
    completed the request? The same client id and attempt; the process may differ (the
    worker reconnected elsewhere before resending it)."""
    if completer is None:
        return False
    (_, client_id), completed_retry = completer
    return client_id == worker[1] and retry in (completed_retry, -1)


def _load(offer: Offer) -> float:
    return len(offer.holding) / offer.capacity
