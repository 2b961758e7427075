"""What the broker core needs from outside one router, as small interfaces of its own.

The core (this package: protocol glue, sessions, router, persistence) serves one router. What
lies beyond it is asked for through these interfaces, never by importing the layer that
provides it (``cluster/`` implements them for many routers and imports the core; the core
never imports ``cluster/``). A single-process node uses the versions in ``broker/local.py``,
so the core has no "am I alone?" branches.

* ``Peers``: the other routers a publish may have to reach, and the route changes they hear.
* ``PartitionLog``: the commit log's partitions, wherever their leaders are (``append`` gives a
  typed ``AppendOutcome``), the high watermark this router may read up to, and reading.
* ``RetainedMessages``: where retained messages are stored and looked up.
* ``SessionDirectory``: which router holds a client id's session (claim on CONNECT, hand-over).
* ``NodeStatistics``: the node-wide totals ``$SYS`` publishes.
* ``BrokerEvents``: who hears of clients coming and going and of publishes (webhooks,
  node/webhooks.py); optional: a broker without one pays a single ``is None`` test.
* ``Services``: request/reply through the broker (``$service/...``, services/): the service
  topics' publishes and subscriptions, connections ending, and the publishes that are replies
  (asked only while replies are awaited here).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from meshmq.broker.client import ClientHandle
    from meshmq.broker.message import Message
    from meshmq.broker.session import Session
    from meshmq.log.record import Record
    from meshmq.mqtt.packets import Publish, SubscriptionOptions
    from meshmq.mqtt.properties import Properties

SharedKey = tuple[str, str]  # (share name, topic filter)
Done = Callable[[], None]


class Peers(Protocol):
    """The node's other routers, as the router sees them."""

    def route(self, message: Message, local_groups: Collection[SharedKey], now: float
              ) -> tuple[Collection[SharedKey], int]:
        """After the local plain deliveries: send ``message`` to every peer with a match and
        choose, for each shared group (``local_groups``: those with members here), who serves
        it. Returns the groups to serve here and the number of peers sent to."""

    def group_elsewhere(self, key: SharedKey, message: Message, now: float) -> int:
        """A shared message none of whose members is left here: 1 if a peer takes it."""

    def route_changed(self, added: bool, group: str, topic_filter: str) -> None:
        """A subscription was added or removed here (``group``: "" for a plain one)."""

    def barrier(self, done: Done) -> None:
        """``done()`` once every peer routes according to the changes made so far."""


# ---------------------------------------------------------------------- the commit log


class Stored:
    """Durable here: the caller routes the message and advances the high watermark. One is
    made per persisted publish: a plain class, not a dataclass, because compiled (mypyc) a
    dataclass is made through its generated Python ``__init__`` at about ten times the cost
    of a native constructor."""

    __slots__ = ("offset", "partition")

    def __init__(self, partition: int, offset: int) -> None:
        self.partition = partition
        self.offset = offset

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Stored) and self.partition == other.partition
                and self.offset == other.offset)

    def __repr__(self) -> str:
        return f"Stored(partition={self.partition}, offset={self.offset})"


@dataclass(slots=True)
class StoredElsewhere:
    """Durable at the partition's leader, which routed it to ``receivers`` receivers, except
    to this router when ``local`` is a list: the caller delivers it to its own subscribers,
    serving those shared groups (it has the message already; the leader did not send it
    back). Not frozen, though never changed: one is made per publish that crosses to its
    leader, and a frozen dataclass takes twice as long to make."""

    partition: int
    offset: int
    receivers: int
    local: list[SharedKey] | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """Not stored: the publisher is told ``reason_code`` (3.1.1: disconnected)."""

    reason_code: int
    why: str


@dataclass(frozen=True, slots=True)
class Unknown:
    """Perhaps stored, perhaps not: the append went to the partition's leader and no answer
    came back (the link dropped, or no answer in time). Never reported as a failure, since
    the leader may have stored and routed it: the caller closes the publisher's connection
    so that it resends (DUP), and the resend carries ``message_id`` (``append``), by which
    the leader recognises a message it stored already and does not store it twice."""

    why: str
    message_id: bytes | None  # None: a retained store's outcome (nothing to recognise)


AppendOutcome = Stored | StoredElsewhere | Refused | Unknown
Completion = Callable[[AppendOutcome], None]


class PartitionLog(Protocol):
    """The commit log as one router sees it."""

    high_watermark: list[int]  # per partition: the offset after the last record routed here

    def wants(self, topic: str, qos: int) -> bool:
        """Is a publish on ``topic`` at ``qos`` persisted?"""

    def append(self, message: Message, client_id: str, done: Completion,
               message_id: bytes | None = None) -> bool:
        """Persist ``message``; ``done`` gets the outcome later, on the loop (never from
        inside this call). False, without ``done``, when the log's queue is full.
        ``message_id``: the id an earlier attempt's ``Unknown`` gave, for a resend of that
        publish (None: a new one)."""

    def routed(self, partition: int, offset: int) -> None:
        """The record at ``offset`` is being routed here: the high watermark passes it."""

    def read(self, partition: int, offset: int, max_records: int) -> list[Record]:
        """Records from ``offset`` (raises ``OffsetOutOfRange`` below the earliest)."""

    def routes_all(self, partition: int) -> bool:
        """Is every record of ``partition`` routed here, with this router's routes as they are
        at the time (it leads the partition)? Otherwise only those its leader forwards are."""

    def earliest_offset(self, partition: int) -> int: ...

    def offset_for_timestamp(self, partition: int, timestamp_ms: int) -> int | None: ...

    def sync(self, done: Done, timestamp_ms: int | None = None) -> None:
        """Bring ``high_watermark`` up to where the leaders are, as of after the route
        changes made so far (and, ``timestamp_ms``, learn where each partition is at that
        time, for ``offset_for_timestamp``); then ``done()``."""

    def views_known(self) -> bool:
        """Is the high watermark of every partition known (heard from its leader)? A
        catch-up does not finish before."""

    def close(self) -> None: ...


