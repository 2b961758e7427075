"""A worker process's service workers: their offers, and the replies expected from them.

Every worker process of a node has a ``Desk``; it knows only the service workers connected to
this process. An offer is made by a SUBSCRIBE to ``$service/NAME`` and lasts as long as that
connection (a session resumed later does not bring it back: the service worker subscribes again
on each connection, as the meshmq client does). It has a *serial*, new for each offer, so that
an attempt sent to an offer that has since gone is not delivered to the next offer of the same
client id.

When a request is delivered here to one of them, the desk *expects* its reply: by (Response
Topic, Correlation Data), and by request id (the topic envelope's replies name it). Those two
tables are what ``ServicesLayer.reply`` looks in, and ``expecting`` is true only while they
hold something, so that a node without pending requests pays nothing per publish. An
expectation stays after its worker goes (for ``EXPECTATION_TTL`` seconds), so that a reply the
worker sends after reconnecting here is recognised as late instead of reaching the caller as an
ordinary publish.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshmq.broker.client import ClientHandle

EXPECTATION_TTL = 300.0  # seconds an unanswered expectation is kept after it was made


@dataclass(eq=False, slots=True)
class LocalOffer:
    """A service worker connected here offering a service."""

    service: str
    client: ClientHandle
    serial: int
    capacity: int
    qos: int  # what its subscription grants
    subscription_id: int | None
    topic_envelope: bool  # a 3.1.1 (or 3.1) client: the envelope goes in the topic
    holding: dict[str, int] = field(default_factory=dict)  # request id -> retry

    @property
    def client_id(self) -> str:
        return self.client.client_id


@dataclass(eq=False, slots=True)
class Expectation:
    """A request delivered here: the reply that will complete it."""

    request_id: str
    service: str
    dispatcher: int  # the worker process dispatching the service
    worker: str  # the client id it was delivered to
    retry: int
    reply_topic: str
    correlation: bytes | None
    made: float


class Desk:
    """This process's offers and expectations (see the module docstring)."""

    def __init__(self) -> None:
        self.offers: dict[tuple[str, str], LocalOffer] = {}  # (service, client id)
        self.by_client: dict[ClientHandle, list[LocalOffer]] = {}
        self.expected: OrderedDict[tuple[str, bytes | None], Expectation] = OrderedDict()
        self.by_id: dict[str, Expectation] = {}
        self.late_replies: dict[str, int] = {}  # per service: dropped here (no dispatcher)
        self._serial = 0

    @property
    def expecting(self) -> bool:
        return bool(self.expected)

    # ------------------------------------------------------------------ offers

    def add(self, service: str, client: ClientHandle, capacity: int, qos: int,
            subscription_id: int | None, topic_envelope: bool) -> tuple[LocalOffer, bool]:
        """``client`` offers ``service``: its offer (and True if it is a new one; an offer
        the same connection renews keeps its serial and what it holds)."""
        key = (service, client.client_id)
        offer = self.offers.get(key)
        if offer is not None and offer.client is client:
            offer.capacity, offer.qos, offer.subscription_id = capacity, qos, subscription_id
            return offer, False
        if offer is not None:  # the client id's earlier connection: its offer ends
            self.remove(offer)
        self._serial += 1
        offer = LocalOffer(service, client, self._serial, capacity, qos, subscription_id,
                           topic_envelope)
        self.offers[key] = offer
        self.by_client.setdefault(client, []).append(offer)
        return offer, True

    def remove(self, offer: LocalOffer) -> None:
        if self.offers.get((offer.service, offer.client_id)) is offer:
            del self.offers[(offer.service, offer.client_id)]
        offers = self.by_client.get(offer.client)
        if offers is not None and offer in offers:
            offers.remove(offer)
            if not offers:
                del self.by_client[offer.client]

    def find(self, service: str, client: ClientHandle) -> LocalOffer | None:
        offer = self.offers.get((service, client.client_id))
        return offer if offer is not None and offer.client is client else None

    def ended(self, client: ClientHandle) -> list[LocalOffer]:
        """``client``'s connection ended: its offers, removed."""
        offers = self.by_client.pop(client, [])
        for offer in offers:
            if self.offers.get((offer.service, offer.client_id)) is offer:
                del self.offers[(offer.service, offer.client_id)]
        return offers

    def serving(self, dispatcher: int, dispatcher_of: dict[str, int]) -> list[LocalOffer]:
        """The offers whose service ``dispatcher`` dispatches (``dispatcher_of``: by service)."""
        return [offer for offer in self.offers.values()
                if dispatcher_of.get(offer.service) == dispatcher]

    # ------------------------------------------------------------------ expectations

    def expect(self, expectation: Expectation, now: float) -> None:
        self._sweep(now)
        key = (expectation.reply_topic, expectation.correlation)
        self.expected.pop(key, None)  # (a retry of the same request: the newest attempt)
        self.expected[key] = expectation
        self.by_id[expectation.request_id] = expectation

    def answered(self, expectation: Expectation) -> None:
        """The reply ``expectation`` waited for was dealt with."""
        key = (expectation.reply_topic, expectation.correlation)
        if self.expected.get(key) is expectation:
            del self.expected[key]
        if self.by_id.get(expectation.request_id) is expectation:
            del self.by_id[expectation.request_id]
        offer = self.offers.get((expectation.service, expectation.worker))
        if offer is not None:
            offer.holding.pop(expectation.request_id, None)

    def _sweep(self, now: float) -> None:
        """Forget expectations older than ``EXPECTATION_TTL`` (oldest first)."""
        expected = self.expected
        while expected:
            expectation = next(iter(expected.values()))
            if now - expectation.made < EXPECTATION_TTL:
                return
            self.answered(expectation)

    def sweep(self, now: float) -> None:
        self._sweep(now)

    def count_late(self, service: str) -> None:
        self.late_replies[service] = self.late_replies.get(service, 0) + 1
