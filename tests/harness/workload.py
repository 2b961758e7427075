"""The workload: QoS 1 publishers with unique values, persistent subscribers, and a drain.

Theory of operation
-------------------
Every value is unique: publisher ``name`` sends payload ``name:seq`` with ``seq`` = 1, 2, 3...
on topic ``{prefix}/{name}/{seq % topics}`` (so one publisher's messages spread over the log's
partitions). Each publish ends in one ``Outcome``:

* ``ACKED``: a PUBACK with a success code. The broker promised it: it must never be lost.
* ``REFUSED``: a PUBACK with a failure code (e.g. 0x80, "partition 3 is offline").
* ``UNKNOWN``: no answer by the end of the run. While its connection is down a publish is
  *pending*; paho resends it with DUP on the next connection (persistent session, clean start
  only on the very first connect), so it may still end acked, refused, or stored twice.

A publisher keeps at most ``window`` publishes unanswered; while it cannot connect it stops
publishing new values, as a device would.

A ``Subscriber`` holds a persistent session (session expiry, clean start only on its first
connect unless told to resume) on one filter at QoS 1 and records every delivery in arrival
order; paho acknowledges each after it is recorded. It reconnects by itself (paho), and
subscribes again only if the broker lost its session (each such loss is recorded).

``drain()``: publishers stop and wait for their answers; then one *barrier* message per log
partition is published (publisher ``barrier-{round}``, on ``{prefix}/barrier/i``, which every
subscriber's filter matches), and the drain waits until every subscriber got every barrier
(20 s at most: one that never gets them is kept in ``undrained`` for the report). A
partition's messages reach a subscriber in log order, live or caught up from the log, so by
then everything stored before a barrier has reached it (a broker that breaks that order shows
up in the checker's report). Subscribers must be subscribed before publishers start: the
checker expects every acknowledged message at every subscriber whose filter matches.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from conftest import WAIT, wait_for
from meshmq.log.partitioner import Partitioner

BARRIER = "barrier"  # drain messages come from publisher barrier-1, barrier-2...
SESSION_EXPIRY = 600  # seconds: longer than any run
KEEPALIVE = 10  # a blackholed client notices in 1.5 x this


class Outcome(enum.Enum):
    PENDING = "pending"  # no answer yet (UNKNOWN once the run is over)
    ACKED = "acked"
    REFUSED = "refused"
    UNKNOWN = "unknown"


@dataclass
class Sent:
    """One value a publisher sent, and what became of it."""

    publisher: str
    seq: int
    topic: str
    outcome: Outcome = Outcome.PENDING
    reason: int | None = None


@dataclass(frozen=True)
class Delivery:
    """One PUBLISH a subscriber received."""

    publisher: str
    seq: int
    topic: str
    dup: bool
    at: float  # time.monotonic() when it arrived


@dataclass(frozen=True)
class Connection:
    """One CONNACK a client got: a lost session shows as ``session_present=False`` after the
    first."""

    at: float
    reason: int
    session_present: bool


def parse_payload(payload: bytes | bytearray) -> tuple[str, int] | None:
    """``(publisher, seq)`` of a workload payload, or None for anything else."""
    name, _, seq = payload.decode("utf-8", "replace").rpartition(":")
    return (name, int(seq)) if name and seq.isdigit() else None


def new_client(name: str, on_connect: Callable[[Connection], None]) -> mqtt.Client:
    """A paho MQTT 5 client that reconnects by itself quickly and records its CONNACKs."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv5,
                         reconnect_on_failure=True)
    client.reconnect_delay_set(0.05, 0.5)  # type: ignore[arg-type]  # floats work; ints are slow

    def connected(_c: mqtt.Client, _u: object, flags: mqtt.ConnectFlags, reason: ReasonCode,
                  _p: Properties | None) -> None:
        on_connect(Connection(time.monotonic(), reason.value, bool(flags.session_present)))

    client.on_connect = connected
    return client