# ---------------------------------------------------------------------- retained messages


Kept = Callable[[Refused | Unknown | None], None]  # None: stored, durably


class RetainedMessages(Protocol):
    """The node's retained messages."""

    def keep(self, message: Message, done: Kept | None) -> None:
        """Store ``message`` as its topic's retained message (an empty payload clears it);
        ``done(None)`` once that is durable, ``done(Refused)`` if it certainly was not stored
        (its store is down), ``done(Unknown)`` if that is not known (no answer). The caller
        has routed it already."""

    def query(self, filters: list[str], done: Callable[[list[list[Message]]], None]) -> None:
        """The retained messages matching each of ``filters`` (plain filters)."""

    def count(self) -> int:
        """Retained messages held by this router (for ``$SYS``)."""


# ---------------------------------------------------------------------- sessions


class SessionDirectory(Protocol):
    """Which router holds each client id's session."""

    @property
    def alone(self) -> bool:
        """True while no one else can hold a session (``claim`` would return False): the
        CONNECT path then skips the claim and the callback it would need."""

    def claim(self, client_id: str, clean_start: bool,
              done: Callable[[list[Session]], None]) -> bool:
        """A CONNECT for ``client_id`` is accepted here: take its session over from wherever
        it is (or end it, with ``clean_start``). False when no one else can hold it (the
        caller goes on at once, ``done`` is never called); else ``done(adopted)`` later."""

    def settled(self, client_id: str, adopted: list[Session]) -> None:
        """The adopted sessions are in place here (their routes announced)."""

    def created(self, session: Session) -> None:
        """A new session exists here."""

    def ended(self, session: Session) -> None:
        """A session here ended."""


class NodeStatistics(Protocol):
    """Where ``$SYS`` gets the node's totals."""

    workers: int  # routers in the node

    def totals(self, mine: dict[str, int]) -> dict[str, int] | None:
        """This router's counters in; the node's totals out, or None when another router
        publishes them."""

    def complete(self) -> bool:
        """Every other router's figures have arrived at least once (since it linked)."""


class BrokerEvents(Protocol):
    """Listeners to client and publish events. Called on the message path: each call must
    return at once (queue the event, never wait for I/O)."""

    def client_connected(self, client_id: str, username: str | None, peer: str, protocol: str,
                         clean_start: bool, session_present: bool, keep_alive: int) -> None:
        """A CONNECT was accepted (after its CONNACK was queued)."""

    def client_disconnected(self, client_id: str, username: str | None, peer: str,
                            protocol: str, reason: str) -> None:
        """An accepted connection ended (``reason`` as the connection log line gives it)."""

    def published(self, message: Message, username: str | None) -> None:
        """A PUBLISH from a client passed the ACL check and goes on to be stored or routed."""

    def statistics(self) -> dict[str, int]:
        """Counters for ``$SYS``: ``sent_events``, ``failed_posts``, ``dropped_queue_full``
        and ``dropped_after_retries`` at least."""


# ---------------------------------------------------------------------- services


class Services(Protocol):
    """Request/reply through the broker (docs/services.md): the ``$service/`` topics belong to
    the services layer (services/), which also recognises replies. Every call returns at once;
    what the layer takes it answers later (PUBACK, SUBACK codes, error replies)."""

    expecting: bool  # replies are awaited on this router: its publishes are offered to ``reply``

    def request(self, client: ClientHandle, packet: Publish) -> bool:
        """A PUBLISH on a ``$service/`` topic, before any other check: True if the layer took
        it (it checks, persists and acknowledges it, ``Publishes.persist``); False: an
        ordinary publish."""

    def reply(self, client: ClientHandle, packet: Publish, message: Message) -> bool:
        """While ``expecting``: a PUBLISH that passed the ACL. True if it is a reply (taken:
        the layer acknowledges it once the request is complete); False: an ordinary one."""

    def stored(self, message: Message) -> bool:
        """A ``$service/`` message stored in a partition this router leads, about to be
        routed: True if the layer took it instead (a request for the service's dispatcher)."""

    def subscribe(self, client: ClientHandle, topic_filter: str, options: SubscriptionOptions,
                  subscription_id: int | None, properties: Properties) -> int | None:
        """A SUBSCRIBE filter on ``$service/``: its SUBACK reason code (the layer took it: an
        offer, not a route), or None: an ordinary subscription."""

    def unsubscribe(self, client: ClientHandle, topic_filter: str) -> bool | None:
        """An UNSUBSCRIBE filter on ``$service/``: whether an offer was withdrawn, or None:
        an ordinary filter."""

    def connection_lost(self, client: ClientHandle) -> None:
        """``client``'s connection ended (or was taken over): its offers end."""
