"""The single-process versions of the core's interfaces (broker/interfaces.py).

A node of one router has no peers, keeps every retained message itself, holds every session
itself and publishes its own ``$SYS`` totals. These classes say so, so that the core has no
"am I alone?" branches; ``cluster/`` provides the versions for several routers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import partial
from typing import TYPE_CHECKING, Protocol

from meshmq.broker.message import SYS_PREFIX
from meshmq.mypycattr import mypyc_attr

if TYPE_CHECKING:
    from meshmq.broker.client import ClientHandle
    from meshmq.broker.interfaces import Done, Kept, SharedKey
    from meshmq.broker.message import Message
    from meshmq.broker.retained import RetainedStore
    from meshmq.broker.session import Session
    from meshmq.mqtt.packets import Publish, SubscriptionOptions
    from meshmq.mqtt.properties import Properties


class LocalPeers:
    """No other router: every shared group is served here, nothing is forwarded."""

    def route(self, message: Message, local_groups: Collection[SharedKey], now: float
              ) -> tuple[Collection[SharedKey], int]:
        return local_groups, 0

    def group_elsewhere(self, key: SharedKey, message: Message, now: float) -> int:
        return 0

    def route_changed(self, added: bool, group: str, topic_filter: str) -> None:
        pass

    def barrier(self, done: Done) -> None:
        done()


class RetainedJournal(Protocol):
    """Where retained changes are made durable: the broker's ``StateKeeper`` (keeper.py)."""

    def retained(self, topic: str, message: Message | None, done: Done | None = None) -> None:
        """Journal ``topic``'s retained message (None: cleared); ``done()`` once durable."""


@mypyc_attr(native_class=False)  # tests replace its ``keep`` on an instance
class LocalRetained:
    """Retained messages in this process's store, journaled by its keeper."""

    def __init__(self, store: RetainedStore[Message], keeper: RetainedJournal,
                 clock: Callable[[], float]) -> None:
        self.store = store
        self.keeper = keeper
        self.clock = clock

    def keep(self, message: Message, done: Kept | None) -> None:
        stored = message if message.payload else None  # MQTT-3.3.1-6: empty payload clears
        self.store.set(message.topic, stored)
        self.keeper.retained(message.topic, stored, None if done is None else partial(done, None))

    def query(self, filters: list[str], done: Callable[[list[list[Message]]], None]) -> None:
        done([self.matching(topic_filter) for topic_filter in filters])

    def matching(self, topic_filter: str) -> list[Message]:
        """The retained messages ``topic_filter`` matches; expired ones are dropped."""
        now = self.clock()
        found = []
        for message in self.store.match(topic_filter):
            if message.expired(now):
                self.store.set(message.topic, None)
                self.keeper.retained(message.topic, None)
            else:
                found.append(message)
        return found

    def count(self) -> int:
        """The retained messages of clients held here: the broker's own ``$SYS/`` topics are
        not counted (the Retained tab and the admin API do not list them; a scrape or a
        ``$SYS`` tick walks only that branch of the store, a dozen topics)."""
        store = self.store
        own = sum(1 for message in store.match("$SYS/#") if message.topic.startswith(SYS_PREFIX))
        return len(store) - own


class LocalDirectory:
    """Every session is here: a CONNECT never has to claim one from elsewhere."""

    alone = True

    def claim(self, client_id: str, clean_start: bool,
              done: Callable[[list[Session]], None]) -> bool:
        return False

    def settled(self, client_id: str, adopted: list[Session]) -> None:
        pass

    def created(self, session: Session) -> None:
        pass

    def ended(self, session: Session) -> None:
        pass


class LocalStatistics:
    """This router's counters are the node's."""

    workers = 1

    def totals(self, mine: dict[str, int]) -> dict[str, int] | None:
        return mine

    def complete(self) -> bool:
        return True


class NoServices:
    """No services layer (services.enabled = false, or a broker built without one): the
    ``$service/`` topics are ordinary topics and nothing is a reply."""

    expecting = False

    def request(self, client: ClientHandle, packet: Publish) -> bool:
        return False

    def reply(self, client: ClientHandle, packet: Publish, message: Message) -> bool:
        return False

    def stored(self, message: Message) -> bool:
        return False

    def subscribe(self, client: ClientHandle, topic_filter: str, options: SubscriptionOptions,
                  subscription_id: int | None, properties: Properties) -> int | None:
        return None

    def unsubscribe(self, client: ClientHandle, topic_filter: str) -> bool | None:
        return None

    def connection_lost(self, client: ClientHandle) -> None:
        pass