def session_properties() -> Properties:
    properties = Properties(PacketTypes.CONNECT)
    properties.SessionExpiryInterval = SESSION_EXPIRY
    return properties


def start_client(client: mqtt.Client, address: tuple[str, int], resume: bool) -> None:
    """Connect in paho's own thread (it retries until the node answers)."""
    clean = False if resume else mqtt.MQTT_CLEAN_START_FIRST_ONLY
    host, port = address
    client.connect_async(host, port, KEEPALIVE, clean_start=clean,
                         properties=session_properties())
    client.loop_start()


def stop_client(client: mqtt.Client) -> None:
    client.disconnect()
    client.loop_stop()


class Publisher:
    """QoS 1 publisher ``name`` on ``address``; see the module docstring."""

    def __init__(self, name: str, address: tuple[str, int], prefix: str = "jepsen",
                 topics: int = 16, window: int = 8, resume: bool = False) -> None:
        self.name = name
        self.address = address
        self.prefix = prefix
        self.topics = topics
        self.window = window
        self.resume = resume
        self.sent: dict[int, Sent] = {}
        self.connections: list[Connection] = []
        self.disconnects = 0  # connections lost or closed (by the broker or a fault)
        self.last_answer = time.monotonic()  # of the last PUBACK, success or failure
        self._by_mid: dict[int, Sent] = {}
        self._early: dict[int, ReasonCode] = {}  # answers that beat publish() returning
        self._pending = 0
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._client = new_client(name, self.connections.append)
        self._client.max_inflight_messages_set(window)
        self._client.on_publish = self._answered
        self._client.on_disconnect = self._disconnected
        self._thread = threading.Thread(target=self._run, name=f"publisher-{name}", daemon=True)

    def start(self) -> Publisher:
        start_client(self._client, self.address, self.resume)
        self._thread.start()
        return self

    def pending(self) -> int:
        """Publishes sent and not answered yet."""
        with self._changed:
            return self._pending

    def count(self, outcome: Outcome) -> int:
        with self._changed:
            return sum(1 for sent in self.sent.values() if sent.outcome is outcome)

    def _run(self) -> None:
        seq = 0
        while not self._stop.is_set():
            with self._changed:
                if self._pending >= self.window:
                    self._changed.wait(0.5)  # woken by an answer or by stop()
                    continue
                self._pending += 1
            seq += 1
            sent = Sent(self.name, seq, f"{self.prefix}/{self.name}/{seq % self.topics}")
            with self._changed:
                self.sent[seq] = sent
            # Not under the lock: paho calls on_publish holding its own lock.
            info = self._client.publish(sent.topic, f"{self.name}:{seq}".encode(), qos=1)
            with self._changed:
                early = self._early.pop(info.mid, None)
                if early is None:
                    self._by_mid[info.mid] = sent
                else:
                    self._settle(sent, early)

    def _answered(self, _c: mqtt.Client, _u: object, mid: int, reason: ReasonCode,
                  _p: Properties | None) -> None:
        with self._changed:
            sent = self._by_mid.pop(mid, None)
            if sent is None:
                self._early[mid] = reason
            else:
                self._settle(sent, reason)

    def _disconnected(self, *_args: object) -> None:
        with self._changed:
            self.disconnects += 1

    def _settle(self, sent: Sent, reason: ReasonCode) -> None:
        self.last_answer = time.monotonic()
        sent.outcome = Outcome.REFUSED if reason.is_failure else Outcome.ACKED
        sent.reason = reason.value
        self._pending -= 1
        self._changed.notify_all()

    def stop(self, timeout: float = WAIT) -> None:
        """Publish nothing new; wait (up to ``timeout``) for the answers still due. What has
        none by then is UNKNOWN."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        self._thread.join(timeout=WAIT)
        with self._changed:
            self._changed.wait_for(lambda: self._pending == 0, timeout)
            for sent in self.sent.values():
                if sent.outcome is Outcome.PENDING:
                    sent.outcome = Outcome.UNKNOWN

    def close(self) -> None:
        self._stop.set()
        stop_client(self._client)


class Subscriber:
    """A persistent session on ``topic_filter`` at QoS 1; see the module docstring."""

    def __init__(self, name: str, address: tuple[str, int], topic_filter: str = "jepsen/#",
                 resume: bool = False) -> None:
        self.name = name
        self.address = address
        self.topic_filter = topic_filter
        self.resume = resume
        self.deliveries: list[Delivery] = []
        self.connections: list[Connection] = []
        self.subscribed = threading.Event()
        self._lock = threading.Lock()
        self._client = new_client(name, self._connected)
        self._client.on_message = self._received
        self._client.on_subscribe = lambda *_: self.subscribed.set()

    def start(self) -> Subscriber:
        """Connect, subscribe (unless resuming a session that has the subscription), return
        once subscribed."""
        start_client(self._client, self.address, self.resume)
        wait_for(self.subscribed.is_set, timeout=30, what=f"{self.name} to subscribe")
        return self

    def _connected(self, connection: Connection) -> None:
        self.connections.append(connection)
        if connection.reason == 0 and connection.session_present:
            self.subscribed.set()
        elif connection.reason == 0:  # a new session, or the broker lost ours: subscribe
            self._client.subscribe(self.topic_filter, qos=1)

    def _received(self, _c: mqtt.Client, _u: object, message: mqtt.MQTTMessage) -> None:
        parsed = parse_payload(message.payload)
        if parsed is not None:
            with self._lock:
                self.deliveries.append(Delivery(*parsed, message.topic, bool(message.dup),
                                                time.monotonic()))

    def snapshot(self) -> list[Delivery]:
        with self._lock:
            return list(self.deliveries)

    def sessions_lost(self) -> int:
        """Connections that found no session although there was one (the broker forgot it):
        every one after the first, and the first too when resuming."""
        later = self.connections if self.resume else self.connections[1:]
        return sum(1 for c in later if c.reason == 0 and not c.session_present)

    def close(self) -> None:
        stop_client(self._client)


def barrier_topics(prefix: str, partitions: int, key_level: int | None = None) -> list[str]:
    """One topic under ``prefix/barrier/`` per log partition, in partition order."""
    partitioner = Partitioner(partitions, key_level)
    found: dict[int, str] = {}
    i = 0
    while len(found) < partitions:
        topic = f"{prefix}/{BARRIER}/{i}"
        found.setdefault(partitioner.partition_for(topic), topic)
        i += 1
    return [found[p] for p in range(partitions)]


def publish_and_wait(address: tuple[str, int], name: str,
                     messages: Sequence[tuple[str, bytes]], timeout: float = WAIT) -> None:
    """Publish ``messages`` at QoS 1 as a new client ``name`` and wait until each is
    acknowledged (a refusal fails the test: a drain needs every partition online)."""
    answers: dict[int, ReasonCode] = {}
    done = threading.Condition()

    def answered(_c: mqtt.Client, _u: object, mid: int, reason: ReasonCode,
                 _p: Properties | None) -> None:
        with done:
            answers[mid] = reason
            done.notify_all()

    client = new_client(name, lambda _connection: None)
    client.on_publish = answered
    start_client(client, address, resume=False)
    try:
        mids = [client.publish(topic, payload, qos=1).mid for topic, payload in messages]
        with done:
            if not done.wait_for(lambda: all(mid in answers for mid in mids), timeout):
                raise TimeoutError(f"{name}: {len(mids) - len(answers)} publishes unanswered")
        refused = {mid: reason for mid, reason in answers.items() if reason.is_failure}
        assert not refused, f"{name}: publishes refused: {refused}"
    finally:
        stop_client(client)


@dataclass
class Workload:
    """Publishers and subscribers of one run (``run_workload`` starts and closes them)."""

    publishers: list[Publisher] = field(default_factory=list)
    subscribers: list[Subscriber] = field(default_factory=list)
    prefix: str = "jepsen"
    partitions: int = 8
    drains: int = 0
    undrained: dict[str, list[int]] = field(default_factory=dict)  # by the last drain

    def acked(self) -> int:
        return sum(p.count(Outcome.ACKED) for p in self.publishers)

    def wait_acked(self, more: int, timeout: float = 30.0) -> None:
        """Wait until ``more`` further publishes are acknowledged (load is flowing)."""
        target = self.acked() + more
        wait_for(lambda: self.acked() >= target, timeout=timeout,
                 what=f"{more} more acknowledged publishes")

    def quiet(self, seconds: float, every: bool = True) -> bool:
        """Whether every publisher (``every=False``: at least one) has had no answer for
        ``seconds`` although it waits for some: a fault that holds them has taken effect."""
        now = time.monotonic()
        held = [p.pending() > 0 and now - p.last_answer >= seconds for p in self.publishers]
        return all(held) if every else any(held)

    def disconnects(self) -> list[int]:
        return [p.disconnects for p in self.publishers]

    def all_disconnected_since(self, before: Sequence[int]) -> bool:
        """Whether every publisher lost its connection since ``disconnects()`` was ``before``."""
        return all(now > then for now, then in zip(self.disconnects(), before, strict=True))

    def stop_publishing(self, timeout: float = WAIT) -> None:
        for publisher in self.publishers:
            publisher.stop(timeout)

    def drain(self, address: tuple[str, int], timeout: float = 20.0) -> dict[str, list[int]]:
        """Stop publishers, then publish a barrier per partition on ``address`` and wait until
        every subscriber has them all (see the module docstring), at most ``timeout`` seconds.

        Returns (and keeps in ``undrained``) each subscriber that still misses barriers, with
        the partitions of those: a subscriber the broker stopped serving. The checker reports
        them; the caller decides whether that fails the test.
        """
        self.stop_publishing()
        self.drains += 1
        name = f"{BARRIER}-{self.drains}"
        topics = barrier_topics(self.prefix, self.partitions)
        publish_and_wait(address, name, [(topic, f"{name}:{k}".encode())
                                         for k, topic in enumerate(topics)], timeout)

        def missing() -> dict[str, list[int]]:
            result = {}
            for subscriber in self.subscribers:
                got = {d.seq for d in subscriber.snapshot() if d.publisher == name}
                if len(got) < len(topics):
                    result[subscriber.name] = sorted(set(range(len(topics))) - got)
            return result

        deadline = time.monotonic() + timeout
        while (undrained := missing()) and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the condition, as conftest.wait_for does
        self.undrained = undrained
        return undrained

    def close(self) -> None:
        clients: list[Publisher | Subscriber] = [*self.publishers, *self.subscribers]
        for client in clients:
            try:
                client.close()
            except Exception:
                pass


@contextmanager
def run_workload(address: tuple[str, int], publishers: int = 2, subscribers: int = 1,
                 prefix: str = "jepsen", partitions: int = 8, window: int = 8,
                 subscriber_address: tuple[str, int] | None = None,
                 names: Sequence[str] = ()) -> Iterator[Workload]:
    """Subscribers first (subscribed when this yields), then publishers, all on ``address``
    (subscribers on ``subscriber_address`` if given); everything is closed on the way out."""
    workload = Workload(prefix=prefix, partitions=partitions)
    try:
        for i in range(subscribers):
            subscriber = Subscriber(f"sub-{i}", subscriber_address or address, f"{prefix}/#")
            workload.subscribers.append(subscriber.start())
        for i in range(publishers):
            name = names[i] if i < len(names) else f"pub-{i}"
            workload.publishers.append(
                Publisher(name, address, prefix, window=window).start())
        yield workload
    finally:
        workload.close()
